"""``relay`` and ``twistd relay-agent`` as processes against a real broker: every
subcommand, the exit codes, ``relay init``'s next steps run as printed, an agent
answering requests, and the agent's way out (a fatal handshake, a second signal).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
import yaml
from twisted.internet import defer

from tests.support import REPO
from tests.support.cli import in_process, python_relay
from tests.support.processes import free_port

BROKER_SECRET = "cli-test-secret-0123456789abcdef"


START_TIMEOUT_SECONDS = 20.0


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


# -- relay, in process and as a process, against a real broker -----------------------------


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
def test_the_next_steps_of_init_work_as_printed(tmp_path: Path) -> None:
    """`relay init --json` names its next steps; run them: a broker, then a selfcheck."""
    import urllib.request

    from tests.support.processes import free_port

    port, ops_port = free_port(), free_port()
    env = {"HOME": str(tmp_path), "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "relay.cli", "init", "--port", str(port), "--ops-port",
         str(ops_port), "--json"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    start, check = json.loads(done.stdout)["nextSteps"]
    with open(tmp_path / "broker.log", "wb") as log:
        broker = subprocess.Popen(shlex.split(start), env=env, cwd=tmp_path, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
                break
            except OSError:
                assert broker.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "broker.log").read_text()
                time.sleep(0.05)
        checked = subprocess.run(shlex.split(check), capture_output=True, text=True,
                                 timeout=60, env=env, cwd=tmp_path)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.strip().endswith("selfcheck passed")
        dashboard = json.loads(done.stdout)["dashboardUrl"]
        assert dashboard == f"http://127.0.0.1:{ops_port}/"
        with urllib.request.urlopen(dashboard, timeout=10) as page:
            assert b"/static/dashboard.js" in page.read()
        assert sorted(p.name for p in (tmp_path / ".dsh-agent-relay").iterdir()) == [
            "data", "relay.secret", "relay.yaml"]
    finally:
        broker.terminate()
        broker.wait(20)


# -- twistd relay-agent --------------------------------------------------------------------


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


@pytest.mark.process
def test_a_second_signal_stops_a_stopping_agent_at_once_without_a_traceback(
    tmp_path: Path,
) -> None:
    """Stopping waits for the handler (and, with the broker down, for its ack's
    retries); a second SIGTERM used to log ReactorNotRunning's traceback."""
    import signal
    import subprocess
    import time

    from tests.support.processes import BrokerProcess

    broker = BrokerProcess(str(tmp_path)).start()
    twistd = Path(sys.executable).parent / "twistd"
    env = dict(os.environ, HOME=str(tmp_path))
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [str(twistd), "-n", "--pidfile=", "relay-agent", "--broker", broker.url, "--agent",
         "w", "--secret", broker.secret, "--exec", "exec sleep 60", "--shutdown-grace", "60"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        assert broker.request("a", "POST", "/register", {})[0] == 200
        deadline = time.monotonic() + 30
        while broker.request("a", "POST", "/messages", {"id": "q1", "to": "w",
                                                        "kind": "request"})[0] not in (200, 201):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        while broker.request("a", "POST", "/v1/status", {"messageIds": ["q1"]})[1][
                "messages"][0]["status"] != "leased":
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
            time.sleep(0.2)
        broker.stop()
        agent.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert agent.poll() is None, "the first signal waits for the handler"
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        broker.stop()
        log.close()
    output = (tmp_path / "agent.log").read_text()
    assert "a second Ctrl-C or SIGTERM stops it at once" in output
    assert "Traceback" not in output and "ReactorNotRunning" not in output, output
