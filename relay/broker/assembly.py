"""The composition root: the whole broker built from a config and a store.

:func:`assemble` is the one place where the relay's parts are made and wired
together: the counters, the broker and its policy, the authenticator and rate
limiter, the HTTP API and its site, the listeners of ``broker.listen``, the ops
app with its site and listeners, and the periodic sweeps. ``twistd relay``
(:mod:`relay.broker.tap`), the warm-up before listening (:mod:`relay.broker.warmup`), the test
harness (:mod:`relay.testing`) and the benchmarks all build through it;
:class:`relay.broker.service.RelayService` starts, stops and reloads what it returns.

A reload is :meth:`Assembly.reconfigure`: it hands each owner its new settings
through a method of its own (``configure``), and writes no other object's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Set

from twisted.application.internet import TimerService
from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from relay.broker.api import RelayAPI
from relay.broker.counters import SAMPLE_SECONDS, Counters
from relay.broker.operations import Broker, Policy
from relay.broker.site import RelaySite
from relay.broker.streams import EventStreams
from relay.broker.v2.operations import ModeACL
from relay.broker.webhooks import HookSettings, Poster, WebhookDelivery, http_poster
from relay.rules.auth import EVERY_ADDRESS, Authenticator, RateLimiter
from relay.rules.config import Config
from relay.rules.endpoints import server_endpoints
from relay.store.interface import ISharedLockouts, ISharedNonces

log = Logger(namespace="relay.service")

EXPIRY_SWEEP_SECONDS = 60.0
MIN_EXPIRY_SWEEP_SECONDS = 0.5
PEER_SWEEP_SECONDS = 15.0


def expiry_sweep_seconds(ttl_seconds: float) -> float:
    """How often the message TTL sweep runs: every minute, or every tenth of a
    shorter TTL (``messageTtlDays`` may be fractional or 0), so nothing outlives
    its lifetime by more than that."""
    return min(EXPIRY_SWEEP_SECONDS, max(MIN_EXPIRY_SWEEP_SECONDS, ttl_seconds / 10))


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


class Listener(Service):
    """Listens on one endpoint with one factory while running.

    A listener that cannot listen raises from ``privilegedStartService`` when the
    endpoint answers at once (as TCP and TLS endpoints do), so the start stops
    with the reason instead of logging it and serving nothing.
    """

    def __init__(self, endpoint: IStreamServerEndpoint, factory: Any) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.port: Any = None
        self._listening: Optional[Deferred] = None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        outcome: List[Any] = []
        d = self.endpoint.listen(self.factory)
        d.addBoth(outcome.append)
        if not outcome:  # an endpoint that listens later (systemd, a plugin)
            self._listening = d
            d.addCallback(self._listened)
            d.addErrback(lambda failure: log.failure("cannot listen", failure))
            outcome.append(None)
            return
        if isinstance(outcome[0], Failure):
            outcome[0].raiseException()
        self.port = outcome[0]

    def _listened(self, port: Any) -> None:
        self.port = port
        self._listening = None

    def startService(self) -> None:
        if self.port is None and self._listening is None:
            self.privilegedStartService()
        super().startService()

    def stopService(self) -> Optional[Deferred]:
        super().stopService()
        if self._listening is not None:
            self._listening.cancel()
            self._listening = None
        port, self.port = self.port, None
        return maybeDeferred(port.stopListening) if port is not None else None


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
             counters: Optional[Counters] = None, post: Optional[Poster] = None) -> RelayAPI:
    """The broker over ``store`` under ``config``'s policy, and its HTTP API. Webhooks
    are POSTed with ``post`` (Twisted's Agent on ``clock`` by default); they go out once the
    broker's :class:`~relay.broker.webhooks.WebhookDelivery` service runs."""
    counters = counters if counters is not None else Counters()
    streams = EventStreams(store, clock, config.max_streams_per_agent, config.max_streams,
                           counters)
    post = post if post is not None else http_poster(clock, config.webhook_concurrency)
    webhooks = WebhookDelivery(store, clock, post,
                               HookSettings.from_config(config), config.secret, counters)
    broker = Broker(store, clock, Policy.from_config(config), counters=counters,
                    streams=streams, webhooks=webhooks)
    store.observe_commits(counters.commit_timed)
    auth = make_authenticator(config, clock, counters)
    if ISharedLockouts.providedBy(store):  # several brokers count failures together
        auth.lockout.share(store.share_lockouts(auth.lockout))
    if ISharedNonces.providedBy(store):  # several brokers accept each signed nonce once
        auth.nonces.share(store)
    limiter = RateLimiter(clock, config.rate_limit_loopback, config.rate_limit_remote,
                          on_refusal=_log_rate_refusal)
    return RelayAPI(broker, auth, limiter, config.allowed_hosts, ModeACL.from_config(config),
                    config.agents)


@dataclass
class Assembly:
    """The parts of one broker, wired; the services to run them."""

    config: Config
    store: Any
    clock: IReactorTime
    counters: Counters
    api: RelayAPI
    site: RelaySite
    ops: Any = None
    ops_site: Optional[RelaySite] = None
    peer_watch: Optional[PeerWatch] = None
    services: List[Service] = field(default_factory=list)

    @property
    def broker(self) -> Broker:
        return self.api.broker

    def reconfigure(self, config: Config) -> None:
        """Put the settings of ``config`` that need no restart in force."""
        self.api.configure(make_authenticator(config, self.clock, self.counters, self.api.auth),
                           config.allowed_hosts, ModeACL.from_config(config), config.agents)
        self.api.rate_limiter.configure(config.rate_limit_loopback, config.rate_limit_remote)
        self.broker.configure(Policy.from_config(config))
        self.broker.streams.configure(config.max_streams_per_agent, config.max_streams)
        self.broker.webhooks.configure(HookSettings.from_config(config), config.secret)
        self.api.refresh_info()  # after the broker's settings: GET / advertises them
        self.site.configure(config.access_log, config.max_connections_per_address)
        if self.ops is not None:
            self.ops.configure(config.ops.tokens)
        self.config = config


def assemble(config: Config, store, reactor: Any, clock: Optional[IReactorTime] = None,
             listen: bool = True) -> Assembly:
    """The broker of ``config`` over ``store``: its API and site, its listeners and
    the ops app's when ``listen``, and its sweeps (as services, not yet started).

    ``clock`` is the time of the broker and its sweeps (``reactor`` by default).
    Raises ConfigError for a malformed endpoint string or a bad TLS file.
    """
    clock = clock if clock is not None else reactor
    counters = Counters()
    api = make_api(config, store, clock, counters)
    site = RelaySite(
        api.resource(),
        access_log=config.access_log,
        request_read_seconds=config.request_read_seconds,
        counters=counters,
        max_connections=config.max_connections,
        max_per_address=config.max_connections_per_address,
        reactor=clock,
    )
    assembly = Assembly(config, store, clock, counters, api, site)
    if not listen:
        return assembly
    services = assembly.services
    for endpoint in server_endpoints(reactor, config.listen, config.tls_client_ca):
        services.append(Listener(endpoint, site))
    if config.ops.listen:
        from prometheus_client import ProcessCollector

        from relay.broker.ops.web import OpsAPI

        assembly.ops = OpsAPI(api.broker, clock, config.ops.tokens,
                              extra_collectors=[ProcessCollector(registry=None)],
                              lockout=api.auth.lockout)
        assembly.ops_site = RelaySite(assembly.ops.resource(),
                                      request_read_seconds=config.request_read_seconds,
                                      reactor=clock)
        for endpoint in server_endpoints(reactor, config.ops.listen, key="broker.opsListen"):
            services.append(Listener(endpoint, assembly.ops_site))
    broker = api.broker

    def every(interval: float, name: str, step: Callable[[], object]) -> None:
        timer = TimerService(interval, guarded(name, step))
        timer.clock = clock
        timer.setName(name)
        services.append(timer)

    services.append(broker.webhooks)
    every(config.sweep_seconds, "leases", broker.sweep_leases)
    every(expiry_sweep_seconds(config.message_ttl_seconds), "expiry", broker.sweep_expired)
    assembly.peer_watch = PeerWatch(broker)
    every(PEER_SWEEP_SECONDS, "peers", assembly.peer_watch.check)
    every(SAMPLE_SECONDS, "samples", lambda: counters.sample(clock.seconds()))
    return assembly
