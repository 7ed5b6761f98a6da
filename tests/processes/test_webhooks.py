"""Webhooks through the real ``twistd -n relay`` process to a real local HTTP
receiver: order, retries and backoff, skip and disable, the signature checked with
the agent's own secret, allow-list refusals, a reload that narrows the allow-list,
and delivery resumed after a SIGKILL."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

import pytest
import yaml

from relay.wire.signing import verify
from tests.support.processes import BrokerProcess

SECRETS = {"alpha": "alpha-own-secret-0123456789", "beta": "beta-own-secret-0123456789"}


class Receiver:
    """A local HTTP server recording each POST; answers with the next scripted code."""

    def __init__(self, codes: Optional[List[int]] = None) -> None:
        self.codes = list(codes or [])
        self.got: List[Dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.got.append({"path": self.path, "headers": dict(self.headers),
                                         "raw": raw, "at": time.monotonic()})
                    code = receiver.codes.pop(0) if receiver.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 20.0) -> List[Dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.got) >= count:
                    return list(self.got)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.got)} webhook requests, not {count}")

    def ids(self) -> List[str]:
        return [json.loads(g["raw"])["data"]["id"] for g in self.got]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_config(broker: BrokerProcess, **extra: Any) -> None:
    with open(broker.config_path) as f:
        config = yaml.safe_load(f)
    config["broker"].update(extra)
    config["agents"] = {name: {"secret": secret} for name, secret in SECRETS.items()}
    with open(broker.config_path, "w") as f:
        yaml.safe_dump(config, f)


def call(broker: BrokerProcess, agent: str, method: str, path: str, body: Any = None):
    broker.secret = SECRETS[agent]
    return broker.request(agent, method, path, body)


def send(broker: BrokerProcess, count: int) -> List[str]:
    ids = []
    for i in range(count):
        status, answer = call(broker, "alpha", "POST", "/messages",
                              {"to": "beta", "body": {"n": i}})
        assert status == 201
        ids.append(answer["id"])
    return ids


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def start(tmp_path, **broker: Any) -> BrokerProcess:
    process = BrokerProcess(str(tmp_path), storage="sqlite", **broker)
    write_config(process)
    return process.start()


@pytest.mark.process
def test_order_signature_retries_and_backoff(tmp_path, receiver):
    receiver.codes = [500, 502]
    broker = start(tmp_path)
    try:
        url = f"http://127.0.0.1:{receiver.port}/hook?k=1"
        status, answer = call(broker, "beta", "POST", "/register", {"webhook": {"url": url}})
        assert status == 200 and answer["webhook"] == {"url": url}
        call(broker, "alpha", "POST", "/register", {})
        ids = send(broker, 3)
        got = receiver.wait_for(5)
        assert receiver.ids() == [ids[0], ids[0], ids[0], ids[1], ids[2]]
        # 1 s, then 2 s between the tries of the first event
        assert got[1]["at"] - got[0]["at"] >= 0.9 and got[2]["at"] - got[1]["at"] >= 1.9
        for request in got:
            headers = request["headers"]
            assert headers["X-Relay-Agent"] == "beta"
            assert headers["Content-Type"] == "application/json"
            assert verify(SECRETS["beta"], "POST", "/hook?k=1",
                          int(headers["X-Relay-Timestamp"]), request["raw"],
                          headers["X-Relay-Signature"])
            assert headers["X-Relay-Event-Id"] == json.loads(request["raw"])["id"]
        status, peers = call(broker, "alpha", "GET", "/peers")
        assert str(receiver.port) not in json.dumps(peers)
        assert str(receiver.port) not in broker.log()
    finally:
        broker.kill()


@pytest.mark.process
def test_skip_then_disable_then_enabled_again(tmp_path, receiver):
    receiver.codes = [500] * 4
    broker = start(tmp_path, webhookMaxAttempts=2, webhookDisableAfter=4)
    try:
        url = f"http://127.0.0.1:{receiver.port}/"
        call(broker, "beta", "POST", "/register", {"webhook": {"url": url}})
        first, second, third = send(broker, 3)
        receiver.wait_for(4)
        time.sleep(1.5)
        assert receiver.ids() == [first, first, second, second]
        status, answer = call(broker, "beta", "POST", "/register", {})
        assert answer["webhook"] == {"url": url, "disabled": True}
        assert "skipped" in broker.log() and "disabled" in broker.log()
        status, answer = call(broker, "beta", "POST", "/register", {"webhook": {"url": url}})
        assert answer["webhook"] == {"url": url}
        receiver.wait_for(6)
        assert receiver.ids()[4:] == [second, third]
    finally:
        broker.kill()


@pytest.mark.process
def test_allow_list_refusal_and_a_reload_that_narrows_it(tmp_path, receiver):
    broker = start(tmp_path)
    try:
        status, answer = call(broker, "beta", "POST", "/register",
                              {"webhook": {"url": "http://example.com/hook"}})
        assert status == 400 and "broker.webhookAllow" in answer["error"]["message"]
        url = f"http://localhost:{receiver.port}/"
        assert call(broker, "beta", "POST", "/register", {"webhook": {"url": url}})[0] == 200
        send(broker, 1)
        receiver.wait_for(1)
        write_config(broker, webhookAllow=["http://127.0.0.1:"])
        broker.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload" not in broker.log().lower() and time.monotonic() < deadline:
            time.sleep(0.05)
        send(broker, 2)
        time.sleep(1.5)
        assert len(receiver.got) == 1, "nothing goes to a URL the reloaded list leaves out"
    finally:
        broker.kill()


@pytest.mark.process
def test_delivery_resumes_after_a_sigkill_from_the_last_acknowledged_event(tmp_path,
                                                                         receiver):
    broker = start(tmp_path)
    try:
        url = f"http://127.0.0.1:{receiver.port}/"
        call(broker, "beta", "POST", "/register", {"webhook": {"url": url}})
        first = send(broker, 2)
        receiver.wait_for(2)
        receiver.codes = [503] * 1000  # the receiver is down: nothing is acknowledged
        pending = send(broker, 2)
        receiver.wait_for(3)
        broker.kill()
        receiver.codes = []
        broker.start()
        got = receiver.wait_for(3 + 2, timeout=5)  # at once, not when a role runs out
        ids = [json.loads(g["raw"])["data"]["id"] for g in got]
        assert ids[:2] == first and ids[-2:] == pending
        assert set(ids[2:-2]) <= {pending[0]}
    finally:
        broker.kill()


def postgres_pair(tmp_path, **broker: Any):
    from tests.conftest import reset_postgres

    dsn = reset_postgres()  # skips without RELAY_TEST_POSTGRES_DSN
    brokers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            process = BrokerProcess(str(tmp_path / name), storage="postgres",
                                    postgres={"dsn": dsn, "poolSize": 4}, **broker)
            write_config(process)
            brokers.append(process.start())
        yield brokers
    finally:
        for broker in brokers:
            broker.kill()


@pytest.fixture
def pg_pair(tmp_path):
    yield from postgres_pair(tmp_path)


@pytest.mark.postgres
@pytest.mark.process
def test_two_brokers_on_postgres_deliver_each_event_once_in_order(pg_pair, receiver):
    a, b = pg_pair
    url = f"http://127.0.0.1:{receiver.port}/"
    assert call(b, "beta", "POST", "/register", {"webhook": {"url": url}})[0] == 200
    ids = []
    for i in range(8):  # sends through both brokers, alternately
        ids += send(a if i % 2 == 0 else b, 1)
    receiver.wait_for(8)
    time.sleep(1)
    assert receiver.ids() == ids, "once each, in order, whichever broker caused it"
    # the broker delivering goes away: the other takes over once its role runs out
    a.kill()
    later = send(b, 2)
    receiver.wait_for(10, timeout=40)
    time.sleep(0.5)
    assert receiver.ids()[8:] == later


@pytest.mark.postgres
@pytest.mark.process
def test_every_broker_of_a_shared_store_shows_the_webhook_and_its_disabling(tmp_path,
                                                                           receiver):
    receiver.codes = [500] * 10
    pair = postgres_pair(tmp_path, webhookMaxAttempts=1, webhookDisableAfter=2)
    a, b = next(pair)
    try:
        url = f"http://127.0.0.1:{receiver.port}/"
        assert call(a, "beta", "POST", "/register", {"webhook": {"url": url}})[0] == 200
        assert call(b, "beta", "POST", "/register", {})[1]["webhook"] == {"url": url}
        send(b, 2)
        receiver.wait_for(2)
        deadline = time.monotonic() + 10
        shown = None
        while time.monotonic() < deadline:
            shown = call(b, "beta", "POST", "/register", {})[1]["webhook"]
            if shown.get("disabled"):
                break
            time.sleep(0.1)
        assert shown == {"url": url, "disabled": True}
        assert call(a, "beta", "POST", "/register", {})[1]["webhook"] == shown
    finally:
        pair.close()
