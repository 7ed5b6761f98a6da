"""Roles (REACH §13) and priorities (§14) at the HTTP level: in memory and on SQLite,
and on one PostgreSQL database shared by two brokers.

Time is a ``task.Clock`` (the shared-database test runs on the reactor).
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, ensureDeferred

from tests.conftest import open_backend
from tests.support.api import Broker, answered, assert_error

TEAM = {"alpha": {}, "beta": {}, "dan": {}, "erin": {}, "zed": {},
        "narrow": {"allowed_targets": ["role:triage"]}}
ROLES = {"triage": {"members": ["dan", "erin"], "selfJoin": True},
         "audit": {"members": ["erin"]}}


class TeamBroker(Broker):
    """A broker whose requests are answered once its store committed (the persistent
    stores commit on the reactor)."""

    def request(self, *args, **kwargs) -> Deferred:
        return ensureDeferred(answered(self, super().request(*args, **kwargs)))

    def start(self, agent: str, path: str, body) -> Deferred:
        """A request left running (a long poll)."""
        return super().request(agent, "POST", path, body)


@pytest.fixture(params=["memory", "sqlite"])
def broker(request, tmp_path):
    store = None if request.param == "memory" else open_backend("sqlite", tmp_path)
    b = TeamBroker(store=store, agents=TEAM, roles=ROLES)
    yield b
    if store is not None:
        pytest_twisted.blockon(store.close())


async def ack(b: Broker, agent: str, message, outcome: str = "completed", **fields):
    body = dict(fields, messageId=message["id"], leaseId=message.get("leaseId", "x"),
                outcome=outcome)
    return await b.post(agent, "/v1/ack", body)


@pytest_twisted.ensureDeferred
async def test_capabilities_advertise_roles_and_priority(broker):
    capabilities = (await broker.get(None, "/")).json["capabilities"]
    assert capabilities["roles"] is True
    assert capabilities["priority"] == {"max": 9}


@pytest_twisted.ensureDeferred
async def test_priority_is_an_integer_from_0_to_9(broker):
    await broker.register("beta")
    for bad in (10, -1, 1.5, 3.0, "3", True, [1]):
        reply = await broker.post("alpha", "/messages", {"to": "beta", "priority": bad})
        assert_error(reply, 400, "bad_request")
        assert "priority" in reply.json["error"]["message"]
    for good in (0, 9, None):
        reply = await broker.post("alpha", "/messages", {"to": "beta", "priority": good})
        assert reply.code == 201


@pytest_twisted.ensureDeferred
async def test_a_pull_leases_urgent_work_first_and_the_poll_keeps_its_order(broker):
    await broker.register("beta")
    for message_id, priority in (("old", 0), ("urgent", 7), ("newer", 0), ("most", 9)):
        await broker.message("alpha", "beta", id=message_id, priority=priority)
    polled, _ = await broker.poll("beta")
    assert [m["id"] for m in polled] == ["old", "urgent", "newer", "most"]
    pulled = await broker.pull("beta", limit=10)
    assert [m["id"] for m in pulled] == ["most", "urgent", "old", "newer"]
    assert [m.get("priority") for m in pulled] == [9, 7, None, None]


@pytest_twisted.ensureDeferred
async def test_a_reply_in_an_ack_sets_its_own_priority(broker):
    await broker.register("beta")
    await broker.message("alpha", "beta", id="q", kind="request", priority=2)
    (leased,) = await broker.pull("beta")
    reply = await ack(broker, "beta", leased, reply={"id": "r", "priority": 10})
    assert_error(reply, 400, "bad_request")
    assert "reply.priority" in reply.json["error"]["message"]
    assert (await ack(broker, "beta", leased, reply={"id": "r", "priority": 6})).code == 200
    (answer,) = await broker.pull("alpha")
    assert answer["id"] == "r" and answer["priority"] == 6


@pytest_twisted.ensureDeferred
async def test_a_role_message_is_leased_by_one_member_and_settled_by_it_alone(broker):
    sent = await broker.post("alpha", "/messages", {"to": "role:triage", "id": "t",
                                                    "kind": "request"})
    assert sent.code == 201 and sent.json == {"accepted": True, "id": "t",
                                              "duplicate": False}
    (leased,) = await broker.pull("dan")
    assert leased["to"] == "role:triage" and leased["leaseId"]
    assert await broker.pull("erin") == []
    (entry,) = await broker.status("alpha", "t")
    assert entry["leasedBy"] == "dan" and entry["status"] == "leased"
    assert_error(await ack(broker, "erin", leased), 403, "forbidden")
    renew = await broker.post("erin", "/v1/lease/renew",
                              {"messageId": "t", "leaseId": leased["leaseId"]})
    assert_error(renew, 403, "forbidden")
    assert (await broker.post("dan", "/v1/lease/renew",
                              {"messageId": "t", "leaseId": leased["leaseId"]})).code == 200
    done = await ack(broker, "dan", leased, reply={"id": "answer", "body": {"ok": True}})
    assert done.code == 200 and done.json["status"] == "done"
    (entry,) = await broker.status("alpha", "t")
    assert entry["completedBy"] == "dan" and "leasedBy" not in entry
    (answer,) = await broker.pull("alpha")
    assert (answer["from"], answer["to"], answer["parentId"]) == ("dan", "alpha", "t")


@pytest_twisted.ensureDeferred
async def test_a_lapsed_role_lease_returns_to_the_role_queue(broker):
    await broker.message("alpha", "role:triage", id="t")
    (first,) = await broker.pull("dan", leaseSeconds=5)
    broker.advance(5)
    (again,) = await broker.pull("erin")
    assert again["id"] == "t" and again["leaseId"] != first["leaseId"]
    assert_error(await ack(broker, "dan", first), 403, "forbidden")
    (entry,) = await broker.status("alpha", "t")
    assert entry["leasedBy"] == "erin" and entry["deliveries"] == 2


@pytest_twisted.ensureDeferred
async def test_a_pull_narrowed_to_a_role(broker):
    await broker.register("erin")
    await broker.message("alpha", "erin", id="own")
    await broker.message("alpha", "role:audit", id="audit")
    await broker.message("alpha", "role:triage", id="triage")
    assert [m["id"] for m in await broker.pull("erin", role="audit")] == ["audit"]
    for bad in (7, "", "role:audit", "x" * 65):
        assert_error(await broker.post("erin", "/v1/pull", {"role": bad}), 400, "bad_request")
    assert_error(await broker.post("erin", "/v1/pull", {"role": "nope"}), 404, "no_such_agent")
    assert_error(await broker.post("dan", "/v1/pull", {"role": "audit"}), 403, "forbidden")
    assert [m["id"] for m in await broker.pull("erin")] == ["own", "triage"]


@pytest_twisted.ensureDeferred
async def test_an_unknown_role_is_no_such_agent_and_the_acl_names_role_targets(broker):
    assert_error(await broker.post("alpha", "/messages", {"to": "role:nope"}), 404,
                 "no_such_agent")
    await broker.register("beta")
    assert (await broker.post("narrow", "/messages", {"to": "role:triage"})).code == 201
    assert_error(await broker.post("narrow", "/messages", {"to": "role:audit"}), 403,
                 "forbidden")
    assert_error(await broker.post("narrow", "/messages", {"to": "beta"}), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_the_v10_poll_never_returns_a_role_message(broker):
    await broker.register("dan")
    await broker.message("alpha", "role:triage", id="t")
    assert (await broker.poll("dan"))[0] == []
    assert_error(await broker.post("dan", "/messages/t/ack", {}), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_a_card_joins_an_open_role_only(broker):
    for roles, why in ((["audit"], "not open"), (["nope"], "no role")):
        reply = await broker.post("zed", "/register", {"card": {"roles": roles}})
        assert_error(reply, 400, "bad_request")
        assert why in reply.json["error"]["message"]
    assert_error(await broker.post("zed", "/register", {"card": {"roles": "triage"}}), 400,
                 "bad_request")
    assert (await broker.post("zed", "/register", {"card": {"roles": ["triage"]}})).code == 200
    await broker.message("alpha", "role:triage", id="t")
    (leased,) = await broker.pull("zed")
    assert leased["id"] == "t"
    peers = (await broker.get("zed", "/peers")).json
    assert [p["card"] for p in peers["peers"] if p["agent"] == "zed"] == [{"roles": ["triage"]}]
    # REACH §13: /peers lists a role's members, those that joined by their card too
    assert peers["roles"] == [{"name": "audit", "members": ["erin"]},
                              {"name": "triage", "members": ["dan", "erin", "zed"]}]


@pytest_twisted.ensureDeferred
async def test_a_waiting_member_is_woken_by_a_role_message(broker):
    await broker.register("zed")
    assert (await broker.post("zed", "/register", {"card": {"roles": ["triage"]}})).code == 200
    for member in ("erin", "zed"):
        waiting = broker.start(member, "/v1/pull", {"waitSeconds": 20})
        broker.flush()
        assert not waiting.called
        await broker.message("alpha", "role:triage", id=f"for-{member}")
        reply = await answered(broker, waiting)
        assert [m["id"] for m in reply.json["messages"]] == [f"for-{member}"]


@pytest_twisted.ensureDeferred
async def test_role_depths_and_leases_by_member_in_the_queue_depths(broker):
    await broker.message("alpha", "role:triage", id="t1")
    await broker.message("alpha", "role:triage", id="t2")
    await broker.pull("dan", limit=1)
    depths = {d.agent: d for d in await broker.broker.queue_depths()}
    assert (depths["role:triage"].queued, depths["role:triage"].leased) == (1, 1)


@pytest.mark.postgres
@pytest_twisted.ensureDeferred
async def test_two_brokers_share_one_role_queue_and_lease_each_message_once(tmp_path):
    from twisted.internet import reactor

    from tests.conftest import reset_postgres

    reset_postgres()
    stores = [open_backend("postgres", tmp_path / name) for name in ("a", "b")]
    a, b = (TeamBroker(clock=reactor, store=store, agents=TEAM, roles=ROLES)
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
        assert_error(await ack(a, other, first), 403, "forbidden")
        reply = await ack(a, holder, first)
        assert reply.code == 200
        (entry,) = (await b.post("alpha", "/v1/status", {"messageIds": ["t000"]})).json[
            "messages"]
        assert entry["completedBy"] == holder
    finally:
        for store in stores:
            await store.close()


@pytest_twisted.ensureDeferred
async def test_group_copies_carry_the_sent_priority():
    b = TeamBroker(agents=TEAM, roles=ROLES, groups={"pair": {"members": ["dan", "erin"]}})
    await b.register("dan")
    await b.message("alpha", "dan", id="plain")
    sent = await b.post("alpha", "/messages", {"to": "group:pair", "id": "g", "priority": 6})
    assert sent.code == 201 and len(sent.json["copies"]) == 2
    first, second = await b.pull("dan")
    assert (first["via"], first["priority"]) == ("group:pair", 6)
    assert second["id"] == "plain"
    assert_error(await b.post("alpha", "/messages", {"to": "group:pair", "priority": 10}),
                 400, "bad_request")
