"""The ``relay`` command: parsing, settings precedence, files, output and exit codes."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import pytest
import pytest_twisted
import yaml
from twisted.internet import defer

from relay.cli import (
    CursorState,
    Settings,
    UsageError,
    body_text,
    message_block,
    parse,
    resolve_settings,
    run,
    table,
    watch_line,
)

REPO = Path(__file__).resolve().parent.parent


# -- settings precedence -------------------------------------------------------


def write_settings(home: Path, **values: Any) -> None:
    (home / ".dsh-relay.json").write_text(json.dumps(values), encoding="utf-8")


def test_defaults_without_any_settings(tmp_path: Path) -> None:
    assert resolve_settings({}, {}, tmp_path) == Settings(
        "http://127.0.0.1:19121", None, None, None
    )


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    write_settings(tmp_path, brokerUrl="http://file:1", agent="file-agent", secret="file-secret")
    env = {
        "DSH_RELAY_BROKER_URL": "http://env:2",
        "DSH_RELAY_AGENT": "env-agent",
        "DSH_RELAY_SECRET": "env-secret",
    }
    assert resolve_settings({}, {}, tmp_path) == Settings(
        "http://file:1", "file-agent", "file-secret"
    )
    assert resolve_settings({}, env, tmp_path) == Settings(
        "http://env:2", "env-agent", "env-secret"
    )
    flags = {"broker": "http://flag:3", "agent": "flag-agent", "secret": "flag-secret"}
    assert resolve_settings(flags, env, tmp_path) == Settings(
        "http://flag:3", "flag-agent", "flag-secret"
    )
    # each setting falls through on its own
    assert resolve_settings({"agent": "flag-agent"}, {"DSH_RELAY_SECRET": "e"}, tmp_path) == (
        Settings("http://file:1", "flag-agent", "e")
    )


def test_secret_files_at_each_level(tmp_path: Path) -> None:
    for name, content in (("flag", "  from-flag-file\n"), ("env", "from-env-file"), ("cfg", "c")):
        (tmp_path / name).write_text(content, encoding="utf-8")
    write_settings(tmp_path, secretFile=str(tmp_path / "cfg"))
    assert resolve_settings({}, {}, tmp_path).secret == "c"
    env = {"DSH_RELAY_SECRET_FILE": str(tmp_path / "env")}
    assert resolve_settings({}, env, tmp_path).secret == "from-env-file"
    flags = {"secret_file": str(tmp_path / "flag")}
    assert resolve_settings(flags, env, tmp_path).secret == "from-flag-file"
    # a secret file given as a flag beats a secret from the environment
    env_secret = {"DSH_RELAY_SECRET": "env-secret"}
    assert resolve_settings(flags, env_secret, tmp_path).secret == "from-flag-file"
    # at one level a secret beats a secret file
    both = {"secret": "inline", "secret_file": str(tmp_path / "flag")}
    assert resolve_settings(both, {}, tmp_path).secret == "inline"


def test_unreadable_settings_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read secret file"):
        resolve_settings({"secret_file": str(tmp_path / "missing")}, {}, tmp_path)
    (tmp_path / ".dsh-relay.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(UsageError, match="dsh-relay.json"):
        resolve_settings({}, {}, tmp_path)
    (tmp_path / ".dsh-relay.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(UsageError, match="JSON object"):
        resolve_settings({}, {}, tmp_path)


# -- parsing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["send", "beta", "hi", "--agent", "alpha", "--secret", "s", "--json"],
        ["--agent", "alpha", "--secret", "s", "--json", "send", "beta", "hi"],
        ["--agent", "alpha", "send", "--json", "beta", "hi", "--secret", "s"],
    ],
)
def test_global_flags_before_or_after_the_subcommand(argv: List[str], tmp_path: Path) -> None:
    inv = parse(argv, {}, tmp_path)
    assert (inv.command, inv.json) == ("send", True)
    assert (inv.args.target, inv.args.content) == ("beta", "hi")
    assert (inv.settings.agent, inv.settings.secret) == ("alpha", "s")


def test_flag_after_subcommand_wins_over_the_same_flag_before(tmp_path: Path) -> None:
    inv = parse(["--agent", "one", "peers", "--agent", "two", "--secret", "s"], {}, tmp_path)
    assert inv.settings.agent == "two"


def test_subcommand_options(tmp_path: Path) -> None:
    base = ["--agent", "a", "--secret", "s"]
    inv = parse(
        base + ["send", "b", "x", "--ack", "--kind", "reply", "--reply-to", "q"], {}, tmp_path
    )
    assert (inv.args.ack, inv.args.kind, inv.args.reply_to) == (True, "reply", "q")
    inv = parse(base + ["recv", "--limit", "7", "--once", "--reset"], {}, tmp_path)
    assert (inv.args.limit, inv.args.once, inv.args.reset) == (7, True, True)
    inv = parse(base + ["ack", "m", "L", "retry", "--error", "boom"], {}, tmp_path)
    assert (inv.args.message_id, inv.args.lease_id, inv.args.outcome, inv.args.error) == (
        "m",
        "L",
        "retry",
        "boom",
    )
    inv = parse(base + ["query", "--from", "x", "--status", "done", "--limit", "3"], {}, tmp_path)
    assert (inv.args.from_, inv.args.status, inv.args.limit, inv.args.kind) == (
        "x",
        "done",
        3,
        None,
    )
    inv = parse(base + ["status", "a", "b"], {}, tmp_path)
    assert inv.args.message_ids == ["a", "b"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "required: COMMAND"),
        (["send", "beta"], "usage: relay send"),
        (["recv", "--limit", "0"], "at least 1"),
        (["ack", "m", "L", "finished"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_carry_the_usage_line(argv: List[str], fragment: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        parse(argv + ["--agent", "a", "--secret", "s"] if argv else argv, {}, tmp_path)
    assert "usage: relay" in str(info.value)
    assert fragment in str(info.value)


def test_missing_identity_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no agent name"):
        parse(["peers", "--secret", "s"], {}, tmp_path)
    with pytest.raises(UsageError, match="no secret"):
        parse(["peers", "--agent", "a"], {}, tmp_path)
    # handshake needs neither; selfcheck needs only the secret
    assert parse(["handshake"], {}, tmp_path).command == "handshake"
    assert parse(["selfcheck", "--secret", "s"], {}, tmp_path).command == "selfcheck"


# -- formatting --------------------------------------------------------------------


def test_readable_formats() -> None:
    assert body_text({"text": "hello"}) == "hello"
    assert body_text({"text": "hello", "x": 1}) == '{"text": "hello", "x": 1}'
    block = message_block(
        {
            "id": "m1",
            "from": "a",
            "to": "b",
            "ts": "T",
            "kind": "request",
            "leaseId": "L",
            "ack": True,
            "body": {"text": "two\nlines"},
        }
    )
    assert block == [
        "m1  a -> b  T",
        "  kind request | lease L | receipt requested",
        "  two",
        "  lines",
    ]
    assert table([("alpha", "yes", 5)], ("AGENT", "ONLINE", "LAST SEEN")) == [
        "AGENT  ONLINE  LAST SEEN",
        "alpha  yes     5",
    ]
    line = watch_line({"id": "m", "from": "a", "ts": "T", "body": {"text": "a\nb"}})
    assert line == "T a [m]: a b"
    receipt = {"type": "ack", "from": "b", "replyTo": "m", "body": {"status": "ok"}}
    assert watch_line(receipt) == "[receipt] b ok for m"


# -- files ---------------------------------------------------------------------------


def test_cursor_state_is_per_broker_and_agent_and_private(tmp_path: Path) -> None:
    path = tmp_path / ".dsh-relay-state.json"
    one = CursorState(path, "http://b:1/", "alpha")
    two = CursorState(path, "http://b:1", "beta")
    assert one.get() is None
    one.set("m-5")
    two.set("m-9")
    assert (one.get(), two.get()) == ("m-5", "m-9")
    assert json.loads(path.read_text()) == {
        "http://b:1|alpha": {"since": "m-5"},
        "http://b:1|beta": {"since": "m-9"},
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    one.set(None)
    assert one.get() is None and two.get() == "m-9"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left


def test_cursor_state_survives_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{garbage", encoding="utf-8")
    state = CursorState(path, "http://b", "a")
    assert state.get() is None
    state.set("x")
    assert state.get() == "x"


# -- running commands in process --------------------------------------------------


class Outcome:
    def __init__(self, status: int, out: str, err: str) -> None:
        self.status = status
        self.out = out
        self.err = err

    def json(self) -> Any:
        return json.loads(self.out)


async def run_cli(
    argv: List[str],
    home: Path,
    env: Optional[Mapping[str, str]] = None,
    http: Any = None,
) -> Outcome:
    from twisted.internet import reactor

    out, err = io.StringIO(), io.StringIO()
    status = await run(reactor, argv, env=env or {}, home=home, out=out, err=err, http=http)
    return Outcome(status, out.getvalue(), err.getvalue())


def in_process(argv: List[str], home: Path, **kwargs: Any) -> defer.Deferred:
    return defer.Deferred.fromCoroutine(run_cli(argv, home, **kwargs))


@pytest_twisted.inlineCallbacks
def test_init_writes_a_private_config_and_refuses_to_overwrite(tmp_path: Path) -> Any:
    config = tmp_path / "conf" / "relay.yaml"
    first = yield in_process(["init", "--config", str(config)], tmp_path)
    assert first.status == 0, first.err
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    loaded = yaml.safe_load(config.read_text())
    secret = loaded["broker"]["secret"]
    assert len(secret) == 64 and int(secret, 16) >= 0
    assert loaded["broker"]["port"] == 19121
    assert f"twistd -n relay --config {config}" in first.out

    again = yield in_process(["init", "--config", str(config)], tmp_path)
    assert again.status == 2
    assert "--force" in again.err
    assert yaml.safe_load(config.read_text())["broker"]["secret"] == secret

    forced = yield in_process(["init", "--config", str(config), "--force", "--json"], tmp_path)
    assert forced.status == 0
    document = forced.json()
    assert yaml.safe_load(config.read_text())["broker"]["secret"] == document["secret"] != secret
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


@pytest_twisted.inlineCallbacks
def test_usage_error_exit_code_in_process(tmp_path: Path) -> Any:
    outcome = yield in_process(["send", "beta"], tmp_path)
    assert outcome.status == 2
    assert outcome.err.startswith("usage: relay send")


def python_relay(
    argv: List[str], home: Path, env: Optional[Dict[str, str]] = None, timeout: float = 60
) -> Tuple[int, str, str]:
    """Run ``python -m relay.cli`` as a separate process."""
    full_env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "PYTHONPATH": str(REPO),
    }
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-m", "relay.cli", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=str(home),
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr


def test_process_usage_error_is_exit_2_with_usage(tmp_path: Path) -> None:
    status, out, err = python_relay(["send", "beta", "--agent", "a", "--secret", "s"], tmp_path)
    assert status == 2
    assert "usage: relay send" in err
    assert "Traceback" not in err


def test_process_help_is_exit_0(tmp_path: Path) -> None:
    status, out, _ = python_relay(["--help"], tmp_path)
    assert status == 0
    assert "selfcheck" in out
