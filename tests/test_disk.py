"""Disk trouble (issue 8): the data files stop accepting writes while the broker runs.

The real broker process gets a file-size limit of one byte (``RLIMIT_FSIZE``,
set from outside with ``prlimit``; ``SIGXFSZ`` ignored), so every write to its
database, WAL or log fails with ``EFBIG`` exactly as on a full disk, and later
the limit is lifted again ("the disk recovers"). Its output goes to a pipe, so
the limit never touches the test's own log. Checked, for sqlite and jsonl:

- requests that cannot be stored get ``503 busy`` with the §6 body;
- nothing is acknowledged that was not stored: after a SIGKILL and restart,
  every ``201``/``200`` send exists and every acknowledged completion is done;
- the broker recovers on its own once writes succeed again.

(A read-only ``chmod`` of the data directory would not do: the open files stay
writable through their descriptors.)
"""

from __future__ import annotations

import resource
import signal
import subprocess
import threading
import time
import uuid
from typing import Any, Dict, List, Set

import pytest

from tests.broker_proc import TWISTD, BrokerProcess

pytestmark = pytest.mark.process

UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)


class PipedBroker(BrokerProcess):
    """A BrokerProcess whose output goes to a pipe drained in memory."""

    output: List[bytes]

    def start(self, timeout: float = 20.0) -> PipedBroker:
        self.output = []
        self.proc = subprocess.Popen(
            [TWISTD, "-n", "--pidfile=", "relay", "--config", self.config_path],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.directory,
            preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
        )
        proc = self.proc
        threading.Thread(target=lambda: self.output.extend(iter(proc.stdout.readline, b"")),
                         daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"broker exited: {self.log()}")
            try:
                if self.request("s1", "GET", "/", timeout=1)[0] == 200:
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"broker did not start: {self.log()}")

    def log(self) -> str:
        return b"".join(self.output).decode("utf-8", "replace")

    def limit_files(self, size: Any) -> None:
        resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, size)


def send(broker: BrokerProcess, message_id: str) -> int:
    status, reply = broker.request("s1", "POST", "/messages",
                                   {"id": message_id, "to": "worker", "body": {"k": 1}})
    if status >= 400:
        assert set(reply) == {"error"} and set(reply["error"]) == {"code", "message"}, reply
    if status == 503:
        assert reply["error"]["code"] == "busy"
    return status


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_full_disk_503_then_recovery(tmp_path, storage):
    broker = PipedBroker(str(tmp_path), storage=storage, leaseSeconds=30)
    acked: Set[str] = set()
    completed: Set[str] = set()
    try:
        broker.start()
        for agent in ("s1", "worker"):
            assert broker.request(agent, "POST", "/register", {})[0] == 200
        for _ in range(20):
            message_id = str(uuid.uuid4())
            assert send(broker, message_id) == 201
            acked.add(message_id)
        status, pulled = broker.request("worker", "POST", "/v1/pull", {"limit": 5})
        leases = pulled["messages"]

        broker.limit_files((1, resource.RLIM_INFINITY))  # the disk is full
        refused: List[str] = []
        statuses: Dict[int, int] = {}
        for _ in range(6):  # each waits for the store's next commit retry (1 s)
            message_id = str(uuid.uuid4())
            status = send(broker, message_id)
            statuses[status] = statuses.get(status, 0) + 1
            if status in (200, 201):
                acked.add(message_id)
            else:
                refused.append(message_id)
        assert statuses.get(503, 0) >= 5, statuses
        # Acks that cannot be stored are refused too; reads still work.
        for m in leases:
            status, reply = broker.request("worker", "POST", "/v1/ack", {
                "messageId": m["id"], "leaseId": m["leaseId"], "outcome": "completed"})
            assert status in (200, 503, 409), reply
            if status == 200:
                completed.add(m["id"])
        assert broker.request("s1", "GET", "/")[0] == 200
        # A resend of a refused id is not acknowledged while nothing can be written.
        status = send(broker, refused[0])
        assert status == 503, "a duplicate of an unstored message is not acknowledged"

        broker.limit_files(UNLIMITED)  # the disk recovers
        deadline = time.monotonic() + 15
        recovered = False
        while time.monotonic() < deadline:
            message_id = str(uuid.uuid4())
            status = send(broker, message_id)
            if status in (200, 201):
                acked.add(message_id)
                recovered = True
                break
            time.sleep(0.2)
        assert recovered, f"the broker did not recover: {broker.log()[-2000:]}"
        for message_id in refused:
            assert send(broker, message_id) in (200, 201)
            acked.add(message_id)

        broker.kill()  # SIGKILL: only what was stored survives
        broker.start()
        ids = sorted(acked)
        status, reply = broker.request("s1", "POST", "/v1/status", {"messageIds": ids})
        states = {e["id"]: e["status"] for e in reply["messages"]}
        lost = [i for i in ids if states[i] == "not_found"]
        assert not lost, f"{len(lost)} acknowledged sends lost"
        for message_id in completed:
            assert states[message_id] == "done"
        assert "Traceback" not in broker.log()
    finally:
        broker.kill()


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_concurrent_sends_on_a_failing_disk_ack_only_what_is_stored(tmp_path, storage):
    """Many sends in the same reactor turns as the failing ones: none is acknowledged
    unless it survives a SIGKILL right after."""
    broker = PipedBroker(str(tmp_path), storage=storage)
    acked: Set[str] = set()
    refused: List[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            message_id = str(uuid.uuid4())
            try:
                status = send(broker, message_id)
            except OSError:
                return
            with lock:
                if status in (200, 201):
                    acked.add(message_id)
                else:
                    refused.append(message_id)

    try:
        broker.start()
        for agent in ("s1", "worker"):
            assert broker.request(agent, "POST", "/register", {})[0] == 200
        threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        for _ in range(4):
            time.sleep(0.3)
            broker.limit_files((1, resource.RLIM_INFINITY))
            time.sleep(0.3)
            broker.limit_files(UNLIMITED)
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(15)
        broker.kill()
        broker.start()
        ids = sorted(acked)
        assert len(ids) > 50 and refused, (len(ids), len(refused))
        lost = []
        for i in range(0, len(ids), 200):
            status, reply = broker.request("s1", "POST", "/v1/status",
                                           {"messageIds": ids[i:i + 200]})
            lost += [e["id"] for e in reply["messages"] if e["status"] == "not_found"]
        assert not lost, f"{len(lost)} of {len(ids)} acknowledged sends lost"
    finally:
        stop.set()
        broker.kill()
