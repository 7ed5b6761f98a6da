"""The broker as a Twisted service: listening endpoints and periodic sweeps."""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence, Set

from twisted.application.internet import StreamServerEndpointService, TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.auth import Authenticator, RateLimiter
from relay.broker import Broker, Policy
from relay.config import Config
from relay.http import RelaySite
from relay.tls import server_endpoints
from relay.web import RelayAPI

log = Logger(namespace="relay.service")

EXPIRY_SWEEP_SECONDS = 60.0
MIN_EXPIRY_SWEEP_SECONDS = 0.5
PEER_SWEEP_SECONDS = 15.0
OPEN_FILES_WANTED = 65536
# Reactors that are not limited to select()'s 1024 descriptors.
_MANY_FD_REACTORS = frozenset({"EPollReactor", "PollReactor", "KQueueReactor"})


def expiry_sweep_seconds(ttl_seconds: float) -> float:
    """How often the message TTL sweep runs: every minute, or every tenth of a
    shorter TTL (``messageTtlDays`` may be fractional or 0), so nothing outlives
    its lifetime by more than that."""
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

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.online: Optional[Set[str]] = None

    def check(self) -> Deferred:
        d = self.broker.peers()
        d.addCallback(self._compare)
        return d

    def _compare(self, peers) -> None:
        online = {peer["agent"] for peer in peers if peer["online"]}
        if self.online is not None:
            for name in sorted(self.online - online):
                log.info("peer {agent} went offline", agent=name)
            for name in sorted(online - self.online):
                log.info("peer {agent} is online", agent=name)
        self.online = online


def _log_lock(agent: str) -> None:
    log.warn("agent {agent} is locked after repeated authentication failures", agent=agent)


def make_api(config: Config, store, clock: IReactorTime) -> RelayAPI:
    """The broker over ``store`` under ``config``'s policy, and its HTTP API."""
    broker = Broker(store, clock, Policy.from_config(config))
    auth = Authenticator.from_config(config, clock, _log_lock)
    limiter = RateLimiter(clock, config.rate_limit_loopback, config.rate_limit_remote)
    return RelayAPI(broker, auth, limiter)


class RelayService(MultiService):
    """The whole broker: one store, one API, N endpoints, the sweeps."""

    def __init__(
        self,
        config: Config,
        store,
        reactor,
        clock: Optional[IReactorTime] = None,
        created: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.store = store
        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        self.created = tuple(created)
        self.api = make_api(config, store, self.clock)
        self.broker = self.api.broker
        self.site = RelaySite(
            self.api.resource(),
            access_log=config.access_log,
            request_read_seconds=config.request_read_seconds,
        )
        for endpoint in server_endpoints(reactor, config.listen, config.tls_client_ca):
            listener = StreamServerEndpointService(endpoint, self.site)
            listener._raiseSynchronously = True
            listener.setServiceParent(self)
        self._timer(config.sweep_seconds, "leases", self.broker.sweep_leases)
        self._timer(
            expiry_sweep_seconds(config.message_ttl_seconds), "expiry", self.broker.sweep_expired
        )
        self.peer_watch = PeerWatch(self.broker)
        self._timer(PEER_SWEEP_SECONDS, "peers", self.peer_watch.check)

    def _timer(self, interval: float, name: str, step: Callable[[], object]) -> None:
        timer = TimerService(interval, guarded(name, step))
        timer.clock = self.clock
        timer.setServiceParent(self)

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
        if "broker.secretFile" in self.created:
            log.info("created a new shared secret in {path}", path=self.config.secret_file)
        if "broker.opsTokenFile" in self.created:
            log.info("created a new ops token in {path}", path=self.config.ops.token_file)
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
        self.broker.stop()
        d = maybeDeferred(super().stopService)
        d.addBoth(lambda _: self.store.close())
        return d
