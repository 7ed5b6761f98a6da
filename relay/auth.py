"""Request authentication (spec §3): HMAC-SHA256 signatures, lockout, rate limits.

Pure: no reactor and no I/O. Time comes from an injected ``clock``
(``IReactorTime``); every table is bounded so a client cycling through agent
names or source addresses cannot grow the broker's memory.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from relay import errors
from relay.config import AgentConfig, Config
from relay.protocol import (
    MAX_CLOCK_SKEW_SECONDS,
    address_group,
    is_loopback_host,
    is_valid_agent_name,
)
from relay.signing import NONCE, signed_bytes

RATE_WINDOW_SECONDS = 60.0
MAX_TRACKED = 50_000


class Bounded(OrderedDict):
    """An insertion-ordered dict that forgets its oldest entries past ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class RateLimiter:
    """Requests per source address per minute, as a sliding window of two buckets.

    Each address costs one small tuple; the estimate weights the previous
    minute's count by how much of it still overlaps the sliding window.
    ``on_refusal(address, key, limit)`` hears of the first refusal of an address
    in each minute, with the config key whose limit it reached.
    """

    def __init__(
        self, clock: IReactorTime, loopback: int, remote: int, max_tracked: int = MAX_TRACKED,
        on_refusal: Optional[Callable[[str, str, int], None]] = None,
    ) -> None:
        self.clock = clock
        self.loopback = loopback
        self.remote = remote
        self.on_refusal = on_refusal
        self._windows: Bounded = Bounded(max_tracked)
        self._loopback_cache: Bounded = Bounded(1024)

    def limit_for(self, host: str) -> int:
        """The per-minute limit of a source address."""
        return self.loopback if self._classify(host)[0] else self.remote

    def _classify(self, host: str) -> Tuple[bool, str]:
        """Whether ``host`` is loopback, and the key it is counted under: the address
        itself, or its /64 for IPv6 (one host usually holds a whole /64)."""
        known = self._loopback_cache.get(host)
        if known is None:
            known = (is_loopback_host(host), address_group(host))
            self._loopback_cache.put(host, known)
        return known

    def hit(self, host: str) -> None:
        """Count one request from ``host``; raise 429 ``rate_limited`` over the limit."""
        loop, host = self._classify(host)
        limit = self.loopback if loop else self.remote
        now = self.clock.seconds()
        window = int(now // RATE_WINDOW_SECONDS)
        # (minute, count of the minute before, count of this minute, minute of the
        # last refusal)
        entry = self._windows.get(host)
        if entry is None:
            previous, current, refused = 0, 0, -1
        elif entry[0] < window - 1:
            previous, current, refused = 0, 0, entry[3]
        elif entry[0] == window - 1:
            previous, current, refused = entry[2], 0, entry[3]
        else:
            previous, current, refused = entry[1], entry[2], entry[3]
        elapsed = (now % RATE_WINDOW_SECONDS) / RATE_WINDOW_SECONDS
        estimate = previous * (1.0 - elapsed) + current
        if estimate >= limit:
            key = "rateLimitLoopback" if loop else "rateLimitRemote"
            if refused != window and self.on_refusal is not None:
                self.on_refusal(host, key, limit)
            self._windows.put(host, (window, previous, current, window))
            raise errors.rate_limited(
                f"rate limit exceeded: broker.{key} allows {limit} requests a minute from "
                "one address; slow down and retry")
        self._windows.put(host, (window, previous, current + 1, refused))

    def tracked(self) -> int:
        """How many source addresses have a rate window (for tests and stats)."""
        return len(self._windows)


class SharedLockouts(Protocol):
    """Where a :class:`Lockout` also reports, when several brokers share its counts
    (see :class:`relay.store.interface.ISharedLockouts`). Both calls return at once."""

    def failed(self, agent: str) -> None:
        """Count a failure of ``agent`` for every broker."""

    def succeeded(self, agent: str) -> None:
        """``agent`` authenticated: reset its count for every broker."""


class Lockout:
    """Consecutive authentication failures per agent, and the locks they cause.

    Answers from its own tables, at once. With ``shared`` (brokers sharing one
    store), failures and successes are also reported there, and locks decided
    by another broker arrive through :meth:`lock`.
    """

    def __init__(
        self, clock: IReactorTime, after: int, seconds: float, max_tracked: int = MAX_TRACKED,
        shared: Optional[SharedLockouts] = None,
    ) -> None:
        self.clock = clock
        self.after = after
        self.seconds = seconds
        self.max_tracked = max_tracked
        self.shared = shared
        self._failures: Bounded = Bounded(max_tracked)
        self._locked: Bounded = Bounded(max_tracked)

    def share(self, shared: SharedLockouts) -> None:
        """Report failures and successes to ``shared`` from now on."""
        self.shared = shared

    def is_locked(self, agent: str) -> bool:
        """True while ``agent`` is locked out."""
        until = self._locked.get(agent)
        if until is None:
            return False
        if self.clock.seconds() < until:
            return True
        del self._locked[agent]
        return False

    def seconds_left(self, agent: str) -> float:
        """How long ``agent`` stays locked (0 when it is not)."""
        until = self._locked.get(agent)
        return 0.0 if until is None else max(0.0, until - self.clock.seconds())

    def failed(self, agent: str) -> bool:
        """Count a failure; the ``after``-th consecutive one locks the agent.

        Returns True when this failure locked the agent.
        """
        if self.shared is not None:
            self.shared.failed(agent)
        count = self._failures.get(agent, 0) + 1
        if count >= self.after:
            self._failures.pop(agent, None)
            self._locked.put(agent, self.clock.seconds() + self.seconds)
            return True
        self._failures.put(agent, count)
        return False

    def succeeded(self, agent: str) -> None:
        """A valid request resets the agent's failure count."""
        if agent in self._failures:
            del self._failures[agent]
        if self.shared is not None:
            self.shared.succeeded(agent)

    def lock(self, agent: str, until: float) -> None:
        """Lock ``agent`` until ``until`` (epoch seconds): a lock another broker decided.
        An existing lock that ends later stays."""
        if until <= max(self._locked.get(agent, 0.0), self.clock.seconds()):
            return
        self._failures.pop(agent, None)
        self._locked.put(agent, until)

    def clear(self, agent: str) -> None:
        """Forget ``agent``'s failure count here only (another broker saw it succeed)."""
        self._failures.pop(agent, None)

    def tracked(self) -> Tuple[int, int]:
        """How many agents have failure counts and locks (for tests and stats)."""
        return len(self._failures), len(self._locked)


MAX_NONCES = 200_000


class SharedNonces(Protocol):
    """Where a :class:`NonceTable` also claims its nonces, when several brokers share
    them (see :class:`relay.store.interface.ISharedNonces`)."""

    def claim_nonce(self, agent: str, nonce: str, timestamp: int) -> Deferred:
        """Fires with True when no broker used ``nonce`` of ``agent`` within the skew
        window, False when one did; errbacks (``503 busy``) when it cannot tell."""


class NonceTable:
    """The nonces seen within the skew window (EXTENSIONS.md §9), each accepted once.

    An entry lives as long as a request carrying it could still pass the timestamp
    check. The table is bounded: when it is full of live entries, a nonce request
    is refused (``503 busy``) rather than an entry forgotten early. With ``shared``
    (brokers sharing one store), a nonce new to this table must also be claimed
    there before its request is accepted.
    """

    def __init__(self, clock: IReactorTime, max_entries: int = MAX_NONCES) -> None:
        self.clock = clock
        self.max_entries = max_entries
        self.shared: Optional[SharedNonces] = None
        self._seen: Dict[Tuple[str, str], int] = {}
        self._expiry: List[Tuple[int, Tuple[str, str]]] = []

    def share(self, shared: SharedNonces) -> None:
        """Claim every nonce new to this table from ``shared`` too, from now on."""
        self.shared = shared

    def __len__(self) -> int:
        return len(self._seen)

    def _purge(self, now: int) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] < now:
            until, key = heapq.heappop(expiry)
            if self._seen.get(key) == until:
                del self._seen[key]

    def use(self, agent: str, nonce: str, timestamp: int) -> None:
        """Accept ``nonce`` of ``agent`` once; 401 when it was used, 503 when full."""
        now = int(self.clock.seconds())
        self._purge(now)
        key = (agent, nonce)
        if key in self._seen:
            raise errors.unauthenticated("replayed request (this nonce was used)")
        if len(self._seen) >= self.max_entries:
            raise errors.busy("too many requests with nonces in the skew window")
        until = timestamp + MAX_CLOCK_SKEW_SECONDS
        self._seen[key] = until
        heapq.heappush(self._expiry, (until, key))


# Why a request failed authentication: the ``reason`` of ``relay_auth_failures_total``.
FAILURE_REASONS = ("missing_headers", "bad_nonce", "bad_agent_name", "unknown_agent", "locked",
                   "bad_timestamp", "clock_skew", "bad_signature", "replayed")


def _keys(secrets: Sequence[str]) -> Tuple[Any, ...]:
    """A keyed HMAC-SHA256 per secret, copied per request (the key is prepared once).

    Where :mod:`hmac` wraps OpenSSL's HMAC object, that object itself: its ``copy``,
    ``update`` and ``hexdigest`` are the same, without a Python call each."""
    keyed = (hmac.new(s.encode("utf-8"), digestmod=hashlib.sha256) for s in secrets)
    return tuple(getattr(key, "_hmac", None) or key for key in keyed)


class Authenticator:
    """Checks the §3 headers of a request (and the §9 nonce) and names the agent that
    signed it.

    An agent (or the shared secret) may have several secrets, while one is
    rotated: a signature made with any of them verifies. ``on_failure(reason)``
    hears of every refused request (a reason of :data:`FAILURE_REASONS`).
    ``lockout`` and ``nonces`` carry over the state of the authenticator this one
    replaces (a reload), so a reload neither lifts a lock nor forgets a nonce.
    """

    def __init__(
        self,
        clock: IReactorTime,
        shared_secret: str,
        agents: Mapping[str, AgentConfig],
        lock_after_failures: int = 5,
        lock_seconds: float = 300.0,
        max_tracked: int = MAX_TRACKED,
        on_lock: Optional[Callable[[str], None]] = None,
        require_nonce: bool = False,
        max_nonces: int = MAX_NONCES,
        shared_secrets: Sequence[str] = (),
        lockout: Optional[Lockout] = None,
        nonces: Optional[NonceTable] = None,
        on_failure: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.clock = clock
        self.on_lock = on_lock
        self.on_failure = on_failure
        self.require_nonce = require_nonce
        self.nonces = nonces if nonces is not None else NonceTable(clock, max_nonces)
        self.per_agent = any(a.secrets for a in agents.values())
        self._keys: Dict[str, Tuple[Any, ...]] = {}
        self._shared: Optional[Tuple[Any, ...]] = None
        if self.per_agent:
            for name, agent in agents.items():
                self._keys[name] = _keys(agent.secrets)
        else:
            self._shared = _keys(shared_secrets or (shared_secret,))
        if lockout is None:
            lockout = Lockout(clock, lock_after_failures, lock_seconds, max_tracked)
        else:  # a reload keeps the failure counts and locks, under the new settings
            lockout.after, lockout.seconds = lock_after_failures, lock_seconds
        self.lockout = lockout

    @classmethod
    def from_config(cls, config: Config, clock: IReactorTime,
                    on_lock: Optional[Callable[[str], None]] = None,
                    replacing: Optional[Authenticator] = None,
                    on_failure: Optional[Callable[[str], None]] = None) -> Authenticator:
        """An authenticator for the broker's settings; ``on_lock(agent)`` hears of new
        locks. ``replacing`` is the authenticator it takes over from (a reload)."""
        return cls(
            clock,
            config.secret,
            config.agents,
            config.lock_after_failures,
            config.lock_minutes * 60.0,
            on_lock=on_lock,
            require_nonce=config.require_nonce,
            shared_secrets=config.secrets,
            lockout=replacing.lockout if replacing is not None else None,
            nonces=replacing.nonces if replacing is not None else None,
            on_failure=on_failure,
        )

    def _refused(self, reason: str, error: errors.RelayError) -> errors.RelayError:
        if self.on_failure is not None:
            self.on_failure(reason)
        return error

    def _failed(self, agent: str, reason: str, error: errors.RelayError) -> errors.RelayError:
        if self.lockout.failed(agent) and self.on_lock is not None:
            self.on_lock(agent)
        return self._refused(reason, error)

    def _keys_for(self, agent: str) -> Optional[Tuple[Any, ...]]:
        if self._shared is not None:
            return self._shared
        return self._keys.get(agent)

    def authenticate(
        self,
        method: bytes,
        path: bytes,
        agent_header: Optional[bytes],
        timestamp_header: Optional[bytes],
        signature_header: Optional[bytes],
        raw_body: bytes,
        nonce_header: Optional[bytes] = None,
    ) -> Union[str, Deferred]:
        """The authenticated agent name, or a RelayError (401, 403 ``locked``, or 503
        when the nonce table is full).

        With ``X-Relay-Nonce`` the signing string covers the agent and the nonce,
        and each nonce is accepted once; a replay is refused without counting
        toward the lockout. ``require_nonce`` refuses requests without one.
        When the nonces are shared with other brokers (:meth:`NonceTable.share`),
        a nonce new to this broker gives a Deferred instead, firing with the agent
        name once the shared table accepted it (or failing with the 401 of a
        replay, or 503 when the shared table cannot tell).
        """
        if not agent_header or not timestamp_header or not signature_header:
            raise self._refused("missing_headers",
                                errors.unauthenticated("missing authentication headers"))
        nonce = None
        if nonce_header is not None:
            try:
                nonce = nonce_header.decode("ascii")
            except UnicodeDecodeError:
                nonce = ""
            if not NONCE.match(nonce):
                raise self._refused("bad_nonce", errors.unauthenticated(
                    "invalid X-Relay-Nonce (16 to 64 of A-Z a-z 0-9 _ -)"))
        elif self.require_nonce:
            raise self._refused("bad_nonce", errors.unauthenticated(
                "this broker requires X-Relay-Nonce (signed nonce)"))
        try:
            agent = agent_header.decode("ascii")
        except UnicodeDecodeError:
            raise self._refused("bad_agent_name",
                                errors.unauthenticated("invalid agent name")) from None
        if not is_valid_agent_name(agent):
            raise self._refused("bad_agent_name", errors.unauthenticated("invalid agent name"))
        keys = self._keys_for(agent)
        if keys is None:
            raise self._refused("unknown_agent", errors.unknown_agent())
        if self.lockout.is_locked(agent):
            left = math.ceil(self.lockout.seconds_left(agent))
            raise self._refused("locked", errors.locked(
                f"agent is locked after repeated authentication failures; try again in {left} s"))
        if not _is_integer(timestamp_header):
            raise self._failed(agent, "bad_timestamp", errors.unauthenticated("invalid timestamp"))
        # Whole seconds on both sides: a fractional clock would make the window lopsided.
        if abs(int(self.clock.seconds()) - int(timestamp_header)) > MAX_CLOCK_SKEW_SECONDS:
            raise self._failed(agent, "clock_skew", errors.unauthenticated("timestamp skew"))
        signed = signed_bytes(method, path, timestamp_header, raw_body, agent_header,
                              nonce_header)
        signature = signature_header.lower()
        for key in keys:
            mac = key.copy()
            mac.update(signed)
            if hmac.compare_digest(mac.hexdigest().encode("ascii"), signature):
                break
        else:
            raise self._failed(agent, "bad_signature", errors.unauthenticated(
                "invalid signature; check the secret and the clock"))
        if nonce is not None:
            nonces = self.nonces
            try:
                nonces.use(agent, nonce, int(timestamp_header))
            except errors.RelayError as error:
                raise (self._refused("replayed", error) if error.status == 401 else error) from None
            if nonces.shared is not None:
                d = nonces.shared.claim_nonce(agent, nonce, int(timestamp_header))
                d.addCallback(self._claimed, agent)
                return d
        self.lockout.succeeded(agent)
        return agent

    def _claimed(self, first: bool, agent: str) -> str:
        """The end of :meth:`authenticate` once the shared table answered a claim."""
        if not first:
            raise self._refused("replayed", errors.unauthenticated(
                "replayed request (this nonce was used)"))
        self.lockout.succeeded(agent)
        return agent


def _is_integer(value: bytes) -> bool:
    digits = value[1:] if value[:1] == b"-" else value
    return 0 < len(digits) <= 15 and digits.isdigit()
