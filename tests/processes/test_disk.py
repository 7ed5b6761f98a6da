"""Disk trouble (issue 8): the data files stop accepting writes while the broker runs.

The real broker process gets a file-size limit of one byte (``RLIMIT_FSIZE``,
set from outside with ``prlimit``; ``SIGXFSZ`` ignored), so every write to its
database, WAL or log fails with ``EFBIG`` exactly as on a full disk, and later
the limit is lifted again ("the disk recovers"). Its output goes to a pipe, so
the limit never touches the test's own log. Checked, for sqlite and jsonl:

- every write that cannot be stored (a send, its resend, an ack) gets ``503
  busy`` with the §6 body, and is undone: the store's commit rolls the turn back
  (docs/RELIABILITY.md), so a refused ack leaves its lease as it was and a
  refused send is stored by nothing;
- reads that change nothing still answer ``200`` from the stored state;
- the broker recovers on its own once writes succeed again: the next send is
  ``201``, a refused id sent again is ``201`` (new, not a duplicate), a refused
  ack made again with the same lease is ``200`` ``done``;
- after a SIGKILL and restart every ``201`` send exists, every acknowledged
  completion is done, and every refused send is unknown.

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
from typing import Any, Dict, List, Set, Tuple

import pytest

from tests.support.processes import TWISTD, BrokerProcess

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
    """Send a fresh message: ``201``, or ``503 busy`` with the §6 body; nothing else."""
    status, reply = broker.request("s1", "POST", "/messages",
                                   {"id": message_id, "to": "worker", "body": {"k": 1}})
    if status == 503:
        assert reply == {"error": {"code": "busy", "message": reply["error"]["message"]}}, reply
    else:
        assert (status, reply) == (201, {"accepted": True, "id": message_id,
                                         "duplicate": False}), (status, reply)
    return status


def ack(broker: BrokerProcess, lease: Dict[str, Any]) -> Tuple[int, Any]:
    return broker.request("worker", "POST", "/v1/ack", {
        "messageId": lease["id"], "leaseId": lease["leaseId"], "outcome": "completed"})


def states(broker: BrokerProcess, ids: List[str]) -> Dict[str, str]:
    """The ``/v1/status`` of ``ids`` as ``{id: status}``."""
    out: Dict[str, str] = {}
    for i in range(0, len(ids), 200):
        status, reply = broker.request("s1", "POST", "/v1/status",
                                       {"messageIds": ids[i:i + 200]})
        assert status == 200, reply
        out.update((e["id"], e["status"]) for e in reply["messages"])
    return out


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_full_disk_503_then_recovery(tmp_path, storage):
    broker = PipedBroker(str(tmp_path), storage=storage, leaseSeconds=30)
    sent: List[str] = []
    try:
        broker.start()
        for agent in ("s1", "worker"):
            assert broker.request(agent, "POST", "/register", {})[0] == 200
        for _ in range(20):
            message_id = str(uuid.uuid4())
            assert send(broker, message_id) == 201
            sent.append(message_id)
        status, pulled = broker.request("worker", "POST", "/v1/pull", {"limit": 5})
        leases = pulled["messages"]
        assert (status, len(leases)) == (200, 5), pulled
        before = states(broker, sent)

        broker.limit_files((1, resource.RLIM_INFINITY))  # the disk is full
        refused = [str(uuid.uuid4()) for _ in range(6)]
        for message_id in refused:  # each after the first waits for the 1 s commit retry
            assert send(broker, message_id) == 503
        for lease in leases:
            status, reply = ack(broker, lease)
            assert (status, reply["error"]["code"]) == (503, "busy"), reply
        # A resend of a refused id is not acknowledged while nothing can be written.
        assert send(broker, refused[0]) == 503, "a duplicate of an unstored message"
        # Reads are answered from what is stored: the refused acks changed nothing.
        assert states(broker, sent + refused) == {**before, **dict.fromkeys(refused,
                                                                            "not_found")}
        assert broker.request("s1", "GET", "/")[0] == 200

        broker.limit_files(UNLIMITED)  # the disk recovers
        recovered = str(uuid.uuid4())
        assert send(broker, recovered) == 201, broker.log()[-2000:]
        for message_id in refused:
            assert send(broker, message_id) == 201, "a refused send was stored"
        for lease in leases:  # the refused acks left each lease as it was
            status, reply = ack(broker, lease)
            assert (status, reply["status"]) == (200, "done"), reply
        acked = sent + refused + [recovered]

        broker.kill()  # SIGKILL: only what was stored survives
        broker.start()
        done = {lease["id"] for lease in leases}
        assert states(broker, acked) == {i: "done" if i in done else "queued" for i in acked}
        assert "Traceback" not in broker.log()
    finally:
        broker.kill()


def wait_for(condition: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_concurrent_sends_on_a_failing_disk_ack_only_what_is_stored(tmp_path, storage):
    """Many sends in the same reactor turns as the failing ones: every send is ``201``
    or ``503``; after a SIGKILL right after, each ``201`` is stored and each ``503``
    is not. The disk fails four times, each time until sends were refused, and
    recovers each time until sends were stored again."""
    broker = PipedBroker(str(tmp_path), storage=storage)
    acked: Set[str] = set()
    refused: Set[str] = set()
    errors: List[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            message_id = str(uuid.uuid4())
            try:
                status = send(broker, message_id)
            except AssertionError as e:
                errors.append(str(e))
                return
            with lock:
                (acked if status == 201 else refused).add(message_id)

    def grown(which: Set[str], by: int) -> Any:
        with lock:
            target = len(which) + by
        return lambda: len(which) >= target

    try:
        broker.start()
        for agent in ("s1", "worker"):
            assert broker.request(agent, "POST", "/register", {})[0] == 200
        threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        for _ in range(4):
            wait_for(grown(acked, 20), "sends to be stored")
            broker.limit_files((1, resource.RLIM_INFINITY))
            wait_for(grown(refused, 6), "sends to be refused")
            broker.limit_files(UNLIMITED)
        wait_for(grown(acked, 20), "sends to be stored after the last recovery")
        stop.set()
        for t in threads:
            t.join(15)
        assert not errors, errors[:3]
        broker.kill()
        broker.start()
        found = states(broker, sorted(acked | refused))
        lost = [i for i in acked if found[i] == "not_found"]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged sends lost"
        stored = [i for i in refused if found[i] != "not_found"]
        assert not stored, f"{len(stored)} of {len(refused)} refused sends were stored"
    finally:
        stop.set()
        broker.kill()
