"""Crashes (issue 8): SIGKILL the real broker under concurrent send/pull/ack load,
restart it, and check that nothing it acknowledged was lost.

For sqlite and jsonl, ``RELAY_CRASH_ROUNDS`` rounds (default 20) each run a
short load of random length (senders, and workers that pull and ack) and then
kill the process. After every restart, and at the end:

- the broker starts cleanly;
- every send it answered ``201``/``200`` exists;
- every ``completed`` it answered ``200`` is ``done``;
- re-sending an acknowledged id is ``200 duplicate``;
- read offline from the data files, every id is stored once, in exactly one
  state, with the lease fields that state implies.

A second test kills the jsonl broker in the middle of a compaction.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sqlite3
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from relay.rules.delivery import Message
from relay.store.jsonl import COMPACT_SUFFIX, LOG_NAME, read_log, snapshot_record, state_record
from relay.wire.signing import sign
from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process

ROUNDS = int(os.environ.get("RELAY_CRASH_ROUNDS", "20"))
RECIPIENT = "worker"
# No message can fail here: retries stay far below maxAttempts, and maxDeliveries is
# off, so a failed message would be a broker fault.
MAX_ATTEMPTS = 1000
NOTHING_FAILS = "a message failed, though neither attempts nor deliveries can run out"
SENDERS = ("s1", "s2")


def call(broker: BrokerProcess, conn: Optional[http.client.HTTPConnection], agent: str,
         method: str, path: str, body: Any = None
         ) -> Tuple[http.client.HTTPConnection, int, Any]:
    """One signed request on a keep-alive connection; raises OSError when the broker is gone."""
    if conn is None:
        conn = http.client.HTTPConnection("127.0.0.1", broker.port, timeout=5)
    raw = b"" if body is None else json.dumps(body).encode()
    ts = int(time.time())
    headers = {"X-Relay-Agent": agent, "X-Relay-Timestamp": str(ts),
               "X-Relay-Signature": sign(broker.secret, method, path, ts, raw),
               "Content-Type": "application/json"}
    try:
        conn.request(method, path, body=raw or None, headers=headers)
        response = conn.getresponse()
        return conn, response.status, json.loads(response.read())
    except (OSError, http.client.HTTPException):
        conn.close()
        raise


class Acknowledged:
    """What the broker acknowledged across all rounds (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: Set[str] = set()
        self.completed: Set[str] = set()
        self.errors: List[str] = []


def sender(broker: BrokerProcess, agent: str, acked: Acknowledged, stop: threading.Event
           ) -> None:
    conn = None
    while not stop.is_set():
        message_id = str(uuid.uuid4())
        try:
            conn, status, reply = call(broker, conn, agent, "POST", "/messages",
                                       {"id": message_id, "to": RECIPIENT,
                                        "body": {"n": random.random()}})
        except (OSError, http.client.HTTPException):
            return  # killed: this send was not acknowledged
        if status == 201:  # a fresh id: never a duplicate, and the disk is healthy
            with acked.lock:
                acked.sent.add(message_id)
        else:
            acked.errors.append(f"send {status} {reply}")


def worker(broker: BrokerProcess, acked: Acknowledged, stop: threading.Event) -> None:
    """Pull and ack. Each lease lasts 1 s, so an ack may come after its deadline: the
    answer is ``200`` when the ack was answered before the lease's ``leaseUntil``,
    ``409 not_leased`` when it was sent after it (a lapsed lease is not leased,
    swept or not: EXTENSIONS.md §1), or ``lease_mismatch`` once another worker
    holds the message again; either only in between."""
    conn = None
    rng = random.Random()
    while not stop.is_set():
        try:
            conn, status, reply = call(broker, conn, RECIPIENT, "POST", "/v1/pull",
                                       {"limit": rng.randint(1, 10), "leaseSeconds": 1})
            if status != 200:
                acked.errors.append(f"pull {status} {reply}")
                continue
            for m in reply["messages"]:
                outcome = "retry" if rng.random() < 0.2 else "completed"
                sent_ms = time.time() * 1000
                conn, status, result = call(broker, conn, RECIPIENT, "POST", "/v1/ack",
                                            {"messageId": m["id"], "leaseId": m["leaseId"],
                                             "outcome": outcome})
                answered_ms = time.time() * 1000
                if status == 200:
                    expected = "done" if outcome == "completed" else "queued"
                    if result["status"] != expected or sent_ms > m["leaseUntil"] + 1:
                        acked.errors.append(f"ack {outcome} after {sent_ms - m['leaseUntil']}"
                                            f" ms past the deadline: {result}")
                    elif outcome == "completed":
                        with acked.lock:
                            acked.completed.add(m["id"])
                elif (status != 409 or answered_ms < m["leaseUntil"] - 1
                      or result["error"]["code"] not in ("not_leased", "lease_mismatch")):
                    acked.errors.append(f"ack {status} {answered_ms - m['leaseUntil']} ms "
                                        f"past the deadline: {result}")
        except (OSError, http.client.HTTPException):
            return


def check_served(broker: BrokerProcess, acked: Acknowledged) -> None:
    """Every acknowledged send exists and every acknowledged completion is done."""
    with acked.lock:
        sent, completed = sorted(acked.sent), set(acked.completed)
    conn = None
    for i in range(0, len(sent), 200):
        ids = sent[i:i + 200]
        conn, status, reply = call(broker, conn, RECIPIENT, "POST", "/v1/status",
                                   {"messageIds": ids})
        assert status == 200, reply
        for entry in reply["messages"]:
            assert entry["status"] != "not_found", f"acknowledged send lost: {entry}"
            assert entry["status"] in ("queued", "leased", "done"), NOTHING_FAILS
            if entry["id"] in completed:
                assert entry["status"] == "done", f"acknowledged completion lost: {entry}"
    for message_id in random.sample(sent, min(20, len(sent))):
        conn, status, reply = call(broker, conn, "s1", "POST", "/messages",
                                   {"id": message_id, "to": RECIPIENT})
        assert (status, reply["duplicate"]) == (200, True), reply
    if conn is not None:
        conn.close()


def stored_states(storage: str, data_dir: str) -> Dict[str, Message]:
    """The messages in the data files, read offline; each id once, each state coherent."""
    if storage == "sqlite":
        db = sqlite3.connect(os.path.join(data_dir, "relay.db"))
        try:
            dupes = db.execute(
                "SELECT id, COUNT(*) FROM messages GROUP BY id HAVING COUNT(*) > 1").fetchall()
            assert not dupes, dupes
            rows = db.execute(
                "SELECT id, status, lease_id, lease_until, attempts FROM messages").fetchall()
        finally:
            db.close()
        messages = {}
        for message_id, status, lease_id, lease_until, attempts in rows:
            messages[message_id] = Message(id=message_id, sender="?", to="?", created=0,
                                           status=status, lease_id=lease_id,
                                           lease_until=lease_until, attempts=attempts)
    else:
        loaded = read_log(os.path.join(data_dir, LOG_NAME), time.time())
        ids = [m.id for m in loaded.messages]
        assert len(ids) == len(set(ids)), "an id stored twice"
        seqs = [m.seq for m in loaded.messages]
        assert len(seqs) == len(set(seqs)), "a seq used twice"
        messages = {m.id: m for m in loaded.messages}
    for m in messages.values():
        assert m.status in ("queued", "leased", "done"), (NOTHING_FAILS, m)
        leased = m.status == "leased"
        assert (m.lease_id is not None) == leased and (m.lease_until is not None) == leased, m
        assert 0 <= m.attempts < MAX_ATTEMPTS, m
    return messages


def start_cleanly(broker: BrokerProcess) -> None:
    offset = os.path.getsize(broker.log_path) if os.path.exists(broker.log_path) else 0
    broker.start()
    with open(broker.log_path, "rb") as f:
        f.seek(offset)
        started = f.read().decode("utf-8", "replace")
    assert "Traceback" not in started and "Unhandled" not in started, started[-2000:]


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_sigkill_under_load_loses_nothing_acknowledged(tmp_path, storage):
    broker = BrokerProcess(str(tmp_path), storage=storage, leaseSeconds=1, sweepSeconds=0.2,
                           maxAttempts=MAX_ATTEMPTS, maxDeliveries=0)
    acked = Acknowledged()
    rng = random.Random()
    data_dir = os.path.join(str(tmp_path), "data")
    try:
        for round_number in range(ROUNDS):
            start_cleanly(broker)
            if round_number == 0:
                for agent in (RECIPIENT,) + SENDERS:
                    assert broker.request(agent, "POST", "/register", {})[0] == 200
            else:
                check_served(broker, acked)
            stop = threading.Event()
            threads = [threading.Thread(target=sender, args=(broker, a, acked, stop))
                       for a in SENDERS]
            threads += [threading.Thread(target=worker, args=(broker, acked, stop))
                        for _ in range(3)]
            for t in threads:
                t.daemon = True
                t.start()
            time.sleep(rng.uniform(0.05, 0.6))
            broker.kill()  # SIGKILL, mid-request
            stop.set()
            for t in threads:
                t.join(10)
            assert not acked.errors, acked.errors[:5]
            stored = stored_states(storage, data_dir)
            with acked.lock:
                lost = acked.sent - set(stored)
                undone = {i for i in acked.completed
                          if getattr(stored.get(i), "status", None) != "done"}
            assert not lost, f"round {round_number}: {len(lost)} acknowledged sends lost"
            assert not undone, f"round {round_number}: completions lost: {sorted(undone)[:3]}"
        start_cleanly(broker)
        check_served(broker, acked)
    finally:
        broker.kill()
    print(f"\n{storage}: {ROUNDS} SIGKILL rounds, {len(acked.sent)} acknowledged sends, "
          f"{len(acked.completed)} acknowledged completions, 0 lost")
    assert acked.sent and acked.completed


def write_garbage_heavy_log(path: str, live: int, garbage_per_message: int) -> Set[str]:
    """A jsonl log with ``live`` done messages and many superseded state records."""
    now = time.time()
    ids = set()
    with open(path, "wb") as f:
        f.write(b'{"op":"peer","agent":"worker","lastSeen":%d}\n' % int(now))
        for seq in range(1, live + 1):
            m = Message(id=f"m{seq}", sender="s1", to=RECIPIENT, created=now, seq=seq,
                        body={"n": seq})
            ids.add(m.id)
            lines = [json.dumps(snapshot_record(m), separators=(",", ":"))]
            for _ in range(garbage_per_message):
                m.status, m.lease_id, m.lease_until = "leased", "x" * 32, int(now * 1000)
                lines.append(json.dumps(state_record(m), separators=(",", ":")))
                m.status, m.lease_id, m.lease_until = "queued", None, None
                lines.append(json.dumps(state_record(m), separators=(",", ":")))
            m.status = "done"
            lines.append(json.dumps(state_record(m), separators=(",", ":")))
            f.write(("\n".join(lines) + "\n").encode())
    return ids


def test_sigkill_during_jsonl_compaction(tmp_path):
    """Compaction starts once the log holds > 10k records and > 2x the live ones; the
    broker is killed while ``messages.jsonl.compact`` exists, then restarted."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = str(data_dir / LOG_NAME)
    ids = write_garbage_heavy_log(path, live=30_000, garbage_per_message=1)
    broker = BrokerProcess(str(tmp_path), storage="jsonl")
    rng = random.Random()
    kills = 0
    try:
        for attempt in range(4):
            start_cleanly(broker)
            # One write makes the store check its garbage ratio and start compacting.
            status, _ = broker.request("s1", "POST", "/messages",
                                       {"id": f"trigger{attempt}", "to": RECIPIENT})
            assert status == 201
            ids.add(f"trigger{attempt}")
            compact = path + COMPACT_SUFFIX
            deadline = time.monotonic() + 10
            while not os.path.exists(compact) and time.monotonic() < deadline:
                time.sleep(0.0005)
            if os.path.exists(compact):
                time.sleep(rng.uniform(0, 0.03))
                kills += 1
            broker.kill()
            stored = stored_states("jsonl", str(data_dir))
            assert set(stored) == ids, f"lost {len(ids - set(stored))} messages"
            assert all(stored[i].status == "done" for i in ids if i.startswith("m"))
            if not os.path.exists(compact) and os.path.getsize(path) < 30_000 * 400:
                # The compaction finished before the kill: grow the garbage again.
                write_more_garbage(path, 40_000)
        start_cleanly(broker)
        status, reply = broker.request(RECIPIENT, "POST", "/v1/status",
                                       {"messageIds": ["m1", "m30000", "trigger0"]})
        assert [e["status"] for e in reply["messages"]] == ["done", "done", "queued"]
    finally:
        broker.kill()
    assert kills >= 2, "the kill landed inside a compaction at least twice"
    print(f"\njsonl: killed {kills} times during a compaction of 30000 messages, 0 lost")


def write_more_garbage(path: str, count: int) -> None:
    """Append superseded peer records until compaction is due again."""
    now = int(time.time())
    with open(path, "ab") as f:
        f.write(b"".join(b'{"op":"peer","agent":"worker","lastSeen":%d}\n' % now
                         for _ in range(count)))
