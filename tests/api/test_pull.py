"""The v1.1 HTTP API (spec §5.1, §6): leases, acks, status, recent, query, ACLs,
v1.0 recovery delivery and long polls. Time is a ``task.Clock``; no sleeps.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from relay.testing import START
from relay.wire.protocol import MAX_STATUS_IDS
from tests.support.api import Broker, assert_error, assert_json_headers

START_MS = 1_712_345_678_000


async def two_agents(**broker) -> Broker:
    b = Broker(**broker)
    await b.register("alpha", "beta")
    return b


async def leased_one(b: Broker, **pull):
    msg_id = await b.message("alpha", "beta")
    (leased,) = await b.pull("beta", **pull)
    assert leased["id"] == msg_id
    return leased


# -- POST /v1/pull -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pull_leases_oldest_first_with_lease_fields():
    b = await two_agents()
    await b.register("gamma")
    ids = [await b.message("alpha", "beta", id=f"m{i}", kind="request") for i in range(3)]
    await b.message("alpha", "gamma", id="other")
    reply = await b.post("beta", "/v1/pull", {"limit": 2})
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json["count"] == 2
    messages = reply.json["messages"]
    assert [m["id"] for m in messages] == ids[:2]
    for m in messages:
        assert m["status"] == "leased"
        assert m["leaseUntil"] == START_MS + 600_000, "broker.leaseSeconds default 600"
        assert isinstance(m["leaseId"], str) and m["leaseId"]
        assert m["attempts"] == 0 and m["kind"] == "request" and m["to"] == "beta"
    assert messages[0]["leaseId"] != messages[1]["leaseId"]
    rest = await b.pull("beta")
    assert [m["id"] for m in rest] == ids[2:]
    reply = await b.post("beta", "/v1/pull", {})
    assert reply.json == {"messages": [], "count": 0}


@pytest_twisted.ensureDeferred
async def test_pull_with_empty_body_and_lease_seconds_config():
    b = Broker(leaseSeconds=30)
    await b.register("alpha", "beta")
    await b.message("alpha", "beta")
    reply = await b.post("beta", "/v1/pull")
    assert reply.code == 200
    assert reply.json["messages"][0]["leaseUntil"] == START_MS + 30_000


@pytest_twisted.ensureDeferred
async def test_pull_lease_seconds_bounds():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.message("alpha", "beta", id="b")
    (m,) = await b.pull("beta", limit=1, leaseSeconds=1)
    assert m["leaseUntil"] == START_MS + 1000
    (m,) = await b.pull("beta", limit=1, leaseSeconds=86400)
    assert m["leaseUntil"] == START_MS + 86_400_000


@pytest.mark.parametrize("value", [0, -1, 86401, 1.5, "60", True, [], {}])
@pytest_twisted.ensureDeferred
async def test_pull_invalid_lease_seconds_is_400(value):
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    assert_error(await b.post("beta", "/v1/pull", {"leaseSeconds": value}), 400, "bad_request")
    assert (await b.status("alpha", "a"))[0]["status"] == "queued", "nothing was leased"


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"5", b"null", b"{bad"])
@pytest_twisted.ensureDeferred
async def test_pull_body_must_be_a_json_object(raw):
    b = await two_agents()
    assert_error(await b.post("beta", "/v1/pull", raw=raw), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_pull_body_agent_must_be_the_caller():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    assert_error(await b.post("alpha", "/v1/pull", {"agent": "beta"}), 400, "bad_request")
    reply = await b.post("beta", "/v1/pull", {"agent": "beta"})
    assert [m["id"] for m in reply.json["messages"]] == ["a"]


@pytest.mark.parametrize(("limit", "expected"), [(0, 1), (-3, 1), (1, 1), (2.7, 2),
                                                 (500, 200), ("3", 3), ("x", 50), (None, 50)])
@pytest_twisted.ensureDeferred
async def test_pull_limit_is_clamped(limit, expected):
    b = await two_agents()
    for i in range(210):
        await b.message("alpha", "beta", id=f"m{i:03d}")
    assert len(await b.pull("beta", limit=limit)) == expected


@pytest_twisted.ensureDeferred
async def test_leased_message_is_not_pulled_or_polled_again_until_expiry():
    b = await two_agents()
    leased = await leased_one(b, leaseSeconds=60)
    assert await b.pull("beta") == []
    assert (await b.poll("beta"))[0] == [], "v1.0 poll returns only queued messages"
    b.clock.advance(59.999)
    assert await b.pull("beta") == []
    b.clock.advance(0.001)
    (again,) = await b.pull("beta")
    assert again["id"] == leased["id"] and again["leaseId"] != leased["leaseId"]
    assert again["attempts"] == 0, "an expired lease is not a retry"


# -- POST /v1/ack ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ack_completed_is_done():
    b = await two_agents()
    m = await leased_one(b)
    reply = await b.post("beta", "/v1/ack",
                         {"messageId": m["id"], "leaseId": m["leaseId"], "outcome": "completed"})
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json == {"ok": True, "status": "done", "attempts": 0}
    assert (await b.status("alpha", m["id"]))[0]["status"] == "done"
    b.clock.advance(10**6)
    assert await b.pull("beta") == []
    assert (await b.poll("beta"))[0] == []


@pytest_twisted.ensureDeferred
async def test_ack_retry_requeues_then_fails_after_max_attempts():
    b = await two_agents()
    msg_id = await b.message("alpha", "beta")
    for attempt in range(1, 5):
        (m,) = await b.pull("beta")
        reply = await b.post("beta", "/v1/ack", {"messageId": msg_id, "leaseId": m["leaseId"],
                                                 "outcome": "retry", "error": f"e{attempt}"})
        assert reply.code == 200
        expected = "failed" if attempt == 4 else "queued"
        assert reply.json == {"ok": True, "status": expected, "attempts": attempt}
        assert m["attempts"] == attempt - 1
    assert await b.pull("beta") == []
    (entry,) = await b.status("alpha", msg_id)
    assert entry["status"] == "failed" and entry["attempts"] == 4
    assert entry["error"] == "e4", "the error of the last ack is reported by /v1/status"
    (stored,) = (await b.post("beta", "/v1/recent", {})).json["messages"]
    assert "error" not in stored, "the ack's error is not an envelope field"


@pytest_twisted.ensureDeferred
async def test_max_attempts_is_configurable():
    b = Broker(maxAttempts=1)
    await b.register("alpha", "beta")
    msg_id = await b.message("alpha", "beta")
    statuses = []
    for _ in range(2):
        (m,) = await b.pull("beta")
        reply = await b.post("beta", "/v1/ack",
                             {"messageId": msg_id, "leaseId": m["leaseId"], "outcome": "retry"})
        statuses.append(reply.json["status"])
    assert statuses == ["queued", "failed"]


@pytest.mark.parametrize(
    "body",
    [
        {"leaseId": "l", "outcome": "completed"},
        {"messageId": "", "leaseId": "l", "outcome": "completed"},
        {"messageId": 5, "leaseId": "l", "outcome": "completed"},
        {"messageId": "m", "outcome": "completed"},
        {"messageId": "m", "leaseId": "", "outcome": "completed"},
        {"messageId": "m", "leaseId": None, "outcome": "completed"},
        {"messageId": "m", "leaseId": 7, "outcome": "completed"},
        {"messageId": "m", "leaseId": "l"},
        {"messageId": "m", "leaseId": "l", "outcome": "done"},
        {"messageId": "m", "leaseId": "l", "outcome": None},
        {"messageId": "m", "leaseId": "l", "outcome": "completed", "error": 5},
        [],
        "m",
    ],
    ids=lambda body: json.dumps(body),
)
@pytest_twisted.ensureDeferred
async def test_ack_malformed_is_400(body):
    b = await two_agents()
    await b.message("alpha", "beta", id="m")
    (m,) = await b.pull("beta")
    if isinstance(body, dict) and body.get("leaseId") == "l":
        body["leaseId"] = m["leaseId"]
    assert_error(await b.post("beta", "/v1/ack", body), 400, "bad_request")
    assert (await b.status("alpha", "m"))[0]["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_ack_unknown_message_is_404():
    b = await two_agents()
    reply = await b.post("beta", "/v1/ack",
                         {"messageId": "nope", "leaseId": "l", "outcome": "completed"})
    assert_error(reply, 404, "no_such_message")


@pytest_twisted.ensureDeferred
async def test_ack_by_someone_else_is_403():
    b = await two_agents()
    await b.register("gamma")
    m = await leased_one(b)
    for agent in ("alpha", "gamma"):
        reply = await b.post(agent, "/v1/ack", {"messageId": m["id"], "leaseId": m["leaseId"],
                                                "outcome": "completed"})
        assert_error(reply, 403, "forbidden")
    assert (await b.status("alpha", m["id"]))[0]["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_ack_of_a_queued_message_is_409_not_leased():
    b = await two_agents()
    msg_id = await b.message("alpha", "beta")
    reply = await b.post("beta", "/v1/ack",
                         {"messageId": msg_id, "leaseId": "l", "outcome": "completed"})
    assert_error(reply, 409, "not_leased")


@pytest_twisted.ensureDeferred
async def test_ack_with_the_wrong_lease_is_409_lease_mismatch():
    b = await two_agents()
    m = await leased_one(b)
    reply = await b.post("beta", "/v1/ack",
                         {"messageId": m["id"], "leaseId": "forged", "outcome": "completed"})
    assert_error(reply, 409, "lease_mismatch")
    assert (await b.status("alpha", m["id"]))[0]["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_a_dead_lease_cannot_ack():
    b = await two_agents()
    old = await leased_one(b, leaseSeconds=10)
    b.clock.advance(10)
    body = {"messageId": old["id"], "leaseId": old["leaseId"], "outcome": "completed"}
    assert_error(await b.post("beta", "/v1/ack", body), 409, "not_leased")
    (new,) = await b.pull("beta")
    assert_error(await b.post("beta", "/v1/ack", body), 409, "lease_mismatch")
    body["leaseId"] = new["leaseId"]
    assert (await b.post("beta", "/v1/ack", body)).json["status"] == "done"


@pytest.mark.parametrize("first", ["completed", "retry-to-failed"])
@pytest_twisted.ensureDeferred
async def test_terminal_messages_are_never_revived(first):
    b = Broker(maxAttempts=0)
    await b.register("alpha", "beta")
    m = await leased_one(b, leaseSeconds=5)
    outcome = "completed" if first == "completed" else "retry"
    body = {"messageId": m["id"], "leaseId": m["leaseId"], "outcome": outcome}
    status = (await b.post("beta", "/v1/ack", body)).json["status"]
    assert status == ("done" if first == "completed" else "failed")
    for again in ("completed", "retry"):
        reply = await b.post("beta", "/v1/ack", dict(body, outcome=again))
        assert_error(reply, 409, "not_leased")
    b.clock.advance(10**6)
    assert await b.pull("beta") == []
    assert (await b.poll("beta"))[0] == []
    assert (await b.post("alpha", "/messages", {"id": m["id"], "to": "beta"})).code == 200
    assert (await b.status("alpha", m["id"]))[0]["status"] == status


# -- POST /v1/status --------------------------------------------------------------------


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


# -- POST /v1/recent, /v1/messages/query ------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_recent_is_my_inbox_newest_first_any_status_read_only():
    b = await two_agents()
    ids = [await b.message("alpha", "beta", id=f"m{i}") for i in range(4)]
    await b.message("beta", "alpha", id="outgoing")
    (leased,) = await b.pull("beta", limit=1)
    reply = await b.post("beta", "/v1/recent", {"limit": 3})
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json["count"] == 3
    assert [m["id"] for m in reply.json["messages"]] == ids[::-1][:3]
    everything = (await b.post("beta", "/v1/recent", {})).json["messages"]
    assert [m["id"] for m in everything] == ids[::-1]
    assert everything[-1]["status"] == "leased"
    assert everything[-1]["leaseId"] == leased["leaseId"], "the recipient sees its lease"
    assert [m["id"] for m in await b.pull("beta")] == ids[1:], "recent leased nothing"


@pytest_twisted.ensureDeferred
async def test_recent_validation():
    b = await two_agents()
    assert_error(await b.post("beta", "/v1/recent", {"agent": "alpha"}), 400, "bad_request")
    assert_error(await b.post("beta", "/v1/recent", raw=b"[]"), 400, "bad_request")
    assert (await b.post("beta", "/v1/recent")).json == {"messages": [], "count": 0}


@pytest_twisted.ensureDeferred
async def test_query_filters_newest_first_read_only():
    b = await two_agents()
    await b.register("gamma", "delta")
    await b.message("alpha", "beta", id="req", kind="request")
    await b.message("alpha", "beta", id="plain")
    await b.message("beta", "alpha", id="rep", kind="reply", parentId="req", rootId="req")
    await b.message("gamma", "delta", id="foreign")
    await b.pull("beta", limit=1)

    async def ids(agent, **filters):
        reply = await b.post(agent, "/v1/messages/query", filters)
        assert reply.code == 200, reply
        assert reply.json["count"] == len(reply.json["messages"])
        return [m["id"] for m in reply.json["messages"]]

    # The caller's inbox, newest first (as the reference broker searches).
    assert await ids("beta") == ["plain", "req"]
    assert await ids("beta", limit=1) == ["plain"]
    assert await ids("beta", kind="request") == ["req"]
    assert await ids("beta", status="leased") == ["req"]
    assert await ids("beta", status="queued") == ["plain"]
    assert await ids("beta", **{"from": "alpha"}) == ["plain", "req"]
    assert await ids("beta", to="beta") == ["plain", "req"]
    assert await ids("beta", to="alpha") == [], "what beta sent is not in its inbox"
    assert await ids("beta", **{"from": "gamma"}) == []
    assert await ids("beta", **{"from": "gamma", "to": "delta"}) == []
    assert await ids("alpha", kind="reply") == ["rep"]
    assert await ids("alpha") == ["rep"]
    assert await ids("beta", kind="", status="") == ["plain", "req"]
    assert (await b.status("alpha", "plain"))[0]["status"] == "queued"


@pytest.mark.parametrize("body", [{"kind": 1}, {"status": ["done"]}, {"from": 2},
                                  {"to": True}, {"agent": "alpha"}, []])
@pytest_twisted.ensureDeferred
async def test_query_validation(body):
    b = await two_agents()
    assert_error(await b.post("beta", "/v1/messages/query", body), 400, "bad_request")


# -- §5.1 envelope fields on POST /messages ------------------------------------------


@pytest_twisted.ensureDeferred
async def test_v11_fields_are_stored_and_returned():
    b = await two_agents()
    await b.message("alpha", "beta", id="r", kind="reply", rootId="root", parentId="p")
    (m,) = await b.pull("beta")
    assert (m["kind"], m["rootId"], m["parentId"]) == ("reply", "root", "p")


# -- routing ACL ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_acl_on_send():
    b = Broker(agents={"alpha": {"allowed_targets": ["beta"]}, "gamma": {}})
    await b.register("alpha", "beta", "gamma")
    assert (await b.post("alpha", "/messages", {"to": "beta"})).code == 201
    assert_error(await b.post("alpha", "/messages", {"to": "gamma", "id": "x"}),
                 403, "forbidden")
    assert (await b.store.find("x", START)) is None
    assert (await b.post("beta", "/messages", {"to": "gamma"})).code == 201, "no entry"
    assert (await b.post("gamma", "/messages", {"to": "alpha"})).code == 201, "no list"


@pytest_twisted.ensureDeferred
async def test_acl_is_checked_before_the_recipient_lookup():
    b = Broker(agents={"alpha": {"allowed_targets": ["beta"]}})
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/messages", {"to": "nobody"}), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_acl_empty_list_forbids_everyone():
    b = Broker(agents={"alpha": {"allowed_targets": []}})
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/messages", {"to": "beta"}), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_acl_on_the_v10_ack_receipt():
    b = Broker(agents={"beta": {"allowed_targets": ["gamma"]}})
    await b.register("alpha", "beta", "gamma")
    await b.message("alpha", "beta", id="m1", ack=True)
    assert_error(await b.post("beta", "/messages/m1/ack", {"status": "ok"}), 403, "forbidden")
    assert (await b.poll("alpha"))[0] == [], "no receipt was stored"


# -- §5.1 v1.0 recovery delivery ----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_recovery_delivery_after_lease_expiry():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.message("alpha", "beta", id="b")
    (leased,) = await b.pull("beta", limit=1, leaseSeconds=60)
    assert leased["id"] == "a"
    messages, cursor = await b.poll("beta", "?since=&limit=50")
    assert [m["id"] for m in messages] == ["b"] and cursor == "b"
    b.clock.advance(60)
    messages, cursor2 = await b.poll("beta", f"?since={cursor}&limit=50")
    assert [m["id"] for m in messages] == ["a"], "the expired lease is delivered once"
    assert messages[0]["status"] == "queued"
    assert cursor2 == "b", "the cursor never moves backwards"
    messages, cursor3 = await b.poll("beta", f"?since={cursor2}&limit=50")
    assert messages == [] and cursor3 == "b"


@pytest_twisted.ensureDeferred
async def test_no_recovery_when_the_cursor_has_not_passed():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.pull("beta", leaseSeconds=60)
    b.clock.advance(60)
    messages, cursor = await b.poll("beta", "?since=&limit=50")
    assert [m["id"] for m in messages] == ["a"] and cursor == "a"
    messages, _ = await b.poll("beta", "?since=a&limit=50")
    assert messages == []


# -- the two-agent walkthrough -----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_request_reply_walkthrough():
    b = await two_agents()
    sent = await b.post("alpha", "/messages",
                        {"id": "req-1", "to": "beta", "kind": "request",
                         "body": {"text": "what is 2+2?"}})
    assert sent.code == 201
    (request,) = await b.pull("beta")
    assert request["kind"] == "request" and request["from"] == "alpha"
    assert (await b.status("alpha", "req-1"))[0]["status"] == "leased"
    reply = await b.post("beta", "/messages", {
        "id": "rep-1", "to": "alpha", "kind": "reply", "parentId": request["id"],
        "rootId": request["rootId"] or request["id"], "body": {"text": "4"},
    })
    assert reply.code == 201
    ack = await b.post("beta", "/v1/ack", {"messageId": request["id"],
                                           "leaseId": request["leaseId"],
                                           "outcome": "completed"})
    assert ack.json == {"ok": True, "status": "done", "attempts": 0}
    (answer,) = await b.pull("alpha")
    assert answer["kind"] == "reply" and answer["parentId"] == "req-1"
    assert answer["rootId"] == "req-1" and answer["body"] == {"text": "4"}
    statuses = await b.status("alpha", "req-1", "rep-1")
    assert [(s["id"], s["status"]) for s in statuses] == [("req-1", "done"), ("rep-1", "leased")]


# -- long poll -------------------------------------------------------------------------


@pytest.mark.parametrize("wait", [-1, 21, 1.5, 1.0, "1", "x", True, [5]])
@pytest_twisted.ensureDeferred
async def test_pull_wait_seconds_out_of_range_is_400(wait):
    b = await two_agents()
    assert_error(await b.post("beta", "/v1/pull", {"waitSeconds": wait}), 400, "bad_request")


@pytest.mark.parametrize("raw", [b'{"waitSeconds": 1e0}', b'{"waitSeconds": 2.0}'])
@pytest_twisted.ensureDeferred
async def test_pull_wait_seconds_written_as_a_float_is_400(raw):
    """EXTENSIONS.md §10: waitSeconds is a JSON integer; 2.0 and 1e0 are not."""
    b = await two_agents()
    assert_error(await b.post("beta", "/v1/pull", raw=raw), 400, "bad_request")


@pytest.mark.parametrize("wait", ["-1", "21", "x", "1.5"])
@pytest_twisted.ensureDeferred
async def test_poll_wait_out_of_range_is_400(wait):
    b = await two_agents()
    assert_error(await b.get("beta", f"/messages?wait={wait}"), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_pull_wait_zero_answers_at_once():
    b = await two_agents()
    reply = await b.post("beta", "/v1/pull", {"waitSeconds": 0})
    assert reply.json == {"messages": [], "count": 0}


@pytest_twisted.ensureDeferred
async def test_long_poll_times_out_empty():
    b = await two_agents()
    d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(19.9)
    assert not d.called
    b.advance(0.1)
    reply = d.result
    assert reply.code == 200 and reply.json == {"messages": [], "count": 0}
    assert b.broker.waiters.count() == 0


@pytest_twisted.ensureDeferred
async def test_long_poll_wakes_on_send():
    b = await two_agents()
    d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(3)
    assert not d.called
    msg_id = await b.message("alpha", "beta")
    b.flush()
    reply = d.result
    assert [m["id"] for m in reply.json["messages"]] == [msg_id]
    assert reply.json["messages"][0]["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_v10_long_poll_wakes_on_send():
    b = await two_agents()
    d = b.get("beta", "/messages?since=&limit=50&wait=20")
    b.advance(1)
    assert not d.called
    msg_id = await b.message("alpha", "beta")
    b.flush()
    assert [m["id"] for m in d.result.json["messages"]] == [msg_id]
    assert d.result.json["cursor"] == msg_id


@pytest_twisted.ensureDeferred
async def test_long_poll_wakes_on_retry_ack():
    b = await two_agents()
    m = await leased_one(b)
    d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(1)
    assert not d.called
    await b.post("beta", "/v1/ack",
                 {"messageId": m["id"], "leaseId": m["leaseId"], "outcome": "retry"})
    b.flush()
    (again,) = d.result.json["messages"]
    assert again["id"] == m["id"] and again["attempts"] == 1


@pytest_twisted.ensureDeferred
async def test_long_poll_wakes_on_lease_expiry():
    b = await two_agents()
    m = await leased_one(b, leaseSeconds=5)
    d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(4.9)
    assert not d.called
    b.advance(0.2)
    (again,) = d.result.json["messages"]
    assert again["id"] == m["id"] and again["leaseId"] != m["leaseId"]


@pytest_twisted.ensureDeferred
async def test_a_cancelled_waiter_leases_nothing():
    b = await two_agents()
    d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(1)
    assert b.broker.waiters.count("beta") == 1
    b.hang_up()
    assert b.broker.waiters.count("beta") == 0
    d.addErrback(lambda f: None)
    msg_id = await b.message("alpha", "beta")
    assert (await b.status("alpha", msg_id))[0]["status"] == "queued"
    assert [m["id"] for m in await b.pull("beta")] == [msg_id]


@pytest_twisted.ensureDeferred
async def test_lease_id_is_shown_to_the_recipient_while_leased_and_to_no_one_else():
    b = await two_agents()
    msg_id = await b.message("alpha", "beta", kind="request")
    (leased,) = await b.pull("beta")
    views = {
        "recent": (await b.post("beta", "/v1/recent", {})).json["messages"][0],
        "query": (await b.post("beta", "/v1/messages/query", {"status": "leased"}))
        .json["messages"][0],
    }
    for view in views.values():
        assert view["id"] == msg_id and view["leaseId"] == leased["leaseId"]
    (entry,) = await b.status("alpha", msg_id)
    assert "leaseId" not in entry
    assert (await b.post("alpha", "/v1/messages/query", {"to": "beta"})).json["messages"] == []
    reply = await b.post("beta", "/v1/ack", {"messageId": msg_id, "leaseId": leased["leaseId"],
                                             "outcome": "completed"})
    assert reply.code == 200
    (done,) = (await b.post("beta", "/v1/recent", {})).json["messages"]
    assert done["status"] == "done" and "leaseId" not in done
