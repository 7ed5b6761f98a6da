"""``POST /v1/pull``: leases (seed §5.1), the limit and ``leaseSeconds``, the long pull
and what wakes it, ``maxDeliveries`` (EXTENSIONS.md §3), the pull by parent that waits
for an answer (§5), priorities and role queues (REACH §13, §14); and the pull of the
v2/v3 wire (WIRE-V2).

In memory, time on a ``task.Clock``; the roles in memory and on SQLite, and on one
PostgreSQL database shared by two brokers.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from relay.testing import START, make_config
from tests.conftest import open_backend
from tests.support.api import (
    Broker,
    ack,
    answered,
    assert_error,
    assert_json_headers,
    leased_one,
    two_agents,
)
from tests.support.teams import ROLE_TEAM, ROLES, TeamBroker, ack_as
from tests.support.v2 import assert_v2_error, leased_request

START_MS = 1_712_345_678_000


# -- v1.1: leases (seed §5.1) --------------------------------------------------------------


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


# -- v1.1: the long pull -------------------------------------------------------------------


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


# -- v1.2: deliveries and dead letters (EXTENSIONS.md §3) ----------------------------------


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


# -- v1.2: the pull by parent (EXTENSIONS.md §5) -------------------------------------------


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


# -- v1.3: priorities and role queues (REACH §13, §14) -------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_pull_leases_urgent_work_first_and_the_poll_keeps_its_order(role_broker):
    await role_broker.register("beta")
    for message_id, priority in (("old", 0), ("urgent", 7), ("newer", 0), ("most", 9)):
        await role_broker.message("alpha", "beta", id=message_id, priority=priority)
    polled, _ = await role_broker.poll("beta")
    assert [m["id"] for m in polled] == ["old", "urgent", "newer", "most"]
    pulled = await role_broker.pull("beta", limit=10)
    assert [m["id"] for m in pulled] == ["most", "urgent", "old", "newer"]
    assert [m.get("priority") for m in pulled] == [9, 7, None, None]


@pytest_twisted.ensureDeferred
async def test_a_role_message_is_leased_by_one_member_and_settled_by_it_alone(role_broker):
    sent = await role_broker.post("alpha", "/messages", {"to": "role:triage", "id": "t",
                                                         "kind": "request"})
    assert sent.code == 201 and sent.json == {"accepted": True, "id": "t",
                                              "duplicate": False}
    (leased,) = await role_broker.pull("dan")
    assert leased["to"] == "role:triage" and leased["leaseId"]
    assert await role_broker.pull("erin") == []
    (entry,) = await role_broker.status("alpha", "t")
    assert entry["leasedBy"] == "dan" and entry["status"] == "leased"
    assert_error(await ack_as(role_broker, "erin", leased), 403, "forbidden")
    renew = await role_broker.post("erin", "/v1/lease/renew",
                                   {"messageId": "t", "leaseId": leased["leaseId"]})
    assert_error(renew, 403, "forbidden")
    assert (await role_broker.post("dan", "/v1/lease/renew",
                                   {"messageId": "t", "leaseId": leased["leaseId"]})).code == 200
    done = await ack_as(role_broker, "dan", leased, reply={"id": "answer", "body": {"ok": True}})
    assert done.code == 200 and done.json["status"] == "done"
    (entry,) = await role_broker.status("alpha", "t")
    assert entry["completedBy"] == "dan" and "leasedBy" not in entry
    (answer,) = await role_broker.pull("alpha")
    assert (answer["from"], answer["to"], answer["parentId"]) == ("dan", "alpha", "t")


@pytest_twisted.ensureDeferred
async def test_a_lapsed_role_lease_returns_to_the_role_queue(role_broker):
    await role_broker.message("alpha", "role:triage", id="t")
    (first,) = await role_broker.pull("dan", leaseSeconds=5)
    role_broker.advance(5)
    (again,) = await role_broker.pull("erin")
    assert again["id"] == "t" and again["leaseId"] != first["leaseId"]
    assert_error(await ack_as(role_broker, "dan", first), 403, "forbidden")
    (entry,) = await role_broker.status("alpha", "t")
    assert entry["leasedBy"] == "erin" and entry["deliveries"] == 2


@pytest_twisted.ensureDeferred
async def test_a_pull_narrowed_to_a_role(role_broker):
    await role_broker.register("erin")
    await role_broker.message("alpha", "erin", id="own")
    await role_broker.message("alpha", "role:audit", id="audit")
    await role_broker.message("alpha", "role:triage", id="triage")
    assert [m["id"] for m in await role_broker.pull("erin", role="audit")] == ["audit"]
    for bad in (7, "", "role:audit", "x" * 65):
        assert_error(await role_broker.post("erin", "/v1/pull", {"role": bad}), 400, "bad_request")
    assert_error(await role_broker.post("erin", "/v1/pull", {"role": "nope"}), 404, "no_such_agent")
    assert_error(await role_broker.post("dan", "/v1/pull", {"role": "audit"}), 403, "forbidden")
    assert [m["id"] for m in await role_broker.pull("erin")] == ["own", "triage"]


@pytest_twisted.ensureDeferred
async def test_a_waiting_member_is_woken_by_a_role_message(role_broker):
    await role_broker.register("zed")
    assert (await role_broker.post("zed", "/register", {"card": {"roles": ["triage"]}})).code == 200
    for member in ("erin", "zed"):
        waiting = role_broker.start(member, "/v1/pull", {"waitSeconds": 20})
        role_broker.flush()
        assert not waiting.called
        await role_broker.message("alpha", "role:triage", id=f"for-{member}")
        reply = await answered(role_broker, waiting)
        assert [m["id"] for m in reply.json["messages"]] == [f"for-{member}"]


@pytest_twisted.ensureDeferred
async def test_role_depths_and_leases_by_member_in_the_queue_depths(role_broker):
    await role_broker.message("alpha", "role:triage", id="t1")
    await role_broker.message("alpha", "role:triage", id="t2")
    await role_broker.pull("dan", limit=1)
    depths = {d.agent: d for d in await role_broker.broker.queue_depths()}
    assert (depths["role:triage"].queued, depths["role:triage"].leased) == (1, 1)


@pytest.mark.postgres
@pytest_twisted.ensureDeferred
async def test_two_brokers_share_one_role_queue_and_lease_each_message_once(tmp_path):
    from twisted.internet import reactor

    from tests.conftest import reset_postgres

    reset_postgres()
    stores = [open_backend("postgres", tmp_path / name) for name in ("a", "b")]
    a, b = (TeamBroker(clock=reactor, store=store, agents=ROLE_TEAM, roles=ROLES)
            for store in stores)
    try:
        count = 60
        for n in range(count):
            sender = a if n % 2 else b
            reply = await sender.post("alpha", "/messages", {"to": "role:triage",
                                                             "id": f"t{n:03d}",
                                                             "priority": n % 3})
            assert reply.code == 201, reply
        leased = []
        for _ in range(count):
            pulls = [a.post("dan", "/v1/pull", {"limit": 3}),
                     b.post("erin", "/v1/pull", {"limit": 3}),
                     b.post("dan", "/v1/pull", {"limit": 2})]
            got = []
            for d in pulls:
                got += (await d).json["messages"]
            if not got:
                break
            leased += got
        ids = [m["id"] for m in leased]
        assert len(ids) == len(set(ids)) == count, "every message leased once"
        # each acked through the other broker by its holder; a non-holder is refused
        (first,) = [m for m in leased if m["id"] == "t000"]
        (entry,) = (await b.post("alpha", "/v1/status", {"messageIds": ["t000"]})).json[
            "messages"]
        holder = entry["leasedBy"]
        other = "erin" if holder == "dan" else "dan"
        assert_error(await ack_as(a, other, first), 403, "forbidden")
        reply = await ack_as(a, holder, first)
        assert reply.code == 200
        (entry,) = (await b.post("alpha", "/v1/status", {"messageIds": ["t000"]})).json[
            "messages"]
        assert entry["completedBy"] == holder
    finally:
        for store in stores:
            await store.close()


# -- the v2/v3 wire (WIRE-V2) --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pull_clamps_its_limit_and_lease(v2_broker):
    alpha, beta = v2_broker.client("alpha"), v2_broker.client("beta")
    for n in range(10):
        await alpha.send_request("beta", f"m{n}")
    first = await beta.pull(limit=50, lease_seconds=1)
    assert [m["body"] for m in first] == [f"m{n}" for n in range(8)]
    assert {m["lease_until"] for m in first} == {START + 15}
    second = await beta.pull(limit=0, lease_seconds=10**6)
    assert [m["body"] for m in second] == ["m8"] and second[0]["lease_until"] == START + 3600
    assert [m["body"] for m in await beta.pull(limit="2")] == ["m9"]
    assert await beta.pull() == []
    for body, code in (({"limit": "many"}, 400), ({"lease_seconds": "long"}, 400),
                       ({"agent": "alpha"}, 403)):
        reply = await beta.request("POST", "/v1/pull", body)
        assert reply.code == code, reply


@pytest_twisted.ensureDeferred
async def test_a_lapsed_lease_is_pulled_again_with_one_more_attempt(v2_broker):
    alpha, beta, request_id, message = await leased_request(v2_broker)
    v2_broker.advance(601)
    (again,) = await beta.pull()
    assert again["message_id"] == request_id and again["lease_token"] != message["lease_token"]
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("leased", 2)


@pytest_twisted.ensureDeferred
async def test_a_role_member_on_the_v2_wire_holds_renews_and_acks_a_role_message(
        v2_brokers):
    """REACH §13 on the v2 wire: a member's pull leases from its roles, and only the
    member holding the lease renews or acks it."""
    broker = v2_brokers(agents={"alpha": {}, "dan": {}, "erin": {}},
                        roles={"triage": {"members": ["dan", "erin"]}})
    await broker.register("alpha")
    message_id = await broker.message("alpha", "role:triage", kind="request")
    dan, erin = broker.client("dan"), broker.client("erin")
    (leased,) = await dan.pull()
    assert leased["message_id"] == message_id and leased["lease_token"]
    token = leased["lease_token"]
    assert (await dan.renew(message_id, token)).code == 200
    assert_v2_error(await erin.ack(message_id, lease_token=token), 403, "forbidden")
    (seen,) = await dan.status(message_id)
    assert seen["status"] == "leased"
    assert (await dan.ack(message_id, lease_token=token)).code == 200
    (entry,) = await broker.status("alpha", message_id)
    assert (entry["status"], entry["completedBy"]) == ("done", "dan")


@pytest_twisted.ensureDeferred
async def test_a_pull_by_parent_leases_the_urgent_answer_first_on_every_backend(store):
    """REACH §14 applies to a pull by parent too: by priority, then oldest first
    (EXTENSIONS §4's order among answers of one priority), whatever the limit."""
    b = Broker(store=store, config=make_config(agents={"alpha": {}, "beta": {}}))
    for agent in ("alpha", "beta"):
        assert (await answered(b, b.post(agent, "/register", {}))).code == 200
    for message_id, priority in (("a0", 0), ("a5", 5), ("b0", 0), ("a9", 9), ("b5", 5)):
        sent = await answered(b, b.post("beta", "/messages", {
            "to": "alpha", "id": message_id, "replyTo": "q1", "priority": priority}))
        assert sent.code == 201
    await answered(b, b.post("beta", "/messages", {"to": "alpha", "id": "other",
                                                   "priority": 9}))
    order = []
    for _ in range(5):
        pulled = await answered(b, b.post("alpha", "/v1/pull", {"parentId": "q1",
                                                                "limit": 1}))
        (message,) = pulled.json["messages"]
        order.append(message["id"])
    assert order == ["a9", "a5", "b5", "a0", "b0"]
