"""Compatibility with the reference clients of dsh-agent-relay.

The requests below reproduce, byte for byte, the shapes the reference stdlib
Python client (``adapters/hermes/relay_client.py``) and the Node client and
CLI (``lib/client.js``, ``adapters/cli/relay.mjs``) send: their header
spelling, their JSON formatting of the signed body, their query strings,
and the fields they read back. The code here is our own; only the shapes
come from those clients.

- Python: ``json.dumps(body, ensure_ascii=False)`` (spaces after ``,`` and
  ``:``, raw UTF-8), ``X-Relay-*`` headers plus ``Content-Type`` on every
  request, GET / signed too, ``/messages?since=<quoted cursor or empty>&limit=N``,
  cursor adopted only when a poll returned messages; any 409 is read as a
  duplicate send, 5xx/408/429 are retried with the same id.
- Node: ``JSON.stringify`` (compact), lower-case ``x-relay-*`` headers,
  ``/messages?since=${since ?? ''}&limit=${limit}`` unquoted, ``undefined``
  fields dropped, the CLI's unparsed numbers (``NaN`` -> ``null`` in JSON,
  ``limit=NaN`` in a query) and string filters (``--limit 5`` -> ``"5"``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, Optional
from urllib.parse import quote

import pytest_twisted

from relay.testing import SECRET
from relay.wire.signing import sign
from tests.support.api import Broker, Reply


class PythonShape:
    """Requests shaped like the reference stdlib Python client."""

    def __init__(self, broker: Broker, agent: str) -> None:
        self.b = broker
        self.agent = agent
        self.since: Optional[str] = None

    async def request(self, method: str, path: str, body: Any = None) -> Reply:
        raw = "" if body is None else json.dumps(body, ensure_ascii=False)
        ts = int(self.b.clock.seconds())
        headers = {
            "X-Relay-Agent": self.agent,
            "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(SECRET, method, path, ts, raw.encode("utf-8")),
            "Content-Type": "application/json",
        }
        return await self.b.send(method, path, raw.encode("utf-8"), headers)

    async def recv(self, limit: int = 50) -> Reply:
        path = f"/messages?since={quote(self.since or '', safe='')}&limit={limit}"
        reply = await self.request("GET", path)
        if reply.code == 200 and reply.json["messages"]:
            self.since = reply.json.get("cursor") or self.since
        return reply

    async def send(self, to: str, body: Dict[str, Any], message_id: Optional[str] = None,
                   **v11: str) -> Reply:
        payload: Dict[str, Any] = {"id": message_id or str(uuid.uuid4()), "to": to,
                                   "body": body, "type": "message", "replyTo": None,
                                   "ack": False}
        payload.update(v11)
        return await self.request("POST", "/messages", payload)


class NodeShape:
    """Requests shaped like the reference Node client and CLI."""

    def __init__(self, broker: Broker, agent: str) -> None:
        self.b = broker
        self.agent = agent
        self.since: Optional[str] = None

    async def request(self, method: str, path: str, body: Any = None) -> Reply:
        raw = "" if body is None else json.dumps(body, ensure_ascii=False,
                                                 separators=(",", ":"), allow_nan=False)
        ts = int(self.b.clock.seconds())
        headers = {
            "content-type": "application/json",
            "x-relay-agent": self.agent,
            "x-relay-timestamp": str(ts),
            "x-relay-signature": sign(SECRET, method, path, ts, raw.encode("utf-8")),
        }
        return await self.b.send(method, path, raw.encode("utf-8"), headers)

    async def recv(self, limit: Any = 50) -> Reply:
        reply = await self.request("GET", f"/messages?since={self.since or ''}&limit={limit}")
        if reply.code == 200 and reply.json["messages"]:
            self.since = reply.json["cursor"] if reply.json["cursor"] is not None else self.since
        return reply


async def setup():
    b = Broker()
    return b, PythonShape(b, "hermes"), NodeShape(b, "codex")


# -- the Python client ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_python_handshake_register_peers():
    b, py, node = await setup()
    info = await py.request("GET", "/")
    assert info.code == 200 and info.json["protocol"] == "1.0"
    reply = await py.request("POST", "/register", {"agent": "hermes"})
    assert reply.code == 200 and reply.json["ok"] is True and reply.json["agent"] == "hermes"
    await node.request("POST", "/register", {"agent": "codex"})
    peers = (await py.request("GET", "/peers")).json.get("peers", [])
    assert [(p["agent"], p["online"]) for p in peers] == [("codex", True), ("hermes", True)]
    assert all(isinstance(p["lastSeen"], int) for p in peers)


@pytest_twisted.ensureDeferred
async def test_python_send_recv_and_cursor():
    b, py, node = await setup()
    await py.request("POST", "/register", {"agent": "hermes"})
    await node.request("POST", "/register", {"agent": "codex"})
    sent = await node.request("POST", "/messages", {"id": "n-1", "to": "hermes",
                                                    "body": {"text": "héllo ✓ 你好"},
                                                    "type": "message", "replyTo": None,
                                                    "ack": True})
    assert sent.code == 201 and sent.json == {"accepted": True, "id": "n-1", "duplicate": False}
    first = await py.recv()
    assert first.code == 200
    (message,) = first.json["messages"]
    assert message["body"] == {"text": "héllo ✓ 你好"} and message["ack"] is True
    assert py.since == "n-1" == first.json["cursor"]
    again = await py.recv()
    assert again.json["messages"] == [] and py.since == "n-1"
    # the Python client's own send: spaced JSON, non-ASCII, explicit null replyTo
    reply = await py.send("codex", {"text": "ünïcode — ok"}, message_id="p-1")
    assert reply.code == 201 and reply.json["id"] == "p-1" and reply.json["duplicate"] is False


@pytest_twisted.ensureDeferred
async def test_python_cursor_is_quoted_when_ids_need_it():
    b, py, node = await setup()
    await py.request("POST", "/register", {})
    await node.request("POST", "/register", {})
    for message_id in ("a b&c=d", "next"):
        await node.request("POST", "/messages", {"id": message_id, "to": "hermes"})
    reply = await py.recv(limit=1)
    assert [m["id"] for m in reply.json["messages"]] == ["a b&c=d"]
    reply = await py.recv()
    assert [m["id"] for m in reply.json["messages"]] == ["next"]


@pytest_twisted.ensureDeferred
async def test_python_retry_after_timeout_is_a_duplicate_never_a_409():
    b, py, node = await setup()
    await py.request("POST", "/register", {})
    await node.request("POST", "/register", {})
    first = await py.send("codex", {"text": "x"}, message_id="stable")
    retry = await py.send("codex", {"text": "x"}, message_id="stable")
    assert (first.code, retry.code) == (201, 200)
    assert retry.json == {"accepted": True, "id": "stable", "duplicate": True}


@pytest_twisted.ensureDeferred
async def test_python_receipt_and_v11_methods():
    b, py, node = await setup()
    await py.request("POST", "/register", {"agent": "hermes"})
    await node.request("POST", "/register", {"agent": "codex"})
    await node.request("POST", "/messages", {"id": "req", "to": "hermes", "kind": "request",
                                             "body": {"text": "do it"}})
    receipt = await py.request("POST", "/messages/req/ack", {"status": "ok"})
    assert 200 <= receipt.code < 300
    pulled = await py.request("POST", "/v1/pull", {"limit": 50})
    assert pulled.json["count"] == 1
    (m,) = pulled.json["messages"]
    reply = await py.send("codex", {"text": "done"}, message_id="rep", kind="reply",
                          rootId="req", parentId="req")
    assert reply.code == 201
    acked = await py.request("POST", "/v1/ack", {"messageId": m["id"], "leaseId": m["leaseId"],
                                                 "outcome": "completed"})
    assert acked.json == {"ok": True, "status": "done", "attempts": 0}
    statuses = (await node.request("POST", "/v1/status", {"messageIds": ["req", "rep"]})).json
    assert [(s["id"], s["status"]) for s in statuses["messages"]] == [
        ("req", "done"), ("rep", "queued")]
    recent = (await py.request("POST", "/v1/recent", {"limit": 50})).json.get("messages", [])
    assert [m["id"] for m in recent] == ["req"]
    found = (await node.request("POST", "/v1/messages/query", {"kind": "reply"})).json
    assert [m["id"] for m in found["messages"]] == ["rep"]
    mine = (await py.request("POST", "/v1/messages/query", {"kind": "reply"})).json
    assert mine["messages"] == [], "a query searches the caller's inbox, as the reference does"


@pytest_twisted.ensureDeferred
async def test_python_ack_without_lease_id_is_400_not_409():
    """Older clients ack without ``leaseId``; the spec makes it required.

    The Python client turns any 409 into a successful duplicate, so refusing
    this with 409 would read as success there: it must be 400.
    """
    b, py, node = await setup()
    await py.request("POST", "/register", {})
    await node.request("POST", "/register", {})
    await node.request("POST", "/messages", {"id": "m", "to": "hermes"})
    await py.request("POST", "/v1/pull", {"limit": 50})
    reply = await py.request("POST", "/v1/ack", {"messageId": "m", "outcome": "completed"})
    assert reply.code == 400 and reply.json["error"]["code"] == "bad_request"


@pytest_twisted.ensureDeferred
async def test_python_reads_error_code_and_message():
    b, py, node = await setup()
    await py.request("POST", "/register", {})
    reply = await py.send("nobody", {"text": "x"})
    error = (reply.json or {}).get("error", {})
    assert reply.code == 404 and error.get("code") == "no_such_agent"
    assert isinstance(error.get("message"), str)


# -- the Node client and CLI --------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_node_handshake_send_recv():
    b, py, node = await setup()
    info = await node.request("GET", "/")
    assert info.json["protocol"] == "1.0"
    await node.request("POST", "/register", {"agent": "codex"})
    await py.request("POST", "/register", {"agent": "hermes"})
    # send() with body undefined: JSON.stringify drops the field
    sent = await node.request("POST", "/messages", {"id": str(uuid.uuid4()), "to": "hermes",
                                                    "type": "message", "replyTo": None,
                                                    "ack": False})
    assert sent.code == 201 and sent.json["accepted"] is True
    await py.send("codex", {"text": "one"}, message_id="p1")
    await py.send("codex", {"text": "two"}, message_id="p2")
    batch = await node.recv()
    assert [m["id"] for m in batch.json["messages"]] == ["p1", "p2"] and node.since == "p2"
    assert (await node.recv()).json["messages"] == []
    assert node.since == "p2"


@pytest_twisted.ensureDeferred
async def test_node_cli_unparsed_numbers_fall_back_to_defaults():
    b, py, node = await setup()
    await node.request("POST", "/register", {})
    await py.request("POST", "/register", {})
    for i in range(60):
        await py.send("codex", {"n": i}, message_id=f"m{i:02d}")
    polled = await node.recv(limit="NaN")  # `Number(undefined)` in a template string
    assert polled.code == 200 and len(polled.json["messages"]) == 50
    pulled = await node.request("POST", "/v1/pull", {"limit": None})  # NaN -> null
    assert pulled.code == 200 and pulled.json["count"] == 50
    recent = await node.request("POST", "/v1/recent", {"limit": None})
    assert recent.json["count"] == 50
    found = await node.request("POST", "/v1/messages/query",
                               {"kind": "message", "status": "leased", "from": "hermes",
                                "limit": "5"})
    assert found.code == 200 and found.json["count"] == 5
    assert [m["id"] for m in found.json["messages"]] == [f"m{i:02d}" for i in range(49, 44, -1)]


@pytest_twisted.ensureDeferred
async def test_node_cli_pull_then_ack_with_lease_id_and_error_arg():
    b, py, node = await setup()
    await node.request("POST", "/register", {})
    await py.request("POST", "/register", {})
    await py.send("codex", {"text": "job"}, message_id="job")
    pulled = (await node.request("POST", "/v1/pull", {"limit": 50})).json
    count = pulled.get("count", len(pulled["messages"]))
    assert count == 1
    (m,) = pulled["messages"]
    # the CLI passes argv[0] ("ack") as the error when --error is absent
    acked = await node.request("POST", "/v1/ack", {"messageId": m["id"], "leaseId": m["leaseId"],
                                                   "outcome": "retry", "error": "ack"})
    assert acked.json == {"ok": True, "status": "queued", "attempts": 1}


@pytest_twisted.ensureDeferred
async def test_node_cli_recv_sends_receipts_that_watch_can_read():
    b, py, node = await setup()
    await node.request("POST", "/register", {})
    await py.request("POST", "/register", {})
    await py.send("codex", {"text": "please ack"}, message_id="needs-ack")
    await b.post("hermes", "/messages", {"id": "wants", "to": "codex", "ack": True})
    out = (await node.recv()).json["messages"]
    for msg in out:
        if msg["ack"] and msg["type"] == "message":
            receipt = await node.request("POST", f"/messages/{msg['id']}/ack", {"status": "ok"})
            assert 200 <= receipt.code < 300
    watcher = PythonShape(b, "hermes")
    (ack,) = (await watcher.recv()).json["messages"]
    assert ack["type"] == "ack" and ack["replyTo"] == "wants"
    assert ack["body"]["status"] == "ok" and ack["from"] == "codex"
    assert isinstance(ack["ts"], str) and isinstance(ack["id"], str)


@pytest_twisted.ensureDeferred
async def test_signing_with_a_wall_clock_timestamp_is_within_skew():
    """The clients sign with ``int(time.time())``; the broker's clock is the judge."""
    b = Broker()
    b.clock.advance(time.time() - b.clock.seconds())
    ts = int(time.time())
    headers = {"X-Relay-Agent": "hermes", "X-Relay-Timestamp": str(ts),
               "X-Relay-Signature": sign(SECRET, "POST", "/register", ts, b'{"agent": "hermes"}'),
               "Content-Type": "application/json"}
    reply = await b.send("POST", "/register", b'{"agent": "hermes"}', headers)
    assert reply.code == 200
