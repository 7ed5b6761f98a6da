"""Groups (REACH §13) at the HTTP level, in memory: config, ``/peers``, fan-out.

Time is a ``task.Clock``.
"""

from __future__ import annotations

import json

import pytest_twisted

from relay.testing import make_config
from tests.support.api import Broker, answered, assert_error

TEAM = {"alice": {}, "bob": {}, "carol": {}, "dan": {}, "erin": {}}


def team_broker(**broker) -> Broker:
    broker.setdefault("agents", TEAM)
    broker.setdefault("groups", {"reviewers": {"members": ["alice", "bob", "carol"]}})
    broker.setdefault("roles", {"triage": {"members": ["dan", "erin"], "selfJoin": True}})
    return Broker(**broker)


@pytest_twisted.ensureDeferred
async def test_peers_lists_groups_and_roles_beside_peers():
    b = team_broker(groups={"reviewers": {"members": ["carol", "alice"]},
                            "a-team": {"members": []}})
    await b.register("alice")
    answer = (await b.get("alice", "/peers")).json
    assert [p["agent"] for p in answer["peers"]] == ["alice"]
    assert answer["groups"] == [{"name": "a-team", "members": []},
                                {"name": "reviewers", "members": ["carol", "alice"]}]
    assert answer["roles"] == [{"name": "triage", "members": ["dan", "erin"]}]
    # paged answers carry them too
    paged = (await b.get("alice", "/peers?limit=1")).json
    assert paged["groups"] == answer["groups"]


@pytest_twisted.ensureDeferred
async def test_peers_without_groups_or_roles_keeps_the_v12_shape():
    b = Broker()
    await b.register("alice")
    assert set((await b.get("alice", "/peers")).json) == {"peers"}


# -- group sends on every backend --------------------------------------------------------

GROUPS = {"reviewers": {"members": ["alice", "bob", "carol"]},
          "pair": {"members": ["alice", "bob"]}}


async def on(b: Broker, d):
    """The reply of ``d``, pumping the broker until a persistent store committed."""
    return await answered(b, d)


async def group_broker(store, **broker) -> Broker:
    broker.setdefault("agents", TEAM)
    broker.setdefault("groups", GROUPS)
    b = Broker(store=store, config=make_config(**broker))
    for agent in ("alice", "bob", "carol", "dan"):
        assert (await on(b, b.post(agent, "/register", {}))).code == 200
    return b


async def group_send(b: Broker, sender: str = "alice", to: str = "group:reviewers",
                     **fields):
    return await on(b, b.post(sender, "/messages", dict({"to": to, "body": {"n": 1}},
                                                         **fields)))


@pytest_twisted.ensureDeferred
async def test_a_group_send_stores_one_copy_per_member_but_the_sender(store):
    b = await group_broker(store)
    reply = await group_send(b, id="g1", kind="request", body={"text": "review this"})
    assert reply.code == 201
    copies = reply.json["copies"]
    assert reply.json == {"accepted": True, "id": "g1", "duplicate": False,
                          "copies": copies}
    assert [c["to"] for c in copies] == ["bob", "carol"]
    assert len({c["id"] for c in copies} | {"g1"}) == 3
    for member, copy in (("bob", copies[0]), ("carol", copies[1])):
        (leased,) = (await on(b, b.post(member, "/v1/pull", {}))).json["messages"]
        assert leased["id"] == copy["id"]
        assert leased["to"] == member and leased["from"] == "alice"
        assert leased["via"] == "group:reviewers"
        assert leased["body"] == {"text": "review this"} and leased["kind"] == "request"
        assert leased["rootId"] == "g1"
    assert (await on(b, b.post("alice", "/v1/pull", {}))).json["messages"] == []
    # each copy is an ordinary message: its own lease and ack
    (bob_copy,) = (await on(b, b.post("bob", "/v1/status",
                                      {"messageIds": [copies[0]["id"]]}))).json["messages"]
    assert bob_copy["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_a_repeated_group_send_is_a_duplicate_with_the_same_copies(store):
    b = await group_broker(store)
    first = await group_send(b, id="g1")
    again = await group_send(b, id="g1", body={"n": 2})
    assert again.code == 200
    assert again.json == dict(first.json, duplicate=True)
    (pulled,) = (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"]
    assert pulled["body"] == {"n": 1}
    assert (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"] == []


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


@pytest_twisted.ensureDeferred
async def test_a_full_inbox_of_one_member_refuses_the_whole_send(store):
    b = await group_broker(store, inboxMaxMessages=1)
    assert (await on(b, b.post("dan", "/messages", {"to": "carol", "id": "fill"}))).code == 201
    refused = await group_send(b, id="g1")
    assert_error(refused, 429, "inbox_full")
    assert "'carol'" in refused.json["error"]["message"]
    assert (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"] == []
    (entry,) = (await on(b, b.post("alice", "/v1/status",
                                   {"messageIds": ["g1"]}))).json["messages"]
    assert entry["status"] == "not_found"
    assert b.broker.counters.refused == {"inbox_full": 1}
    # once carol took hers, the same send goes through whole
    (taken,) = (await on(b, b.post("carol", "/v1/pull", {}))).json["messages"]
    await on(b, b.post("carol", "/v1/ack", {"messageId": "fill", "leaseId": taken["leaseId"],
                                            "outcome": "completed"}))
    assert (await group_send(b, id="g1")).code == 201
    assert b.broker.counters.group_sends == {"reviewers": 1}


@pytest_twisted.ensureDeferred
async def test_an_unknown_group_is_no_such_agent(store):
    b = await group_broker(store)
    for to in ("group:nobody", "group:", "group:Reviewers"):
        assert_error(await group_send(b, to=to), 404, "no_such_agent")


@pytest_twisted.ensureDeferred
async def test_the_acl_names_the_group_as_a_target(store):
    agents = dict(TEAM, alice={"allowed_targets": ["group:pair"]},
                  dan={"allowed_targets": ["bob", "carol"]})
    b = await group_broker(store, agents=agents)
    assert (await group_send(b, to="group:pair")).code == 201
    assert_error(await group_send(b, to="group:reviewers"), 403, "forbidden")
    # members themselves are no licence to reach their group
    assert_error(await group_send(b, sender="dan", to="group:pair"), 403, "forbidden")
    # as for an agent, the ACL answers first: an unknown group is no different
    assert_error(await group_send(b, sender="dan", to="group:nobody"), 403, "forbidden")


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


@pytest_twisted.ensureDeferred
async def test_a_sent_id_that_names_a_message_is_an_id_conflict(store):
    b = await group_broker(store)
    assert (await on(b, b.post("alice", "/messages", {"to": "dan", "id": "taken"}))).code == 201
    assert_error(await group_send(b, id="taken"), 409, "id_conflict")
    assert (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"] == []


@pytest_twisted.ensureDeferred
async def test_each_member_is_told_of_its_copy(store):
    b = await group_broker(store)
    copies = (await group_send(b, id="g1")).json["copies"]
    for copy in copies:
        page = await b.store.events(copy["to"], 0, 10)
        assert [(e.type, json.loads(e.data)["id"]) for e in page.events] == [
            ("message", copy["id"])]
        # REACH §11: a message event carries via when set
        assert json.loads(page.events[0].data)["via"] == "group:reviewers"
    assert (await b.store.events("alice", 0, 10)).events == []


@pytest_twisted.ensureDeferred
async def test_a_group_whose_only_member_is_the_sender_makes_no_copy(store):
    b = await group_broker(store, groups={"solo": {"members": ["alice"]}})
    reply = await group_send(b, to="group:solo", id="g1")
    assert reply.code == 201 and reply.json["copies"] == []


@pytest_twisted.ensureDeferred
async def test_capabilities_advertise_groups():
    assert (await Broker().get(None, "/")).json["capabilities"]["groups"] is True
