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

from relay.cli import run
from relay.cli.commands import COMMANDS
from relay.cli.output import body_text, message_block, table, watch_line
from relay.cli.parser import Exit, build_parser, parse
from relay.cli.state import CursorState
from relay.client.settings import Settings, UsageError, resolve_settings
from relay.rules.config import parse_config
from tests.support import REPO

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


# -- against a real broker process ------------------------------------------------

BROKER_SECRET = "cli-test-secret-0123456789abcdef"
START_TIMEOUT_SECONDS = 20.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BrokerProcess:
    """``twistd -n relay`` on a free loopback port with an in-memory store."""

    def __init__(self, directory: Path) -> None:
        import time
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "relay.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "broker": {
                        "host": "127.0.0.1",
                        "port": self.port,
                        "secret": BROKER_SECRET,
                        "storage": "memory",
                    }
                }
            ),
            encoding="utf-8",
        )
        self.log = open(directory / "broker.log", "wb")  # noqa: SIM115
        twistd = Path(sys.executable).with_name("twistd")
        self.process = subprocess.Popen(
            [str(twistd), "-n", "--pidfile=", "relay", "--config", str(config)],
            cwd=str(directory),
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1) as answer:
                    if json.loads(answer.read())["protocol"] == "1.0":
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"broker did not start: {(directory / 'broker.log').read_text()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    process = BrokerProcess(tmp_path_factory.mktemp("broker"))
    try:
        yield process
    finally:
        process.stop()


class Shell:
    """Runs ``relay`` command lines in process against the broker, as one agent."""

    def __init__(self, broker: BrokerProcess, home: Path, agent: str) -> None:
        self.env = {
            "DSH_RELAY_BROKER_URL": broker.url,
            "DSH_RELAY_SECRET": BROKER_SECRET,
            "DSH_RELAY_AGENT": agent,
        }
        self.home = home

    def __call__(self, *argv: str) -> defer.Deferred:
        return in_process(list(argv), self.home, env=self.env)


def unique(name: str) -> str:
    import uuid

    return f"{name}-{uuid.uuid4().hex[:6]}"


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_every_subcommand_against_the_broker(broker: BrokerProcess, tmp_path: Path) -> Any:
    a_name, b_name = unique("alpha"), unique("beta")
    alpha, beta = Shell(broker, tmp_path, a_name), Shell(broker, tmp_path, b_name)

    hs = yield alpha("handshake")
    assert hs.status == 0 and "protocol 1.0" in hs.out
    hs_json = yield alpha("handshake", "--json")
    assert hs_json.json()["protocol"] == "1.0"

    for shell, name in ((alpha, a_name), (beta, b_name)):
        reg = yield shell("register")
        assert (reg.status, reg.out.strip()) == (0, f"registered {name}")

    peers = yield alpha("peers")
    assert peers.out.splitlines()[0].split() == ["AGENT", "ONLINE", "LAST", "SEEN"]
    assert any(line.split()[:2] == [a_name, "yes"] for line in peers.out.splitlines())
    peers_json = yield alpha("peers", "--json")
    assert {a_name, b_name} <= {p["agent"] for p in peers_json.json()["peers"]}

    sent = yield alpha("send", b_name, "hello there", "--ack", "--json")
    assert sent.status == 0, sent.err
    first_id = sent.json()["id"]
    plain = yield alpha("send", b_name, "second")
    assert plain.out.startswith("sent ") and plain.out.strip().endswith(f"to {b_name}")

    got = yield beta("recv", "--json")
    document = got.json()
    assert [m["body"]["text"] for m in document["messages"]] == ["hello there", "second"]
    assert document["count"] == 2
    receipt = yield alpha("recv", "--json")  # beta's recv sent a receipt for --ack
    acks = [m for m in receipt.json()["messages"] if m["type"] == "ack"]
    assert len(acks) == 1 and acks[0]["replyTo"] == first_id
    again = yield beta("recv")
    assert again.out.strip() == "no new messages"  # the cursor was kept in the state file
    state = json.loads((tmp_path / ".dsh-relay-state.json").read_text())
    assert state[f"{broker.url}|{b_name}"]["since"] == document["cursor"]
    reset = yield beta("recv", "--reset", "--once", "--limit", "1")
    assert reset.out.count("hello there") == 1 and "second" not in reset.out

    request = yield alpha("send", b_name, "question", "--kind", "request", "--json")
    request_id = request.json()["id"]
    pulled = yield beta("pull", "--limit", "10", "--lease", "60", "--json")
    leased = {m["id"]: m for m in pulled.json()["messages"]}
    assert request_id in leased
    lease_id = leased[request_id]["leaseId"]
    readable_pull = yield beta("pull")
    assert readable_pull.out.strip() == "nothing to lease"

    reply = yield beta("send", a_name, "answer", "--kind", "reply", "--reply-to", request_id)
    assert reply.status == 0
    acked = yield beta("ack", request_id, lease_id, "completed")
    assert acked.out.strip().startswith(f"{request_id}: done")
    twice = yield beta("ack", request_id, lease_id, "completed")
    assert twice.status == 1 and "not_leased" in twice.err

    status = yield alpha("status", request_id, "--json")
    assert [m["status"] for m in status.json()["messages"]] == ["done"]
    status_table = yield alpha("status", request_id)
    assert status_table.out.splitlines()[1].split()[:2] == [request_id, "done"]

    recent = yield alpha("recent", "--limit", "20", "--json")
    assert any(m.get("parentId") == request_id for m in recent.json()["messages"])
    query = yield alpha("query", "--kind", "reply", "--from", b_name, "--json")
    assert [m["body"]["text"] for m in query.json()["messages"]] == ["answer"]
    readable_query = yield alpha("query", "--kind", "reply")
    assert "answer" in readable_query.out and f"{b_name} -> {a_name}" in readable_query.out

    retry_req = yield alpha("send", b_name, "again", "--kind", "request", "--json")
    retry_id = retry_req.json()["id"]
    pulled = yield beta("pull", "--json")
    lease_id = {m["id"]: m for m in pulled.json()["messages"]}[retry_id]["leaseId"]
    retried = yield beta("ack", retry_id, lease_id, "retry", "--error", "not now", "--json")
    assert retried.json()["status"] == "queued" and retried.json()["attempts"] == 1


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_watch_prints_one_line_per_message(broker: BrokerProcess, tmp_path: Path) -> Any:
    a_name, b_name = unique("alpha"), unique("beta")
    alpha, beta = Shell(broker, tmp_path, a_name), Shell(broker, tmp_path, b_name)
    yield alpha("register")
    yield beta("register")
    watching = beta("watch", "--count", "2")
    yield alpha("send", b_name, "first line")
    yield alpha("send", b_name, "multi\nline")
    watched = yield watching
    assert watched.status == 0, watched.err
    lines = watched.out.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(": first line") and f" {a_name} [" in lines[0]
    assert lines[1].endswith(": multi line")
    assert "long-poll" in watched.err


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_broker_errors_exit_1_with_code(broker: BrokerProcess, tmp_path: Path) -> Any:
    alpha = Shell(broker, tmp_path, unique("alpha"))
    yield alpha("register")
    missing = yield alpha("send", "nobody-" + unique("x"), "hi")
    assert missing.status == 1
    assert missing.err.startswith("error: no_such_agent:")
    as_json = yield alpha("send", "nobody", "hi", "--json")
    assert as_json.status == 1
    assert as_json.json()["error"]["code"] == "no_such_agent"
    wrong = yield in_process(
        ["peers", "--broker", broker.url, "--agent", "alpha", "--secret", "wrong"], tmp_path
    )
    assert (wrong.status, wrong.err.split(":")[1].strip()) == (1, "unauthenticated")


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_selfcheck_passes_against_the_broker(broker: BrokerProcess, tmp_path: Path) -> Any:
    shell = Shell(broker, tmp_path, "unused")
    report = yield shell("selfcheck")
    assert report.status == 0, report.out + report.err
    assert report.out.strip().endswith("selfcheck passed")
    assert report.out.count("ok  ") == 9
    as_json = yield shell("selfcheck", "--json")
    assert as_json.json()["ok"] is True


@pytest.mark.process
def test_process_round_trip_and_exit_codes(broker: BrokerProcess, tmp_path: Path) -> None:
    """The console entry point itself: output, exit codes, no tracebacks."""
    env = {"DSH_RELAY_BROKER_URL": broker.url, "DSH_RELAY_SECRET": BROKER_SECRET}
    a_name, b_name = unique("alpha"), unique("beta")
    for name in (a_name, b_name):
        status, out, err = python_relay(["register", "--agent", name], tmp_path, env)
        assert status == 0, err
    status, out, err = python_relay(
        ["send", b_name, "via process", "--agent", a_name], tmp_path, env
    )
    assert status == 0 and out.startswith("sent "), err
    status, out, err = python_relay(["recv", "--agent", b_name, "--json"], tmp_path, env)
    assert status == 0
    assert [m["body"]["text"] for m in json.loads(out)["messages"]] == ["via process"]
    status, out, err = python_relay(["send", "ghost", "x", "--agent", a_name], tmp_path, env)
    assert status == 1 and err.startswith("error: no_such_agent") and "Traceback" not in err


@pytest.mark.process
def test_process_network_error_exit_1_without_traceback(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    status, _, err = python_relay(
        ["handshake", "--broker", f"http://127.0.0.1:{port}", "--retries", "1"], tmp_path
    )
    assert status == 1
    assert err.startswith("error: connection_error:")
    assert "Traceback" not in err


@pytest.mark.process
def test_relay_agent_process_answers_requests(broker: BrokerProcess, tmp_path: Path) -> None:
    """``twistd -n relay-agent --exec`` as a process: a request gets the command's stdout."""
    import time

    worker = unique("worker")
    env = {"DSH_RELAY_BROKER_URL": broker.url, "DSH_RELAY_SECRET": BROKER_SECRET}
    twistd = Path(sys.executable).with_name("twistd")
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [str(twistd), "-n", "--pidfile=", "relay-agent", "--agent", worker]
        + ["--exec", "tr a-z A-Z", "--receipts-dir", str(tmp_path)],
        cwd=str(tmp_path),
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(REPO),
            "HOME": str(tmp_path),
            **env,
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        asker = unique("asker")
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:  # wait until the agent has registered
            status, out, _ = python_relay(["peers", "--agent", asker, "--json"], tmp_path, env)
            if status == 0 and worker in {p["agent"] for p in json.loads(out)["peers"]}:
                break
            assert agent.poll() is None and time.monotonic() < deadline, (
                tmp_path / "agent.log"
            ).read_text()
            time.sleep(0.1)
        status, _, err = python_relay(["register", "--agent", asker], tmp_path, env)
        assert status == 0, err
        status, out, err = python_relay(
            ["send", worker, "shout this", "--kind", "request", "--agent", asker, "--json"],
            tmp_path,
            env,
        )
        assert status == 0, err
        request_id = json.loads(out)["id"]
        while True:
            status, out, _ = python_relay(["pull", "--agent", asker, "--json"], tmp_path, env)
            replies = [m for m in json.loads(out)["messages"] if m.get("parentId") == request_id]
            if replies:
                break
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
            time.sleep(0.1)
        assert replies[0]["body"] == {"text": "SHOUT THIS"}
        assert "shout this" not in (tmp_path / "agent.log").read_text().lower()
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(timeout=10)
        log.close()


@pytest.mark.process
def test_relay_agent_process_exits_nonzero_on_a_fatal_handshake(tmp_path: Path) -> None:
    """A broker speaking another protocol stops the agent with status 1, so a
    supervisor (systemd ``Restart=on-failure``) sees the failure."""
    import http.server
    import threading

    class OtherProtocol(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            body = b'{"protocol":"9.0","broker":"elsewhere"}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), OtherProtocol)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    twistd = Path(sys.executable).with_name("twistd")
    try:
        done = subprocess.run(
            [str(twistd), "-n", "--pidfile=", "relay-agent", "--agent", "worker",
             "--exec", "cat", "--receipts-dir", str(tmp_path)],
            cwd=str(tmp_path),
            env={
                "PATH": os.environ.get("PATH", ""),
                "PYTHONPATH": str(REPO),
                "HOME": str(tmp_path),
                "DSH_RELAY_BROKER_URL": f"http://127.0.0.1:{server.server_port}",
                "DSH_RELAY_SECRET": "s3cret",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=START_TIMEOUT_SECONDS * 2,
        )
    finally:
        server.shutdown()
        server.server_close()
    output = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 1, output
    assert "protocol_mismatch" in output


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
