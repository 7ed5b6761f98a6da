"""The twistd plugin, the composition root and the periodic sweeps."""

from __future__ import annotations

import subprocess
import sys

import pytest
import pytest_twisted
from twisted.application.service import IServiceMaker
from twisted.internet.defer import fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs
from twisted.plugin import IPlugin, getPlugins
from zope.interface.verify import verifyObject

from relay.broker.assembly import assemble
from relay.broker.service import RelayService
from relay.broker.tap import Options, makeService
from relay.store.interface import IMessageStore, IStoreFactory
from relay.store.memory import MemoryStore
from relay.store.plugins import find_store_factory, store_factories
from relay.testing import RULES, START, make_config, make_rules, new_message


def test_twistd_plugins_are_found():
    import twisted.plugins

    names = {p.tapname for p in getPlugins(IServiceMaker, twisted.plugins)}
    assert {"relay", "relay-agent"} <= names


@pytest.mark.process
def test_twistd_lists_relay():
    out = subprocess.run(
        [sys.executable, "-m", "twisted", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert " relay " in out


def test_store_factories_are_plugins():
    factories = store_factories()
    assert {"memory", "sqlite", "jsonl", "postgres"} <= set(factories)
    for factory in factories.values():
        assert verifyObject(IPlugin, factory)
        assert verifyObject(IStoreFactory, factory)


def test_memory_store_provides_the_interface():
    assert verifyObject(IMessageStore, MemoryStore())


def test_unknown_backend_lists_the_names():
    from relay.wire.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        find_store_factory("oracle")
    assert info.value.key == "broker.storage"
    assert "memory" in info.value.reason and "sqlite" in info.value.reason


def options(*argv: str) -> Options:
    o = Options()
    o.parseOptions(list(argv))
    return o


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "relay.yaml"
    path.write_text(text)
    return str(path)


def test_make_service_listens_on_every_endpoint(tmp_path):
    conf = write_config(
        tmp_path,
        "broker: {secret: s0123456789abcdef, storage: memory, "
        "listen: ['tcp:19991:interface=127.0.0.1', "
        "'tcp6:19992:interface=\\:\\:1']}\n",
    )
    reactor = MemoryReactorClock()
    service = makeService(options("--config", conf), reactor)
    service.startService()
    try:
        ports = sorted((port, iface) for port, _, _, iface in reactor.tcpServers)
        assert ports == [(19991, "127.0.0.1"), (19992, "::1")]
    finally:
        service.stopService()


def test_command_line_listen_overrides_the_file(tmp_path):
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, storage: memory}\n")
    reactor = MemoryReactorClock()
    service = makeService(
        options("--config", conf, "--listen", "tcp:19993:interface=127.0.0.1"), reactor
    )
    service.startService()
    try:
        assert [port for port, *_ in reactor.tcpServers] == [19993]
    finally:
        service.stopService()


def test_config_error_exits_with_one_line(tmp_path, capsys):
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, port: nope}\n")
    with pytest.raises(SystemExit) as info:
        makeService(options("--config", conf), MemoryReactorClock())
    assert info.value.code == 78  # EX_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broker.port" in err


class FlakyStore(MemoryStore):
    """A store whose lease sweep fails the first time."""

    def __init__(self) -> None:
        super().__init__()
        self.sweeps = 0

    def sweep_leases(self, now, rules):
        self.sweeps += 1
        if self.sweeps == 1:
            return fail(RuntimeError("disk on fire"))
        return super().sweep_leases(now, rules)


def make_service(store=None, **broker):
    clock = Clock()
    clock.advance(START)
    config = make_config(listen=["tcp:0:interface=127.0.0.1"], sweepSeconds=5, **broker)
    reactor = MemoryReactorClock()
    service = RelayService(assemble(config, store or MemoryStore(), reactor, clock), reactor)
    return service, clock


def test_a_failing_sweep_runs_again():
    store = FlakyStore()
    service, clock = make_service(store)
    with capturedLogs() as events:
        service.startService()
        clock.advance(5)
        clock.advance(5)
    service.stopService()
    assert store.sweeps == 3
    assert [e["kind"] for e in events if e.get("sweep") == "leases"] == ["RuntimeError"]


def test_lease_sweep_requeues_and_wakes_waiters():
    store = MemoryStore()
    service, clock = make_service(store, leaseSeconds=10)
    service.startService()
    store.add(new_message("alpha", "beta", START, id="m1"), RULES)
    store.pull("beta", 1, 10, clock.seconds(), make_rules())
    woken = []
    service.broker.waiters.wake = woken.append
    clock.advance(5)
    assert store.records.by_id["m1"].status == "leased"
    clock.advance(5)
    # woken at the lease deadline, and again by the sweep that requeued the message
    assert store.records.by_id["m1"].status == "queued" and woken == ["beta", "beta"]
    service.stopService()


def test_expiry_sweep_removes_old_messages():
    store = MemoryStore()
    service, clock = make_service(store, messageTtlDays=1)
    service.startService()
    store.add(new_message("alpha", "beta", START, id="old"), RULES)
    clock.advance(86400 - 60)
    store.add(new_message("alpha", "beta", clock.seconds(), id="new"), RULES)
    clock.advance(120)
    assert set(store.records.by_id) == {"new"}
    service.stopService()


def test_ttl_zero_expires_every_message_as_the_reference_does():
    store = MemoryStore()
    store.add(new_message("alpha", "beta", START - 1, id="before the start"), RULES)
    service, clock = make_service(store, messageTtlDays=0)
    service.startService()
    assert set(store.records.by_id) == set(), "swept when the broker starts"
    store.add(new_message("alpha", "beta", START, id="sent now"), RULES)
    clock.advance(0.5)
    assert set(store.records.by_id) == set(), "and within half a second afterwards"
    service.stopService()


def test_peer_watch_logs_offline_peers_by_name():
    store = MemoryStore()
    service, clock = make_service(store)
    store.register("beta", clock.seconds())
    with capturedLogs() as events:
        service.startService()
        clock.advance(100)
    service.stopService()
    messages = [e["log_format"].format(**e) for e in events if "agent" in e]
    assert "peer beta went offline" in messages


@pytest_twisted.ensureDeferred
async def test_stop_answers_waiters_and_closes_the_store():
    closed = []

    class ClosingStore(MemoryStore):
        def close(self):
            closed.append(True)
            return succeed(None)

    service, clock = make_service(ClosingStore())
    service.startService()
    d = service.broker.waiters.wait_for("beta", lambda: succeed([]), bool, 20)
    assert not d.called
    await service.stopService()
    assert d.called and closed == [True]


def test_a_short_fractional_ttl_is_swept_within_a_tenth_of_it():
    store = MemoryStore()
    service, clock = make_service(store, messageTtlDays=0.0001)  # 8.64 s
    service.startService()
    store.add(new_message("alpha", "beta", clock.seconds(), id="short"), RULES)
    clock.advance(8.0)
    assert set(store.records.by_id) == {"short"}
    clock.advance(0.64 + 0.864 + 0.01)
    assert set(store.records.by_id) == set()
    service.stopService()


def test_expiry_sweep_interval():
    from relay.broker.service import expiry_sweep_seconds

    assert expiry_sweep_seconds(0.0) == 0.5
    assert expiry_sweep_seconds(7 * 86400.0) == 60.0
    assert expiry_sweep_seconds(100.0) == 10.0
    assert expiry_sweep_seconds(1.0) == 0.5


class _Limits:
    """A stand-in for the ``resource`` module."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse

    def getrlimit(self, which: int):
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits) -> None:
        if self.refuse:
            raise ValueError("not allowed")
        self.limits = tuple(limits)


class EPollReactor:
    """Named like the reactor that can watch many descriptors."""


class SelectReactor:
    """Named like select()'s reactor, limited to 1024 descriptors."""


def test_open_files_limit_is_raised_toward_the_hard_limit():
    from relay.broker.service import raise_open_files_limit

    limits = _Limits(1024, 524288)
    assert raise_open_files_limit(EPollReactor(), limits) == 65536
    assert limits.limits == (65536, 524288)
    small = _Limits(1024, 4096)
    assert raise_open_files_limit(EPollReactor(), small) == 4096
    unlimited = _Limits(1024, _Limits.RLIM_INFINITY)
    assert raise_open_files_limit(EPollReactor(), unlimited) == 65536
    high = _Limits(100000, 200000)
    assert raise_open_files_limit(EPollReactor(), high) == 100000 and high.limits[0] == 100000


def test_open_files_limit_is_left_alone_when_it_cannot_or_should_not_change():
    from relay.broker.service import raise_open_files_limit

    refused = _Limits(1024, 524288, refuse=True)
    assert raise_open_files_limit(EPollReactor(), refused) == 1024
    select_bound = _Limits(1024, 524288)
    assert raise_open_files_limit(SelectReactor(), select_bound) is None
    assert select_bound.limits == (1024, 524288)


def test_a_backend_section_is_validated_by_its_factory(tmp_path, capsys):
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, storage: memory, "
                                  "sqlite: {sync: sometimes}}\n")
    with pytest.raises(SystemExit):
        makeService(options("--config", conf), MemoryReactorClock())
    err = capsys.readouterr().err
    assert err == "relay: config error: broker.sqlite.sync: must be one of off, normal, full\n"
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, storage: jsonl, "
                                  "jsonl: {compact: 1}}\n")
    with pytest.raises(SystemExit):
        makeService(options("--config", conf), MemoryReactorClock())
    assert "broker.jsonl.compact: unknown key" in capsys.readouterr().err


@pytest_twisted.ensureDeferred
async def test_a_backend_section_sets_the_backends_options(tmp_path):
    from relay.store.plugins import open_configured_store

    config = make_config(storage="sqlite", dataDir=str(tmp_path), sync="off",
                         sqlite={"sync": "full"})
    store = open_configured_store(config, MemoryReactorClock())
    try:
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    finally:
        await store.close()
    config = make_config(storage="jsonl", dataDir=str(tmp_path), jsonl={"compactMinRecords": 500})
    store = open_configured_store(config, MemoryReactorClock())
    try:
        assert (store.compact_min_records, store.fsync) == (500, False)
    finally:
        await store.close()


def test_a_dropin_backend_gets_its_own_section_without_touching_the_config_module(tmp_path):
    from zope.interface import implementer

    from relay.rules.config import load_config
    from relay.store.plugins import open_configured_store
    from relay.wire.errors import ConfigError

    opened = []

    @implementer(IPlugin, IStoreFactory)
    class RemoteFactory:
        name = "remote"

        def parse_options(self, section, config):
            if not isinstance(section.get("dsn"), str):
                raise ConfigError("broker.remote.dsn", "is required")
            return {"dsn": section["dsn"], "pool": section.get("poolSize", 4)}

        def open(self, config, options, clock):
            opened.append(options)
            return MemoryStore()

    factories = dict(store_factories(), remote=RemoteFactory())
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, storage: remote, "
                                  "remote: {dsn: 'host=db', poolSize: 8}}\n")
    config, _ = load_config(conf, backends=factories)
    open_configured_store(config, MemoryReactorClock(), factories)
    assert opened == [{"dsn": "host=db", "pool": 8}]
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, storage: remote}\n")
    config, _ = load_config(conf, backends=factories)
    with pytest.raises(ConfigError) as info:
        open_configured_store(config, MemoryReactorClock(), factories)
    assert info.value.key == "broker.remote.dsn"


# -- the ops listener and reloads ------------------------------------------------------


def test_the_ops_listener_is_a_second_site(tmp_path):
    conf = write_config(
        tmp_path,
        "broker: {secret: s0123456789abcdef, storage: memory, "
        "listen: ['tcp:19994:interface=127.0.0.1'], "
        "opsListen: ['tcp:19995:interface=127.0.0.1']}\n",
    )
    reactor = MemoryReactorClock()
    service = makeService(options("--config", conf), reactor)
    service.startService()
    try:
        sites = {port: factory for port, factory, _, _ in reactor.tcpServers}
        assert set(sites) == {19994, 19995}
        assert sites[19995] is service.ops_site and sites[19994] is service.site
        assert sites[19995].counters is None and sites[19994].counters is service.counters
    finally:
        service.stopService()
    assert service.ops.stopping


def test_a_bad_ops_endpoint_names_its_key(tmp_path, capsys):
    conf = write_config(tmp_path, "broker: {secret: s0123456789abcdef, storage: memory, "
                                  "opsListen: ['ssl:19996:privateKey=missing.pem']}\n")
    with pytest.raises(SystemExit):
        makeService(options("--config", conf), MemoryReactorClock())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broker.opsListen" in err and "missing.pem" in err


def reloading_service(tmp_path, text: str):
    conf = write_config(tmp_path, text)
    service = makeService(options("--config", conf), MemoryReactorClock())
    return service, conf


def test_reload_applies_secrets_acls_limits_and_lockout(tmp_path):
    from relay.rules.auth import Authenticator

    service, conf = reloading_service(
        tmp_path, "broker: {secret: s0123456789abcdef, storage: memory, rateLimitRemote: 10}\n"
                  "agents: {alpha: {secret: a1-0123456789abcdef}, "
                  "beta: {secret: b1-0123456789abcdef}}\n")
    old_auth = service.api.auth
    with open(conf, "w") as f:
        f.write("broker: {secret: s0123456789abcdef, storage: memory, rateLimitRemote: 20, "
                "maxAttempts: 7}\n"
                "security: {lockAfterFailures: 9}\n"
                "agents: {alpha: {secret: [a2-0123456789abcdef, a1-0123456789abcdef], "
                "allowed_targets: [beta]}, beta: {secret: b1-0123456789abcdef}, "
                "gamma: {secret: g1-0123456789abcdef}}\n")
    with capturedLogs() as events:
        assert service.reload() is True
    auth = service.api.auth
    assert isinstance(auth, Authenticator) and auth is not old_auth
    assert auth.lockout is old_auth.lockout and auth.lockout.after == 9
    assert set(auth._keys) == {"alpha", "beta", "gamma"} and len(auth._keys["alpha"]) == 2
    assert service.api.rate_limiter.remote == 20
    assert service.broker.policy.rules.max_attempts == 7
    assert service.broker.policy.allowed_targets == {"alpha": frozenset({"beta"})}
    assert any("config reloaded" in e.get("log_format", "") for e in events)


def test_a_reload_changes_the_capabilities_get_slash_advertises(tmp_path):
    """Capabilities that carry settings (EXTENSIONS.md, REACH) follow a reload: a
    client reads the limits in force, not those of the start."""
    import json

    service, conf = reloading_service(
        tmp_path, "broker: {secret: s0123456789abcdef, storage: memory}\n")
    with open(conf, "w") as f:
        f.write("broker: {secret: s0123456789abcdef, storage: memory, maxDeliveries: 4, "
                "notifyFailures: false, messageTtlDays: 2, eventRetentionSeconds: 60, "
                "webhookMaxAttempts: 5}\n"
                "security: {requireNonce: true}\n")
    assert service.reload() is True
    capabilities = json.loads(service.api.info)["capabilities"]
    assert capabilities["deadLetters"] == {"maxDeliveries": 4, "failureNotices": False}
    assert capabilities["messageTtl"] == {"maxSeconds": 2 * 86400}
    assert capabilities["signedNonce"] == {"required": True}
    assert capabilities["events"] == {"retentionSeconds": 60, "keepaliveSeconds": 15}
    assert capabilities["webhooks"] == {"maxAttempts": 5}


def test_a_reload_with_errors_is_refused_with_one_line(tmp_path):
    service, conf = reloading_service(tmp_path,
                                      "broker: {secret: s0123456789abcdef, storage: memory}\n")
    auth, policy = service.api.auth, service.broker.policy
    with open(conf, "w") as f:
        f.write("broker: {secret: s0123456789abcdef, storage: memory, leaseSeconds: 0}\n")
    with capturedLogs() as events:
        assert service.reload() is False
    assert service.api.auth is auth and service.broker.policy is policy
    (line,) = [e for e in events if e.get("log_level").name == "error"]
    assert "reload refused" in line["log_format"] and "broker.leaseSeconds" in line["error"]


def test_a_reload_names_the_keys_that_wait_for_a_restart(tmp_path):
    service, conf = reloading_service(tmp_path,
                                      "broker: {secret: s0123456789abcdef, storage: memory}\n")
    with open(conf, "w") as f:
        f.write("broker: {secret: s0123456789abcdef, storage: memory, "
                "listen: ['tcp:1:interface=127.0.0.1'],"
                " sweepSeconds: 9}\n")
    with capturedLogs() as events:
        assert service.reload() is True
    (warning,) = [e for e in events if "keys" in e]
    assert warning["keys"] == "broker.listen, broker.sweepSeconds"
    # Pending until the restart, whatever reloads come between; gone once the file
    # says again what the broker runs with.
    with capturedLogs() as events:
        assert service.reload() is True
    (warning,) = [e for e in events if "keys" in e]
    assert warning["keys"] == "broker.listen, broker.sweepSeconds"
    with open(conf, "w") as f:
        f.write("broker: {secret: s0123456789abcdef, storage: memory}\n")
    with capturedLogs() as events:
        assert service.reload() is True
    assert [e for e in events if "keys" in e] == []


def test_a_reload_warns_of_a_secret_file_others_can_read(tmp_path):
    secret = tmp_path / "relay.secret"
    secret.write_text("f" * 64 + "\n")
    secret.chmod(0o600)
    service, _ = reloading_service(tmp_path,
                                   "broker: {secretFile: relay.secret, storage: memory}\n")
    secret.write_text("e" * 64 + "\n" + "f" * 64 + "\n")
    secret.chmod(0o644)
    with capturedLogs() as events:
        assert service.reload() is True
    (warning,) = [e for e in events if e.get("log_level").name == "warn"]
    assert "relay.secret (broker.secretFile) is readable by other users" in warning["warning"]


def test_reload_changes_the_ops_tokens(tmp_path):
    service, conf = reloading_service(
        tmp_path, "broker: {secret: s0123456789abcdef, storage: memory, "
                  "opsToken: t1-0123456789abcdef, "
                  "opsListen: ['tcp:19997:interface=127.0.0.1']}\n")
    assert service.ops.tokens == ("t1-0123456789abcdef",)
    with open(conf, "w") as f:
        f.write("broker: {secret: s0123456789abcdef, storage: memory, "
                "opsToken: [t2-0123456789abcdef, t1-0123456789abcdef], "
                "opsListen: ['tcp:19997:interface=127.0.0.1']}\n")
    service.reload()
    assert service.ops.tokens == ("t2-0123456789abcdef", "t1-0123456789abcdef")



def test_no_store_imports_the_global_reactor():
    """A store's time and threads come from the reactor IStoreFactory.open hands it."""
    import pathlib
    import re

    import relay.store

    found = []
    for path in sorted(pathlib.Path(relay.store.__file__).parent.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"from twisted\.internet import[^\n]*\breactor\b|twisted\.internet\.reactor",
                     text):
            found.append(path.name)
    assert found == []
