"""Concurrency (issue 8): many workers pull one agent's queue at once through the
HTTP API of the real broker while senders keep sending.

Every lease a worker gets is recorded with the broker's own times (a lease
starts at ``leaseUntil - leaseSeconds``) and the client's times of its acks,
so the checks are exact: a message is never granted while a previous lease on
it is still live, every message ends ``done`` exactly once, and ``attempts``
counts the ``retry`` outcomes only (a lease that merely expires is not an
attempt, spec §5.1).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import pytest

from relay.wire.signing import sign
from tests.conftest import broker_storage
from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process

WORKERS = 8
SENDERS = 2
RECIPIENT = "worker"


class Client:
    """One keep-alive HTTP connection that signs its requests (spec §3)."""

    def __init__(self, broker: BrokerProcess, agent: str) -> None:
        self.broker = broker
        self.agent = agent
        self.conn: Optional[http.client.HTTPConnection] = None

    def call(self, method: str, path: str, body: Any = None) -> Tuple[int, Any]:
        raw = b"" if body is None else json.dumps(body).encode()
        for attempt in range(3):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.broker.port,
                                                       timeout=10)
            ts = int(time.time())
            headers = {"X-Relay-Agent": self.agent, "X-Relay-Timestamp": str(ts),
                       "X-Relay-Signature": sign(self.broker.secret, method, path, ts, raw),
                       "Content-Type": "application/json"}
            try:
                self.conn.request(method, path, body=raw or None, headers=headers)
                response = self.conn.getresponse()
                return response.status, json.loads(response.read())
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class Ledger:
    """What the clients saw: sends, leases, acks (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: List[str] = []
        self.leases: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        self.completed: Dict[str, int] = defaultdict(int)
        self.retries: Dict[str, int] = defaultdict(int)
        self.errors: List[str] = []

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)


def sender(broker: BrokerProcess, name: str, count: int, ledger: Ledger) -> None:
    client = Client(broker, name)
    try:
        for _ in range(count):
            message_id = str(uuid.uuid4())
            status, reply = client.call("POST", "/messages",
                                        {"id": message_id, "to": RECIPIENT, "kind": "request"})
            if status not in (200, 201):
                ledger.error(f"send {status} {reply}")
                continue
            with ledger.lock:
                ledger.sent.append(message_id)
            time.sleep(random.uniform(0, 0.004))
    finally:
        client.close()


def worker(broker: BrokerProcess, ledger: Ledger, stop: threading.Event, lease_seconds: int,
           p_die: float, p_retry: float) -> None:
    client = Client(broker, RECIPIENT)
    rng = random.Random()
    try:
        while not stop.is_set():
            status, reply = client.call("POST", "/v1/pull",
                                        {"limit": rng.randint(1, 5), "leaseSeconds": lease_seconds})
            if status != 200:
                ledger.error(f"pull {status} {reply}")
                continue
            if not reply["messages"]:
                time.sleep(0.01)
                continue
            for m in reply["messages"]:
                lease = {"leaseId": m["leaseId"], "granted": m["leaseUntil"] - lease_seconds * 1000,
                         "until": m["leaseUntil"], "ended": None, "attempts": m["attempts"],
                         "received": int(time.time() * 1000)}
                with ledger.lock:
                    ledger.leases[m["id"]].append(lease)
                roll = rng.random()
                if roll < p_die:
                    continue  # this worker "dies" holding the lease
                outcome = "retry" if roll < p_die + p_retry else "completed"
                sent_ms = int(time.time() * 1000)
                status, result = client.call("POST", "/v1/ack", {
                    "messageId": m["id"], "leaseId": m["leaseId"], "outcome": outcome})
                if status == 200:
                    with ledger.lock:
                        lease["ended"] = sent_ms
                        if outcome == "completed":
                            ledger.completed[m["id"]] += 1
                        else:
                            ledger.retries[m["id"]] += 1
                elif status != 409:  # 409: the lease expired meanwhile; that is legal
                    ledger.error(f"ack {status} {result}")
    except Exception as e:  # noqa: BLE001 (reported by the test)
        ledger.error(f"worker crashed: {e!r}")
    finally:
        client.close()


def run_load(broker: BrokerProcess, per_sender: int, lease_seconds: int, p_die: float,
             p_retry: float, deadline: float) -> Ledger:
    """Senders and workers at once, until every sent message is done (or the deadline)."""
    ledger = Ledger()
    stop = threading.Event()
    workers = [threading.Thread(target=worker, daemon=True,
                                args=(broker, ledger, stop, lease_seconds, p_die, p_retry))
               for _ in range(WORKERS)]
    senders = [threading.Thread(target=sender, daemon=True,
                                args=(broker, f"sender{i}", per_sender, ledger))
               for i in range(SENDERS)]
    for t in workers + senders:
        t.start()
    for t in senders:
        t.join(deadline)
    try:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if set(ledger.completed) >= set(ledger.sent):
                break
            time.sleep(0.2)
    finally:
        stop.set()
        for t in workers:
            t.join(15)
    return ledger


def check(broker: BrokerProcess, ledger: Ledger, per_sender: int,
          threaded: bool = False) -> Dict[str, int]:
    """The promises; returns a few counts for the report.

    A store whose operations wait for a worker thread (postgres) dates a lease from
    when the pull was asked for, so ``leaseUntil - leaseSeconds`` may precede the
    grant by that wait: there a grant is bounded by the arrival of its answer.
    """
    assert not ledger.errors, ledger.errors[:5]
    assert len(ledger.sent) == SENDERS * per_sender
    # Every message completed exactly once.
    missing = [m for m in ledger.sent if ledger.completed.get(m) != 1]
    assert not missing, (len(missing), missing[:3])
    assert set(ledger.completed) == set(ledger.sent)
    # Never two live leases: each grant comes after the previous lease ended
    # (its successful ack, or its deadline).
    # On a threaded store a pull that waited for its thread may grant after a pull that
    # was asked later: grants are put in order by the arrival of their answers there.
    order = "received" if threaded else "granted"
    regrants = 0
    for message_id, leases in ledger.leases.items():
        leases.sort(key=lambda lease: lease[order])
        assert len({lease["leaseId"] for lease in leases}) == len(leases)
        for before, after in zip(leases, leases[1:]):
            ended = before["ended"] if before["ended"] is not None else before["until"]
            granted = after["received"] if threaded else after["granted"]
            assert granted >= min(ended, before["until"]) - 1, (message_id, leases)
            regrants += 1
        assert ledger.completed[message_id] == 1
    # The broker agrees (asked by the recipient, who sees every message): done, with
    # attempts = the retry outcomes.
    client = Client(broker, RECIPIENT)
    try:
        for i in range(0, len(ledger.sent), 200):
            ids = ledger.sent[i:i + 200]
            status, reply = client.call("POST", "/v1/status", {"messageIds": ids})
            assert status == 200
            for entry in reply["messages"]:
                assert entry["status"] == "done", entry
                assert entry["attempts"] == ledger.retries.get(entry["id"], 0), entry
    finally:
        client.close()
    return {"messages": len(ledger.sent), "leases": sum(map(len, ledger.leases.values())),
            "regrants": regrants}


def start(tmp_path, storage: str, lease_seconds: int) -> BrokerProcess:
    b = BrokerProcess(str(tmp_path), **broker_storage(storage), leaseSeconds=lease_seconds,
                      sweepSeconds=0.2, maxAttempts=1000, maxDeliveries=0)
    b.start()
    for agent in (RECIPIENT, "sender0", "sender1"):
        assert b.request(agent, "POST", "/register", {})[0] == 200
    return b


@pytest.mark.parametrize("storage", ["memory", "sqlite", "jsonl", "postgres"])
def test_all_workers_ack_every_message_completed_once(tmp_path, storage):
    broker = start(tmp_path, storage, 30)
    try:
        ledger = run_load(broker, per_sender=200, lease_seconds=30, p_die=0.0, p_retry=0.0,
                          deadline=60)
        counts = check(broker, ledger, 200, threaded=storage == "postgres")
        assert counts["regrants"] == 0, "with every worker completing, nothing is leased twice"
    finally:
        broker.kill()


@pytest.mark.parametrize("storage", ["memory", "sqlite", "jsonl", "postgres"])
def test_dying_workers_every_message_completed_after_expiry(tmp_path, storage):
    broker = start(tmp_path, storage, 1)
    try:
        ledger = run_load(broker, per_sender=100, lease_seconds=1, p_die=0.25, p_retry=0.15,
                          deadline=90)
        counts = check(broker, ledger, 100, threaded=storage == "postgres")
        assert counts["regrants"] > 0, "some leases expired and were granted again"
        expired_then_granted = sum(
            1 for leases in ledger.leases.values()
            for a, b in zip(leases, leases[1:]) if a["ended"] is None
            and b["granted"] >= a["until"]
        )
        assert expired_then_granted > 0
    finally:
        broker.kill()
