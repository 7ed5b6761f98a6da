"""Conversations across routes and wires: a request and its reply through the v1.1 routes
(seed §5.1), and a v2/v3 agent and a seed agent asking and answering each other, each
sender getting the failure notice of its own wire (WIRE-V2).

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted

from tests.support.api import two_agents

# -- v1.1: a request and its reply (seed §5.1) ---------------------------------------------


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


# -- across the wires (WIRE-V2) ------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_v2_agent_asks_and_a_seed_agent_answers(v2_broker):
    alpha = v2_broker.client("alpha")
    sent = await alpha.send_request("beta", "ünïcode?", topic="t", context="ctx",
                                    execution_mode="continue", session_ref="s")
    request_id = sent.json["message_id"]
    await v2_broker.register("beta")
    (seen,) = await v2_broker.pull("beta")
    assert seen["id"] == request_id and seen["kind"] == "request"
    assert seen["body"] == {"text": "ünïcode?", "topic": "t", "context": "ctx",
                            "executionMode": "continue", "sessionRef": "s"}
    reply = await v2_broker.post("beta", "/v1/ack", {
        "messageId": request_id, "leaseId": seen["leaseId"], "outcome": "completed",
        "reply": {"id": "answer-1", "body": {"text": "yes"}}})
    assert reply.code == 200, reply
    (answer,) = await alpha.pull()
    assert (answer["message_id"], answer["parent_id"], answer["root_id"], answer["body"]) == (
        "answer-1", request_id, seen["rootId"], "yes")
    assert answer["kind"] == "reply" and answer["execution_mode"] == "read"
    assert (await alpha.ack("answer-1")).code == 200
    (entry,) = await v2_broker.status("alpha", "answer-1")
    assert entry["status"] == "done"


@pytest_twisted.ensureDeferred
async def test_a_seed_agent_asks_and_a_v2_agent_answers(v2_broker):
    await v2_broker.register("alpha")
    beta = v2_broker.client("beta")
    assert await beta.pull() == []  # which registers beta for the seed wire
    request_id = await v2_broker.message("alpha", "beta", kind="request",
                                         body={"text": "plain", "n": 1})
    plain_id = await v2_broker.message("alpha", "beta", body={"text": "just text"})
    first, second = await beta.pull()
    assert first["body"] == '{"n":1,"text":"plain"}' and first["kind"] == "request"
    assert second["body"] == "just text" and second["message_id"] == plain_id
    assert first["root_id"] == request_id and first["parent_id"] is None
    reply = await beta.send_reply(request_id, "alpha", "the answer")
    assert reply.code == 200
    assert (await beta.ack(request_id, lease_token=first["lease_token"])).code == 200
    (answer,) = await v2_broker.pull("alpha")
    assert answer["id"] == reply.json["message_id"]
    assert answer["body"] == {"text": "the answer", "executionMode": "read"}
    assert (answer["parentId"], answer["replyTo"], answer["rootId"]) == (
        request_id, request_id, request_id)
    (entry,) = await v2_broker.status("alpha", request_id)
    assert entry["status"] == "done"


@pytest_twisted.ensureDeferred
async def test_each_sender_gets_the_notice_of_its_own_wire(v2_brokers):
    broker = v2_brokers(maxDeliveries=1)
    alpha = broker.client("alpha")
    v2_request = (await alpha.send_request("beta", "from v2")).json["message_id"]
    await broker.register("gamma", "beta")
    seed_request = await broker.message("gamma", "beta", kind="request",
                                        body={"text": "from seed"})
    beta = broker.client("beta")
    for message in await beta.pull():
        assert (await beta.ack(message["message_id"], outcome="retry")).code == 200
    (v2_notice,) = await alpha.pull()
    assert v2_notice["parent_id"] == v2_request
    assert "from v2" in v2_notice["body"] and v2_notice["body"].startswith("[Relay]")
    (seed_notice,) = await broker.pull("gamma")
    assert seed_notice["body"]["relayNotice"]["messageId"] == seed_request
    assert seed_notice["body"]["relayNotice"]["event"] == "failed"
