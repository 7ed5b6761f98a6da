"""Request authentication (spec §3): HMAC-SHA256 signatures, lockout, rate limits.

Pure: no reactor and no I/O. Time comes from an injected ``clock``
(``IReactorTime``); every table is bounded so a client cycling through agent
names or source addresses cannot grow the broker's memory.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import OrderedDict
from typing import Callable, Dict, Mapping, Optional, Tuple

from twisted.internet.interfaces import IReactorTime

from relay import errors
from relay.config import AgentConfig, Config
from relay.protocol import MAX_CLOCK_SKEW_SECONDS, is_loopback_host, is_valid_agent_name
from relay.signing import signing_string

RATE_WINDOW_SECONDS = 60.0
MAX_TRACKED = 50_000


class _Bounded(OrderedDict):
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
    """

    def __init__(
        self, clock: IReactorTime, loopback: int, remote: int, max_tracked: int = MAX_TRACKED
    ) -> None:
        self.clock = clock
        self.loopback = loopback
        self.remote = remote
        self._windows: _Bounded = _Bounded(max_tracked)
        self._loopback_cache: _Bounded = _Bounded(1024)

    def limit_for(self, host: str) -> int:
        """The per-minute limit of a source address."""
        loop = self._loopback_cache.get(host)
        if loop is None:
            loop = is_loopback_host(host)
            self._loopback_cache.put(host, loop)
        return self.loopback if loop else self.remote

    def hit(self, host: str) -> None:
        """Count one request from ``host``; raise 429 ``rate_limited`` over the limit."""
        now = self.clock.seconds()
        window = int(now // RATE_WINDOW_SECONDS)
        entry = self._windows.get(host)
        if entry is None or entry[0] < window - 1:
            previous, current = 0, 0
        elif entry[0] == window - 1:
            previous, current = entry[2], 0
        else:
            previous, current = entry[1], entry[2]
        elapsed = (now % RATE_WINDOW_SECONDS) / RATE_WINDOW_SECONDS
        estimate = previous * (1.0 - elapsed) + current
        if estimate >= self.limit_for(host):
            self._windows.put(host, (window, previous, current))
            raise errors.rate_limited()
        self._windows.put(host, (window, previous, current + 1))

    def tracked(self) -> int:
        """How many source addresses have a rate window (for tests and stats)."""
        return len(self._windows)


class Lockout:
    """Consecutive authentication failures per agent, and the locks they cause."""

    def __init__(
        self, clock: IReactorTime, after: int, seconds: float, max_tracked: int = MAX_TRACKED
    ) -> None:
        self.clock = clock
        self.after = after
        self.seconds = seconds
        self._failures: _Bounded = _Bounded(max_tracked)
        self._locked: _Bounded = _Bounded(max_tracked)

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

    def tracked(self) -> Tuple[int, int]:
        """How many agents have failure counts and locks (for tests and stats)."""
        return len(self._failures), len(self._locked)


class Authenticator:
    """Checks the §3 headers of a request and names the agent that signed it."""

    def __init__(
        self,
        clock: IReactorTime,
        shared_secret: str,
        agents: Mapping[str, AgentConfig],
        lock_after_failures: int = 5,
        lock_seconds: float = 300.0,
        max_tracked: int = MAX_TRACKED,
        on_lock: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.clock = clock
        self.on_lock = on_lock
        self.per_agent = any(a.secret for a in agents.values())
        self._keys: Dict[str, hmac.HMAC] = {}
        if self.per_agent:
            for name, agent in agents.items():
                self._keys[name] = hmac.new(agent.secret.encode("utf-8"), digestmod=hashlib.sha256)
            self._shared = None
        else:
            self._shared = hmac.new(shared_secret.encode("utf-8"), digestmod=hashlib.sha256)
        self.lockout = Lockout(clock, lock_after_failures, lock_seconds, max_tracked)

    @classmethod
    def from_config(cls, config: Config, clock: IReactorTime,
                    on_lock: Optional[Callable[[str], None]] = None) -> Authenticator:
        """An authenticator for the broker's settings; ``on_lock(agent)`` hears of new locks."""
        return cls(
            clock,
            config.secret,
            config.agents,
            config.lock_after_failures,
            config.lock_minutes * 60.0,
            on_lock=on_lock,
        )

    def _failed(self, agent: str, error: errors.RelayError) -> errors.RelayError:
        if self.lockout.failed(agent) and self.on_lock is not None:
            self.on_lock(agent)
        return error

    def _key_for(self, agent: str) -> Optional[hmac.HMAC]:
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
    ) -> str:
        """The authenticated agent name, or a RelayError (401 or 403 ``locked``)."""
        if not agent_header or not timestamp_header or not signature_header:
            raise errors.unauthenticated("missing authentication headers")
        try:
            agent = agent_header.decode("ascii")
        except UnicodeDecodeError:
            raise errors.unauthenticated("invalid agent name") from None
        if not is_valid_agent_name(agent):
            raise errors.unauthenticated("invalid agent name")
        key = self._key_for(agent)
        if key is None:
            raise errors.unknown_agent()
        if self.lockout.is_locked(agent):
            left = math.ceil(self.lockout.seconds_left(agent))
            raise errors.locked(
                f"agent is locked after repeated authentication failures; "
                f"try again in {left} s"
            )
        if not _is_integer(timestamp_header):
            raise self._failed(agent, errors.unauthenticated("invalid timestamp"))
        # Whole seconds on both sides: a fractional clock would make the window lopsided.
        if abs(int(self.clock.seconds()) - int(timestamp_header)) > MAX_CLOCK_SKEW_SECONDS:
            raise self._failed(agent, errors.unauthenticated("timestamp skew"))
        mac = key.copy()
        mac.update(signing_string(method, path, timestamp_header, raw_body))
        if not hmac.compare_digest(mac.hexdigest().encode("ascii"), signature_header.lower()):
            raise self._failed(
                agent, errors.unauthenticated("invalid signature; check the secret and the clock")
            )
        self.lockout.succeeded(agent)
        return agent


def _is_integer(value: bytes) -> bool:
    digits = value[1:] if value[:1] == b"-" else value
    return 0 < len(digits) <= 15 and digits.isdigit()
