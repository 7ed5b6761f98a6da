"""``POST /v1/requeue`` and ``POST /v1/cancel`` (EXTENSIONS.md §3, §10): who may, from which
state, and what a requeued message looks like; and the admin routes of the v2/v3 wire
(``/v1/admin/status``, ``/v1/admin/requeue``, ``/v1/admin/cancel``, WIRE-V2).

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted

from tests.support.api import ack, assert_error, lease, refused, registered, two_agents
from tests.support.v2 import assert_v2_error, leased_request

# -- v1.2 (EXTENSIONS.md §3, §10) ----------------------------------------------------------


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


@pytest_twisted.ensureDeferred
async def test_requeueing_a_message_its_sender_cancelled_is_refused_with_the_reason():
    _, client, _ = await registered("alpha", "beta")
    assert (await client.post("alpha", "/messages", {"to": "beta", "id": "c1"}))[0] == 201
    assert (await client.post("alpha", "/v1/cancel", {"messageId": "c1"}))[0] == 200
    message = refused(await client.post("beta", "/v1/requeue", {"messageId": "c1"}),
                      403, "forbidden")
    assert "cancelled" in message and "sender" in message
    assert (await client.post("alpha", "/v1/requeue", {"messageId": "c1"}))[0] == 200


# -- the v2/v3 wire's admin routes (WIRE-V2) -----------------------------------------------


@pytest_twisted.ensureDeferred
async def test_admin_status_requeue_and_cancel(v2_broker):
    alpha, beta, request_id, message = await leased_request(v2_broker, body="b" * 200)
    (stuck,) = await beta.admin_status()
    assert stuck["message_id"] == request_id and stuck["status"] == "leased"
    assert stuck["body_preview"] == "b" * 120
    assert await alpha.admin_status() == []
    assert_v2_error(await alpha.requeue(request_id), 403, "forbidden")
    assert_v2_error(await beta.requeue("unknown"), 404, "no_such_message")
    assert_v2_error(await beta.requeue(""), 400, "bad_request")
    assert (await beta.requeue(request_id)).json == {"ok": True, "message_id": request_id}
    assert_v2_error(await beta.requeue(request_id), 404, "no_such_message")  # queued already
    assert_v2_error(await beta.cancel(request_id), 403, "forbidden")
    assert (await alpha.cancel(request_id)).json == {"ok": True, "message_id": request_id}
    assert_v2_error(await alpha.cancel(request_id), 404, "no_such_message")
    assert await beta.pull() == []
    (entry,) = await alpha.status(request_id)
    assert entry["status"] == "completed"


@pytest_twisted.ensureDeferred
async def test_admin_agents_may_requeue_and_cancel_anything(v2_brokers):
    broker = v2_brokers(security={"admin_agents": ["ops"]})
    alpha, beta, request_id, message = await leased_request(broker)
    ops = broker.client("ops")
    assert (await beta.ack(request_id)).code == 200
    assert (await ops.requeue(request_id)).code == 200  # a completed one too
    assert (await ops.cancel(request_id)).code == 200


@pytest_twisted.ensureDeferred
async def test_admin_ids_reach_the_log_escaped_and_only_when_the_action_was_done(v2_brokers):
    """A message_id is any text a client sends: a refused one is not logged (a
    non-admin could fill the log with a mebibyte a request), a done one is logged
    escaped and cut, so it cannot forge a line."""
    from twisted.logger import capturedLogs, formatEvent

    broker = v2_brokers(security={"admin_agents": ["ops"]})
    alpha, beta, request_id, message = await leased_request(broker)
    forged = "x\n2026-01-01T00:00:00+0000 [relay#critical] forged\x00" + "y" * 5000
    with capturedLogs() as events:
        for client in (alpha, beta, broker.client("ops")):
            assert (await client.requeue(forged)).code in (403, 404)
            assert (await client.cancel(forged)).code in (403, 404)
        assert (await broker.client("ops").requeue(request_id)).code == 200
    lines = [formatEvent(event) for event in events]
    assert [line for line in lines if "admin" in line] == [
        f"admin requeue {request_id} by ops"]
    assert not any("forged" in line or "yyyy" in line for line in lines)
    from relay.wire.protocol import loggable
    assert loggable("a\nb\x00") == "a\\nb\\x00" and loggable("m-1 é") == "m-1 é"
    assert len(loggable(forged)) < 1200 and "\n" not in loggable(forged)
