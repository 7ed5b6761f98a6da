"""``relay events`` (and so ``RelayClient.events``) against the real ``twistd -n relay``
process: human lines and ``--json``, resuming without loss or repeat across a broker
restart, ``--since``, and Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, List

import pytest

from tests.support import REPO
from tests.support.processes import BrokerProcess

ALPHA, BETA = "alpha", "beta"


class Events:
    """``relay events`` as a process, its standard output read line by line."""

    def __init__(self, broker: BrokerProcess, agent: str, *extra: str) -> None:
        env = {**os.environ, "HOME": broker.directory, "DSH_RELAY_BROKER_URL": broker.url,
               "DSH_RELAY_AGENT": agent, "DSH_RELAY_SECRET": broker.secret}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "events", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.err: List[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        started: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._error(started)),
                         daemon=True).start()
        # its first line on standard error says it follows (or the process ends)
        if "--json" not in extra:
            started.get(timeout=30)

    @staticmethod
    def _pump(stream: Any, put: Any) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def _error(self, started: queue.Queue) -> Any:
        def put(line: str) -> None:
            self.err.append(line)
            started.put(line)
        return put

    def take(self, count: int, timeout: float = 30.0) -> List[str]:
        return [self.lines.get(timeout=timeout) for _ in range(count)]

    def finish(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def register(broker: BrokerProcess, *agents: str) -> None:
    for agent in agents:
        assert broker.request(agent, "POST", "/register", {})[0] == 200


def send(broker: BrokerProcess, n: int, to: str = BETA) -> List[str]:
    ids = []
    for i in range(n):
        status, answer = broker.request(ALPHA, "POST", "/messages",
                                        {"to": to, "body": {"text": f"body-{i}"}})
        assert status == 201, answer
        ids.append(answer["id"])
    return ids


@pytest.fixture()
def broker(tmp_path):
    b = BrokerProcess(str(tmp_path), storage="sqlite").start()
    register(b, ALPHA, BETA)
    yield b
    b.kill()


@pytest.mark.process
def test_relay_events_prints_lines_and_json_without_bodies(broker):
    # from the first event on: the processes need not be connected before the sends
    human = Events(broker, BETA, "--count", "2", "--since", "0")
    as_json = Events(broker, BETA, "--json", "--count", "2", "--since", "0")
    try:
        ids = send(broker, 2)
        assert human.finish() == 0, human.err
        assert as_json.finish() == 0, as_json.err
        lines = human.take(2)
        for line, message_id in zip(lines, ids):
            assert line.startswith("message ") and line.endswith(
                f" from alpha (message) [{message_id}]")
        assert "Ctrl+C" in human.err[0]
        documents = [json.loads(line) for line in as_json.take(2)]
        assert [d["data"]["id"] for d in documents] == ids
        assert {d["event"] for d in documents} == {"message"}
        assert [d["id"] for d in documents] == [line.split()[1] for line in lines]
        assert "body-" not in repr(lines) + repr(documents)
        assert as_json.err == []
    finally:
        human.kill()
        as_json.kill()


@pytest.mark.process
def test_it_resumes_across_a_broker_restart_without_loss_or_repeat(broker):
    follower = Events(broker, BETA, "--json", "--count", "6", "--since", "0")
    try:
        before = send(broker, 2)
        got = [json.loads(line) for line in follower.take(2)]
        assert broker.stop() in (0, -15)
        broker.start()
        during = send(broker, 2)  # sent while the client waits to reconnect
        time.sleep(8)  # it has reconnected (1 + 2 + 4 s at most)
        after = send(broker, 2)
        got += [json.loads(line) for line in follower.take(4)]
        assert follower.finish() == 0
        assert [d["data"]["id"] for d in got] == before + during + after
        assert len({d["id"] for d in got}) == 6
        # resuming after the fourth event in a later run gives the last two again
        later = Events(broker, BETA, "--json", "--count", "2", "--since", got[3]["id"])
        assert later.finish() == 0
        assert [json.loads(line)["data"]["id"] for line in later.take(2)] == after
    finally:
        follower.kill()


@pytest.mark.process
def test_ctrl_c_exits_130(broker):
    follower = Events(broker, BETA)
    try:
        time.sleep(1)  # the command's own SIGINT handler replaces the reactor's at start
        follower.proc.send_signal(signal.SIGINT)
        assert follower.finish() == 130
        assert not any("Traceback" in line for line in follower.err)
    finally:
        follower.kill()


@pytest.mark.process
def test_a_locked_agent_waits_out_the_lock_saying_so_then_follows(tmp_path):
    import yaml

    b = BrokerProcess(str(tmp_path), storage="sqlite")
    with open(b.config_path) as f:
        config = yaml.safe_load(f)
    config["security"] = {"lockAfterFailures": 2, "lockMinutes": 0.05}  # 3 s
    with open(b.config_path, "w") as f:
        yaml.safe_dump(config, f)
    b.start()
    follower = None
    try:
        register(b, ALPHA, BETA)
        secret, b.secret = b.secret, "not the secret"
        for _ in range(2):
            assert b.request(BETA, "POST", "/register", {})[0] == 401
        b.secret = secret
        follower = Events(b, BETA, "--count", "1", "--since", "0")
        deadline = time.monotonic() + 20
        while not any("tries again in" in line for line in follower.err):
            assert time.monotonic() < deadline and follower.proc.poll() is None, follower.err
            time.sleep(0.1)
        (said,) = [line for line in follower.err if "tries again in" in line]
        assert "locked" in said and said.endswith(("in 1 s", "in 2 s", "in 3 s"))
        (sent,) = send(b, 1)  # its event is read once the lock ran out
        assert follower.finish() == 0, follower.err
        assert follower.take(1)[0].endswith(f"[{sent}]")
    finally:
        if follower is not None:
            follower.kill()
        b.kill()


# -- the examples of docs/CLIENT.md and docs/MCP.md -----------------------------------

EXAMPLES = os.path.join(REPO, "docs", "examples")


def example_env(broker: BrokerProcess, **more: str) -> dict:
    return {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "HOME": broker.directory, "PYTHONPATH": str(REPO), "DSH_RELAY_BROKER_URL": broker.url,
            "DSH_RELAY_SECRET": broker.secret, **more}


@pytest.mark.process
def test_the_follow_events_example_runs(tmp_path):
    broker = BrokerProcess(str(tmp_path)).start()
    try:
        for _ in range(2):  # and again: a run leaves nothing behind that trips the next
            done = subprocess.run(
                [sys.executable, os.path.join(EXAMPLES, "follow_events.py")],
                capture_output=True, text=True, timeout=60, env=example_env(broker))
            assert done.returncode == 0, done.stderr
            assert done.stdout.splitlines() == [
                "event: a request from example-alpha",
                "pulled: first",
                "event: a message from example-alpha",
                "pulled: second",
                "resumed: message True",
            ]
    finally:
        broker.kill()


@pytest.mark.process
def test_the_webhook_receiver_example_takes_the_brokers_webhooks_and_nothing_else(tmp_path):
    import urllib.error
    import urllib.request

    from tests.support.processes import free_port

    broker = BrokerProcess(str(tmp_path)).start()
    secret_file = tmp_path / "agent.secret"
    secret_file.write_text(broker.secret + "\n")
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, os.path.join(EXAMPLES, "webhook_receiver.py"), str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=example_env(broker, DSH_RELAY_SECRET_FILE=str(secret_file)))
    try:
        deadline = time.monotonic() + 20
        while True:  # until it listens
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            except urllib.error.HTTPError:
                break
            except OSError:
                assert time.monotonic() < deadline, receiver.stderr.read()
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/relay?from=test"
        assert broker.request("hooked", "POST", "/register", {"webhook": {"url": url}})[0] == 200
        assert broker.request(ALPHA, "POST", "/register", {})[0] == 200
        forged = urllib.request.Request(url, method="POST", data=b'{"id":"1","event":"message",'
                                        b'"data":{"kind":"request","from":"mallory"}}',
                                        headers={"X-Relay-Timestamp": str(int(time.time())),
                                                 "X-Relay-Signature": "0" * 64})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=10)
        assert refused.value.code == 401
        status, _ = broker.request(ALPHA, "POST", "/messages", {
            "to": "hooked", "kind": "request", "body": {"text": "secret body"}})
        assert status == 201
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in receiver.stdout],
                         daemon=True).start()
        assert lines.get(timeout=30).strip() == "a request from 'alpha' to pull"
    finally:
        receiver.kill()
        receiver.wait(10)
        broker.kill()


@pytest.mark.process
def test_the_inbox_hook_counts_what_is_queued_and_not_leased(tmp_path):
    broker = BrokerProcess(str(tmp_path)).start()
    env = example_env(broker, DSH_RELAY_AGENT="hooky")
    hook = os.path.join(EXAMPLES, "inbox_hook.sh")

    def said() -> str:
        done = subprocess.run(["sh", hook], capture_output=True, text=True, timeout=60,
                              env=env)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        return done.stdout

    try:
        register(broker, ALPHA, "hooky")
        assert said() == ""
        send(broker, 2, to="hooky")
        assert said() == "You have 2 relay messages waiting: call relay_inbox to take them.\n"
        assert broker.request("hooky", "POST", "/v1/pull", {"limit": 1})[0] == 200
        assert said() == "You have 1 relay message waiting: call relay_inbox to take it.\n"
    finally:
        broker.kill()


@pytest.mark.process
def test_a_broker_without_events_is_one_line_and_exit_1(tmp_path):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Older(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the server's name)
            body = json.dumps({"protocol": "1.0", "broker": "older", "capabilities": {
                "leaseDelivery": True}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Older)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "relay.cli", "events", "--agent", "a", "--secret", "s" * 32,
             "--broker", f"http://127.0.0.1:{server.server_port}"],
            capture_output=True, text=True, timeout=60, cwd=REPO,
            env={**os.environ, "HOME": str(tmp_path)})
    finally:
        server.shutdown()
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines()[-1].startswith(
        "error: unsupported: the broker lacks events (the event stream, REACH.md §11)")
