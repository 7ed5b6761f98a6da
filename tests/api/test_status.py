"""``POST /v1/status``: each id's state as its sender or recipient sees it (seed §5.1), at
most 200 ids, an expired lease seen without a pull, the copies of a group send (REACH
§13); and status, recent and query on the v2/v3 wire (WIRE-V2): completion times,
expired messages, terminal ones kept past their TTL.

In memory, time on a ``task.Clock``; group sends on every backend.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from relay.rules import delivery
from relay.testing import START
from relay.wire.protocol import MAX_STATUS_IDS
from tests.support.api import assert_error, assert_json_headers, leased_one, two_agents
from tests.support.teams import group_broker, group_send, on
from tests.support.v2 import assert_v2_error, leased_request, swept

# -- v1.1 (seed §5.1) ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_status_entries_and_visibility():
    b = await two_agents()
    await b.register("gamma")
    msg_id = await b.message("alpha", "beta", id="req", kind="request")
    reply = await b.post("alpha", "/v1/status", {"messageIds": [msg_id, "unknown"]})
    assert reply.code == 200
    assert_json_headers(reply)
    (entry, missing) = reply.json["messages"]
    assert entry == {"id": "req", "status": "queued", "attempts": 0, "ts": entry["ts"],
                     "from": "alpha", "to": "beta", "kind": "request", "deliveries": 0}
    assert missing == {"id": "unknown", "status": "not_found", "attempts": 0}
    assert (await b.status("beta", "req"))[0]["status"] == "queued"
    assert await b.status("gamma", "req") == [
        {"id": "req", "status": "not_found", "attempts": 0}
    ], "a third agent cannot see the message"


@pytest_twisted.ensureDeferred
async def test_status_uses_the_first_200_ids():
    b = await two_agents()
    ids = [f"id{i}" for i in range(MAX_STATUS_IDS + 50)]
    reply = await b.post("alpha", "/v1/status", {"messageIds": ids})
    assert [e["id"] for e in reply.json["messages"]] == ids[:MAX_STATUS_IDS]


@pytest.mark.parametrize("body", [{}, {"messageIds": "a"}, {"messageIds": None},
                                  {"messageIds": {"a": 1}}, []])
@pytest_twisted.ensureDeferred
async def test_status_needs_an_array(body):
    b = await two_agents()
    assert_error(await b.post("alpha", "/v1/status", body), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_status_sees_an_expired_lease_without_a_pull():
    b = await two_agents()
    m = await leased_one(b, leaseSeconds=30)
    b.clock.advance(30)
    (entry,) = await b.status("alpha", m["id"])
    assert entry["status"] == "queued"


# -- v1.3: the copies of a group send (REACH §13) ------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_status_of_the_sent_id_lists_the_copies_to_the_sender_only(store):
    b = await group_broker(store)
    copies = (await group_send(b, id="g1")).json["copies"]
    (leased,) = (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"]
    await on(b, b.post("bob", "/v1/ack", {"messageId": leased["id"],
                                           "leaseId": leased["leaseId"],
                                           "outcome": "completed"}))
    (entry,) = (await on(b, b.post("alice", "/v1/status",
                                   {"messageIds": ["g1"]}))).json["messages"]
    assert entry == {"id": "g1", "via": "group:reviewers", "copies": [
        {"to": "bob", "id": copies[0]["id"], "status": "done"},
        {"to": "carol", "id": copies[1]["id"], "status": "queued"}]}
    for other in ("bob", "carol", "dan"):
        (hidden,) = (await on(b, b.post(other, "/v1/status",
                                        {"messageIds": ["g1"]}))).json["messages"]
        assert hidden["status"] == "not_found"


# -- the v2/v3 wire: status, recent and query (WIRE-V2) ------------------------------------


@pytest_twisted.ensureDeferred
async def test_status_recent_and_query(v2_broker):
    alpha, beta = v2_broker.client("alpha"), v2_broker.client("beta")
    one = (await alpha.send_request("beta", "one", topic="alpha-topic")).json["message_id"]
    v2_broker.advance(1)
    two = (await alpha.send_request("beta", "two")).json["message_id"]
    v2_broker.advance(1)
    theirs = (await v2_broker.client("gamma").send_request("beta", "x")).json["message_id"]
    entries = await alpha.status(one, theirs, "nope", "")
    assert [e["status"] for e in entries] == ["queued", "not_found", "not_found"]
    assert set(entries[0]) == {"message_id", "origin", "target", "kind", "status",
                               "attempts", "last_error", "created_at", "expires_at",
                               "completed_at", "topic"}
    assert entries[0]["topic"] == "alpha-topic"
    assert len(await alpha.status(*[one] * 150)) == 100
    assert_v2_error(await alpha.request("POST", "/v1/status", {"message_ids": "x"}), 400,
                    "bad_request")
    recent = await alpha.recent()
    assert [e["message_id"] for e in recent] == [two, one] and "body" not in recent[0]
    assert [e["message_id"] for e in await alpha.recent(limit=1)] == [two]
    found = await alpha.query(topic="alpha")
    assert [(e["message_id"], e["body"]) for e in found] == [(one, "one")]
    assert [e["message_id"] for e in await alpha.query(since=START + 1)] == [two]
    assert [e["message_id"] for e in await alpha.query(message_id=theirs)] == []
    assert [e["message_id"] for e in await beta.query(origin="gamma")] == [theirs]
    assert [e["message_id"] for e in await beta.query(status="completed")] == []
    assert len(await beta.query(kind="request", limit=2)) == 2
    assert_v2_error(await alpha.request("POST", "/v1/messages/query", {"since": "yesterday"}),
                    400, "bad_request")
    assert_v2_error(await alpha.request("POST", "/v1/recent", {"agent": "beta"}), 403,
                    "forbidden")


@pytest_twisted.ensureDeferred
async def test_the_completion_time_is_shown_in_epoch_seconds(v2_brokers):
    broker = v2_brokers(maxAttempts=1)
    alpha, beta, done_id, message = await leased_request(broker)
    failing = (await alpha.send_request("beta", "fails")).json["message_id"]
    (entry,) = await alpha.status(done_id)
    assert (entry["status"], entry["completed_at"]) == ("leased", None)
    broker.advance(12.5)
    assert (await beta.ack(done_id, lease_token=message["lease_token"])).code == 200
    (other,) = await beta.pull()
    broker.advance(1)
    assert (await beta.ack(failing, outcome="retry", error="no")).code == 200
    done, failed = await alpha.status(done_id, failing)
    assert (done["status"], done["completed_at"]) == ("completed", START + 12.5)
    assert (failed["status"], failed["completed_at"]) == ("failed", START + 13.5)
    recent = {e["message_id"]: e["completed_at"] for e in await alpha.recent()}
    assert (recent[failing], recent[done_id]) == (START + 13.5, START + 12.5)
    (found,) = await alpha.query(message_id=done_id)
    assert found["completed_at"] == START + 12.5


@pytest_twisted.ensureDeferred
async def test_an_expired_request_reads_expired_on_v2_and_is_gone_on_the_seed_wire(v2_broker):
    alpha, beta = v2_broker.client("alpha"), v2_broker.client("beta")
    late = (await alpha.send_request("beta", "too late", ttl_seconds=60)).json["message_id"]
    await v2_broker.register("alpha")
    v2_broker.advance(61)  # (which starts the broker's own sweeps, too)
    (entry,) = await alpha.status(late)
    assert (entry["status"], entry["completed_at"]) == ("expired", None)  # swept or not
    await swept(v2_broker, alpha, delivery.notice_id(late))
    (entry,) = await alpha.status(late)
    assert (entry["status"], entry["attempts"], entry["expires_at"]) == (
        "expired", 0, START + 60)
    assert await v2_broker.status("alpha", late) == [
        {"id": late, "status": "not_found", "attempts": 0}]  # the seed wire's answer
    assert (await v2_broker.get("alpha", f"/messages/{late}")).code == 404
    assert [e["message_id"] for e in await alpha.query(status="expired")] == [late]
    assert [e["message_id"] for e in await alpha.recent()] == [delivery.notice_id(late), late]
    (stuck,) = await beta.admin_status()
    assert (stuck["message_id"], stuck["status"]) == (late, "expired")
    (notice,) = await alpha.pull()
    assert notice["parent_id"] == late and "expired in the queue" in notice["body"]
    # the recipient puts it back: it lives its TTL again and is delivered
    assert (await beta.requeue(late)).json == {"ok": True, "message_id": late}
    (again,) = await beta.pull()
    assert (again["message_id"], again["expires_at"]) == (late, START + 61 + 60)
    assert (await beta.ack(late, lease_token=again["lease_token"])).code == 200
    (entry,) = await alpha.status(late)
    assert (entry["status"], entry["completed_at"]) == ("completed", START + 61)


@pytest_twisted.ensureDeferred
async def test_terminal_v2_messages_are_kept_past_their_ttl_until_retention(v2_broker):
    alpha, beta, request_id, message = await leased_request(v2_broker)
    assert (await beta.ack(request_id, lease_token=message["lease_token"])).code == 200
    v2_broker.advance(3601)
    await swept(v2_broker, alpha, request_id)
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["completed_at"]) == ("completed", START)
    assert_v2_error(await beta.requeue(request_id), 403, "forbidden")  # completed
    assert await v2_broker.status("alpha", request_id) == [
        {"id": request_id, "status": "not_found", "attempts": 0}]
    v2_broker.advance(7 * 86400)  # messageTtlDays
    await swept(v2_broker, alpha, request_id, stored=False)
