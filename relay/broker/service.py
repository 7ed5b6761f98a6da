"""The broker as a Twisted service: it starts, stops and reloads an
:class:`relay.broker.assembly.Assembly` (its listeners and periodic sweeps)."""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.logger import Logger

from relay.broker.assembly import (  # noqa: F401 (named here for the callers that know them so)
    Assembly,
    PeerWatch,
    assemble,
    expiry_sweep_seconds,
    guarded,
    make_api,
    make_authenticator,
)
from relay.broker.warmup import warm_up
from relay.rules.config import RESTART_KEYS, Config
from relay.wire.errors import ConfigError

log = Logger(namespace="relay.service")

OPEN_FILES_WANTED = 65536
# Descriptors kept for the store, the logs and the listeners themselves.
FILES_IN_RESERVE = 64
# Reactors that are not limited to select()'s 1024 descriptors.
_MANY_FD_REACTORS = frozenset({"EPollReactor", "PollReactor", "KQueueReactor"})


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


def _value(config: Config, path: str) -> object:
    value: object = config
    for name in path.split("."):
        value = getattr(value, name)
    return dict(value) if isinstance(value, Mapping) else value


class _Part:
    """A read-only attribute of a :class:`RelayService` that is its assembly's."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, service: Any, owner: Any = None) -> Any:
        if service is None:
            return self
        return getattr(service.assembly, self.name)


class RelayService(MultiService):
    """The whole broker: the listeners, the sweeps and the ops listener of an
    :class:`relay.broker.assembly.Assembly`, and its store, closed when the service stops.

    ``reload_config`` (when given) loads the config file again, as at start;
    :meth:`reload` (``SIGHUP``) applies what it can of the new config.
    """

    def __init__(
        self,
        assembly: Assembly,
        reactor,
        created: Sequence[str] = (),
        reload_config: Optional[Callable[[], Tuple[Config, Sequence[str]]]] = None,
        handle_signals: bool = False,
    ) -> None:
        super().__init__()
        self.assembly = assembly
        self.config = assembly.config
        # What the running listeners, store and timers were built from: a key that
        # needs a restart is pending while the config read last differs from this.
        self.started_config = assembly.config
        self.reactor = reactor
        self.created = tuple(created)
        self.reload_config = reload_config
        self.handle_signals = handle_signals
        self._previous_hup: Any = None
        for service in assembly.services:
            service.setServiceParent(self)

    # The parts of the assembly, under the names callers and tests know them by.
    store = _Part("store")
    clock = _Part("clock")
    counters = _Part("counters")
    api = _Part("api")
    broker = _Part("broker")
    site = _Part("site")
    ops = _Part("ops")
    ops_site = _Part("ops_site")
    peer_watch = _Part("peer_watch")

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
        self.assembly.reconfigure(config)
        kept = [key for key, path in RESTART_KEYS
                if _value(config, path) != _value(self.started_config, path)]
        log.info("config reloaded: {agents} agents", agents=len(config.agents))
        if kept:
            log.warn("config reload: {keys} take effect at the next start",
                     keys=", ".join(kept))
        self.config = config

    def _hangup(self, signum: int, frame: Any) -> None:
        self.reactor.callFromThread(self.reload)

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
