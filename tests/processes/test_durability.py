"""A broker killed with SIGKILL mid-burst loses nothing it acknowledged (real process)."""

from __future__ import annotations

import http.client
import threading
import time
from typing import Dict, List, Set

import pytest

from tests.conftest import broker_storage
from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process

SENDERS = 4
TARGET_SENT = 300
BURST_SECONDS = 15.0
NETWORK_ERRORS = (OSError, http.client.HTTPException, ValueError)


class Burst:
    """Sender threads (alpha -> beta) and one worker (beta pulls and acks) until stopped."""

    def __init__(self, broker: BrokerProcess) -> None:
        self.broker = broker
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent: Set[str] = set()
        self.pulled: Set[str] = set()
        self.done: Set[str] = set()
        self.threads: List[threading.Thread] = [
            threading.Thread(target=self.send, args=(n,), daemon=True) for n in range(SENDERS)
        ] + [threading.Thread(target=self.work, daemon=True)]

    def send(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            message_id = f"burst-{n}-{i}"
            i += 1
            body = {"id": message_id, "to": "beta", "body": {"n": n, "i": i}}
            try:
                code, _ = self.broker.request("alpha", "POST", "/messages", body, timeout=5)
            except NETWORK_ERRORS:
                return
            if code in (200, 201):
                with self.lock:
                    self.sent.add(message_id)

    def work(self) -> None:
        while not self.stop.is_set():
            try:
                code, body = self.broker.request("beta", "POST", "/v1/pull", {"limit": 5},
                                                 timeout=5)
                if code != 200:
                    continue
                for m in body["messages"]:
                    with self.lock:
                        self.pulled.add(m["id"])
                    ack = {"messageId": m["id"], "leaseId": m["leaseId"], "outcome": "completed"}
                    code, _ = self.broker.request("beta", "POST", "/v1/ack", ack, timeout=5)
                    if code == 200:
                        with self.lock:
                            self.done.add(m["id"])
            except NETWORK_ERRORS:
                return

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wait_for(self, count: int, timeout: float) -> None:
        """Until ``count`` sends and a few acks succeeded (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (len(self.sent) < count or len(self.done) < 10):
            time.sleep(0.01)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def statuses(broker: BrokerProcess, ids: List[str]) -> Dict[str, dict]:
    out = {}
    for i in range(0, len(ids), 200):
        code, body = broker.request("alpha", "POST", "/v1/status", {"messageIds": ids[i:i + 200]})
        assert code == 200, body
        out.update({entry["id"]: entry for entry in body["messages"]})
    return out


@pytest.mark.parametrize("storage", ["sqlite", "jsonl", "postgres"])
def test_sigkill_loses_no_acknowledged_message(tmp_path, storage):
    broker = BrokerProcess(str(tmp_path), **broker_storage(storage))
    burst = Burst(broker)
    try:
        broker.start()
        for agent in ("beta", "alpha"):
            assert broker.request(agent, "POST", "/register", {})[0] == 200
        burst.start()
        burst.wait_for(TARGET_SENT, BURST_SECONDS)
        broker.kill()  # SIGKILL, with requests in flight
        burst.join()
        with burst.lock:
            sent, pulled, done = set(burst.sent), set(burst.pulled), set(burst.done)
        assert len(sent) >= 50, f"the burst barely ran: {broker.log()[-2000:]}"
        assert done, "the worker acked nothing before the kill"

        broker.start()
        found = statuses(broker, sorted(sent))
        missing = sorted(i for i in sent if found[i]["status"] == "not_found")
        assert missing == [], f"{len(missing)} acknowledged messages lost"
        for message_id in sent:
            entry = found[message_id]
            assert (entry["from"], entry["to"]) == ("alpha", "beta")
            if message_id in done:
                assert entry["status"] == "done", message_id
            elif message_id in pulled:
                assert entry["status"] in ("leased", "done"), message_id
            else:
                assert entry["status"] in ("queued", "leased", "done"), message_id
        # the registrations survived too: sending needs a registered recipient
        code, body = broker.request("alpha", "POST", "/messages", {"to": "beta"})
        assert code == 201, body
    finally:
        burst.stop.set()
        broker.kill()


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_sigkill_keeps_every_v12_change_it_acknowledged(tmp_path, storage):
    """EXTENSIONS.md §10: deliveries, errors, notBefore, expiresAt, cards, notices and
    renewed deadlines survive a SIGKILL right after they were answered."""
    broker = BrokerProcess(str(tmp_path), storage=storage).start()
    try:
        card = {"description": "durable", "skills": ["x"]}
        assert broker.request("beta", "POST", "/register", {"card": card})[0] == 200
        assert broker.request("alpha", "POST", "/register", {})[0] == 200
        for i in range(3):
            body = {"id": f"k{i}", "to": "beta", "kind": "request", "ttlSeconds": 3600}
            assert broker.request("alpha", "POST", "/messages", body)[0] == 201
        assert broker.request("alpha", "POST", "/messages",
                              {"id": "later", "to": "beta", "delaySeconds": 3600})[0] == 201
        _, pulled = broker.request("beta", "POST", "/v1/pull", {"limit": 3})
        lease = {m["id"]: m["leaseId"] for m in pulled["messages"]}
        _, renewed = broker.request("beta", "POST", "/v1/lease/renew",
                                    {"messageId": "k0", "leaseId": lease["k0"],
                                     "leaseSeconds": 7200})
        assert broker.request("beta", "POST", "/v1/ack", {
            "messageId": "k1", "leaseId": lease["k1"], "outcome": "reject",
            "error": "bad input"})[0] == 200
        assert broker.request("beta", "POST", "/v1/ack", {
            "messageId": "k2", "leaseId": lease["k2"], "outcome": "retry",
            "retryAfterSeconds": 900})[0] == 200
        _, before = broker.request("alpha", "POST", "/v1/status",
                                   {"messageIds": ["k0", "k1", "k2", "later"]})
        broker.kill()
        broker.start()
        _, after = broker.request("alpha", "POST", "/v1/status",
                                  {"messageIds": ["k0", "k1", "k2", "later"]})
        assert after == before
        k0, k1, k2, later = after["messages"]
        assert (k0["status"], k0["deliveries"], "expiresAt" in k0) == ("leased", 1, True)
        assert (k1["status"], k1["error"]) == ("failed", "bad input")
        assert k2["status"] == "queued" and k2["notBefore"] > time.time() * 1000
        assert later["notBefore"] > time.time() * 1000
        _, recent = broker.request("beta", "POST", "/v1/recent", {})
        held = {m["id"]: m for m in recent["messages"]}
        assert held["k0"]["leaseUntil"] == renewed["leaseUntil"]
        _, peers = broker.request("alpha", "GET", "/peers")
        assert [p.get("card") for p in peers["peers"]] == [None, card]
        _, notices = broker.request("alpha", "POST", "/v1/pull", {"parentId": "k1"})
        (notice,) = notices["messages"]
        assert notice["body"]["relayNotice"]["error"] == "bad input"
    finally:
        broker.kill()
