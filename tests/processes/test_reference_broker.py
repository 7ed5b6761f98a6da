"""Our client side against the reference broker itself (v1.1 only), run with Node.

``RelayClient``, the agent runtime and the ``relay`` command must keep working
against it: no ``X-Relay-Nonce`` (the reference would refuse the signature), no
v1.2 path or field, ``request`` falls back to read-only polling, the runtime
answers through receipts, and every v1.2-only call is refused before anything
is sent. Skipped unless ``node`` is installed and the reference checkout is at
``$RELAY_REFERENCE_DIR`` (default ``/work/ref``). Real processes and sockets;
each wait is bounded.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import pytest_twisted
from twisted.internet import defer

from relay.agent.receipts import ReceiptStore
from relay.agent.runtime import AgentService, Reject
from relay.cli import run
from relay.client.client import RelayClient, RequestFailed
from relay.client.trust import make_http_client
from relay.wire.errors import RelayError
from tests.support.client import Recording, assert_v11_requests
from tests.support.processes import free_port

REFERENCE = Path(os.environ.get("RELAY_REFERENCE_DIR", "/work/ref"))
ENTRY = REFERENCE / "broker" / "src" / "index.js"
NODE = shutil.which("node")
SECRET = "reference-secret-0123456789abcdef"
START_SECONDS = 20.0
POLL = 0.2

pytestmark = [
    pytest.mark.process,  # it starts node and `relay` processes
    pytest.mark.skipif(
        NODE is None or not ENTRY.exists(),
        reason="needs node and the reference broker checkout ($RELAY_REFERENCE_DIR)",
    ),
]


class Reference:
    """The reference broker on a free loopback port, in memory only."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = directory / "config.yaml"
        self.config.write_text(
            "broker:\n"
            "  host: 127.0.0.1\n"
            f"  port: {self.port}\n"
            f"  secret: {SECRET}\n"
            "  persist: false\n"
            "  storage: jsonl\n"
            f"  dataDir: {directory / 'data'}\n"
            "  rateLimitLoopback: 1000000\n"
            "  maxAttempts: 1\n",
            encoding="utf-8",
        )
        self.log = directory / "reference.log"

    def start(self) -> subprocess.Popen:
        with open(self.log, "ab") as log:
            process = subprocess.Popen(
                [str(NODE), str(ENTRY), "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT, cwd=str(self.config.parent),
            )
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1):
                    return process
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    process.wait(10)
                    raise RuntimeError(self.log.read_text()) from None
                time.sleep(0.05)


@pytest.fixture
def reference(tmp_path: Path) -> Iterator[Reference]:
    broker = Reference(tmp_path)
    process = broker.start()
    try:
        yield broker
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def client(reference: Reference, agent: str, http: Recording) -> RelayClient:
    from twisted.internet import reactor

    return RelayClient(reference.url, agent, SECRET, clock=reactor, http=http)


def echo(message: Dict[str, Any]) -> str:
    text = message["body"].get("text", "")
    if text == "poison":
        raise Reject("cannot digest this")
    return text.upper()


@pytest_twisted.ensureDeferred
async def test_client_and_runtime_against_the_reference(
    reference: Reference, tmp_path: Path
) -> None:
    from twisted.internet import reactor

    http = Recording(make_http_client(reactor))
    asker = client(reference, "asker", http)
    worker_client = client(reference, "worker", http)
    receipts = ReceiptStore(tmp_path / "receipts.sqlite3", reactor)
    runtime = AgentService(worker_client, echo, clock=reactor, receipts=receipts,
                           poll_interval=POLL, retry_delay=0, card={"skills": ["echo"]})
    runtime.startService()
    try:
        info = await asker.handshake()
        assert not asker.signs_nonce and "leaseRenew" not in info["capabilities"]
        await asker.register()
        for _ in range(50):
            if "worker" in [p["agent"] for p in (await asker.peers())["peers"]]:
                break
            await deferLater(reactor, 0.1)
        unrelated = await worker_client.send("asker", {"text": "not an answer"})

        reply = await asker.request("worker", {"text": "hello"}, timeout=20, poll_interval=POLL)
        assert reply["body"] == {"text": "HELLO"} and reply["from"] == "worker"
        request_id = reply["parentId"]
        assert receipts.get(request_id)["reply"]["id"] == reply["id"], "answered by receipt"
        statuses = await asker.status([unrelated["id"], reply["id"], request_id])
        assert [s["status"] for s in statuses["messages"]] == ["queued", "queued", "done"], (
            "request() leased and completed nothing")

        with pytest.raises(RequestFailed) as failed:
            await asker.request("worker", {"text": "poison"}, timeout=20, poll_interval=POLL)
        assert failed.value.event == "failed", "Reject fell back to retry until attempts ran out"

        for call in (
            lambda: asker.renew(request_id, "lease"),
            lambda: asker.release(request_id, "lease"),
            lambda: asker.complete(request_id, "lease", reply={"body": {}}),
            lambda: asker.thread(request_id),
            lambda: asker.pull(parent_id=request_id),
            lambda: asker.send("worker", {}, ttl_seconds=60),
            lambda: asker.register(card={"skills": ["x"]}),
        ):
            before = len(http.requests)
            with pytest.raises(RelayError) as refused:
                await call()
            assert refused.value.code == "unsupported" and len(http.requests) == before
    finally:
        await runtime.stopService()
        receipts.close()
    assert_v11_requests(http.requests)
    paths = {path.split("?")[0] for _, path, _, _ in http.requests}
    assert paths <= {"/", "/register", "/peers", "/messages", "/v1/pull", "/v1/ack",
                     "/v1/status", "/v1/messages/query"}, paths


@pytest_twisted.ensureDeferred
async def test_the_relay_command_against_the_reference(
    reference: Reference, tmp_path: Path
) -> None:
    from twisted.internet import reactor

    http = Recording(make_http_client(reactor))

    async def relay(agent: str, *argv: str) -> List[Any]:
        out, err = io.StringIO(), io.StringIO()
        flags = ["--broker", reference.url, "--secret", SECRET, "--agent", agent]
        status = await run(reactor, [*argv, *flags], env={}, home=tmp_path, out=out, err=err,
                           http=http, interactive=False)
        return [status, out.getvalue(), err.getvalue()]

    assert (await relay("worker", "register"))[0] == 0
    status, out, err = await relay("asker", "send", "worker", "hi", "--id", "key-1")
    assert status == 0 and out.startswith("sent "), err
    status, out, err = await relay("asker", "send", "worker", "hi", "--id", "key-1")
    assert out.endswith("(already accepted earlier)\n"), "the derived id is stable"
    asking = defer.ensureDeferred(relay("asker", "ask", "worker", "2 + 2?", "--timeout", "20"))
    worker = client(reference, "worker", http)
    for _ in range(100):
        leased = (await worker.pull())["messages"]
        requests = [m for m in leased if m.get("kind") == "request"]
        for message in leased:
            if message in requests:
                await worker.send("asker", {"text": "4"}, kind="reply", reply_to=message["id"],
                                  parent_id=message["id"])
            await worker.ack_outcome(message["id"], message["leaseId"], "completed")
        if requests:
            break
        await deferLater(reactor, 0.1)
    status, out, err = await asking
    assert (status, out) == (0, "4\n"), err
    status, out, err = await relay("worker", "renew", "m", "l")
    assert status == 1 and err.startswith("error: unsupported: the broker lacks leaseRenew")
    status, out, err = await relay("worker", "dead")
    assert status == 0 and "received messages only" in err
    assert_v11_requests(http.requests)


def deferLater(reactor: Any, seconds: float) -> defer.Deferred:
    from twisted.internet.task import deferLater as later

    return later(reactor, seconds)
