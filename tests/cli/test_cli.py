"""The ``relay`` command: parsing, settings precedence, files, output and exit codes, in
process and as a process with no broker. The commands against the in-memory broker are
tests/cli/test_commands.py, against a real broker tests/processes/test_cli.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import pytest_twisted
import yaml

from relay.cli.commands import COMMANDS
from relay.cli.commands.events import event_line
from relay.cli.output import body_text, message_block, table, watch_line
from relay.cli.parser import Exit, build_parser, parse
from relay.cli.state import CursorState
from relay.client.settings import Settings, UsageError, resolve_settings
from relay.client.sse import RelayEvent
from relay.rules.config import parse_config
from tests.support import REPO
from tests.support.cli import in_process, python_relay
from tests.support.processes import free_port

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
    assert (inv.command.name, inv.json) == ("send", True)
    assert (inv.args.target, inv.args.content) == ("beta", "hi")
    assert (inv.settings.agent, inv.settings.secret) == ("alpha", "s")


def test_flag_after_subcommand_wins_over_the_same_flag_before(tmp_path: Path) -> None:
    inv = parse(["--agent", "one", "peers", "--agent", "two", "--secret", "s"], {}, tmp_path)
    assert inv.settings.agent == "two"


@pytest.mark.parametrize("flag", ["--broker", "--url"])
def test_broker_url_flag_has_a_second_name(flag: str, tmp_path: Path) -> None:
    """``--url`` (the word in the settings' ``brokerUrl``) names the same setting."""
    inv = parse([flag, "http://flag:3", "peers", "--agent", "a", "--secret", "s"], {}, tmp_path)
    assert inv.settings.broker_url == "http://flag:3"
    inv = parse(["peers", flag, "http://flag:4", "--agent", "a", "--secret", "s"], {}, tmp_path)
    assert inv.settings.broker_url == "http://flag:4"


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
    inv = parse(base + ["status", "a", "b", "--retries", "0"], {}, tmp_path)
    assert inv.args.retries == 0
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
    printed = info.value.lines()
    assert printed.startswith("usage: relay")
    assert printed.splitlines()[-1].startswith("error: ")
    assert fragment in printed


def test_missing_identity_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no agent name"):
        parse(["peers", "--secret", "s"], {}, tmp_path)
    with pytest.raises(UsageError, match="no secret"):
        parse(["peers", "--agent", "a"], {}, tmp_path)
    # handshake needs neither; selfcheck needs only the secret
    assert parse(["handshake"], {}, tmp_path).command.name == "handshake"
    assert parse(["selfcheck", "--secret", "s"], {}, tmp_path).command.name == "selfcheck"


def test_every_table_entry_is_a_subcommand_in_table_order(tmp_path: Path) -> None:
    parser, parsers = build_parser(COMMANDS)
    names = [command.name for command in COMMANDS]
    assert list(parsers) == names
    listing = parser.format_help()
    assert [listing.index(f"    {name} ") for name in names] == sorted(
        listing.index(f"    {name} ") for name in names
    )
    for command in COMMANDS:
        with pytest.raises(Exit) as done:
            parse([command.name, "--help"], {}, tmp_path)
        assert done.value.status == 0


# -- formatting --------------------------------------------------------------------


NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def test_readable_formats() -> None:
    assert body_text({"text": "hello"}) == "hello"
    assert body_text({"text": "hello", "x": 1}) == '{"text": "hello", "x": 1}'
    block = message_block(
        {
            "id": "m1",
            "from": "a",
            "to": "b",
            "ts": "2023-11-14T22:13:08.000Z",
            "kind": "request",
            "leaseId": "L",
            "ack": True,
            "body": {"text": "two\nlines"},
        },
        NOW,
    )
    assert block == [
        "m1  a -> b  12 s ago",
        "  kind request | lease L | receipt requested",
        "  two",
        "  lines",
    ]
    assert table([("alpha", "yes", "5 s ago")], ("AGENT", "ONLINE", "LAST SEEN")) == [
        "AGENT  ONLINE  LAST SEEN",
        "alpha  yes     5 s ago",
    ]
    line = watch_line(
        {"id": "m", "from": "a", "ts": "2023-11-14T22:10:20Z", "body": {"text": "a\nb"}}, NOW
    )
    assert line == "3 min ago a [m]: a b"
    receipt = {"type": "ack", "from": "b", "replyTo": "m", "body": {"status": "ok"}}
    assert watch_line(receipt, NOW) == "[receipt] b ok for m"


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


@pytest_twisted.inlineCallbacks
def test_init_writes_a_private_config_and_refuses_to_overwrite(tmp_path: Path) -> Any:
    config = tmp_path / "conf" / "relay.yaml"
    secret_file = tmp_path / "conf" / "relay.secret"
    first = yield in_process(["init", "--config", str(config)], tmp_path)
    assert first.status == 0, first.err
    for path in (config, secret_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = yaml.safe_load(config.read_text())
    assert loaded == {
        "broker": {
            "listen": ["tcp:19121:interface=127.0.0.1"],
            "opsListen": ["tcp:19122:interface=127.0.0.1"],
            "secretFile": "relay.secret",
            "dataDir": "data",
            "rateLimitLoopback": 60000,
        }
    }
    parsed = parse_config(loaded, str(config.parent), secret_file.read_text().strip())
    assert parsed.rate_limit_loopback == 60000
    assert parsed.ops.listen == ("tcp:19122:interface=127.0.0.1",)
    assert "the dashboard:         http://127.0.0.1:19122/" in first.out
    secret = secret_file.read_text().strip()
    assert len(secret) == 64 and int(secret, 16) >= 0
    assert secret not in first.out + first.err  # it is in the file, not on the screen
    assert f"twistd -n relay --config {config}" in first.out
    assert f"relay --secret-file {secret_file} selfcheck" in first.out

    again = yield in_process(["init", "--config", str(config)], tmp_path)
    assert again.status == 2
    assert again.err.startswith("error: ") and "--force" in again.err
    assert secret_file.read_text().strip() == secret

    forced = yield in_process(
        ["init", "--config", str(config), "--force", "--json", "--port", "19200"], tmp_path
    )
    assert forced.status == 0
    document = forced.json()
    assert secret not in forced.out and "secret" not in document
    assert document["secretFile"] == str(secret_file)
    assert document["brokerUrl"] == "http://127.0.0.1:19200"
    assert secret_file.read_text().strip() != secret
    assert yaml.safe_load(config.read_text())["broker"]["listen"] == [
        "tcp:19200:interface=127.0.0.1"
    ]
    assert yaml.safe_load(config.read_text())["broker"]["opsListen"] == [
        "tcp:19201:interface=127.0.0.1"
    ]
    assert document["dashboardUrl"] == "http://127.0.0.1:19201/"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


@pytest_twisted.inlineCallbacks
def test_init_by_default_writes_a_directory_of_its_own(tmp_path: Path) -> Any:
    """Not the working directory, where a checkout's `make run` keeps conf/, data/ and
    its pid file."""
    done = yield in_process(["init"], tmp_path)
    assert done.status == 0, done.err
    home = tmp_path / ".dsh-agent-relay"
    assert sorted(p.name for p in home.iterdir()) == ["relay.secret", "relay.yaml"]
    assert [p.name for p in tmp_path.iterdir()] == [".dsh-agent-relay"]


@pytest_twisted.inlineCallbacks
def test_init_warns_when_its_port_is_taken(tmp_path: Path) -> Any:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        done = yield in_process(["init", "--port", str(port)], tmp_path)
    assert done.status == 0
    assert f"already listens on http://127.0.0.1:{port}" in done.err
    assert f"relay --broker http://127.0.0.1:{port} --secret-file" in done.out


@pytest_twisted.inlineCallbacks
def test_usage_error_exit_code_in_process(tmp_path: Path) -> Any:
    outcome = yield in_process(["send", "beta"], tmp_path)
    assert outcome.status == 2
    assert outcome.err.startswith("usage: relay send")


# -- as a process, with no broker ------------------------------------------------------


@pytest.mark.process
def test_process_usage_error_is_exit_2_with_usage(tmp_path: Path) -> None:
    status, out, err = python_relay(["send", "beta", "--agent", "a", "--secret", "s"], tmp_path)
    assert status == 2
    assert "usage: relay send" in err
    assert "Traceback" not in err


@pytest.mark.process
def test_process_help_is_exit_0(tmp_path: Path) -> None:
    status, out, _ = python_relay(["--help"], tmp_path)
    assert status == 0
    assert "selfcheck" in out


@pytest.mark.process
def test_process_network_error_exit_1_without_traceback(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    status, _, err = python_relay(
        ["handshake", "--broker", f"http://127.0.0.1:{port}", "--retries", "1"], tmp_path
    )
    assert status == 1
    assert err.startswith("error: connection_error:")
    assert "Traceback" not in err


# -- lines and secret files --------------------------------------------------------------


def test_watch_line_stays_one_line_whatever_the_fields_hold():
    line = watch_line(
        {"id": "a\nb", "from": "alpha", "ts": "2024\n01", "body": {"text": "x"}}, NOW
    )
    assert "\n" not in line and line == "2024 01 alpha [a b]: x"
    receipt = watch_line({"type": "ack", "from": "beta", "replyTo": "m\r\n1",
                          "body": {"status": "ok"}}, NOW)
    assert receipt == "[receipt] beta ok for m 1"


def test_a_secret_file_of_several_lines_signs_with_the_first(tmp_path):
    """A broker's secret file holds several lines while a secret is rotated."""
    (tmp_path / "s").write_text("\nnew\nold\n")
    assert resolve_settings({"secret_file": str(tmp_path / "s")}, {}, tmp_path).secret == "new"


def test_the_broker_and_the_client_read_a_secret_file_by_one_rule(tmp_path):
    """The file of OPERATIONS.md's rotation procedure: the broker accepts both lines,
    the client signs with the first (docs/CONFIG.md, "Secret files")."""
    from relay.rules.config import load_config

    new, old = "n" * 64, "o" * 64
    (tmp_path / "relay.secret").write_text(f"  {new}  \n\n{old}\n")
    (tmp_path / "relay.yaml").write_text("broker: {secretFile: relay.secret}\n")
    config, _ = load_config(str(tmp_path / "relay.yaml"))
    assert config.secrets == (new, old) and config.secret == new
    settings = resolve_settings({"secret_file": str(tmp_path / "relay.secret")}, {}, tmp_path)
    assert settings.secret == new


# -- relay events' lines -------------------------------------------------------------------


def test_event_lines_name_type_id_agents_and_kind_on_one_escaped_line():
    assert event_line(RelayEvent("7", "message", {"id": "m1", "from": "alpha",
                                                  "kind": "request"})) == (
        "message 7 from alpha (request) [m1]")
    assert event_line(RelayEvent("8", "status", {"id": "m0", "to": "beta", "status": "done",
                                                 "attempts": 1, "error": "e"})) == (
        "status 8 [m0] to beta: done (attempts 1)")
    assert event_line(RelayEvent("9", "reset", {"reason": "unknown event id"})) == (
        "reset 9: unknown event id; pull to re-sync")
    assert event_line(RelayEvent("10", "later", {})) == "later 10"
    forged = event_line(RelayEvent("7", "message", {"id": "m\n2", "from": "evil\nok 8 x",
                                                    "kind": "a\r\nb"}))
    assert "\n" not in forged and "\r" not in forged


# -- structure -------------------------------------------------------------------


def _cli_imports() -> Dict[str, set]:
    """``relay.cli`` module -> the ``relay.cli`` modules it imports, at any depth of
    its code (an import inside a function closes a loop as well)."""
    import ast

    root = REPO / "relay" / "cli"
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: Dict[str, set] = {}
    for module, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = {t for t in targets if t in names and t != module}
    return graph


def test_the_cli_modules_import_each_other_in_no_loop() -> None:
    graph = _cli_imports()
    assert "relay.cli.parser" in graph and graph["relay.cli.parser"]

    def loop_from(start: str) -> Optional[List[str]]:
        path: List[str] = [start]

        def visit(module: str) -> Optional[List[str]]:
            for target in sorted(graph[module]):
                if target == start:
                    return path + [start]
                if target not in path:
                    path.append(target)
                    found = visit(target)
                    if found:
                        return found
                    path.pop()
            return None

        return visit(start)

    loops = [loop for loop in map(loop_from, sorted(graph)) if loop]
    assert loops == [], " -> ".join(loops[0]) if loops else ""
