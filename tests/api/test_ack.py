"""The delivery extensions v1.2 (EXTENSIONS.md) at the HTTP level, in memory.

Each test names the section it covers; time is a ``task.Clock``.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import pytest_twisted

from relay.rules.delivery import notice_id
from relay.testing import START
from relay.wire.protocol import iso_timestamp
from tests.support.api import Broker, assert_error

V11_FIELDS = {"id", "from", "to", "ts", "type", "body", "replyTo", "ack", "kind", "rootId",
              "parentId", "status", "attempts", "leaseUntil"}


async def two_agents(**broker) -> Broker:
    b = Broker(**broker)
    await b.register("alpha", "beta")
    return b


async def lease(b: Broker, **fields) -> Dict[str, Any]:
    await b.message("alpha", "beta", **fields)
    (leased,) = await b.pull("beta", limit=1)
    return leased


async def ack(b: Broker, leased: Dict[str, Any], outcome: str, agent: str = "beta", **extra):
    body = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": outcome}
    body.update(extra)
    return await b.post(agent, "/v1/ack", body)


# -- capabilities ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_capabilities_are_advertised_as_listed():
    b = Broker(maxDeliveries=7, notifyFailures=False, messageTtlDays=2)
    capabilities = (await b.get(None, "/")).json["capabilities"]
    assert {key: capabilities[key] for key in (
        "leaseRenew", "ackOutcomes", "retryAfter", "deadLetters", "replyInAck", "pullFilter",
        "threads", "messageTtl", "delayedDelivery", "peerCards", "signedNonce")} == {
        "leaseRenew": True,
        "ackOutcomes": ["completed", "retry", "release", "reject"],
        "retryAfter": {"maxSeconds": 43200},
        "deadLetters": {"maxDeliveries": 7, "failureNotices": False},
        "replyInAck": True,
        "pullFilter": True,
        "threads": True,
        "messageTtl": {"maxSeconds": 172800},
        "delayedDelivery": {"maxSeconds": 86400},
        "peerCards": True,
        "signedNonce": {"required": False},
    }
    assert capabilities["leaseDelivery"] is True  # the v1.1 keys stay
    required = Broker(security={"requireNonce": True})
    assert (await required.get(None, "/")).json["capabilities"]["signedNonce"] == {
        "required": True}


@pytest_twisted.ensureDeferred
async def test_a_message_without_extension_fields_has_the_v11_fields_everywhere():
    b = await two_agents()
    await b.message("alpha", "beta", id="plain", kind="request")
    views = [(await b.poll("beta"))[0][0],
             (await b.post("beta", "/v1/recent", {})).json["messages"][0],
             (await b.post("beta", "/v1/messages/query", {})).json["messages"][0],
             (await b.post("alpha", "/v1/thread", {"rootId": "plain"})).json["messages"][0]]
    for view in views:
        assert set(view) == V11_FIELDS, view
    (leased,) = await b.pull("beta")
    assert set(leased) == V11_FIELDS | {"leaseId"}


# -- §1 renew --------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_renew():
    b = await two_agents()
    leased = await lease(b)
    b.clock.advance(100)
    reply = await b.post("beta", "/v1/lease/renew", {"messageId": leased["id"],
                                                     "leaseId": leased["leaseId"],
                                                     "leaseSeconds": 30})
    assert reply.code == 200
    assert reply.json == {"ok": True, "leaseId": leased["leaseId"],
                          "leaseUntil": int((START + 130) * 1000)}
    reply = await b.post("beta", "/v1/lease/renew", {"messageId": leased["id"],
                                                     "leaseId": leased["leaseId"]})
    assert reply.json["leaseUntil"] == int((START + 100 + 600) * 1000), "broker.leaseSeconds"
    (entry,) = await b.status("alpha", leased["id"])
    assert (entry["attempts"], entry["deliveries"]) == (0, 1)


@pytest_twisted.ensureDeferred
async def test_a_waiting_pull_wakes_at_the_renewed_deadline_not_the_old_one():
    b = await two_agents()
    await b.message("alpha", "beta", id="m")
    (leased,) = await b.pull("beta", leaseSeconds=5)
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    reply = await b.post("beta", "/v1/lease/renew", {"messageId": "m",
                                                     "leaseId": leased["leaseId"],
                                                     "leaseSeconds": 15})
    assert reply.code == 200
    b.advance(5.5)
    assert not waiting.called, "the old deadline is no deadline any more"
    b.advance(10)
    (again,) = (await waiting).json["messages"]
    assert again["id"] == "m" and again["leaseId"] != leased["leaseId"]


@pytest.mark.parametrize("seconds", [0, 86401, 30.0, 3e1, 30.5, "30", True, [], {}])
@pytest_twisted.ensureDeferred
async def test_renew_lease_seconds_must_be_an_integer_in_range(seconds):
    b = await two_agents()
    leased = await lease(b)
    reply = await b.post("beta", "/v1/lease/renew", {"messageId": leased["id"],
                                                     "leaseId": leased["leaseId"],
                                                     "leaseSeconds": seconds})
    assert_error(reply, 400, "bad_request")
    assert "leaseSeconds" in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_renew_checks_in_order():
    b = await two_agents()
    await b.register("gamma")
    leased = await lease(b)
    body = {"messageId": leased["id"], "leaseId": leased["leaseId"]}
    assert_error(await b.post("beta", "/v1/lease/renew", {"leaseId": "x"}), 400, "bad_request")
    assert_error(await b.post("beta", "/v1/lease/renew", dict(body, messageId="nope")),
                 404, "no_such_message")
    assert_error(await b.post("gamma", "/v1/lease/renew", body), 403, "forbidden")
    assert_error(await b.post("beta", "/v1/lease/renew", dict(body, leaseId="other")),
                 409, "lease_mismatch")
    b.clock.advance(600)
    assert_error(await b.post("beta", "/v1/lease/renew", body), 409, "not_leased")


# -- §2 outcomes -----------------------------------------------------------------------------


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


# -- §3 deliveries and dead letters ----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_max_deliveries_makes_a_dead_letter():
    b = await two_agents(maxDeliveries=2, leaseSeconds=10)
    msg_id = await b.message("alpha", "beta", kind="request")
    for _ in range(2):
        assert len(await b.pull("beta")) == 1
        b.clock.advance(10)
    assert await b.pull("beta") == []
    dead = (await b.post("beta", "/v1/messages/query", {"status": "failed"})).json["messages"]
    assert [m["id"] for m in dead] == [msg_id]
    (entry,) = await b.status("alpha", msg_id)
    assert entry["error"] == "delivered 2 times without completion"
    (notice,) = await b.pull("alpha")
    assert notice["body"]["relayNotice"]["error"] == "delivered 2 times without completion"


@pytest_twisted.ensureDeferred
async def test_requeue_and_cancel():
    b = await two_agents()
    await b.register("gamma")
    leased = await lease(b)
    await ack(b, leased, "reject")
    for body in ({}, {"messageId": 5}, {"messageId": ""}):
        assert_error(await b.post("alpha", "/v1/requeue", body), 400, "bad_request")
    assert_error(await b.post("alpha", "/v1/requeue", {"messageId": "nope"}), 404,
                 "no_such_message")
    assert_error(await b.post("gamma", "/v1/requeue", {"messageId": leased["id"]}), 403,
                 "forbidden")
    reply = await b.post("beta", "/v1/requeue", {"messageId": leased["id"]})
    assert (reply.code, reply.json) == (200, {"ok": True, "status": "queued", "attempts": 0})
    assert_error(await b.post("alpha", "/v1/requeue", {"messageId": leased["id"]}), 409,
                 "wrong_state")
    (again,) = await b.pull("beta")
    assert_error(await b.post("beta", "/v1/cancel", {"messageId": again["id"]}), 403,
                 "forbidden")
    assert_error(await b.post("alpha", "/v1/cancel", {"messageId": again["id"],
                                                      "reason": "x" * 1001}), 400, "bad_request")
    reply = await b.post("alpha", "/v1/cancel", {"messageId": again["id"], "reason": "obsolete"})
    assert (reply.code, reply.json) == (200, {"ok": True, "status": "failed", "attempts": 0})
    assert_error(await ack(b, again, "completed"), 409, "not_leased")
    assert_error(await b.post("alpha", "/v1/cancel", {"messageId": again["id"]}), 409,
                 "wrong_state")
    (entry,) = await b.status("alpha", again["id"])
    assert entry["error"] == "obsolete"


# -- §4 failure notices ---------------------------------------------------------------------


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


# -- §5 conversations -------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_await_reply_with_a_long_pull_by_parent():
    b = await two_agents()
    request_id = await b.message("alpha", "beta", kind="request")
    waiting = b.post("alpha", "/v1/pull", {"parentId": request_id, "waitSeconds": 20})
    await b.message("beta", "alpha", body={"text": "unrelated"})
    b.advance(1)
    assert not waiting.called, "a message that does not answer does not end the wait"
    (request,) = await b.pull("beta")
    reply = await ack(b, request, "completed", reply={"id": "answer", "body": {"text": "42"}})
    assert reply.json == {"ok": True, "status": "done", "attempts": 0, "replyId": "answer",
                          "duplicate": False}
    b.flush()
    got = (await waiting).json["messages"]
    assert [m["id"] for m in got] == ["answer"] and got[0]["body"] == {"text": "42"}
    other = await b.pull("alpha")
    assert [m["body"] for m in other] == [{"text": "unrelated"}], "untouched by the pull"


@pytest_twisted.ensureDeferred
async def test_a_long_pull_by_parent_ends_with_the_failure_notice():
    b = await two_agents()
    request_id = await b.message("alpha", "beta", kind="request")
    waiting = b.post("alpha", "/v1/pull", {"parentId": request_id, "waitSeconds": 20})
    (request,) = await b.pull("beta")
    await ack(b, request, "reject")
    b.flush()
    (notice,) = (await waiting).json["messages"]
    assert notice["body"]["relayNotice"]["event"] == "failed"


@pytest_twisted.ensureDeferred
async def test_a_long_pull_by_parent_ends_with_the_expiry_notice_when_the_ttl_runs_out():
    """§4, §7: the notice of a request that expired unprocessed is stored when it
    expires, not at the next periodic sweep (a minute away, beyond any wait)."""
    b = await two_agents()
    reply = await b.post("alpha", "/messages", {"to": "beta", "kind": "request",
                                                "ttlSeconds": 3})
    request_id = reply.json["id"]
    waiting = b.post("alpha", "/v1/pull", {"parentId": request_id, "waitSeconds": 20})
    b.advance(2.9)
    assert not waiting.called
    b.advance(0.6)
    (notice,) = (await waiting).json["messages"]
    assert notice["body"]["relayNotice"] == {
        "event": "expired", "messageId": request_id, "attempts": 0, "deliveries": 0,
        "error": "expired unprocessed"}


@pytest_twisted.ensureDeferred
async def test_thread_paging():
    b = await two_agents()
    await b.message("alpha", "beta", id="root", kind="request")
    for i in range(3):
        await b.message("beta", "alpha", id=f"r{i}", rootId="root", parentId="root")
    page = (await b.post("alpha", "/v1/thread", {"rootId": "root", "limit": 2})).json
    assert ([m["id"] for m in page["messages"]], page["count"], page["cursor"]) == (
        ["root", "r0"], 2, "r0")
    page = (await b.post("alpha", "/v1/thread", {"rootId": "root", "since": "r0"})).json
    assert ([m["id"] for m in page["messages"]], page["cursor"]) == (["r1", "r2"], "r2")
    page = (await b.post("alpha", "/v1/thread", {"rootId": "root", "limit": 0})).json
    assert page["count"] == 1, "limit is clamped as everywhere"
    page = (await b.post("alpha", "/v1/thread", {"rootId": "unknown"})).json
    assert page == {"messages": [], "count": 0, "cursor": None}
    for body in ({}, {"rootId": 5}, {"rootId": "root", "since": 5}):
        assert_error(await b.post("alpha", "/v1/thread", body), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_query_box_and_conversation_filters():
    b = await two_agents()
    await b.message("alpha", "beta", id="q", kind="request", rootId="c")
    await b.message("beta", "alpha", id="a", parentId="q", rootId="c", kind="reply")

    async def ids(agent, **body):
        reply = await b.post(agent, "/v1/messages/query", body)
        assert reply.code == 200, reply
        return [m["id"] for m in reply.json["messages"]]

    assert await ids("alpha") == ["a"]
    assert await ids("alpha", box="sent") == ["q"]
    assert await ids("alpha", box="all") == ["a", "q"]
    assert await ids("alpha", box="all", rootId="c") == ["a", "q"]
    assert await ids("beta", box="all", parentId="q") == ["a"]
    assert_error(await b.post("alpha", "/v1/messages/query", {"box": "outbox"}), 400,
                 "bad_request")


# -- §6 reply in the ack -----------------------------------------------------------------------


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


# -- §7 TTL and delay -----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ttl():
    b = await two_agents(messageTtlDays=1)
    reply = await b.post("alpha", "/messages", {"to": "beta", "ttlSeconds": 30, "kind": "request"})
    assert reply.code == 201
    msg_id = reply.json["id"]
    (message,), _ = await b.poll("beta")
    assert message["expiresAt"] == iso_timestamp(START + 30)
    (entry,) = await b.status("alpha", msg_id)
    assert entry["expiresAt"] == int((START + 30) * 1000)
    b.clock.advance(30)
    assert await b.pull("beta") == []
    (entry,) = await b.status("alpha", msg_id)
    assert entry["status"] == "not_found"
    await b.broker.sweep_expired()
    (notice,) = await b.pull("alpha")
    assert notice["body"]["relayNotice"]["event"] == "expired"


@pytest.mark.parametrize(("ttl", "days"), [(0, 7), (-1, 7), (1.5, 7), (30.0, 7), ("30", 7),
                                           (86401, 1), (1, 0)])
@pytest_twisted.ensureDeferred
async def test_ttl_seconds_range(ttl, days):
    b = await two_agents(messageTtlDays=days)
    reply = await b.post("alpha", "/messages", {"to": "beta", "ttlSeconds": ttl})
    assert_error(reply, 400, "bad_request")
    assert "ttlSeconds" in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_delay():
    b = await two_agents()
    reply = await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": 120, "id": "d"})
    assert reply.code == 201
    assert await b.pull("beta") == []
    (view,) = (await b.post("beta", "/v1/recent", {})).json["messages"]
    assert view["notBefore"] == iso_timestamp(START + 120)
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(19)
    assert not waiting.called
    b.advance(1)
    assert (await waiting).json["messages"] == []
    b.clock.advance(99)  # START + 119
    pulls = []
    store_pull = b.store.pull
    b.store.pull = lambda *args: pulls.append(args) or store_pull(*args)
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    for _ in range(9):
        b.advance(0.1)
    assert not waiting.called and len(pulls) == 1, "no busy loop while the delay runs"
    b.advance(0.15)  # the delay runs out: the waiting pull wakes then, not at its deadline
    (leased,) = (await waiting).json["messages"]
    assert leased["id"] == "d" and "notBefore" not in leased


@pytest_twisted.ensureDeferred
async def test_a_requeued_delayed_message_shows_no_not_before():
    """§10: requeue clears ``notBefore`` — from the envelope in every view, as from
    ``/v1/status``: the message is due at once."""
    b = await two_agents()
    await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": 300, "id": "d",
                                        "kind": "request"})
    await b.post("alpha", "/v1/cancel", {"messageId": "d"})
    (view,) = (await b.post("alpha", "/v1/messages/query", {"box": "sent"})).json["messages"]
    assert "notBefore" not in view  # failed: never due
    reply = await b.post("alpha", "/v1/requeue", {"messageId": "d"})
    assert reply.json == {"ok": True, "status": "queued", "attempts": 0}
    (entry,) = await b.status("alpha", "d")
    assert "notBefore" not in entry
    for agent, path, body in (("beta", "/v1/recent", {}), ("alpha", "/v1/thread", {"rootId": "d"}),
                              ("alpha", "/v1/messages/query", {"box": "sent"})):
        (view,) = (await b.post(agent, path, body)).json["messages"]
        assert "notBefore" not in view, path
    (polled,), _ = await b.poll("beta")
    assert polled["id"] == "d" and "notBefore" not in polled
    (leased,) = await b.pull("beta")
    assert leased["id"] == "d" and "notBefore" not in leased


@pytest.mark.parametrize("delay", [-1, 86401, 1.5, "5", True])
@pytest_twisted.ensureDeferred
async def test_delay_seconds_range(delay):
    b = await two_agents()
    assert_error(await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": delay}),
                 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_a_zero_delay_and_null_fields_are_no_extension():
    b = await two_agents()
    await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": 0, "ttlSeconds": None})
    (message,), _ = await b.poll("beta")
    assert set(message) == V11_FIELDS


# -- §8 peer cards --------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_peer_cards():
    b = await two_agents()
    card = {"description": "reviews Python diffs", "skills": ["review", "python"]}
    assert (await b.post("beta", "/register", {"card": card})).code == 200
    peers = (await b.get("alpha", "/peers")).json["peers"]
    assert peers == [{"agent": "alpha", "online": True, "lastSeen": int(START)},
                     {"agent": "beta", "online": True, "lastSeen": int(START), "card": card}]
    b.clock.advance(10)
    await b.post("beta", "/register", {})
    assert (await b.get("alpha", "/peers")).json["peers"][1]["card"] == card
    await b.post("beta", "/register", {"card": None})
    assert "card" not in (await b.get("alpha", "/peers")).json["peers"][1]


@pytest.mark.parametrize("card", [
    [], "text", 5, {"name": "x"}, {"description": 5}, {"description": "é" * 2001},
    {"skills": "python"}, {"skills": [1]}, {"skills": ["x" * 101]}, {"skills": ["s"] * 51},
])
@pytest_twisted.ensureDeferred
async def test_a_bad_card_is_400_and_changes_nothing(card):
    b = await two_agents()
    await b.post("beta", "/register", {"card": {"skills": ["kept"]}})
    b.clock.advance(30)
    assert_error(await b.post("beta", "/register", {"card": card}), 400, "bad_request")
    (_, beta) = (await b.get("alpha", "/peers")).json["peers"]
    assert beta["card"] == {"skills": ["kept"]} and beta["lastSeen"] == int(START)


@pytest_twisted.ensureDeferred
async def test_card_lengths_count_code_points():
    b = await two_agents()
    card = {"description": "☃" * 2000, "skills": ["é" * 100] * 50}
    assert (await b.post("beta", "/register", {"card": card})).code == 200


def logged_store():
    """A memory store that notes the store operations requests make (``operations``)."""
    from relay.store.memory import MemoryStore

    class Logged(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.operations: list = []

        def find(self, *args, **kwargs):
            self.operations.append("find")
            return super().find(*args, **kwargs)

        def add(self, *args, **kwargs):
            self.operations.append("add")
            return super().add(*args, **kwargs)

        def settle(self, *args, **kwargs):
            self.operations.append("settle")
            return super().settle(*args, **kwargs)

    return Logged()


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
