"""The broker as a Twisted service: listening endpoints and periodic sweeps."""

from __future__ import annotations

import sys
from typing import Callable, Optional, Set

from twisted.application.internet import StreamServerEndpointService, TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.config import Config
from relay.http import RelaySite
from relay.protocol import HEARTBEAT_TTL_SECONDS
from relay.tls import server_endpoints
from relay.web import RelayAPI

log = Logger(namespace="relay.service")

EXPIRY_SWEEP_SECONDS = 60.0
MIN_EXPIRY_SWEEP_SECONDS = 0.5
PEER_SWEEP_SECONDS = 15.0
OPEN_FILES_WANTED = 65536
# Reactors that are not limited to select()'s 1024 descriptors.
_MANY_FD_REACTORS = frozenset({"EPollReactor", "PollReactor", "KQueueReactor"})


def expiry_sweep_seconds(ttl_seconds: Optional[float]) -> float:
    """How often the message TTL sweep runs: every minute, or every tenth of a
    shorter TTL (``messageTtlDays`` may be fractional), so nothing outlives its
    lifetime by more than that."""
    if ttl_seconds is None:
        return EXPIRY_SWEEP_SECONDS
    return min(EXPIRY_SWEEP_SECONDS, max(MIN_EXPIRY_SWEEP_SECONDS, ttl_seconds / 10))


def raise_open_files_limit(reactor, resource_module=None) -> Optional[int]:
    """Raise the soft limit on open files toward its hard limit (at most
    ``OPEN_FILES_WANTED``): every connection, idle or long-polling, holds one, and a
    service manager's default soft limit is often 1024. Only for reactors that can
    watch that many descriptors. Returns the soft limit in force, or None."""
    if type(reactor).__name__ not in _MANY_FD_REACTORS:
        return None
    if resource_module is None:
        try:
            import resource as resource_module
        except ImportError:  # not on this platform
            return None
    soft, hard = resource_module.getrlimit(resource_module.RLIMIT_NOFILE)
    infinity = resource_module.RLIM_INFINITY
    wanted = OPEN_FILES_WANTED if hard == infinity else min(hard, OPEN_FILES_WANTED)
    if soft != infinity and soft < wanted:
        try:
            resource_module.setrlimit(resource_module.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft
        return wanted
    return soft


def guarded(name: str, step: Callable[[], object]) -> Callable[[], Deferred]:
    """Wrap a periodic step so a failure is logged and the next run still happens."""

    def run() -> Deferred:
        d = maybeDeferred(step)

        def failed(failure) -> None:
            log.error("sweep {sweep} failed: {kind}", sweep=name, kind=failure.type.__name__)

        d.addErrback(failed)
        return d

    return run


class PeerWatch:
    """Logs (names only) when a registered peer goes offline or comes back."""

    def __init__(self, store, clock: IReactorTime) -> None:
        self.store = store
        self.clock = clock
        self.online: Optional[Set[str]] = None

    def check(self) -> Deferred:
        d = self.store.peers()
        d.addCallback(self._compare)
        return d

    def _compare(self, peers) -> None:
        now = self.clock.seconds()
        online = {name for name, seen in peers if now - seen < HEARTBEAT_TTL_SECONDS}
        if self.online is not None:
            for name in sorted(self.online - online):
                log.info("peer {agent} went offline", agent=name)
            for name in sorted(online - self.online):
                log.info("peer {agent} is online", agent=name)
        self.online = online


class RelayService(MultiService):
    """The whole broker: one store, one API, N endpoints, the sweeps."""

    def __init__(
        self,
        config: Config,
        store,
        reactor,
        clock: Optional[IReactorTime] = None,
        secret_created: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.store = store
        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        self.secret_created = secret_created
        self.api = RelayAPI(store, config, self.clock)
        self.site = RelaySite(
            self.api.resource(),
            access_log=config.access_log,
            request_read_seconds=config.request_read_seconds,
        )
        for endpoint in server_endpoints(reactor, config.listen, config.tls_client_ca):
            listener = StreamServerEndpointService(endpoint, self.site)
            listener._raiseSynchronously = True
            listener.setServiceParent(self)
        self._timer(config.sweep_seconds, "leases", self.sweep_leases)
        self._timer(
            expiry_sweep_seconds(config.message_ttl_seconds), "expiry", self.sweep_expired
        )
        self.peer_watch = PeerWatch(store, self.clock)
        self._timer(PEER_SWEEP_SECONDS, "peers", self.peer_watch.check)

    def _timer(self, interval: float, name: str, step: Callable[[], object]) -> None:
        timer = TimerService(interval, guarded(name, step))
        timer.clock = self.clock
        timer.setServiceParent(self)

    def sweep_leases(self) -> Deferred:
        """Release expired leases and wake the agents that got messages back."""
        d = self.store.sweep_leases(self.clock.seconds())

        def woke(agents) -> None:
            for agent in agents:
                self.api.waiters.wake(agent)

        d.addCallback(woke)
        return d

    def sweep_expired(self) -> Deferred:
        """Remove messages older than ``messageTtlDays``."""
        ttl = self.config.message_ttl_seconds
        if ttl is None:
            return maybeDeferred(lambda: 0)
        d = self.store.sweep_expired(self.clock.seconds() - ttl)

        def removed(count: int) -> None:
            if count:
                log.info("expired {count} messages", count=count)

        d.addCallback(removed)
        return d

    def privilegedStartService(self) -> None:
        """Listen on every endpoint; one that cannot listen stops the start with one line."""
        raise_open_files_limit(self.reactor)
        try:
            super().privilegedStartService()
        except CannotListenError as e:
            reason = getattr(e.socketError, "strerror", None) or str(e.socketError)
            sys.stderr.write(f"relay: cannot listen on {e.interface or '*'}:{e.port}: {reason}\n")
            raise SystemExit(1) from None

    def startService(self) -> None:
        if self.secret_created:
            log.info("created a new shared secret in {path}", path=self.config.secret_file)
        for key in self.config.ignored_keys:
            log.warn("config key {key} has no effect in this broker", key=key)
        if self.config.allow_insecure_remote:
            log.warn(
                "broker.allowInsecureRemote is set: plaintext HTTP may be reachable beyond "
                "loopback, and HMAC does not encrypt message content"
            )
        log.info(
            "relay broker starting: storage={storage}, listening on {listen}",
            storage=self.store.name,
            listen=", ".join(self.config.listen),
        )
        super().startService()

    def stopService(self) -> Deferred:
        self.api.waiters.stop()
        d = maybeDeferred(super().stopService)
        d.addBoth(lambda _: self.store.close())
        return d
