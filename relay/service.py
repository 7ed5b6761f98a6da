"""The broker as a Twisted service: listening endpoints and periodic sweeps."""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Set, Tuple

from twisted.application.internet import StreamServerEndpointService, TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.auth import EVERY_ADDRESS, Authenticator, RateLimiter
from relay.broker import Broker, Policy
from relay.config import Config
from relay.counters import SAMPLE_SECONDS, Counters
from relay.errors import ConfigError
from relay.http import RelaySite
from relay.ops.web import OpsAPI
from relay.store.interface import ISharedLockouts, ISharedNonces
from relay.tls import server_endpoints
from relay.warmup import warm_up
from relay.web import RelayAPI

log = Logger(namespace="relay.service")

EXPIRY_SWEEP_SECONDS = 60.0
MIN_EXPIRY_SWEEP_SECONDS = 0.5
PEER_SWEEP_SECONDS = 15.0
OPEN_FILES_WANTED = 65536
# Descriptors kept for the store, the logs and the listeners themselves.
FILES_IN_RESERVE = 64
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


def _lock_reporter(counters: Counters) -> Callable[[str, str], None]:
    def locked(agent: str, address: str) -> None:
        if address == EVERY_ADDRESS:
            log.warn("agent {agent} is locked after authentication failures from several "
                     "addresses", agent=agent)
        else:
            log.warn("agent {agent} is locked for address {address} after repeated "
                     "authentication failures", agent=agent, address=address)
        counters.agent_locked(agent)

    return locked


def _log_rate_refusal(address: str, key: str, limit: int) -> None:
    log.warn("rate limit: requests from {address} refused over broker.{key} ({limit} a "
             "minute); further refusals of this address are not logged this minute",
             address=address, key=key, limit=limit)


def make_authenticator(config: Config, clock: IReactorTime, counters: Counters,
                       replacing: Optional[Authenticator] = None) -> Authenticator:
    """The authenticator of ``config``, reporting to ``counters``; it takes over the
    locks and seen nonces of ``replacing`` (a reload)."""
    return Authenticator.from_config(config, clock, _lock_reporter(counters),
                                     replacing=replacing, on_failure=counters.auth_failed)


def make_api(config: Config, store, clock: IReactorTime,
             counters: Optional[Counters] = None) -> RelayAPI:
    """The broker over ``store`` under ``config``'s policy, and its HTTP API."""
    counters = counters if counters is not None else Counters()
    broker = Broker(store, clock, Policy.from_config(config), counters=counters)
    store.observe_commits(counters.commit_timed)
    auth = make_authenticator(config, clock, counters)
    if ISharedLockouts.providedBy(store):  # several brokers count failures together
        auth.lockout.share(store.share_lockouts(auth.lockout))
    if ISharedNonces.providedBy(store):  # several brokers accept each signed nonce once
        auth.nonces.share(store)
    limiter = RateLimiter(clock, config.rate_limit_loopback, config.rate_limit_remote,
                          on_refusal=_log_rate_refusal)
    return RelayAPI(broker, auth, limiter, config.allowed_hosts)


def _ops_endpoints(reactor, descriptions: Sequence[str]) -> list:
    """The ops listener's endpoints; their errors name ``broker.opsListen``."""
    try:
        return server_endpoints(reactor, descriptions)
    except ConfigError as error:
        raise ConfigError("broker.opsListen", error.reason) from None
    except ValueError as error:  # a malformed endpoint string
        raise ConfigError("broker.opsListen", str(error)) from None


# Keys read only at start: a reload that changes them says so and keeps them.
RESTART_KEYS = (
    ("broker.listen", "listen"),
    ("broker.opsListen", "ops.listen"),
    ("broker.storage", "storage_backend"),
    ("broker.dataDir", "data_dir"),
    ("broker.sync", "sync"),
    ("broker.tlsClientCA", "tls_client_ca"),
    ("broker.sweepSeconds", "sweep_seconds"),
    ("broker.requestReadSeconds", "request_read_seconds"),
    ("broker.messageTtlDays (the sweep interval)", "message_ttl_seconds"),
    ("broker.maxConnections", "max_connections"),
    ("broker.<backend> sections", "backend_sections"),
)


def _value(config: Config, path: str) -> object:
    value: object = config
    for name in path.split("."):
        value = getattr(value, name)
    return dict(value) if isinstance(value, Mapping) else value


class RelayService(MultiService):
    """The whole broker: one store, one API, N endpoints, the sweeps, and the ops
    listener when ``broker.opsListen`` has endpoints.

    ``reload_config`` (when given) loads the config file again, as at start;
    :meth:`reload` (``SIGHUP``) applies what it can of the new config.
    """

    def __init__(
        self,
        config: Config,
        store,
        reactor,
        clock: Optional[IReactorTime] = None,
        created: Sequence[str] = (),
        reload_config: Optional[Callable[[], Tuple[Config, Sequence[str]]]] = None,
        handle_signals: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        # What the running listeners, store and timers were built from: a key that
        # needs a restart is pending while the config read last differs from this.
        self.started_config = config
        self.store = store
        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        self.created = tuple(created)
        self.reload_config = reload_config
        self.handle_signals = handle_signals
        self._previous_hup: Any = None
        self.counters = Counters()
        self.api = make_api(config, store, self.clock, self.counters)
        self.broker = self.api.broker
        self.site = RelaySite(
            self.api.resource(),
            access_log=config.access_log,
            request_read_seconds=config.request_read_seconds,
            counters=self.counters,
            max_connections=config.max_connections,
            max_per_address=config.max_connections_per_address,
        )
        for endpoint in server_endpoints(reactor, config.listen, config.tls_client_ca):
            listener = StreamServerEndpointService(endpoint, self.site)
            listener._raiseSynchronously = True
            listener.setServiceParent(self)
        self.ops: Optional[OpsAPI] = None
        if config.ops.listen:
            from prometheus_client import ProcessCollector

            self.ops = OpsAPI(self.broker, self.clock, config.ops.tokens,
                              extra_collectors=[ProcessCollector(registry=None)],
                              lockout=self.api.auth.lockout)
            self.ops_site = RelaySite(self.ops.resource(),
                                      request_read_seconds=config.request_read_seconds)
            for endpoint in _ops_endpoints(reactor, config.ops.listen):
                listener = StreamServerEndpointService(endpoint, self.ops_site)
                listener._raiseSynchronously = True
                listener.setServiceParent(self)
        self._timer(config.sweep_seconds, "leases", self.broker.sweep_leases)
        self._timer(
            expiry_sweep_seconds(config.message_ttl_seconds), "expiry", self.broker.sweep_expired
        )
        self.peer_watch = PeerWatch(self.broker)
        self._timer(PEER_SWEEP_SECONDS, "peers", self.peer_watch.check)
        self._timer(SAMPLE_SECONDS, "samples",
                    lambda: self.counters.sample(self.clock.seconds()))

    # -- reload ----------------------------------------------------------------------

    def reload(self) -> bool:
        """Read the config file again and apply it: agents, secrets, ACLs, policy, rate
        limits, lockout settings and the ops tokens change at once; connections and
        waiting requests are untouched. A config with errors is refused with one log
        line and the running one stays. Returns whether the new config was applied."""
        if self.reload_config is None:
            log.warn("config reload asked for, but this broker has no config file to read")
            return False
        try:
            config, created = self.reload_config()
        except ConfigError as error:
            log.error("config reload refused, the running config stays: {error}",
                      error=str(error))
            return False
        self.apply(config)
        for key in created:
            log.info("config reload created {key}", key=key)
        for warning in config.warnings:
            log.warn("config: {warning}", warning=warning)
        return True

    def apply(self, config: Config) -> None:
        """Put the settings of ``config`` that need no restart in force."""
        api = self.api
        api.auth = make_authenticator(config, self.clock, self.counters, api.auth)
        api.rate_limiter.loopback = config.rate_limit_loopback
        api.rate_limiter.remote = config.rate_limit_remote
        self.broker.policy = Policy.from_config(config)
        self.site.access_log = config.access_log
        self.site.max_per_address = config.max_connections_per_address
        api.allowed_hosts = frozenset(config.allowed_hosts)
        if self.ops is not None:
            self.ops.tokens = config.ops.tokens
        kept = [key for key, path in RESTART_KEYS
                if _value(config, path) != _value(self.started_config, path)]
        log.info("config reloaded: {agents} agents", agents=len(config.agents))
        if kept:
            log.warn("config reload: {keys} take effect at the next start",
                     keys=", ".join(kept))
        self.config = config

    def _hangup(self, signum: int, frame: Any) -> None:
        self.reactor.callFromThread(self.reload)

    def _timer(self, interval: float, name: str, step: Callable[[], object]) -> None:
        timer = TimerService(interval, guarded(name, step))
        timer.clock = self.clock
        timer.setServiceParent(self)

    def privilegedStartService(self) -> None:
        """Listen on every endpoint; one that cannot listen stops the start with one line.

        The connection cap stays below the open-files limit, so an accept never fails
        for want of a descriptor (and Twisted never logs that, once per attempt).
        """
        # Before listening: no client waits on a request path a JIT has not compiled.
        warm_up(self.config, self.config.warmup_seconds)
        soft = raise_open_files_limit(self.reactor)
        if soft is not None and soft - FILES_IN_RESERVE < self.site.max_connections:
            self.site.max_connections = max(1, soft - FILES_IN_RESERVE)
            log.info("at most {count} connections: the open-files limit is {soft}",
                     count=self.site.max_connections, soft=soft)
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
        for warning in self.config.warnings:
            log.warn("config: {warning}", warning=warning)
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
        if self.config.ops.listen:
            log.info("ops listener (health, metrics, dashboard) on {listen}",
                     listen=", ".join(self.config.ops.listen))
        if self.handle_signals and hasattr(signal, "SIGHUP"):
            self._previous_hup = signal.signal(signal.SIGHUP, self._hangup)
        super().startService()

    def stopService(self) -> Deferred:
        if self._previous_hup is not None:
            signal.signal(signal.SIGHUP, self._previous_hup)
            self._previous_hup = None
        if self.ops is not None:
            self.ops.stopping = True
        self.broker.stop()
        d = maybeDeferred(super().stopService)
        d.addBoth(lambda _: self.store.close())
        return d
