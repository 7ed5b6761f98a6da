"""Configuration: the reference keys, defaults, and loud errors naming the key."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import MISSING, fields

import pytest
import yaml

from relay.rules.config import (
    RESTART_KEYS,
    SETTINGS,
    Config,
    ConfigError,
    GroupConfig,
    OpsConfig,
    RoleConfig,
    load_config,
    parse_config,
)
from relay.store import jsonl, memory, postgres, sqlite
from relay.testing import SECRET, make_config
from tests.support import REPO
from tests.support.teams import ALICE, HUMAN


def parse(text: str, base_dir: str = "/srv/relay", secret_from_file=None):
    return parse_config(yaml.safe_load(text), base_dir, secret_from_file)


def error_of(text: str, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, **kw)
    return info.value


def test_defaults_follow_the_spec():
    config = parse("broker: {secret: s0123456789abcdef}")
    assert config.listen == ("tcp:19121:interface=127.0.0.1",)
    assert (config.rate_limit_loopback, config.rate_limit_remote) == (600, 120)
    assert config.message_ttl_days == 7 and config.message_ttl_seconds == 7 * 86400
    assert (config.lease_seconds, config.max_attempts) == (600, 3)
    assert (config.lock_after_failures, config.lock_minutes) == (5, 5)
    assert config.storage == "sqlite" and config.storage_backend == "sqlite"
    assert config.data_dir == "/srv/relay/data"
    assert config.sync == "normal"
    assert config.agents == {}


def test_the_shipped_config_gives_local_agents_room():
    """conf/relay.yaml's loopback budget: a dozen busy local agents never reach it,
    where the default of 600 a minute stops a four-agent demo within half a minute."""
    from relay.cli.commands.bootstrap import LOCAL_RATE_LIMIT

    shipped = REPO / "conf" / "relay.yaml"
    config = parse(shipped.read_text(encoding="utf-8"), secret_from_file="s" * 32)
    assert config.rate_limit_loopback == LOCAL_RATE_LIMIT >= 12 * 60 * 50
    assert config.rate_limit_remote == 120


def test_reference_config_loads_unchanged():
    config = parse(
        """
broker:
  host: 127.0.0.1
  port: 19555
  secret: "4f1b2c9d7e8a0b3c6d5e4f1a2b3c4d5e"
  rateLimitLoopback: 1000
  rateLimitRemote: 50
  messageTtlDays: 3
  persist: false
  storage: jsonl
  dataDir: ./state
  leaseSeconds: 30
  maxAttempts: 5
  notifyFailedToSender: true
security:
  lockAfterFailures: 7
  lockMinutes: 2
  admin_agents: [ops]
agents:
  alpha:
    allowed_targets: [beta, gamma]
  beta: {}
"""
    )
    assert config.listen == ("tcp:19555:interface=127.0.0.1",)
    assert config.storage_backend == "memory", "persist: false means memory"
    assert config.data_dir == "/srv/relay/state"
    assert config.agents["alpha"].allowed_targets == ("beta", "gamma")
    assert config.agents["beta"].allowed_targets is None
    assert config.notify_failed_to_sender is True and config.admin_agents == ("ops",)
    assert config.ignored_keys == (), "every reference key means here what it means there"


@pytest.mark.parametrize(
    "text, key",
    [
        ("broker: {secret: s0123456789abcdef, prot: 1}", "broker.prot"),
        ("brokr: {secret: s0123456789abcdef}", "brokr"),
        ("broker: {secret: s0123456789abcdef, port: '19121'}", "broker.port"),
        ("broker: {secret: s0123456789abcdef, port: 70000}", "broker.port"),
        ("broker: {secret: s0123456789abcdef, leaseSeconds: 0}", "broker.leaseSeconds"),
        ("broker: {secret: s0123456789abcdef, leaseSeconds: 86401}", "broker.leaseSeconds"),
        ("broker: {secret: s0123456789abcdef, persist: 'yes'}", "broker.persist"),
        ("broker: {secret: s0123456789abcdef, maxAttempts: -1}", "broker.maxAttempts"),
        ("broker: {secret: s0123456789abcdef, sync: sometimes}", "broker.sync"),
        ("broker: {secret: s0123456789abcdef, listen: []}", "broker.listen"),
        ("broker: {port: 1}", "broker.secret"),
        ("broker: {secret: CHANGE_ME_RUN_SETUP_INIT}", "broker.secret"),
        ("broker: {secret: s0123456789abcdef}\nsecurity: {lockMinutes: 0}", "security.lockMinutes"),
        ("broker: {secret: s0123456789abcdef}\nagents: {alpha: {allowed_targets: beta}}",
         "agents.alpha.allowed_targets"),
        ("broker: {secret: s0123456789abcdef}\n"
         "agents: {alpha: {secret: a0123456789abcdef}, beta: {}}", "agents.beta.secret"),
        ("broker: {secret: s0123456789abcdef}\nagents: {'bad name': {}}", "agents.bad name"),
        ("broker: {secret: s0123456789abcdef}\nagents: {alpha: {colour: red}}",
         "agents.alpha.colour"),
    ],
)
def test_errors_name_the_key(text, key):
    assert error_of(text).key == key


@pytest.mark.parametrize(
    "text, key",
    [
        ("broker: {secret: s0123456789abcdef, messageTtlDays: -1}", "broker.messageTtlDays"),
        ("broker: {secret: s0123456789abcdef, messageTtlDays: .nan}", "broker.messageTtlDays"),
        ("broker: {secret: s0123456789abcdef, messageTtlDays: .inf}", "broker.messageTtlDays"),
        ("broker: {secret: s0123456789abcdef, leaseSeconds: '30'}", "broker.leaseSeconds"),
        ("broker: {secret: s0123456789abcdef}\nsecurity: {lockMinutes: true}",
         "security.lockMinutes"),
    ],
)
def test_bad_durations_name_the_key(text, key):
    assert error_of(text).key == key


def test_durations_may_be_fractional():
    """The reference reads these as plain numbers; short values make lockout, lease
    and TTL behaviour observable in seconds."""
    config = parse(
        "broker: {secret: s0123456789abcdef, messageTtlDays: 0.0001, leaseSeconds: 1.5}\n"
        "security: {lockMinutes: 0.05}\n"
    )
    assert config.message_ttl_seconds == pytest.approx(8.64)
    assert config.lease_seconds == 1.5
    assert config.lock_minutes == 0.05


def test_plaintext_remote_listen_is_refused():
    for listen in ("tcp:19121", "tcp:19121:interface=0.0.0.0", "tcp6:19121:interface=\\:\\:",
                   "tcp:19121:interface=192.0.2.7"):
        error = error_of(f"broker: {{secret: s0123456789abcdef, listen: ['{listen}']}}")
        assert error.key == "broker.listen" and "ssl" in error.reason
    host = error_of("broker: {secret: s0123456789abcdef, host: 0.0.0.0}")
    assert host.key == "broker.listen"
    config = parse("broker: {secret: s0123456789abcdef, host: 0.0.0.0, allowInsecureRemote: true}")
    assert config.listen == ("tcp:19121:interface=0.0.0.0",)


def test_loopback_and_tls_listen_are_fine():
    config = parse(
        "broker: {secret: s0123456789abcdef, listen: ['tcp:1:interface=127.0.0.1', "
        "'tcp6:2:interface=\\:\\:1', "
        "'ssl:3:privateKey=tls/k.pem:certKey=/etc/c.pem', 'unix:/tmp/relay.sock']}"
    )
    assert config.listen[2] == "ssl:3:privateKey=/srv/relay/tls/k.pem:certKey=/etc/c.pem"
    assert parse("broker: {secret: s0123456789abcdef, host: '::1'}").listen == (
        "tcp6:19121:interface=\\:\\:1",)


def test_per_agent_secrets():
    config = parse("broker: {secret: s0123456789abcdef}\n"
                   "agents: {alpha: {secret: a0123456789abcdef},\n"
                   "         beta: {secret: b0123456789abcdef}}")
    assert {name: agent.secret for name, agent in config.agents.items()} == {
        "alpha": "a0123456789abcdef", "beta": "b0123456789abcdef"}
    alpha = parse("broker: {secret: s0123456789abcdef}\nagents: {alpha: {}}").agents["alpha"]
    assert alpha.secret is None


def test_secret_file_is_created_once_with_mode_0600(tmp_path):
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker: {secretFile: relay.secret, storage: memory}\n")
    config, created = load_config(str(conf))
    secret_path = tmp_path / "relay.secret"
    assert created and config.secret_file == str(secret_path)
    assert stat.S_IMODE(os.stat(secret_path).st_mode) == 0o600
    assert len(config.secret) == 64 and int(config.secret, 16) >= 0
    again, created_again = load_config(str(conf))
    assert not created_again and again.secret == config.secret


def test_secret_and_secret_file_together_are_an_error(tmp_path):
    conf = tmp_path / "relay.yaml"
    (tmp_path / "s").write_text("x\n")
    conf.write_text("broker: {secret: a0123456789abcdef, secretFile: s}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(conf))
    assert info.value.key == "broker.secret"


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("broker: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(str(bad))


def test_command_line_overrides(tmp_path):
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker: {secret: s0123456789abcdef, listen: ['tcp:1:interface=127.0.0.1']}\n")
    config, _ = load_config(
        str(conf), {"listen": ["tcp:2:interface=127.0.0.1"], "dataDir": "rel"}
    )
    assert config.listen == ("tcp:2:interface=127.0.0.1",)
    assert config.data_dir == os.path.abspath("rel")



def test_a_backend_may_have_its_own_section():
    config = parse("broker: {secret: s0123456789abcdef, storage: sqlite, sqlite: {sync: full}, "
                   "jsonl: null}")
    assert dict(config.backend_sections["sqlite"]) == {"sync": "full"}
    assert dict(config.backend_sections["jsonl"]) == {}
    assert "memory" not in config.backend_sections


@pytest.mark.parametrize("text, key, reason", [
    ("broker: {secret: s0123456789abcdef, rateLimitLoopbak: 9}", "broker.rateLimitLoopbak",
     "unknown key; did you mean rateLimitLoopback?"),
    ("broker: {secret: s0123456789abcdef, ratelimitloopback: 9}",
     "broker.ratelimitloopback", "unknown key; did you mean rateLimitLoopback?"),
    ("brokers: {secret: s0123456789abcdef}", "brokers", "unknown key; did you mean broker?"),
    ("security: {lockMinuts: 3}\nbroker: {secret: s0123456789abcdef}", "security.lockMinuts",
     "unknown key; did you mean lockMinutes?"),
    ("broker: {secret: s0123456789abcdef, colour: blue}", "broker.colour", "unknown key"),
])
def test_a_mistyped_key_is_named_with_the_known_one(text, key, reason):
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert (info.value.key, info.value.reason) == (key, reason)


def test_a_section_of_an_unknown_backend_is_an_unknown_key():
    with pytest.raises(ConfigError) as info:
        parse("broker: {secret: s0123456789abcdef, postgress: {dsn: x}}")
    assert (info.value.key, info.value.reason) == ("broker.postgress", "unknown key")


def test_a_backend_section_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        parse("broker: {secret: s0123456789abcdef, sqlite: full}")
    assert info.value.key == "broker.sqlite"


def test_a_dropin_backend_names_its_own_section():
    from relay.rules.config import parse_config

    data = {"broker": {"secret": "s0123456789abcdef", "storage": "remote",
                       "remote": {"dsn": "host=x"}}}
    config = parse_config(data, "/etc/relay", backends=("memory", "remote"))
    assert dict(config.backend_sections["remote"]) == {"dsn": "host=x"}
    assert config.base_dir == "/etc/relay"


# Secrets of at least 16 bytes, for the tests below.
S, NEW, OLD = "s0123456789abcdef", "new-0123456789abcdef", "old-0123456789abcdef"
T1, T2 = "t1-0123456789abcdef", "t2-0123456789abcdef"


def broker(**keys) -> str:
    """A config document: the shared secret S and ``keys`` under ``broker``."""
    return yaml.safe_dump({"broker": dict({"secret": S}, **keys)})


def test_listen_interface_reads_positional_and_named_forms():
    from relay.rules.config import beyond_loopback, listen_interface

    assert listen_interface("tcp:19121:127.0.0.1") == "127.0.0.1"
    assert listen_interface("tcp:19121:interface=10.0.0.1") == "10.0.0.1"
    assert listen_interface("tcp6:19121") == "::"
    assert listen_interface("ssl:443:k.pem:c.pem:TLS_METHOD:127.0.0.1") == "127.0.0.1"
    assert listen_interface("ssl:443:privateKey=k.pem") == "0.0.0.0"
    assert listen_interface("unix:/tmp/s") is None
    assert beyond_loopback("unix:/tmp/s") is None
    assert beyond_loopback("systemd:domain=INET:index=0") == "unknown endpoint type 'systemd'"
    assert parse(broker(listen=["tcp:1:127.0.0.1"])).listen == ("tcp:1:127.0.0.1",)


@pytest.mark.parametrize("listen", [
    "TCP6:29131:interface=\\:\\:", "Tcp6:29131:interface=\\:\\:", "TCP:29131",
    "Tcp:29131:interface=0.0.0.0", "systemd:domain=INET:index=0", "unix:@abstract",
    "someplugin:29131", "tcp:29131:interface=192.168.1.5",
])
def test_a_listener_not_provably_local_needs_tls(listen):
    """Endpoint types match case-insensitively, as Twisted matches them; a type the
    check does not know counts as remote."""
    with pytest.raises(ConfigError) as info:
        parse(broker(listen=[listen]))
    assert info.value.key == "broker.listen" and "ssl:" in info.value.reason
    assert parse(broker(listen=[listen], allowInsecureRemote=True)).listen


@pytest.mark.parametrize("listen", [
    "TCP:29131:interface=127.0.0.1", "tcp6:29131:interface=\\:\\:1",
    "unix:/run/relay/relay.sock", "unix:address=/tmp/relay.sock", "SSL:443:privateKey=k.pem",
])
def test_a_listener_that_is_local_or_tls_needs_nothing(listen):
    assert parse(broker(listen=[listen])).listen


# -- several secrets (rotation) ------------------------------------------------------------


def test_a_secret_may_be_a_list_and_the_first_signs():
    config = parse(yaml.safe_dump({"broker": {"secret": [NEW, OLD]},
                                   "agents": {"alpha": {"secret": [T2, T1]}}}))
    assert (config.secret, config.secrets) == (NEW, (NEW, OLD))
    alpha = config.agents["alpha"]
    assert (alpha.secret, alpha.secrets) == (T2, (T2, T1))
    assert parse(broker()).secrets == (S,)


@pytest.mark.parametrize("value, key", [
    ({"broker": {"secret": []}}, "broker.secret"),
    ({"broker": {"secret": [S, ""]}}, "broker.secret"),
    ({"broker": {"secret": [S, 3]}}, "broker.secret"),
    ({"broker": {"secret": [S, "CHANGE_ME"]}}, "broker.secret"),
    ({"broker": {"secret": [S, "short"]}}, "broker.secret"),
    ({"broker": {"secret": S}, "agents": {"alpha": {"secret": [S, {}]}}}, "agents.alpha.secret"),
    ({"broker": {"secret": S}, "agents": {"alpha": {"secret": [S, "short"]}}},
     "agents.alpha.secret"),
])
def test_bad_secret_lists_name_the_key(value, key):
    assert error_of(yaml.safe_dump(value)).key == key


def test_a_secret_file_holds_one_secret_per_line(tmp_path):
    conf = tmp_path / "relay.yaml"
    (tmp_path / "relay.secret").write_text(f"{NEW}\n\n  {OLD}  \n")
    conf.write_text("broker: {secretFile: relay.secret, storage: memory}\n")
    config, created = load_config(str(conf))
    assert created == () and config.secrets == (NEW, OLD) and config.secret == NEW


# -- the ops listener ----------------------------------------------------------------------


def test_no_ops_listener_by_default():
    ops = parse(broker()).ops
    assert ops.listen == () and ops.tokens == ()


def test_a_loopback_ops_listener_needs_no_token():
    ops = parse(broker(opsListen=["tcp:19122:interface=127.0.0.1",
                                  "unix:/run/relay-ops.sock"])).ops
    assert ops.listen == ("tcp:19122:interface=127.0.0.1", "unix:/run/relay-ops.sock")
    ops = parse(broker(opsListen="tcp6:1:interface=\\:\\:1")).ops
    assert ops.listen == ("tcp6:1:interface=\\:\\:1",)


@pytest.mark.parametrize("listen, word", [
    ("tcp:19122", "ssl"),
    ("tcp:19122:interface=0.0.0.0", "ssl"),
    ("ssl:19122:privateKey=k.pem", "opsToken"),
    ("ssl:19122:privateKey=k.pem:interface=192.0.2.1", "opsToken"),
    ("systemd:domain=INET:index=0", "ssl"),
])
def test_an_ops_listener_beyond_loopback_needs_tls_and_a_token(listen, word):
    error = error_of(broker(opsListen=[listen]))
    assert error.key == "broker.opsListen" and word in error.reason


def test_a_remote_ops_listener_with_tls_and_a_token():
    ops = parse(broker(opsToken=[T2, T1], opsListen=["ssl:19122:privateKey=tls/k.pem"])).ops
    assert ops.listen == ("ssl:19122:privateKey=/srv/relay/tls/k.pem",)
    assert ops.tokens == (T2, T1)
    # allowInsecureRemote lifts the TLS rule (TLS ends in front of the broker), not the token's
    parse(broker(opsToken=T1, allowInsecureRemote=True, opsListen=["tcp:1"]))
    error = error_of(broker(allowInsecureRemote=True, opsListen=["tcp:1"]))
    assert "opsToken" in error.reason


@pytest.mark.parametrize("keys, key", [
    ({"opsListen": [3]}, "broker.opsListen"),
    ({"opsListen": {"a": "b"}}, "broker.opsListen"),
    ({"opsToken": ""}, "broker.opsToken"),
    ({"opsToken": "short"}, "broker.opsToken"),
    ({"opsToken": T1, "opsTokenFile": "f"}, "broker.opsToken"),
])
def test_bad_ops_keys_name_the_key(keys, key):
    assert error_of(broker(**keys)).key == key


def test_the_ops_token_file_is_created_like_the_secret_file(tmp_path):
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker: {secret: s0123456789abcdef, storage: memory, opsTokenFile: ops.token, "
                    "opsListen: ['ssl:19122:privateKey=k.pem']}\n")
    config, created = load_config(str(conf))
    path = tmp_path / "ops.token"
    assert created == ("broker.opsTokenFile",)
    assert config.ops.token_file == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (token,) = config.ops.tokens
    assert len(token) == 64 and path.read_text().strip() == token
    again, created_again = load_config(str(conf))
    assert created_again == () and again.ops.tokens == (token,)


@pytest.mark.parametrize(("text", "key"), [
    ("broker: {secret: a}", "broker.secret"),
    ("broker: {secret: 0123456789abcde}", "broker.secret"),
    ("broker: {secret: s0123456789abcdef}\nagents: {alpha: {secret: short}}",
     "agents.alpha.secret"),
])
def test_a_secret_shorter_than_16_bytes_stops_the_start(text, key):
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert info.value.key == key and "at least 16 bytes" in info.value.reason
    assert "0123456789abcde" not in str(info.value) and "short" not in info.value.reason


def test_sixteen_bytes_of_any_kind_are_enough():
    assert parse("broker: {secret: 0123456789abcdef}").secret == "0123456789abcdef"
    assert parse("broker: {secret: éééééééé}").secret == "é" * 8, "bytes, not characters"


def test_a_short_secret_file_stops_the_start(tmp_path):
    (tmp_path / "relay.secret").write_text("tiny\n")
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker: {secretFile: relay.secret}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(conf))
    assert info.value.key == "broker.secretFile" and "4 bytes" in info.value.reason


def test_an_acl_without_per_agent_secrets_is_warned_about():
    config = parse("broker: {secret: s0123456789abcdef}\n"
                   "agents: {alpha: {allowed_targets: [beta]}}")
    (warning,) = config.warnings
    assert "allowed_targets" in warning and "protects nothing" in warning
    per_agent = parse("broker: {secret: s0123456789abcdef}\nagents: "
                      "{alpha: {secret: a0123456789abcdef, allowed_targets: [beta]}}")
    assert per_agent.warnings == ()


def test_a_config_file_with_secrets_readable_by_others_is_warned_about(tmp_path):
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker: {secret: s0123456789abcdef}\n")
    os.chmod(conf, 0o644)
    config, _ = load_config(str(conf))
    assert any("readable by other users" in w for w in config.warnings)
    os.chmod(conf, 0o600)
    assert load_config(str(conf))[0].warnings == ()
    (tmp_path / "relay.secret").write_text("f" * 64)
    os.chmod(tmp_path / "relay.secret", 0o600)
    conf.write_text("broker: {secretFile: relay.secret}\n")
    os.chmod(conf, 0o644)
    assert load_config(str(conf))[0].warnings == (), "no secret in the file itself"
    # the secret file itself, e.g. rewritten for a key rotation under umask 022
    os.chmod(tmp_path / "relay.secret", 0o644)
    (warning,) = load_config(str(conf))[0].warnings
    assert warning == (f"{tmp_path / 'relay.secret'} (broker.secretFile) is readable by "
                       "other users: chmod 600 it")


# -- the table of settings ----------------------------------------------------------

BACKEND_SETTINGS = sqlite.SETTINGS + jsonl.SETTINGS + postgres.SETTINGS
CONFIG_MD = REPO / "docs" / "CONFIG.md"


def documented_keys():
    """``{name: (default cell, marked restart)}`` of every row of docs/CONFIG.md's key
    tables; a backend table's ``sqlite.sync`` is ``broker.sqlite.sync``."""
    rows, section = {}, None
    for line in CONFIG_MD.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"## `(\w+)`", line)
        if heading:
            section = heading.group(1)
        row = re.match(r"\| `([\w.]+)`((?: \*[\w.]+\*)*) \| (.*?) \|", line)
        if row and section:
            rows[f"{section}.{row.group(1)}"] = (row.group(3), "*restart*" in row.group(2))
    return rows


def test_the_config_reference_documents_every_key_of_the_table_and_no_other():
    documented = documented_keys()
    table = {s.name: (s.documented_default, s.restart) for s in SETTINGS + BACKEND_SETTINGS}
    assert sorted(set(table) - set(documented)) == [], "keys docs/CONFIG.md leaves out"
    assert sorted(set(documented) - set(table)) == [], "documented keys the broker refuses"
    wrong = {name: (documented[name], row) for name, row in table.items()
             if documented[name] != row}
    assert wrong == {}, "docs/CONFIG.md's default or *restart* mark differs from the table"


def test_a_config_that_sets_nothing_has_the_defaults_of_the_table():
    config = parse(f"broker: {{secret: {S}}}")
    for setting in SETTINGS:
        value = config
        for name in setting.field.split("."):
            value = getattr(value, name)
        expected = {"listen": ("tcp:19121:interface=127.0.0.1",), "secrets": (S,),
                    "data_dir": os.path.join("/srv/relay", "data"),
                    "ops.tokens": ()}.get(setting.field, setting.default)
        assert value == expected and type(value) is type(expected), setting.name


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.kind in ("int", "number")],
                         ids=lambda s: s.name)
def test_every_number_is_held_to_the_bounds_of_the_table(setting):
    step = 1 if setting.kind == "int" else setting.lo / 10 or 0.01

    def document(value):
        data = {"broker": {"secret": S}}
        data.setdefault(setting.section, {})[setting.key] = value
        return yaml.safe_dump(data)

    for inside in (setting.lo, setting.hi):
        value = parse(document(inside))
        for name in setting.field.split("."):
            value = getattr(value, name)
        assert value == inside
    for outside in (setting.lo - step, setting.hi + step):
        error = error_of(document(outside))
        assert error.key == setting.name and "must be" in error.reason


def test_the_fields_of_config_are_the_rows_of_the_table():
    names = [f.name for f in fields(Config)]
    assert names[:len(SETTINGS) - 3] == [s.field for s in SETTINGS if "." not in s.field]
    assert names[len(SETTINGS) - 3:] == ["ops", "agents", "groups", "roles",
                                         "backend_sections", "ignored_keys", "warnings",
                                         "base_dir"]
    assert [f.name for f in fields(OpsConfig)] == ["listen", "tokens", "token_file"]
    assert all(f.default is MISSING for f in fields(Config) + fields(OpsConfig))


def test_policy_and_rules_take_every_value_from_the_config():
    from relay.broker.operations import Policy
    from relay.rules.delivery import Role, Rules

    assert [f.name for f in fields(Rules) if f.default is not MISSING] == []
    assert [f.name for f in fields(Policy) if f.default is not MISSING
            or f.default_factory is not MISSING] == []
    config = parse(yaml.safe_dump({"broker": {
        "secret": S, "leaseSeconds": 31, "maxAttempts": 4, "maxDeliveries": 5,
        "notifyFailures": False, "messageTtlDays": 2, "inboxMaxMessages": 6,
        "inboxMaxBytes": 7, "minFreeDiskMB": 8, "maxAgents": 9,
        "eventRetentionSeconds": 10, "notifyFailedToSender": False},
        "security": {"requireNonce": True}, "agents": {"alpha": {"allowed_targets": ["beta"]}},
        "groups": {"g": {"members": ["alpha"]}},
        "roles": {"r": {"members": ["alpha"], "selfJoin": True}}}))
    assert Policy.from_config(config) == Policy(
        lease_seconds=31, message_ttl_seconds=2 * 86400.0,
        rules=Rules(max_attempts=4, max_deliveries=5, notify_failures=False,
                    inbox_max_messages=6, inbox_max_bytes=7, notify_v2=False,
                    roles={"r": Role(frozenset({"alpha"}), self_join=True)}),
        allowed_targets={"alpha": frozenset({"beta"})}, require_nonce=True, max_agents=9,
        min_free_disk_bytes=8 * 1024 * 1024, event_retention_seconds=10,
        groups={"g": GroupConfig(members=("alpha",))},
        roles={"r": RoleConfig(members=("alpha",), self_join=True)},
        humans=frozenset())


def test_the_restart_list_comes_from_the_table():
    assert RESTART_KEYS == (
        ("broker.listen", "listen"),
        ("broker.tlsClientCA", "tls_client_ca"),
        ("broker.maxConnections", "max_connections"),
        ("broker.requestReadSeconds", "request_read_seconds"),
        ("broker.opsListen", "ops.listen"),
        ("broker.storage", "storage_backend"),
        ("broker.dataDir", "data_dir"),
        ("broker.sync", "sync"),
        ("broker.messageTtlDays (the sweep interval)", "message_ttl_days"),
        ("broker.sweepSeconds", "sweep_seconds"),
        ("broker.webhookConcurrency", "webhook_concurrency"),
        ("broker.<backend> sections", "backend_sections"),
    )
    # host, port and persist wait too, through the value they make (listen, the backend)
    named = {label.split(" ")[0] for label, _ in RESTART_KEYS}
    assert {s.name for s in SETTINGS if s.restart} - named == {
        "broker.host", "broker.port", "broker.persist"}
    assert all(s.restart for s in BACKEND_SETTINGS)


def test_the_running_broker_reports_the_restart_keys_of_the_table():
    from relay.broker import service

    assert service.RESTART_KEYS is RESTART_KEYS


def test_a_backend_section_is_read_by_its_table():
    config = parse(f"broker: {{secret: {S}, sync: full}}")
    assert sqlite.parse_options({}, config).sync == "full", "broker.sync when absent"
    assert jsonl.parse_options({"sync": "OFF"}, config).sync == "off"
    with pytest.raises(ConfigError) as info:
        sqlite.parse_options({"sync": None}, config)
    assert (info.value.key, info.value.reason) == ("broker.sqlite.sync",
                                                   "must be a non-empty string")
    with pytest.raises(ConfigError) as info:
        memory.parse_options({"sync": "full"}, config)
    assert info.value.key == "broker.memory.sync"


def test_agent_webhooks_and_the_webhook_settings():
    from relay.testing import make_config as config_of

    agents = {"a": {"secret": "a" * 20, "webhook": "http://127.0.0.1:1/"},
              "b": {"secret": "b" * 20, "webhook": {"url": "https://h.example/in"}},
              "c": {"secret": "c" * 20}}
    config = config_of(agents=agents, webhookAllow=["https://h.example/"])
    assert [config.agents[n].webhook for n in "abc"] == [
        "http://127.0.0.1:1/", "https://h.example/in", None]
    assert config.webhook_allow == ("https://h.example/",)
    assert config_of().webhook_allow == (
        "http://127.0.0.1:", "http://localhost:", "http://[::1]:")
    for bad, key in (({"url": "ftp://x"}, "agents.a.webhook"),
                     ({"uri": "http://x"}, "agents.a.webhook.uri"),
                     (5, "agents.a.webhook")):
        with pytest.raises(ConfigError) as caught:
            config_of(agents={"a": {"secret": "a" * 20, "webhook": bad}})
        assert caught.value.key == key
    with pytest.raises(ConfigError) as caught:
        config_of(webhookAllow=["127.0.0.1"])
    assert caught.value.key == "broker.webhookAllow" and "http://" in caught.value.reason


# -- groups and roles (REACH §13) ---------------------------------------------------

TEAM_AGENTS = "broker: {secret: s0123456789abcdef}\nagents: {alice: {}, bob: {}, carol: {}}\n"


def test_groups_and_roles_are_read_with_their_members_in_order():
    config = parse(TEAM_AGENTS + "groups: {reviewers: {members: [carol, alice]}}\n"
                   "roles: {triage: {members: [bob], selfJoin: true}, ops.on-call: "
                   "{members: []}}")
    assert config.groups["reviewers"].members == ("carol", "alice")
    assert config.roles["triage"].members == ("bob",)
    assert config.roles["triage"].self_join is True
    assert config.roles["ops.on-call"].self_join is False
    assert config.roles["ops.on-call"].members == ()


def test_no_groups_or_roles_by_default():
    config = parse("broker: {secret: s0123456789abcdef}")
    assert dict(config.groups) == {} and dict(config.roles) == {}


@pytest.mark.parametrize(
    "text, key, reason",
    [
        ("groups: {'bad name': {members: [alice]}}", "groups.bad name", "names are 1-64"),
        ("roles: {'': {members: [alice]}}", "roles.", "names are 1-64"),
        ("groups: {" + "g" * 65 + ": {members: [alice]}}", "groups." + "g" * 65, "1-64"),
        ("groups: [reviewers]", "groups", "must be a mapping"),
        ("groups: {reviewers: [alice]}", "groups.reviewers", "must be a mapping"),
        ("groups: {reviewers: {}}", "groups.reviewers.members", "is required"),
        ("groups: {reviewers: {members: alice}}", "groups.reviewers.members", "list"),
        ("groups: {reviewers: {members: [alice, 3]}}", "groups.reviewers.members", "list"),
        ("groups: {reviewers: {members: [alice, dave]}}", "groups.reviewers.members",
         "'dave' is not an agent of agents:"),
        ("groups: {reviewers: {members: ['group:x']}}", "groups.reviewers.members",
         "is not an agent name"),
        ("groups: {reviewers: {members: [alice, alice]}}", "groups.reviewers.members",
         "twice"),
        ("groups: {reviewers: {members: [alice], selfJoin: true}}",
         "groups.reviewers.selfJoin", "unknown key"),
        ("roles: {triage: {members: [bob], selfjoin: true}}", "roles.triage.selfjoin",
         "did you mean selfJoin?"),
        ("roles: {triage: {members: [bob], selfJoin: 'yes'}}", "roles.triage.selfJoin",
         "true or false"),
        ("teams: {}", "teams", "unknown key"),
    ],
)
def test_group_and_role_errors_name_the_key_and_the_reason(text, key, reason):
    error = error_of(TEAM_AGENTS + text)
    assert error.key == key
    assert reason in str(error)


def test_members_must_be_configured_agents_even_with_a_shared_secret():
    error = error_of("broker: {secret: s0123456789abcdef}\ngroups: {g: {members: [alice]}}")
    assert error.key == "groups.g.members"
    assert "'alice: {}' is enough" in str(error)


# -- people (REACH §15) --------------------------------------------------------------------


def test_human_is_read_from_the_agent_entry():
    config = make_config(agents={"alpha": {"secret": ALICE},
                                 "dana": {"secret": HUMAN, "human": True},
                                 "erin": {"secret": "erin-secret-0123456789", "human": False}})
    assert [name for name, agent in config.agents.items() if agent.human] == ["dana"]


@pytest.mark.parametrize("entry, key, reason", [
    ({"secret": HUMAN, "human": "yes"}, "agents.dana.human", "must be true or false"),
    ({"secret": HUMAN, "human": 1}, "agents.dana.human", "must be true or false"),
    ({"human": True}, "agents.dana.secret", "its own secret"),
])
def test_a_bad_human_entry_stops_the_start_with_its_key(entry, key, reason):
    with pytest.raises(ConfigError) as caught:
        parse_config({"broker": {"secret": SECRET, "storage": "memory"},
                      "agents": {"dana": entry}}, "/tmp")
    assert caught.value.key == key and reason in str(caught.value)


def test_a_human_may_sign_with_a_keyring_instead_of_a_secret():
    config = make_config(agents={"alpha": {"secret": ALICE},
                                 "dana": {"human": True, "keys": {"k1": {"secret": HUMAN}}}})
    assert config.agents["dana"].human and config.agents["dana"].keys


def test_a_human_with_the_shared_secret_only_is_refused():
    """A person signs in with a secret of their own: the shared ``broker.secret``
    (which every agent holds) would let any agent read and answer as them."""
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_load(f"""
broker: {{secret: {SECRET}, storage: memory}}
agents: {{dana: {{human: true}}}}
"""), "/tmp")
    assert caught.value.key == "agents.dana.secret"
