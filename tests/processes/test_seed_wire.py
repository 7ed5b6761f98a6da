"""The seed wire through the real ``twistd -n relay`` process, on each persistent
backend and across a restart: the broker's ``ts`` (spec §2), the ack ``error`` outside
the envelope, a receipt path that only matches once percent-decoded, ``leaseId`` for the
recipient, and ``messageTtlDays: 0`` as the reference broker reads it (each found by an
independent black-box conformance run).
"""

from __future__ import annotations

import datetime
import http.client
import json
import time

import pytest

from relay.wire.signing import sign
from tests.conftest import broker_storage
from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process

SENT_TS = "1999-01-01T00:00:00.000Z"


def raw_request(broker: BrokerProcess, agent: str, method: str, path: str, body=None):
    """A signed request whose path goes out byte for byte (urllib would re-quote it)."""
    raw = b"" if body is None else json.dumps(body).encode()
    ts = int(time.time())
    connection = http.client.HTTPConnection("127.0.0.1", broker.port, timeout=10)
    try:
        connection.request(method, path, body=raw or None, headers={
            "X-Relay-Agent": agent, "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(broker.secret, method, path, ts, raw),
            "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


@pytest.fixture(params=["sqlite", "jsonl", "postgres"])
def persistent(request, tmp_path):
    broker = BrokerProcess(str(tmp_path), **broker_storage(request.param)).start()
    yield broker
    broker.kill()


def register(broker: BrokerProcess, *agents: str) -> None:
    for agent in agents:
        assert broker.request(agent, "POST", "/register", {})[0] == 200


def test_ts_is_the_time_the_broker_stored_the_message(persistent):
    register(persistent, "alpha", "beta")
    before = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    status, _ = persistent.request("alpha", "POST", "/messages",
                                   {"to": "beta", "ts": SENT_TS, "body": {}})
    assert status == 201
    _, page = persistent.request("beta", "GET", "/messages")
    (message,) = page["messages"]
    stored = datetime.datetime.fromisoformat(message["ts"].replace("Z", "+00:00"))
    assert message["ts"] != SENT_TS and stored >= before


def test_the_ack_error_is_reported_by_status_not_in_envelopes(persistent):
    register(persistent, "alpha", "beta")
    _, sent = persistent.request("alpha", "POST", "/messages", {"to": "beta"})
    _, pulled = persistent.request("beta", "POST", "/v1/pull", {})
    (leased,) = pulled["messages"]
    status, _ = persistent.request("beta", "POST", "/v1/ack", {
        "messageId": sent["id"], "leaseId": leased["leaseId"], "outcome": "retry",
        "error": "tool timed out"})
    assert status == 200
    _, states = persistent.request("alpha", "POST", "/v1/status", {"messageIds": [sent["id"]]})
    assert states["messages"][0]["error"] == "tool timed out"
    envelopes = [
        persistent.request("beta", "GET", "/messages")[1]["messages"][0],
        persistent.request("beta", "POST", "/v1/recent", {})[1]["messages"][0],
        persistent.request("beta", "POST", "/v1/messages/query", {})[1]["messages"][0],
        persistent.request("beta", "POST", "/v1/pull", {})[1]["messages"][0],
    ]
    for envelope in envelopes:
        assert "error" not in envelope


def test_a_receipt_path_that_matches_only_once_decoded_is_no_route(persistent):
    register(persistent, "alpha", "beta")
    _, sent = persistent.request("alpha", "POST", "/messages", {"to": "beta"})
    status, body = raw_request(persistent, "beta", "POST", f"/messages/{sent['id']}%2Fack", {})
    assert (status, body["error"]["code"]) == (404, "not_found")
    _, page = persistent.request("alpha", "GET", "/messages")
    assert page["messages"] == [], "no receipt was stored"
    status, _ = raw_request(persistent, "beta", "POST", f"/messages/{sent['id']}/ack", {})
    assert status == 201


def test_the_recipient_sees_its_lease_id_also_after_a_restart(persistent):
    register(persistent, "alpha", "beta")
    _, sent = persistent.request("alpha", "POST", "/messages", {"to": "beta"})
    _, pulled = persistent.request("beta", "POST", "/v1/pull", {"leaseSeconds": 3600})
    lease_id = pulled["messages"][0]["leaseId"]
    persistent.stop()
    persistent.start()
    (recent,) = persistent.request("beta", "POST", "/v1/recent", {})[1]["messages"]
    (found,) = persistent.request("beta", "POST", "/v1/messages/query",
                                  {"status": "leased"})[1]["messages"]
    assert recent["leaseId"] == found["leaseId"] == lease_id
    _, states = persistent.request("alpha", "POST", "/v1/status", {"messageIds": [sent["id"]]})
    assert "leaseId" not in states["messages"][0]
    status, acked = persistent.request("beta", "POST", "/v1/ack", {
        "messageId": sent["id"], "leaseId": lease_id, "outcome": "completed"})
    assert (status, acked["status"]) == (200, "done")


def test_message_ttl_days_zero_expires_every_message(tmp_path):
    broker = BrokerProcess(str(tmp_path), storage="sqlite").start()
    try:
        register(broker, "alpha", "beta")
        ids = [broker.request("alpha", "POST", "/messages", {"to": "beta"})[1]["id"]
               for _ in range(3)]
        broker.stop()
        conf = broker.config_path
        with open(conf) as f:
            text = f.read()
        with open(conf, "w") as f:
            f.write(text.replace("broker:\n", "broker:\n  messageTtlDays: 0\n", 1))
        broker.start()
        _, states = broker.request("alpha", "POST", "/v1/status", {"messageIds": ids})
        assert {entry["status"] for entry in states["messages"]} == {"not_found"}
        _, sent = broker.request("alpha", "POST", "/messages", {"to": "beta"})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            _, states = broker.request("alpha", "POST", "/v1/status",
                                       {"messageIds": [sent["id"]]})
            if states["messages"][0]["status"] == "not_found":
                break
            time.sleep(0.1)
        assert states["messages"][0]["status"] == "not_found"
        _, info = broker.request("alpha", "GET", "/")
        assert info["storage"] == "sqlite"
    finally:
        broker.kill()
