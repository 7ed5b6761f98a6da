"""``POST /v1/ack``: the checks of a lease (seed §5.1), the four outcomes and
``retryAfterSeconds`` (EXTENSIONS.md §2), failure notices (§4), the reply in the ack
(§6) and its priority (REACH §14); and the ack of the v2/v3 wire (WIRE-V2).

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import notice_id
from relay.testing import START
from tests.support.api import (
    Broker,
    ack,
    assert_error,
    assert_json_headers,
    lease,
    leased_one,
    logged_store,
    two_agents,
)
from tests.support.teams import ack_as
from tests.support.v2 import assert_v2_error, leased_request

# -- v1.1: completed and retry, and the checks of a lease (seed §5.1) ----------------------


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


# -- v1.2: release, reject, retry after (EXTENSIONS.md §2) ---------------------------------


@pytest_twisted.ensureDeferred
async def test_release_and_reject():
    b = await two_agents()
    leased = await lease(b)
    reply = await ack(b, leased, "release")
    assert reply.json == {"ok": True, "status": "queued", "attempts": 0}
    (again,) = await b.pull("beta")
    reply = await ack(b, again, "reject", error="schema does not match")
    assert reply.json == {"ok": True, "status": "failed", "attempts": 0}
    (entry,) = await b.status("alpha", again["id"])
    assert (entry["status"], entry["error"], entry["deliveries"]) == (
        "failed", "schema does not match", 2)


@pytest_twisted.ensureDeferred
async def test_retry_after():
    b = await two_agents()
    leased = await lease(b)
    reply = await ack(b, leased, "retry", retryAfterSeconds=60, error="rate limited upstream")
    assert reply.json == {"ok": True, "status": "queued", "attempts": 1}
    assert await b.pull("beta") == []
    assert (await b.poll("beta"))[0] == []
    (entry,) = await b.status("alpha", leased["id"])
    assert entry["notBefore"] == int((START + 60) * 1000)
    b.clock.advance(60)
    (again,) = await b.pull("beta")
    assert again["id"] == leased["id"] and "notBefore" not in again


@pytest.mark.parametrize(("outcome", "extra"), [
    ("completed", {"retryAfterSeconds": 5}), ("reject", {"retryAfterSeconds": 5}),
    ("retry", {"retryAfterSeconds": 43201}), ("retry", {"retryAfterSeconds": -1}),
    ("release", {"retryAfterSeconds": 1.5}), ("release", {"retryAfterSeconds": "5"}),
    ("retry", {"reply": {"body": {}}}), ("reject", {"reply": {}}),
    ("completed", {"reply": []}), ("completed", {"reply": {"to": "gamma"}}),
    ("completed", {"reply": {"from": "x"}}), ("completed", {"reply": {"parentId": "x"}}),
    ("completed", {"reply": {"replyTo": "x"}}), ("completed", {"reply": {"rootId": "x"}}),
    ("completed", {"reply": {"kind": "request"}}), ("completed", {"reply": {"body": [1]}}),
    ("completed", {"reply": {"id": ""}}), ("completed", {"reply": {"ack": "yes"}}),
    ("later", {}),
])
@pytest_twisted.ensureDeferred
async def test_bad_ack_fields_are_400_and_change_nothing(outcome, extra):
    b = await two_agents()
    leased = await lease(b)
    assert_error(await ack(b, leased, outcome, **extra), 400, "bad_request")
    (entry,) = await b.status("alpha", leased["id"])
    assert entry["status"] == "leased"


# -- v1.2: failure notices (EXTENSIONS.md §4) ----------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_rejected_request_leaves_one_notice_in_both_threads():
    b = await two_agents()
    leased = await lease(b, id="q1", kind="request", rootId="conv")
    await ack(b, leased, "reject", error="cannot parse")
    (notice,), _ = await b.poll("alpha")
    assert notice["id"] == notice_id("q1")
    assert (notice["from"], notice["to"], notice["kind"], notice["parentId"], notice["replyTo"],
            notice["rootId"], notice["type"], notice["ack"]) == (
        "beta", "alpha", "reply", "q1", "q1", "conv", "message", False)
    assert notice["body"] == {"relayNotice": {"event": "failed", "messageId": "q1",
                                              "attempts": 0, "deliveries": 1,
                                              "error": "cannot parse"}}
    sent = (await b.post("beta", "/v1/messages/query", {"box": "sent"})).json["messages"]
    assert [m["id"] for m in sent] == [notice_id("q1")]
    for agent in ("alpha", "beta"):
        thread = (await b.post(agent, "/v1/thread", {"rootId": "conv"})).json["messages"]
        assert notice_id("q1") in [m["id"] for m in thread]


# -- v1.2: the reply in the ack (EXTENSIONS.md §6) -----------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_retried_reply_is_recognised_whatever_lease_id_it_carries():
    b = await two_agents()
    leased = await lease(b, kind="request")
    body = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": "completed",
            "reply": {"id": "r1", "body": {"n": 1}, "unknown": "ignored"}}
    first = await b.post("beta", "/v1/ack", body)
    assert first.json["duplicate"] is False
    again = await b.post("beta", "/v1/ack", dict(body, leaseId="stale"))
    assert (again.code, again.json) == (200, {"ok": True, "status": "done", "attempts": 0,
                                              "replyId": "r1", "duplicate": True})
    replies, _ = await b.poll("alpha")
    assert [m["id"] for m in replies] == ["r1"], "stored once"


@pytest_twisted.ensureDeferred
async def test_a_reply_id_used_elsewhere_is_409_with_the_lease_intact():
    b = await two_agents()
    await b.message("alpha", "beta", id="taken")
    leased = await lease(b)
    reply = await ack(b, leased, "completed", reply={"id": "taken"})
    assert_error(reply, 409, "id_conflict")
    assert (await ack(b, leased, "completed")).json["status"] == "done"


@pytest_twisted.ensureDeferred
async def test_the_routing_acl_applies_to_the_reply():
    b = await two_agents(agents={"beta": {"allowed_targets": ["gamma"]}})
    leased = await lease(b)
    assert_error(await ack(b, leased, "completed", reply={"body": {}}), 403, "forbidden")
    (entry,) = await b.status("alpha", leased["id"])
    assert entry["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_an_ack_with_a_reply_is_one_settle_also_when_retried():
    """The reply, the completion and the duplicate rule are one store operation."""
    store = logged_store()
    b = await two_agents(store=store)
    leased = await lease(b, kind="request")
    del store.operations[:]
    body = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": "completed",
            "reply": {"id": "r1", "body": {"n": 1}}}
    assert (await b.post("beta", "/v1/ack", body)).json["duplicate"] is False
    assert store.operations == ["settle"]
    del store.operations[:]
    assert (await b.post("beta", "/v1/ack", body)).json["duplicate"] is True
    assert store.operations == ["settle"]
    del store.operations[:]
    await b.message("alpha", "beta", id="other")
    (other,) = await b.pull("beta", limit=1)
    del store.operations[:]
    clash = dict(body, messageId="other", leaseId=other["leaseId"])
    assert_error(await b.post("beta", "/v1/ack", clash), 409, "id_conflict")
    assert store.operations == ["settle"]


@pytest_twisted.ensureDeferred
async def test_a_reply_is_refused_on_a_nearly_full_disk_but_a_retry_is_still_a_duplicate():
    store = logged_store()
    b = await two_agents(store=store)
    leased = await lease(b, kind="request")
    body = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": "completed",
            "reply": {"id": "r1", "body": {"n": 1}}}
    assert (await b.post("beta", "/v1/ack", body)).json["duplicate"] is False
    await b.message("alpha", "beta", id="next")
    (other,) = await b.pull("beta", limit=1)
    store.space_left = lambda: 0
    assert (await b.post("beta", "/v1/ack", body)).json["duplicate"] is True
    refused = await b.post("beta", "/v1/ack", dict(body, messageId="next",
                                                   leaseId=other["leaseId"],
                                                   reply={"id": "r2", "body": {}}))
    assert_error(refused, 503, "busy")
    assert "disk is nearly full" in refused.json["error"]["message"]
    assert b.broker.counters.refused == {"disk_full": 1}
    assert (await b.store.find("next", START)).status == "leased", "nothing was settled"


# -- v1.3: the priority of a reply (REACH §14) ---------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_reply_in_an_ack_sets_its_own_priority(role_broker):
    await role_broker.register("beta")
    await role_broker.message("alpha", "beta", id="q", kind="request", priority=2)
    (leased,) = await role_broker.pull("beta")
    reply = await ack_as(role_broker, "beta", leased, reply={"id": "r", "priority": 10})
    assert_error(reply, 400, "bad_request")
    assert "reply.priority" in reply.json["error"]["message"]
    assert (await ack_as(role_broker, "beta", leased, reply={"id": "r", "priority": 6})).code == 200
    (answer,) = await role_broker.pull("alpha")
    assert answer["id"] == "r" and answer["priority"] == 6


# -- the v2/v3 wire (WIRE-V2) --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ack_with_and_without_the_lease_token(v2_broker):
    alpha, beta, request_id, message = await leased_request(v2_broker)
    assert_v2_error(await beta.ack(request_id, lease_token="stale"), 409, "lease_mismatch")
    assert_v2_error(await alpha.ack(request_id), 403, "forbidden")
    assert_v2_error(await beta.ack("unknown-id"), 403, "forbidden")
    assert_v2_error(await beta.ack(""), 400, "bad_request")
    assert_v2_error(await beta.ack(request_id, outcome="maybe"), 400, "bad_request")
    assert_v2_error(await beta.ack(request_id, agent="alpha"), 403, "forbidden")
    reply = await beta.ack(request_id, lease_token=message["lease_token"])
    assert (reply.code, reply.json) == (200, {"ok": True})
    assert_v2_error(await beta.ack(request_id), 400, "bad_request")  # not leased any more
    assert_v2_error(await beta.ack(request_id, lease_token=message["lease_token"]), 409,
                    "lease_mismatch")
    (entry,) = await alpha.status(request_id)
    assert entry["status"] == "completed"


@pytest_twisted.ensureDeferred
async def test_retry_requeues_then_fails_with_a_notice(v2_brokers):
    broker = v2_brokers(maxDeliveries=2)
    alpha, beta, request_id, message = await leased_request(broker)
    assert (await beta.ack(request_id, outcome="retry", error="e" * 400)).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["last_error"]) == ("queued", "e" * 300)
    (again,) = await beta.pull()
    assert (await beta.ack(request_id, outcome="retry", error="gave up")).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("failed", 2)
    (notice,) = await alpha.pull()
    assert notice["message_id"] == delivery.notice_id(request_id)
    assert notice["kind"] == "reply" and notice["parent_id"] == request_id
    assert notice["body"].startswith("[Relay] Your relay message was not delivered")
    assert "attempts: 2/2" in notice["body"] and "hello" in notice["body"]


@pytest_twisted.ensureDeferred
async def test_a_retry_fails_a_request_pulled_max_attempts_times(v2_brokers):
    """The reference's rule (store-v2.js; its lifecycle test with maxAttempts 1): the
    pull counted the attempt, so a retry of a message pulled maxAttempts times fails it."""
    broker = v2_brokers(maxAttempts=1)
    alpha, beta, request_id, _ = await leased_request(broker)
    assert (await beta.ack(request_id, outcome="retry", error="no")).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("failed", 1)
    (notice,) = await alpha.pull()
    assert "attempts: 1/1" in notice["body"]


@pytest_twisted.ensureDeferred
async def test_the_third_retry_fails_by_default(v2_brokers):
    broker = v2_brokers()
    alpha, beta, request_id, _ = await leased_request(broker)
    for _ in range(2):
        assert (await beta.ack(request_id, outcome="retry")).code == 200
        (entry,) = await alpha.status(request_id)
        assert entry["status"] == "queued"
        (again,) = await beta.pull()
        assert again["message_id"] == request_id
    assert (await beta.ack(request_id, outcome="retry")).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("failed", 3)
    (notice,) = await alpha.pull()
    assert "attempts: 3/3" in notice["body"]


@pytest_twisted.ensureDeferred
async def test_notify_failed_to_sender_false_sends_v2_senders_no_notice(v2_brokers):
    broker = v2_brokers(maxDeliveries=1, notifyFailedToSender=False)
    alpha = broker.client("alpha")
    await alpha.send_request("beta", "from v2")
    await broker.register("gamma", "beta")
    seed_request = await broker.message("gamma", "beta", kind="request",
                                        body={"text": "from seed"})
    beta = broker.client("beta")
    for message in await beta.pull():
        assert (await beta.ack(message["message_id"], outcome="retry")).code == 200
    assert await alpha.pull() == []
    (seed_notice,) = await broker.pull("gamma")  # broker.notifyFailures still holds
    assert seed_notice["body"]["relayNotice"]["messageId"] == seed_request
