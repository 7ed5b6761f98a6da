"""Configuration of the second wire: keyrings, the per-mode whitelists, the reference's
keys (notifyFailedToSender, admin_agents) and a reference operator's file."""

from __future__ import annotations

import datetime
import os
import stat

import pytest
import yaml

from relay.rules.config import AgentConfig, ConfigError, load_config, may_send, parse_config
from relay.wire.v2.signing import SigningKey

S = "s0123456789abcdef"
A, B, C = "a" * 32, "b" * 32, "c" * 32


def parse(data, base_dir="/srv/relay", key_files=None):
    if isinstance(data, str):
        data = yaml.safe_load(data)
    return parse_config(data, base_dir, key_files=key_files)


def agents(**entries):
    return {"broker": {"secret": S}, "agents": entries}


def error_of(data, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(data, **kw)
    return info.value


# -- keyrings ----------------------------------------------------------------------------


def test_an_agent_secret_is_its_legacy_key():
    config = parse(agents(alpha={"secret": A}))
    assert dict(config.agents["alpha"].keys) == {"legacy": SigningKey((A,))}


def test_a_rotating_secret_list_is_one_legacy_key_of_several_secrets():
    config = parse(agents(alpha={"secret": [B, A]}))
    assert dict(config.agents["alpha"].keys) == {"legacy": SigningKey((B, A))}


def test_keys_add_to_the_legacy_key_in_file_order():
    config = parse(agents(alpha={"secret": A, "keys": {
        "k2027": {"secret": B, "notAfter": 1798761600},
        "k2028": {"secret": C}}}))
    ring = config.agents["alpha"].keys
    assert list(ring) == ["legacy", "k2027", "k2028"]
    assert ring["k2027"] == SigningKey((B,), 1798761600.0)
    assert ring["k2028"] == SigningKey((C,), None)


def test_the_legacy_key_may_be_listed_to_give_the_secret_a_not_after():
    config = parse(agents(alpha={"secret": A, "keys": {
        "legacy": {"not_after": 1798761600}, "new": {"secret": B}}}))
    assert config.agents["alpha"].keys["legacy"] == SigningKey((A,), 1798761600.0)
    same = parse(agents(alpha={"secret": A, "keys": {"legacy": {"secret": A}}}))
    assert same.agents["alpha"].keys["legacy"] == SigningKey((A,))


def test_an_agent_with_keys_only_signs_its_webhooks_with_its_first_key():
    config = parse(agents(alpha={"keys": {"k1": {"secret": B}, "k2": {"secret": C}}}))
    alpha = config.agents["alpha"]
    assert list(alpha.keys) == ["k1", "k2"] and alpha.secret == B and alpha.secrets == ()


def test_the_reference_spelling_of_a_keyring_loads():
    config = parse("""
broker: {secret: s0123456789abcdef}
agents:
  alpha:
    secret: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
    keys:
      legacy:
        secret: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
      rotated-2027:
        secret: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
        not_after: 1798761600
""")
    assert config.agents["alpha"].keys["rotated-2027"] == SigningKey((B,), 1798761600.0)


@pytest.mark.parametrize("value, expected", [
    (1798761600, 1798761600.0),
    (1798761600.5, 1798761600.5),
    ("1798761600", 1798761600.0),
    ("2027-01-01T00:00:00Z", 1798761600.0),
    ("2027-01-01T01:00:00+01:00", 1798761600.0),
    (datetime.datetime(2027, 1, 1, tzinfo=datetime.timezone.utc), 1798761600.0),
    (datetime.datetime(2027, 1, 1), 1798761600.0),
])
def test_not_after_is_epoch_seconds_or_an_iso_date_and_time(value, expected):
    config = parse(agents(alpha={"keys": {"k": {"secret": B, "notAfter": value}}}))
    assert config.agents["alpha"].keys["k"].not_after == expected


def test_an_unquoted_yaml_time_is_read_as_such():
    config = parse("broker: {secret: s0123456789abcdef}\nagents: {alpha: {keys: {k: "
                   "{secret: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb, notAfter: 2027-01-01T00:00:00Z}}}}")
    assert config.agents["alpha"].keys["k"].not_after == 1798761600.0


@pytest.mark.parametrize("value", ["soon", "2027-01-01", datetime.date(2027, 1, 1), 0, -5,
                                   True, [1], float("inf"), "2027-13-01T00:00:00Z"])
def test_a_bad_not_after_stops_the_start_naming_the_key(value):
    error = error_of(agents(alpha={"keys": {"k": {"secret": B, "notAfter": value}}}))
    assert error.key == "agents.alpha.keys.k.notAfter"
    assert "must be a time" in error.reason


@pytest.mark.parametrize("entry, key, reason", [
    ({"keys": []}, "agents.alpha.keys", "non-empty mapping"),
    ({"keys": {}}, "agents.alpha.keys", "non-empty mapping"),
    ({"keys": {"-x": {"secret": B}}}, "agents.alpha.keys.-x", "key id"),
    ({"keys": {"k": "bbbb"}}, "agents.alpha.keys.k", "must be a mapping"),
    ({"keys": {"k": {}}}, "agents.alpha.keys.k.secret", "is not set"),
    ({"keys": {"k": {"secret": "short"}}}, "agents.alpha.keys.k.secret", "at least 16 bytes"),
    ({"keys": {"k": {"secret": "CHANGE_ME"}}}, "agents.alpha.keys.k.secret", "placeholder"),
    ({"keys": {"k": {"secret": B, "secretFile": "k"}}}, "agents.alpha.keys.k.secret",
     "either"),
    ({"keys": {"k": {"secret": B, "notAfter": 1, "not_after": 1}}},
     "agents.alpha.keys.k.not_after", "either"),
    ({"keys": {"k": {"secret": B, "expires": 1}}}, "agents.alpha.keys.k.expires",
     "unknown key"),
    ({"keys": {"legacy": {}}}, "agents.alpha.keys.legacy.secret", "the agent's secret"),
    ({"secret": A, "keys": {"legacy": {"secret": B}}}, "agents.alpha.keys.legacy.secret",
     "differs from agents.alpha.secret"),
    ({"keys": {"k": {"secretFile": "missing.key"}}}, "agents.alpha.keys.k.secretFile",
     "cannot read /srv/relay/missing.key"),
])
def test_keyring_errors_name_the_key_and_the_reason(entry, key, reason):
    error = error_of(agents(alpha=entry))
    assert error.key == key and reason in error.reason, str(error)


def test_every_agent_needs_a_secret_or_keys_once_one_has_either():
    error = error_of(agents(alpha={"keys": {"k": {"secret": B}}}, beta={}))
    assert error.key == "agents.beta.secret" and "or keys" in error.reason
    assert parse(agents(alpha={"keys": {"k": {"secret": B}}}, beta={"secret": A}))


def test_agent_config_made_in_code_has_the_same_ring():
    made = AgentConfig(secret=A, keys={"k": SigningKey((B,), 5.0)})
    assert list(made.keys) == ["legacy", "k"] and made.keys["legacy"] == SigningKey((A,))
    assert made.allowed_write_targets == () and made.allowed_read_targets is None


# -- key files and load_config ---------------------------------------------------------------


def write(path, text, mode=0o600):
    path.write_text(text, encoding="utf-8")
    os.chmod(path, mode)
    return path


def test_a_key_secret_file_is_read_relative_to_the_config(tmp_path):
    write(tmp_path / "alpha-2027.key", f"\n{B}\n")
    conf = write(tmp_path / "relay.yaml", yaml.safe_dump(agents(alpha={
        "secret": A, "keys": {"k2027": {"secretFile": "alpha-2027.key"}}})))
    config, _ = load_config(str(conf))
    assert config.agents["alpha"].keys["k2027"] == SigningKey((B,))
    assert config.warnings == ()


def test_a_key_file_readable_by_others_is_warned_about(tmp_path):
    write(tmp_path / "k.key", B, mode=0o644)
    conf = write(tmp_path / "relay.yaml", yaml.safe_dump(agents(alpha={
        "keys": {"k": {"secretFile": "k.key"}}})))
    config, _ = load_config(str(conf))
    assert any("k.key" in w and "chmod 600" in w for w in config.warnings)


@pytest.mark.parametrize("content, reason", [("", "is empty"), (f"{A}\n{B}\n", "holds 2 lines"),
                                             ("short\n", "at least 16 bytes")])
def test_a_bad_key_file_stops_the_start(tmp_path, content, reason):
    write(tmp_path / "k.key", content)
    conf = write(tmp_path / "relay.yaml", yaml.safe_dump(agents(alpha={
        "keys": {"k": {"secretFile": "k.key"}}})))
    with pytest.raises(ConfigError) as info:
        load_config(str(conf))
    assert info.value.key == "agents.alpha.keys.k.secretFile" and reason in info.value.reason


def test_a_missing_key_file_stops_the_start_with_the_path(tmp_path):
    conf = write(tmp_path / "relay.yaml", yaml.safe_dump(agents(alpha={
        "keys": {"k": {"secretFile": "nowhere.key"}}})))
    with pytest.raises(ConfigError) as info:
        load_config(str(conf))
    assert info.value.key == "agents.alpha.keys.k.secretFile"
    assert str(tmp_path / "nowhere.key") in info.value.reason


def test_inline_key_secrets_make_the_config_file_one_that_holds_secrets(tmp_path):
    conf = write(tmp_path / "relay.yaml", yaml.safe_dump({
        "broker": {"secretFile": "broker.secret"},
        "agents": {"alpha": {"keys": {"k": {"secret": B}}}}}), mode=0o644)
    config, _ = load_config(str(conf))
    assert any("holds secrets" in w for w in config.warnings)
    assert stat.S_IMODE(os.stat(tmp_path / "broker.secret").st_mode) == 0o600


# -- the per-mode whitelists ---------------------------------------------------------------


def test_read_and_continue_default_to_allowed_targets_and_write_is_closed():
    config = parse(agents(alpha={"secret": A, "allowed_targets": ["Beta", " gamma "]},
                          beta={"secret": B}))
    alpha, beta = config.agents["alpha"], config.agents["beta"]
    assert alpha.allowed_targets == ("Beta", " gamma "), "the seed wire's list as written"
    assert alpha.allowed_read_targets == alpha.allowed_continue_targets == ("beta", "gamma")
    assert alpha.allowed_write_targets == ()
    assert (beta.allowed_read_targets, beta.allowed_continue_targets) == (None, None)
    assert beta.may_send("anyone", "read") and beta.may_send("anyone", "continue")
    assert not beta.may_send("anyone", "write")


def test_each_mode_has_its_own_list_in_either_spelling():
    config = parse(agents(alpha={"secret": A, "allowed_targets": ["beta"],
                                 "allowed_read_targets": ["Gamma"],
                                 "allowedContinueTargets": [],
                                 "allowed_write_targets": ["beta"]}))
    alpha = config.agents["alpha"]
    assert alpha.targets_for("read") == ("gamma",)
    assert alpha.targets_for("continue") == ()
    assert alpha.targets_for("write") == ("beta",)
    assert alpha.may_send("beta", "write") and not alpha.may_send("beta", "read")


def test_an_agent_without_an_entry_may_read_and_continue_anyone_and_write_no_one():
    config = parse(agents(alpha={"allowed_write_targets": ["beta"]}))
    assert may_send(config.agents, "zeta", "beta", "read")
    assert may_send(config.agents, "zeta", "beta", "continue")
    assert not may_send(config.agents, "zeta", "beta", "write")
    assert may_send(config.agents, "alpha", "beta", "write")
    with pytest.raises(ValueError):
        may_send(config.agents, "zeta", "beta", "delete")


@pytest.mark.parametrize("entry, key", [
    ({"allowed_write_targets": "beta"}, "agents.alpha.allowed_write_targets"),
    ({"allowed_read_targets": [1]}, "agents.alpha.allowed_read_targets"),
    ({"allowed_continue_targets": ["a"], "allowedContinueTargets": ["b"]},
     "agents.alpha.allowedContinueTargets"),
])
def test_a_bad_whitelist_names_its_key(entry, key):
    assert error_of(agents(alpha=entry)).key == key


def test_a_per_mode_list_without_per_agent_secrets_is_warned_about():
    (warning,) = parse(agents(alpha={"allowed_write_targets": ["beta"]})).warnings
    assert "protects nothing" in warning


# -- the reference's broker and security keys -------------------------------------------


def test_notify_failed_to_sender_is_read_and_defaults_to_true():
    assert parse({"broker": {"secret": S}}).notify_failed_to_sender is True
    off = parse({"broker": {"secret": S, "notifyFailedToSender": False}})
    assert off.notify_failed_to_sender is False and off.notify_failures is True
    error = error_of({"broker": {"secret": S, "notifyFailedToSender": "yes"}})
    assert error.key == "broker.notifyFailedToSender"


def test_admin_agents_are_names_read_in_lower_case():
    config = parse({"broker": {"secret": S}, "security": {"admin_agents": ["Ops", "root"]}})
    assert config.admin_agents == ("ops", "root")
    assert parse({"broker": {"secret": S}}).admin_agents == ()
    for bad in ("ops", ["a b"], [3]):
        error = error_of({"broker": {"secret": S}, "security": {"admin_agents": bad}})
        assert error.key == "security.admin_agents"


REFERENCE_CONFIG = """\
# A reference operator's config.yaml (the reference's config.example.yaml, filled in)
broker:
  host: 127.0.0.1          # loopback by default
  port: 19121
  secret: 9e4c2b7a1f0d3e5c8b6a4f2e0d1c3b5a
  rateLimitLoopback: 600
  rateLimitRemote: 120
  messageTtlDays: 7
  persist: true
  storage: sqlite
  dataDir: ./data
  leaseSeconds: 600
  maxAttempts: 3
  notifyFailedToSender: false

security:
  lockAfterFailures: 5
  lockMinutes: 5
  admin_agents: [ops]

agents:
  alpha:
    secret: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
    allowed_targets: [beta]
    allowed_read_targets: [beta, ops]
    allowed_continue_targets: [beta]
    allowed_write_targets: []
    keys:
      legacy:
        secret: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
      rotated-2027:
        secret: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
        not_after: 1798761600
  beta:
    secret: cccccccccccccccccccccccccccccccc
    allowed_write_targets: [alpha]
  ops:
    secret: dddddddddddddddddddddddddddddddd
"""


def test_a_reference_operators_file_starts_the_broker_with_the_same_meaning(tmp_path):
    conf = write(tmp_path / "config.yaml", REFERENCE_CONFIG)
    config, created = load_config(str(conf))
    assert created == () and config.ignored_keys == () and config.warnings == ()
    assert config.listen == ("tcp:19121:interface=127.0.0.1",)
    assert (config.storage_backend, config.data_dir) == ("sqlite", str(tmp_path / "data"))
    assert (config.lease_seconds, config.max_attempts, config.message_ttl_days) == (600, 3, 7)
    assert (config.rate_limit_loopback, config.rate_limit_remote) == (600, 120)
    assert (config.lock_after_failures, config.lock_minutes) == (5, 5)
    assert config.notify_failed_to_sender is False
    assert config.admin_agents == ("ops",)
    alpha, beta, ops = (config.agents[n] for n in ("alpha", "beta", "ops"))
    assert dict(alpha.keys) == {"legacy": SigningKey((A,)),
                                "rotated-2027": SigningKey((B,), 1798761600.0)}
    assert alpha.allowed_targets == ("beta",)
    assert (alpha.targets_for("read"), alpha.targets_for("continue"),
            alpha.targets_for("write")) == (("beta", "ops"), ("beta",), ())
    assert beta.targets_for("read") is None and beta.may_send("alpha", "write")
    assert not ops.may_send("alpha", "write") and ops.may_send("alpha", "continue")
    assert dict(ops.keys) == {"legacy": SigningKey(("d" * 32,))}
