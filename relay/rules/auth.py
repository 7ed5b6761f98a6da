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
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from relay.rules.config import AgentConfig, Config
from relay.wire import errors
from relay.wire.protocol import (
    MAX_CLOCK_SKEW_SECONDS,
    address_group,
    is_loopback_host,
    is_valid_agent_name,
)
from relay.wire.signing import NONCE, signed_bytes
from relay.wire.v2.signing import (
    LEGACY_KEY_ID,
    Keyring,
    Refusal,
    SignedHeaders,
    SigningKey,
    check_request,
    read_agent,
)

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

    def configure(self, loopback: int, remote: int) -> None:
        """Apply the limits a reload may change."""
        self.loopback = loopback
        self.remote = remote

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


# The key of an agent-wide lock: it refuses the agent from every address.
EVERY_ADDRESS = "*"
# Failures from this many addresses within one lock period lock the agent itself.
AGENT_LOCK_ADDRESSES = 3
# The failure counts kept per agent, one per address (the oldest are forgotten).
MAX_ADDRESSES_PER_AGENT = 64


class Counted(NamedTuple):
    """What one authentication failure did: the lock it caused (an address, or
    :data:`EVERY_ADDRESS`; None when it locked nothing), and, where brokers share
    their counts, a Deferred that fires once the failure is counted in the shared
    table (it never fails)."""

    locked: Optional[str]
    shared: Optional[Deferred]


class SharedLockouts(Protocol):
    """Where a :class:`Lockout` also reports, when several brokers share its counts
    (see :class:`relay.store.interface.ISharedLockouts`)."""

    def failed(self, agent: str, address: str) -> Deferred:
        """Count a failure of ``agent`` from ``address`` (an address group) for every
        broker; fires once it is counted (and any lock it caused applied), never
        fails."""

    def succeeded(self, agent: str, address: str) -> None:
        """``agent`` authenticated from ``address``: reset that count for every broker."""

    def unlocked(self, agent: str) -> Deferred:
        """An operator cleared ``agent``'s locks and counts: for every broker. Fires
        once the shared table is cleared; fails (``503 busy``) when it cannot be."""


class Lockout:
    """Authentication failures per agent and source address, and the locks they
    cause (docs/SECURITY.md, "Brute force and the lockout").

    ``after`` consecutive failures of an agent from one address lock that address
    out for that agent for ``seconds``. The agent itself is locked (from every
    address) once ``after`` of its failures within ``seconds`` of the first came
    from at least :data:`AGENT_LOCK_ADDRESSES` addresses. Addresses are counted by
    :func:`relay.wire.protocol.address_group` (an IPv6 /64 is one address).

    Answers from its own tables, at once. With ``shared`` (brokers sharing one
    store), failures and successes are also reported there, and locks decided by
    another broker arrive through :meth:`lock`. Every table is bounded.
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
        # agent -> {address: consecutive failures}
        self._failures: Bounded = Bounded(max_tracked)
        # agent -> (first failure of the period, failures, addresses (at most
        # AGENT_LOCK_ADDRESSES of them))
        self._spread: Bounded = Bounded(max_tracked)
        # agent -> {address or EVERY_ADDRESS: the lock's end}
        self._locked: Bounded = Bounded(max_tracked)
        self._groups: Bounded = Bounded(1024)

    def share(self, shared: SharedLockouts) -> None:
        """Report failures and successes to ``shared`` from now on."""
        self.shared = shared

    def address(self, source: str) -> str:
        """The address a request from the client address ``source`` is counted under."""
        group = self._groups.get(source)
        if group is None:
            group = address_group(source) if source else source
            self._groups.put(source, group)
        return group

    def seconds_left(self, agent: str, source: str) -> Tuple[float, str]:
        """How long ``agent`` stays locked for requests from the client address
        ``source`` (0 when it is not), and the lock's scope (the address, or
        :data:`EVERY_ADDRESS`)."""
        locks = self._locked.get(agent)
        if locks is None:
            return 0.0, EVERY_ADDRESS
        now = self.clock.seconds()
        for address in (EVERY_ADDRESS, self.address(source)):
            until = locks.get(address)
            if until is not None:
                if now < until:
                    return until - now, address
                del locks[address]
        if not locks:
            del self._locked[agent]
        return 0.0, EVERY_ADDRESS

    def is_locked(self, agent: str, source: str) -> bool:
        """True while ``agent`` is locked for requests from ``source``."""
        return self.seconds_left(agent, source)[0] > 0

    def failed(self, agent: str, source: str) -> Counted:
        """Count a failure of ``agent`` from the client address ``source``."""
        address = self.address(source)
        shared = self.shared.failed(agent, address) if self.shared is not None else None
        now = self.clock.seconds()
        until = now + self.seconds
        started, count, addresses = self._spread.get(agent) or (now, 0, ())
        if now - started >= self.seconds:
            started, count, addresses = now, 0, ()
        if address not in addresses and len(addresses) < AGENT_LOCK_ADDRESSES:
            addresses += (address,)
        count += 1
        if count >= self.after and len(addresses) >= AGENT_LOCK_ADDRESSES:
            self._spread.pop(agent, None)
            return Counted(self.lock(agent, until), shared)
        self._spread.put(agent, (started, count, addresses))
        counts = self._failures.get(agent)
        if counts is None:
            counts = {}
            self._failures.put(agent, counts)
        failures = counts.pop(address, 0) + 1
        if failures >= self.after:
            return Counted(self.lock(agent, until, address), shared)
        counts[address] = failures
        if len(counts) > MAX_ADDRESSES_PER_AGENT:
            del counts[next(iter(counts))]
        return Counted(None, shared)

    def succeeded(self, agent: str, source: str) -> None:
        """A valid request resets the failure count of its agent and address."""
        counts = self._failures.get(agent)
        if counts is None and self.shared is None:
            return
        address = self.address(source)
        if counts is not None and counts.pop(address, None) is not None and not counts:
            del self._failures[agent]
        if self.shared is not None:  # it knows whether another broker counted any
            self.shared.succeeded(agent, address)

    def lock(self, agent: str, until: float, address: str = EVERY_ADDRESS) -> Optional[str]:
        """Lock ``agent`` from ``address`` (an address group, or every address)
        until ``until`` (epoch seconds). An existing lock that ends later stays.
        Returns ``address`` when this locked it, None when a lock held already."""
        now = self.clock.seconds()
        locks = self._locked.get(agent)
        if locks is None:
            locks = {}
            self._locked.put(agent, locks)
        for old in [a for a, end in locks.items() if end <= now]:
            del locks[old]
        if until <= max(locks.get(address, 0.0), now):
            if not locks:
                del self._locked[agent]
            return None
        locks[address] = until
        counts = self._failures.get(agent)
        if counts is not None:
            counts.pop(address, None)
            if address == EVERY_ADDRESS or not counts:
                del self._failures[agent]
        return address

    def clear(self, agent: str, address: str) -> None:
        """Forget ``agent``'s failure count from ``address`` here only (another
        broker saw it succeed)."""
        counts = self._failures.get(agent)
        if counts is not None:
            counts.pop(address, None)
            if not counts:
                del self._failures[agent]

    def unlock(self, agent: str) -> Tuple[int, Optional[Deferred]]:
        """An operator's clearing: ``agent``'s locks and failure counts are
        forgotten, here and (with ``shared``) on every broker. Returns how many
        locks were in force here, and the shared clearing's Deferred."""
        now = self.clock.seconds()
        live = sum(1 for until in (self._locked.get(agent) or {}).values() if until > now)
        self.forget(agent)
        return live, self.shared.unlocked(agent) if self.shared is not None else None

    def forget(self, agent: str) -> None:
        """Drop ``agent``'s failure counts and locks here only (an operator cleared
        them on another broker)."""
        self._failures.pop(agent, None)
        self._spread.pop(agent, None)
        self._locked.pop(agent, None)

    def locks(self) -> List[Tuple[str, str, float]]:
        """The locks in force: ``(agent, address or EVERY_ADDRESS, seconds left)``."""
        now = self.clock.seconds()
        return [(agent, address, until - now) for agent, locks in self._locked.items()
                for address, until in locks.items() if until > now]

    def tracked(self) -> Tuple[int, int]:
        """How many agents have failure counts and locks (for tests and stats)."""
        return len(self._failures), len(self._locked)


MAX_NONCES = 200_000


class Signed(NamedTuple):
    """A request whose signature verified: the agent that signed it, its nonce
    (None without ``X-Relay-Nonce``, and always on the v2/v3 wire), its timestamp, the
    client address it came from, the id of the agent's key that verified it
    (:data:`~relay.wire.v2.signing.LEGACY_KEY_ID` for the agent's ``secret`` or the
    shared secret), and the wire's scheme: ``seed``, ``v2`` or ``v3``."""

    agent: str
    nonce: Optional[str]
    timestamp: int
    source: str = ""
    key_id: str = LEGACY_KEY_ID
    scheme: str = "seed"


class SharedNonces(Protocol):
    """Where a :class:`NonceTable` also claims its nonces, when several brokers share
    them (see :class:`relay.store.interface.ISharedNonces`)."""

    def claim_nonce(self, agent: str, nonce: str, timestamp: int,
                    address: Optional[str] = None) -> Deferred:
        """Fires with True when no broker used ``nonce`` of ``agent`` within the skew
        window, False when one did; errbacks (``503 busy``) when it cannot tell.
        Where lockouts are shared too, a lock of ``agent`` for ``address`` that any
        broker set is applied to this broker's :class:`Lockout` before it fires."""


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
                   "bad_timestamp", "clock_skew", "bad_signature", "replayed", "unknown_key",
                   "expired_key")


def _keys(ring: Keyring) -> Tuple[Tuple[Any, str, Optional[float]], ...]:
    """A keyed HMAC-SHA256 per secret of ``ring``, copied per request (the key is
    prepared once), with the id and ``not_after`` of its key.

    Where :mod:`hmac` wraps OpenSSL's HMAC object, that object itself: its ``copy``,
    ``update`` and ``hexdigest`` are the same, without a Python call each."""
    prepared = []
    for key_id, key in ring.items():
        for secret in key.secrets:
            mac = hmac.new(secret.encode("utf-8"), digestmod=hashlib.sha256)
            prepared.append((getattr(mac, "_hmac", None) or mac, key_id, key.not_after))
    return tuple(prepared)


class Authenticator:
    """Checks the §3 headers of a request (and the §9 nonce), or those of the v2/v3
    wire (:meth:`verify_v2`), and names the agent that signed it.

    Each agent has a keyring (WIRE-V2 §4; without per-agent secrets, every agent has
    the one key ``legacy`` of the shared secrets): a seed-wire or v2 signature made
    with any key not past its ``notAfter`` verifies, a v3 one with the key it names.
    A key may hold several secrets while one is rotated. ``on_failure(reason)``
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
        on_lock: Optional[Callable[[str, str], None]] = None,
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
        self.per_agent = any(a.keys for a in agents.values())
        self._rings: Dict[str, Keyring] = {}
        self._keys: Dict[str, Tuple[Any, ...]] = {}
        self._shared_ring: Optional[Keyring] = None
        self._shared: Optional[Tuple[Any, ...]] = None
        if self.per_agent:
            for name, agent in agents.items():
                self._rings[name] = agent.keys
                self._keys[name] = _keys(agent.keys)
        else:
            self._shared_ring = {LEGACY_KEY_ID: SigningKey(
                tuple(shared_secrets or (shared_secret,)))}
            self._shared = _keys(self._shared_ring)
        if lockout is None:
            lockout = Lockout(clock, lock_after_failures, lock_seconds, max_tracked)
        else:  # a reload keeps the failure counts and locks, under the new settings
            lockout.after, lockout.seconds = lock_after_failures, lock_seconds
        self.lockout = lockout

    @classmethod
    def from_config(cls, config: Config, clock: IReactorTime,
                    on_lock: Optional[Callable[[str, str], None]] = None,
                    replacing: Optional[Authenticator] = None,
                    on_failure: Optional[Callable[[str], None]] = None) -> Authenticator:
        """An authenticator for the broker's settings; ``on_lock(agent, address)``
        hears of new locks (``address`` is :data:`EVERY_ADDRESS` for the agent's own).
        ``replacing`` is the authenticator it takes over from (a reload)."""
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

    @property
    def shares_nonces(self) -> bool:
        """True when a nonce accepted here must also be claimed from a table shared
        with other brokers (:meth:`claim`)."""
        return self.nonces.shared is not None

    def _refused(self, reason: str, error: errors.RelayError) -> errors.RelayError:
        if self.on_failure is not None:
            self.on_failure(reason)
        return error

    def _failed(self, agent: str, source: str, reason: str,
                error: errors.RelayError) -> errors.RelayError:
        counted = self.lockout.failed(agent, source)
        if counted.locked is not None and self.on_lock is not None:
            self.on_lock(agent, counted.locked)
        error.pending = counted.shared
        return self._refused(reason, error)

    def _keys_for(self, agent: str) -> Optional[Tuple[Any, ...]]:
        if self._shared is not None:
            return self._shared
        return self._keys.get(agent)

    def keyring(self, agent: str) -> Optional[Keyring]:
        """The keys that verify ``agent``'s requests, by id; None for an agent this
        broker does not know (one not configured, where agents have their own secrets)."""
        if self._shared_ring is not None:
            return self._shared_ring
        return self._rings.get(agent)

    def verify(
        self,
        method: bytes,
        path: bytes,
        agent_header: Optional[bytes],
        timestamp_header: Optional[bytes],
        signature_header: Optional[bytes],
        raw_body: bytes,
        nonce_header: Optional[bytes] = None,
        source: str = "",
    ) -> Signed:
        """The first step: check the §3 headers (and the §9 nonce) of a request from
        the client address ``source``; returns who signed it. Raises a RelayError
        on every failure: 401, 403 ``locked``, or 503 when the nonce table is full.

        A failure that counts toward the lockout carries, in ``pending``, the
        Deferred of its count in a table shared with other brokers (None when the
        counts are not shared): answer the refusal once it fired, so that the
        refusal that locks an agent means every broker refuses it.

        With ``X-Relay-Nonce`` the signing string covers the agent and the nonce,
        and each nonce is accepted once by this broker; a replay is refused
        without counting toward the lockout. ``require_nonce`` refuses requests
        without one. Where nonces are shared (:attr:`shares_nonces`), a request
        with a nonce is accepted only once :meth:`claim` succeeded too.
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
        left, scope = self.lockout.seconds_left(agent, source)
        if left > 0:
            raise self._refused("locked", errors.locked(locked_message(agent, scope, left)))
        if not _is_integer(timestamp_header):
            raise self._failed(agent, source, "bad_timestamp",
                               errors.unauthenticated("invalid timestamp"))
        timestamp = int(timestamp_header)
        # Whole seconds on both sides: a fractional clock would make the window lopsided.
        if abs(int(self.clock.seconds()) - timestamp) > MAX_CLOCK_SKEW_SECONDS:
            raise self._failed(agent, source, "clock_skew",
                               errors.unauthenticated("timestamp skew"))
        signed = signed_bytes(method, path, timestamp_header, raw_body, agent_header,
                              nonce_header)
        signature = signature_header.lower()
        now = self.clock.seconds()
        expired = False
        key_id = None
        for key, kid, not_after in keys:
            if not_after is not None and now > not_after:
                expired = True
                continue
            mac = key.copy()
            mac.update(signed)
            if hmac.compare_digest(mac.hexdigest().encode("ascii"), signature):
                key_id = kid
                break
        if key_id is None:
            if expired and _signed_by_expired(keys, now, signed, signature):
                raise self._refused("expired_key", errors.unauthenticated(
                    "signed with a key past its notAfter; sign with a current key"))
            raise self._failed(agent, source, "bad_signature", errors.unauthenticated(
                "invalid signature; check the secret and the clock"))
        if nonce is not None:
            try:
                self.nonces.use(agent, nonce, timestamp)
            except errors.RelayError as error:
                raise (self._refused("replayed", error) if error.status == 401 else error) from None
            if self.nonces.shared is not None:  # the success is the claim's to count
                return Signed(agent, nonce, timestamp, source, key_id)
        self.lockout.succeeded(agent, source)
        return Signed(agent, nonce, timestamp, source, key_id)

    def verify_v2(self, method: bytes, path: bytes, headers: SignedHeaders, raw_body: bytes,
                  source: str = "") -> Signed:
        """Authenticate a request of the v2/v3 wire (one carrying ``X-Agent-Relay-Agent``)
        from the client address ``source``; returns who signed it, with which key and
        scheme (``v3`` when it names a key id, else ``v2``). ``method`` and ``path`` are
        the request's method and target (path and query) as sent, ``headers`` its four
        authentication headers (``SignedHeaders.read(header)``), ``raw_body`` the body
        as received.

        The same rails as :meth:`verify`: unknown agents, the failure lockout (shared
        with the seed wire: it counts per agent and address), the rate limit (the
        caller's, before this). The v2/v3 wire carries no nonce, so a broker with
        ``security.requireNonce`` refuses every v2/v3 request. Raises a RelayError
        whose body is the reference's ``{"error": {"code", "message"}}``:

        - ``401 unauthenticated``: a missing or empty header, a bad agent name, a
          timestamp not a number or more than 300 s off, a signature no key
          verifies, or ``requireNonce`` set;
        - ``401 unknown_agent``: an agent this broker does not know (where agents
          have their own secrets);
        - ``401 unknown_key``: a v3 key id the agent's keyring lacks, or a key past
          its ``notAfter``;
        - ``403 locked``: the agent is locked for this address, or everywhere.

        As with :meth:`verify`, a failure that counts toward the lockout (a bad
        timestamp or signature) carries in ``pending`` the Deferred of its count in a
        table shared with other brokers: answer once it fired.
        """
        try:
            agent = read_agent(headers)
        except Refusal as refusal:
            raise self._refused(refusal.reason, refusal.error) from None
        ring = self.keyring(agent)
        if ring is None:
            raise self._refused("unknown_agent", errors.unknown_agent())
        left, scope = self.lockout.seconds_left(agent, source)
        if left > 0:
            raise self._refused("locked", errors.locked(locked_message(agent, scope, left)))
        if self.require_nonce:
            raise self._refused("bad_nonce", errors.unauthenticated(
                "this broker requires a signed nonce on every request (security.requireNonce); "
                "the v2/v3 wire carries none"))
        try:
            verified = check_request(ring, agent, headers, method, path, raw_body,
                                     self.clock.seconds())
        except Refusal as refusal:
            if refusal.counts:
                raise self._failed(agent, source, refusal.reason, refusal.error) from None
            raise self._refused(refusal.reason, refusal.error) from None
        self.lockout.succeeded(agent, source)
        return Signed(agent, None, verified.timestamp, source, verified.key_id,
                      verified.scheme)

    def claim(self, signed: Signed) -> Deferred:
        """The second step, where :attr:`shares_nonces` and ``signed.nonce`` is not
        None: claim the nonce from the table shared with other brokers. Fires with
        the agent name once no broker had accepted it; fails with the 401 of a
        replay (which counts toward no lockout), the 403 ``locked`` of a lock
        another broker set meanwhile, or 503 ``busy`` when the shared table cannot
        tell."""
        shared = self.nonces.shared
        if shared is None or signed.nonce is None:
            raise ValueError("claim() is for a nonce of a broker sharing its nonces")
        d = shared.claim_nonce(signed.agent, signed.nonce, signed.timestamp,
                               self.lockout.address(signed.source))
        d.addCallback(self._claimed, signed)
        return d

    def _claimed(self, first: bool, signed: Signed) -> str:
        if not first:
            raise self._refused("replayed", errors.unauthenticated(
                "replayed request (this nonce was used)"))
        # A lock another broker set while this one verified (its notification on
        # the way, or found by the claim itself) holds already.
        left, scope = self.lockout.seconds_left(signed.agent, signed.source)
        if left > 0:
            raise self._refused("locked", errors.locked(
                locked_message(signed.agent, scope, left)))
        self.lockout.succeeded(signed.agent, signed.source)
        return signed.agent


def locked_message(agent: str, scope: str, seconds_left: float) -> str:
    """The message of a ``403 locked``: what is locked, for how long, and how an
    operator clears it."""
    if seconds_left >= 60:
        left = f"{math.ceil(seconds_left / 60)} min"
    else:
        left = f"{max(1, math.ceil(seconds_left))} s"
    what = (f"agent {agent} is locked after authentication failures from several addresses"
            if scope == EVERY_ADDRESS else
            f"agent {agent} is locked for this address after repeated authentication failures")
    return (f"{what}; try again in {left}, or an operator clears it with "
            f"`relay unlock {agent}` or the dashboard")


def _signed_by_expired(keys: Tuple[Tuple[Any, str, Optional[float]], ...], now: float,
                       signed: bytes, signature: bytes) -> bool:
    """True when a key of ``keys`` past its ``not_after`` made ``signature``."""
    for key, _, not_after in keys:
        if not_after is not None and now > not_after:
            mac = key.copy()
            mac.update(signed)
            if hmac.compare_digest(mac.hexdigest().encode("ascii"), signature):
                return True
    return False


def _is_integer(value: bytes) -> bool:
    digits = value[1:] if value[:1] == b"-" else value
    return 0 < len(digits) <= 15 and digits.isdigit()
