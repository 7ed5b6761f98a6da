"""What a person at a terminal sees from ``relay``: safe, readable output, help, errors.

Commands run in process against the in-memory broker (``StubTreq`` over the
real API), with a ``task.Clock`` as the reactor, so ages and retry delays are
exact and nothing waits in real time.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import pytest
import pytest_twisted
from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.web.resource import Resource

from relay.cli import run
from relay.cli.commands import COMMANDS
from relay.cli.output import Console, age, printable, table
from relay.cli.parser import build_parser
from relay.cli.state import STATE_FILE, CursorState
from relay.client.client import RelayClient
from relay.client.settings import UsageError, resolve_settings
from relay.testing import SECRET, make_api
from relay.wire.errors import RelayError
from tests.support import REPO

HOSTILE = "hi\x1b]0;owned\x07\x1b[2J\x9b31m\u202eevil\rover"


class Shell:
    """``relay`` command lines as several agents, in process, on one memory broker."""

    def __init__(self, home: Path) -> None:
        from tests.support.client import relay_stub

        self.api, _, self.clock = make_api()
        self.http = relay_stub(self.api.resource(), self.clock)
        self.home = home

    def run(
        self,
        agent: Optional[str],
        *argv: str,
        stdin: str = "",
        interactive: bool = False,
        http: Any = None,
        broker: str = "http://127.0.0.1:19121",
    ) -> defer.Deferred:
        out, err = io.StringIO(), io.StringIO()
        flags = ["--broker", broker, "--secret", SECRET] + (["--agent", agent] if agent else [])
        d = defer.Deferred.fromCoroutine(
            run(
                self.clock,
                [*argv, *flags],
                env={},
                home=self.home,
                out=out,
                err=err,
                http=http or self.http,
                stdin=io.StringIO(stdin),
                interactive=interactive,
            )
        )
        return d.addCallback(lambda status: Done(status, out.getvalue(), err.getvalue()))


class Done:
    def __init__(self, status: int, out: str, err: str) -> None:
        self.status, self.out, self.err = status, out, err

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def shell(tmp_path: Path) -> Shell:
    return Shell(tmp_path)


def controls(text: str) -> List[str]:
    """The control characters in ``text`` other than the newlines that end lines."""
    return [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0
                                             or 0x202A <= ord(c) <= 0x202E)]


# -- escaping -------------------------------------------------------------------


def test_printable_escapes_every_control_character() -> None:
    assert printable("a\x1b[31mb\x07") == "a\\x1b[31mb\\x07"
    assert printable("\x9b2J \x7f \u202e \u2066 \u2028") == "\\x9b2J \\x7f \\u202e \\u2066 \\u2028"
    assert printable("tab\tcr\rnl\n") == "tab\\tcr\\rnl\\n"
    assert printable("héllo — 日本 👋 \u200d") == "héllo — 日本 👋 \u200d"
    assert printable(printable("\x1b")) == "\\x1b"
    assert table([("a\x1bb", 1)], ("X", "Y")) == ["X       Y", "a\\x1bb  1"]


def test_console_escapes_readable_lines_not_json() -> None:
    out, err = io.StringIO(), io.StringIO()
    console = Console(out, err, False, lambda: 0.0)
    console.line(HOSTILE)
    console.warn(HOSTILE)
    console.document({"text": HOSTILE})
    lines = out.getvalue().splitlines()
    assert controls(lines[0]) == [] and "\\x1b]0;owned\\x07" in lines[0]
    assert controls(err.getvalue()) == []
    assert json.loads(lines[1]) == {"text": HOSTILE}


@pytest_twisted.ensureDeferred
async def test_a_sender_cannot_reach_the_terminal_through_recv_watch_or_query(
    shell: Shell,
) -> None:
    await shell.run("beta", "register")
    await shell.run("alpha", "register")
    sent = await shell.run("alpha", "send", "beta", HOSTILE, "--kind", "request")
    assert sent.status == 0, sent.err
    recv = await shell.run("beta", "recv", "--reset")
    query = await shell.run("beta", "query")
    recent = await shell.run("beta", "recent")
    pulled = await shell.run("beta", "pull")
    for done in (recv, query, recent, pulled):
        assert done.status == 0, done.err
        assert controls(done.out) == [], done.out
        assert "hi\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202eevil\\rover" in done.out
    as_json = await shell.run("beta", "query", "--json")
    assert as_json.json()["messages"][0]["body"] == {"text": HOSTILE}


def test_watch_lines_are_escaped() -> None:
    from relay.cli.output import watch_line

    out = io.StringIO()
    Console(out, io.StringIO(), False, lambda: 0.0).line(
        watch_line({"id": "m", "from": "a", "body": {"text": HOSTILE}}, 0.0)
    )
    assert controls(out.getvalue()) == []


# -- ages -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, shown",
    [
        (1_000_000, "just now"),
        (999_988, "12 s ago"),
        (1_000_000 - 150, "2 min ago"),
        (1_000_000 - 7300, "2 h ago"),
        (1_000_000 - 3 * 86400, "3 d ago"),
        (1_000_000 + 90, "in 1 min"),
        ("1970-01-12T13:46:30.000Z", "10 s ago"),
        ("1970-01-12T13:46:40+00:00", "just now"),
    ],
)
def test_ages(value: Any, shown: str) -> None:
    assert age(value, 1_000_000.0) == shown


def test_epoch_milliseconds_are_read_as_such() -> None:
    assert age(1_700_000_030_000, 1_700_000_000.0) == "in 30 s"  # v1.1's leaseUntil


@pytest.mark.parametrize("value", [None, True, "yesterday", {}, ""])
def test_things_that_are_not_times_have_no_age(value: Any) -> None:
    assert age(value, 1_000_000.0) is None


@pytest_twisted.ensureDeferred
async def test_peers_shows_ages_and_hides_selfcheck_agents(shell: Shell) -> None:
    await shell.run("alpha", "register")
    await shell.run("selfcheck-0123abcd-a", "register")
    await shell.run("selfcheck-0123abcd-b", "register")
    shell.clock.advance(12)
    await shell.run("beta", "register")
    peers = await shell.run("beta", "peers")
    assert peers.out.splitlines() == [
        "AGENT  ONLINE  LAST SEEN",
        "alpha  yes     12 s ago",
        "beta   yes     just now",
        "(2 selfcheck agents not shown; `relay peers --all` lists them)",
    ]
    every = await shell.run("beta", "peers", "--all")
    assert "selfcheck-0123abcd-a  yes     12 s ago" in every.out
    raw = (await shell.run("beta", "peers", "--json")).json()
    assert len(raw["peers"]) == 4
    assert all(isinstance(p["lastSeen"], int) for p in raw["peers"])


@pytest_twisted.ensureDeferred
async def test_status_and_query_show_the_last_error(shell: Shell) -> None:
    await shell.run("beta", "register")
    await shell.run("alpha", "register")
    sent = (await shell.run("alpha", "send", "beta", "job", "--kind", "request", "--json")).json()
    leased = (await shell.run("beta", "pull", "--json")).json()["messages"][0]
    retried = await shell.run(
        "beta", "ack", sent["id"], leased["leaseId"], "retry", "--error", "disk\nfull"
    )
    assert retried.status == 0, retried.err
    shell.clock.advance(65)
    status = await shell.run("alpha", "status", sent["id"])
    head, row = status.out.splitlines()
    assert head.split() == ["ID", "STATUS", "ATTEMPTS", "DELIVERIES", "FROM", "TO", "KIND",
                            "SENT", "LAST", "ERROR"]
    assert row.split() == [sent["id"], "queued", "1", "1", "alpha", "beta", "request", "1",
                           "min", "ago", "disk", "full"]
    query = await shell.run("beta", "query", "--status", "queued")
    assert "attempts 1 | error disk\nfull" not in query.out
    assert "| error disk\\nfull" in query.out
    clean = await shell.run("beta", "query", "--kind", "message")
    assert clean.out.strip() == "no matching messages"


# -- send bodies ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_send_reads_the_body_from_stdin_a_file_or_json(shell: Shell, tmp_path: Path) -> None:
    await shell.run("beta", "register")
    (tmp_path / "note.txt").write_text("from a file\n", encoding="utf-8")
    (tmp_path / "body.json").write_text('{"task": "sum", "args": [1, 2]}', encoding="utf-8")
    for argv, stdin in (
        (["-"], "from stdin\n"),
        ([f"@{tmp_path / 'note.txt'}"], ""),
        (["@@beta, hello"], ""),
        (["--json-body", '{"n": 1}'], ""),
        (["--json-body", f"@{tmp_path / 'body.json'}"], ""),
        (["--json-body", "-"], '{"from": "stdin"}'),
    ):
        done = await shell.run("alpha", "send", "beta", *argv, stdin=stdin)
        assert done.status == 0, done.err
    inbox = (await shell.run("beta", "recv", "--json")).json()["messages"]
    assert [m["body"] for m in inbox] == [
        {"text": "from stdin"},
        {"text": "from a file"},
        {"text": "@beta, hello"},
        {"n": 1},
        {"task": "sum", "args": [1, 2]},
        {"from": "stdin"},
    ]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["@/no/such/file"], "cannot read /no/such/file: No such file or directory (write @@"),
        (["--json-body", "{oops"], "--json-body: not valid JSON"),
        (["--json-body", "[1, 2]"], "--json-body: the body must be a JSON object"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_send_body_problems_are_usage_errors(
    shell: Shell, argv: List[str], fragment: str
) -> None:
    await shell.run("beta", "register")
    done = await shell.run("alpha", "send", "beta", *argv)
    assert (done.status, done.out) == (2, "")
    assert done.err.startswith(f"error: {fragment}")


# -- receipts ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_recv_reset_does_not_send_receipts_twice(shell: Shell) -> None:
    await shell.run("beta", "register")
    await shell.run("alpha", "register")
    sent = (await shell.run("alpha", "send", "beta", "please confirm", "--ack", "--json")).json()
    first = await shell.run("beta", "recv")
    assert "receipt requested" in first.out
    again = await shell.run("beta", "recv", "--reset")
    assert "please confirm" in again.out
    # watch reads the inbox from the start too once the cursor is gone
    CursorState(shell.home / STATE_FILE, "http://127.0.0.1:19121", "beta").set(None)
    watched = await shell.run("beta", "watch", "--count", "1")
    assert watched.status == 0, watched.err
    receipts = [
        m
        for m in (await shell.run("alpha", "recv", "--json")).json()["messages"]
        if m["type"] == "ack"
    ]
    assert [r["replyTo"] for r in receipts] == [sent["id"]]


# -- retries ----------------------------------------------------------------------


class FlakyBroker(Resource):
    """Answers the handshake, then 503 ``busy`` ``failures`` times, then the peers list."""

    isLeaf = True

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def render(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if request.path == b"/":
            return b'{"protocol": "1.0"}'
        if self.failures:
            self.failures -= 1
            request.setResponseCode(503)
            return b'{"error": {"code": "busy", "message": "internal broker error"}}'
        return b'{"peers": []}'


def test_retries_are_announced_in_interactive_use(shell: Shell) -> None:
    done: List[Done] = []
    d = shell.run("alpha", "peers", interactive=True, http=StubTreq(FlakyBroker(2)))
    d.addCallback(done.append)
    shell.clock.advance(2)
    shell.clock.advance(4)
    assert done and done[0].status == 0, done
    assert done[0].err.splitlines() == [
        "retrying in 2 s (1/3): busy: internal broker error",
        "retrying in 4 s (2/3): busy: internal broker error",
    ]
    quiet: List[Done] = []
    shell.run("alpha", "peers", http=StubTreq(FlakyBroker(1))).addCallback(quiet.append)
    shell.clock.advance(2)
    assert quiet[0].status == 0 and quiet[0].err == ""


class RefusingHTTP:
    def __init__(self) -> None:
        self.calls = 0

    def request(self, *args: Any, **kwargs: Any) -> defer.Deferred:
        from twisted.internet.error import ConnectionRefusedError

        self.calls += 1
        return defer.fail(ConnectionRefusedError("refused"))


@pytest.mark.parametrize(
    "url, calls", [("http://127.0.0.1:1", 1), ("http://localhost:1", 1), ("http://[::1]:1", 1),
                   ("http://relay.test:1", 4)]
)
def test_a_refused_loopback_connection_can_fail_at_once(url: str, calls: int) -> None:
    clock, http = Clock(), RefusingHTTP()
    client = RelayClient(url, "a", SECRET, clock=clock, http=http, retry_refused_loopback=False)
    failures: List[Any] = []
    client.peers().addErrback(failures.append)
    clock.pump([2, 4, 8])
    assert http.calls == calls
    error = failures[0].value
    assert isinstance(error, RelayError) and error.code == "connection_error"
    assert "connection refused; is the broker running" in error.message
    retrying = RelayClient(url, "a", SECRET, clock=clock, http=RefusingHTTP())
    retrying.peers().addErrback(lambda _: None)
    clock.pump([2, 4, 8])
    assert retrying._http.calls == 4


@pytest.mark.process
def test_a_refused_loopback_broker_fails_fast_from_the_shell(tmp_path: Path) -> None:
    from tests.support.processes import free_port

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "relay.cli", "--broker", f"http://127.0.0.1:{free_port()}",
         "handshake"],
        capture_output=True, text=True, timeout=60, env={"HOME": str(tmp_path),
                                                         "PYTHONPATH": str(REPO)},
    )
    assert time.monotonic() - started < 10  # the interpreter starting, not 2 + 4 + 8 s
    assert done.returncode == 1
    assert done.stderr.startswith("error: connection_error: cannot reach")
    assert "connection refused; is the broker running" in done.stderr


# -- settings file ----------------------------------------------------------------


def write_settings(home: Path, text: str) -> None:
    (home / ".dsh-relay.json").write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"brokerURL": "http://x"}', "unknown key 'brokerURL' (known keys: agent, brokerUrl,"),
        ('{"agent": 7}', "agent: must be a string"),
        ("{not json", "not valid JSON"),
        ("[]", "must hold a JSON object"),
    ],
)
def test_the_settings_file_is_strict(tmp_path: Path, text: str, fragment: str) -> None:
    write_settings(tmp_path, text)
    with pytest.raises(UsageError) as info:
        resolve_settings({}, {}, tmp_path)
    assert str(info.value).startswith(f"{tmp_path / '.dsh-relay.json'}: ")
    assert fragment in str(info.value)


def test_relative_paths_in_the_settings_file_are_relative_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "relay.secret").write_text("from-home\n", encoding="utf-8")
    write_settings(tmp_path, '{"secretFile": "keys/relay.secret", "caFile": "keys/ca.crt"}')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    settings = resolve_settings({}, {}, tmp_path)
    assert settings.secret == "from-home"
    assert settings.ca_file == str(tmp_path / "keys" / "ca.crt")


@pytest_twisted.ensureDeferred
async def test_every_error_line_has_the_same_form(shell: Shell, tmp_path: Path) -> None:
    write_settings(tmp_path, '{"brokerURL": "http://x"}')
    settings_error = await shell.run("alpha", "peers")
    assert settings_error.status == 2
    assert settings_error.err.startswith(f"error: {tmp_path / '.dsh-relay.json'}: unknown key")
    (tmp_path / ".dsh-relay.json").unlink()
    usage = await shell.run("alpha", "query", "--status", "lost")
    assert usage.status == 2
    assert usage.err.splitlines()[0].startswith("usage: relay query")
    assert usage.err.splitlines()[-1].startswith("error: argument --status: invalid choice")
    broker = await shell.run("alpha", "send", "nobody", "hi")
    assert (broker.status, broker.err.split(":")[0]) == (1, "error")


# -- help, version, completion ------------------------------------------------------


def _every_parser() -> List[argparse.ArgumentParser]:
    parser, parsers = build_parser(COMMANDS)
    return [parser, *parsers.values()]


def test_every_option_has_help_and_a_readable_metavar() -> None:
    for parser in _every_parser():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, (parser.prog, action.option_strings or action.dest)
            shown = parser._get_formatter()._format_args(action, action.dest.upper())
            assert not re.search(r"[A-Z]_\b", shown), (parser.prog, shown)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["query", "--status", "sent"], "argument --status: invalid choice: 'sent'"),
        (["query", "--kind", "note"], "argument --kind: invalid choice: 'note'"),
        (["init", "--port", "70000"], "must be at most 65535"),
    ],
)
def test_unknown_values_are_refused(tmp_path: Path, argv: List[str], fragment: str) -> None:
    from relay.cli.parser import parse

    with pytest.raises(UsageError) as info:
        parse([*argv, "--agent", "a", "--secret", "s"], {}, tmp_path)
    assert fragment in info.value.message


@pytest_twisted.ensureDeferred
async def test_version_and_help_go_to_stdout(shell: Shell) -> None:
    from relay import __version__

    version = await shell.run(None, "--version")
    assert (version.status, version.out) == (0, f"relay {__version__} (wire protocol 1.0)\n")
    helped = await shell.run(None, "send", "--help")
    assert helped.status == 0 and "@PATH" in helped.out and "--json-body" in helped.out


@pytest.mark.parametrize("shell_name", ["bash", "zsh"])
@pytest_twisted.ensureDeferred
async def test_completion_covers_every_command_and_option(shell: Shell, shell_name: str) -> None:
    done = await shell.run(None, "completion", shell_name)
    assert done.status == 0, done.err
    for command in COMMANDS:
        assert command.name in done.out
    for option in ("--json-body", "--secret-file", "--reply-to", "--all"):
        assert option in done.out


@pytest.mark.process
def test_bash_completion_completes_commands_and_options(tmp_path: Path) -> None:
    """Load the script into bash and ask it, as the shell does on Tab."""
    script = tmp_path / "relay.bash"
    status = subprocess.run(
        [sys.executable, "-m", "relay.cli", "completion", "bash"],
        capture_output=True, text=True, timeout=60,
        env={"HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
    )
    script.write_text(status.stdout, encoding="utf-8")

    def complete(*words: str) -> List[str]:
        line = " ".join(("relay", *words))
        probe = (
            f"source {script}; COMP_WORDS=(relay {' '.join(words)}); "
            f"COMP_CWORD={len(words)}; COMP_LINE='{line}'; COMP_POINT={len(line)}; "
            "_shtab_relay relay; printf '%s\\n' \"${COMPREPLY[@]}\""
        )
        done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
        return done.stdout.split()

    assert {"selfcheck", "send", "completion"} <= set(complete("se"[:0]))
    assert complete("sel") == ["selfcheck"]
    assert "--json-body" in complete("send", "--js")
    assert set(complete("query", "--status", "")) == {"queued", "leased", "done", "failed"}


@pytest_twisted.ensureDeferred
async def test_a_request_registers_its_sender_so_the_reply_can_reach_it(shell: Shell) -> None:
    await shell.run("beta", "register")
    await shell.run("alpha", "send", "beta", "a plain message")
    listed = (await shell.run("beta", "peers", "--json")).json()["peers"]
    assert [p["agent"] for p in listed] == ["beta"]
    asked = await shell.run("alpha", "send", "beta", "a question", "--kind", "request")
    assert asked.status == 0, asked.err
    listed = (await shell.run("beta", "peers", "--json")).json()["peers"]
    assert [p["agent"] for p in listed] == ["alpha", "beta"]
    reply = await shell.run("beta", "send", "alpha", "an answer", "--kind", "reply")
    assert reply.status == 0, reply.err


def test_a_closed_pipe_ends_the_command_quietly(shell: Shell) -> None:
    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    results: List[int] = []
    d = defer.Deferred.fromCoroutine(
        run(shell.clock, ["--version"], env={}, home=shell.home, out=io.StringIO(),
            err=io.StringIO())
    )
    d.addCallback(results.append)
    err = io.StringIO()
    d = defer.Deferred.fromCoroutine(
        run(shell.clock, ["handshake", "--broker", "http://127.0.0.1:19121"], env={},
            home=shell.home, out=Closed(), err=err, http=shell.http)
    )
    d.addCallback(results.append)
    assert results == [0, 1]
    assert err.getvalue() == ""


@pytest.mark.process
def test_ctrl_c_during_ask_stops_at_once_with_status_130(tmp_path: Path) -> None:
    """It used to print a false "retrying... use https://" line (the reactor closed
    the connection) and exit 0."""
    import os
    import signal
    import socket

    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        env = {"HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        asking = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "--broker", f"http://127.0.0.1:{port}",
             "--agent", "alpha", "--secret", SECRET, "ask", "beta", "hello"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            connection, _ = silent.accept()  # the command is waiting for its answer
            started = time.monotonic()
            os.kill(asking.pid, signal.SIGINT)
            out, err = asking.communicate(timeout=20)
            connection.close()
        finally:
            if asking.poll() is None:
                asking.kill()
    assert asking.returncode == 130, (out, err)
    assert time.monotonic() - started < 5
    assert "retrying" not in err and "https" not in err and "Traceback" not in err, err


@pytest_twisted.ensureDeferred
async def test_a_mistyped_agent_name_gets_a_did_you_mean(shell: Shell) -> None:
    await shell.run("reviewer", "register")
    sent = await shell.run("alpha", "send", "reviewr", "hi")
    assert sent.status == 1
    assert sent.err == ("error: no_such_agent: recipient 'reviewr' has never registered; "
                        "did you mean reviewer?\n")
    far = await shell.run("alpha", "ask", "zzz", "hi", "--timeout", "1")
    assert far.err == "error: no_such_agent: recipient 'zzz' has never registered\n"


@pytest_twisted.ensureDeferred
async def test_pull_done_reads_the_queue_and_empties_it(shell: Shell) -> None:
    """The quick start read with `recv`, which leaves what it read queued forever."""
    await shell.run("beta", "register")
    await shell.run("alpha", "send", "beta", "hello")
    pulled = await shell.run("beta", "pull", "--done")
    assert pulled.status == 0 and "hello" in pulled.out
    assert pulled.err == "completed 1 of 1\n"
    depths = await shell.api.broker.queue_depths()
    assert [(d.agent, d.queued, d.leased) for d in depths if d.queued or d.leased] == []
    again = await shell.run("beta", "pull", "--done")
    assert "nothing to lease" in again.out and again.err == ""
