"""``POST /v1/recent`` and ``POST /v1/messages/query``: the inbox newest first, read only
(seed §5.1), the lease id shown to its holder alone, the boxes and conversation filters
(EXTENSIONS.md §5), the copies of a group send in the sent box (REACH §13); and a query
of the v2/v3 wire filled up to its limit (WIRE-V2).

In memory, time on a ``task.Clock``; group sends on every backend.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.support.api import assert_error, assert_json_headers, two_agents
from tests.support.teams import group_broker, group_send, on

# -- v1.1 (seed §5.1) ----------------------------------------------------------------------


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


# -- v1.2: boxes and conversations (EXTENSIONS.md §5) --------------------------------------


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


# -- v1.3: group sends (REACH §13) ---------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_copies_are_in_the_sent_box_and_the_thread_but_the_sent_id_is_not(store):
    b = await group_broker(store)
    copies = (await group_send(b, id="g1")).json["copies"]
    ids = [c["id"] for c in copies]
    sent = (await on(b, b.post("alice", "/v1/messages/query",
                               {"box": "sent"}))).json["messages"]
    assert sorted(m["id"] for m in sent) == sorted(ids)
    assert all(m["via"] == "group:reviewers" for m in sent)
    thread = (await on(b, b.post("alice", "/v1/thread", {"rootId": "g1"}))).json["messages"]
    assert [m["id"] for m in thread] == ids
    bob_thread = (await on(b, b.post("bob", "/v1/thread", {"rootId": "g1"}))).json["messages"]
    assert [m["id"] for m in bob_thread] == ids[:1]
    # a send inside a thread keeps its root
    more = (await group_send(b, id="g2", rootId="topic")).json["copies"]
    thread = (await on(b, b.post("alice", "/v1/thread", {"rootId": "topic"}))).json["messages"]
    assert [m["id"] for m in thread] == [c["id"] for c in more]
    inbox = (await on(b, b.post("bob", "/v1/messages/query", {}))).json["messages"]
    assert "g1" not in {m["id"] for m in inbox}


# -- the v2/v3 wire (WIRE-V2) --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_query_answers_up_to_its_limit_however_many_newer_messages_differ(v2_broker):
    alpha = v2_broker.client("alpha")
    wanted = [(await alpha.send_request("beta", f"needle {n}", topic="needle")).json[
        "message_id"] for n in range(3)]
    for n in range(205):
        assert (await alpha.send_request("beta", f"hay {n}")).code == 200
    found = await alpha.query(topic="needle", limit=3)
    assert [e["message_id"] for e in found] == wanted[::-1]
    assert len(await alpha.query(kind="request", limit=100)) == 100
    assert [e["message_id"] for e in await alpha.query(topic="needle", status="queued",
                                                       limit=2)] == wanted[:0:-1]
    assert await alpha.query(status="nonsense") == [] and await alpha.query(kind="note") == []
