"""``GET /peers``: who is online (seed §4), cards, the byte budget and ``next``, groups
and roles beside the peers (REACH §13), people marked (§15), and agents forgotten once
offline past the message TTL.

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted

from relay.broker.operations import Policy
from relay.testing import make_api, make_config
from tests.support.api import Broker, assert_json_headers, refused, registered
from tests.support.teams import ALICE, GROUP_TEAM, HUMAN, human_broker


def team_broker(**broker) -> Broker:
    broker.setdefault("agents", GROUP_TEAM)
    broker.setdefault("groups", {"reviewers": {"members": ["alice", "bob", "carol"]}})
    broker.setdefault("roles", {"triage": {"members": ["dan", "erin"], "selfJoin": True}})
    return Broker(**broker)


CARD = {"description": "d" * 2000, "skills": ["s" * 100] * 50}


# -- v1.0 (seed §4) ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_peers_sorted_with_ttl_90_seconds():
    b = Broker()
    await b.register("gamma")
    b.clock.advance(10)
    await b.register("alpha")
    start = int(b.clock.seconds())
    reply = await b.get("alpha", "/peers")
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json == {
        "peers": [
            {"agent": "alpha", "online": True, "lastSeen": start},
            {"agent": "gamma", "online": True, "lastSeen": start - 10},
        ]
    }
    b.clock.advance(79.5)
    online = {p["agent"]: p["online"] for p in (await b.get("alpha", "/peers")).json["peers"]}
    assert online == {"alpha": True, "gamma": True}
    b.clock.advance(0.5)  # gamma: now - lastSeen == 90, not < 90
    online = {p["agent"]: p["online"] for p in (await b.get("alpha", "/peers")).json["peers"]}
    assert online == {"alpha": True, "gamma": False}


@pytest_twisted.ensureDeferred
async def test_heartbeat_refreshes_last_seen():
    b = Broker()
    await b.register("alpha")
    b.clock.advance(200)
    await b.register("alpha")
    (peer,) = (await b.get("alpha", "/peers")).json["peers"]
    assert peer == {"agent": "alpha", "online": True, "lastSeen": int(b.clock.seconds())}


@pytest_twisted.ensureDeferred
async def test_agents_offline_longer_than_the_message_ttl_are_forgotten():
    api, client, clock = make_api(messageTtlDays=1)
    for agent in ("idle", "busy", "fresh"):
        assert (await client.post(agent, "/register", {}))[0] == 200
    clock.advance(3600)
    assert (await client.post("fresh", "/messages", {"to": "busy"}))[0] == 201
    clock.advance(86400 - 3600 + 1)
    assert (await client.post("fresh", "/register", {}))[0] == 200
    await api.broker.sweep_expired()
    _, peers, _ = await client.get("fresh", "/peers")
    assert [p["agent"] for p in peers["peers"]] == ["busy", "fresh"], (
        "busy holds a message; idle is forgotten")
    code, body, _ = await client.post("fresh", "/messages", {"to": "idle"})
    assert (code, body["error"]["code"]) == (404, "no_such_agent")
    assert (await client.post("idle", "/register", {}))[0] == 200, "it may come back"


@pytest_twisted.ensureDeferred
async def test_agents_seen_within_the_heartbeat_ttl_are_never_forgotten():
    api, client, clock = make_api(messageTtlDays=0)
    assert (await client.post("beta", "/register", {}))[0] == 200
    clock.advance(60)
    await api.broker.sweep_expired()
    _, peers, _ = await client.get("beta", "/peers")
    assert [p["agent"] for p in peers["peers"]] == ["beta"]


# -- v1.2: a budget of bytes, paged by after (EXTENSIONS.md §8) ----------------------------


@pytest_twisted.ensureDeferred
async def test_peers_stop_at_the_byte_budget_and_page_on_with_after(monkeypatch):
    from relay.wire import protocol

    _, client, _ = await registered()
    names = [f"agent{i:02d}" for i in range(12)]
    for name in names:
        assert (await client.post(name, "/register", {"card": CARD}))[0] == 200
    code, everything, _ = await client.get("agent00", "/peers")
    assert code == 200 and set(everything) == {"peers"}, "the seed's shape when all fit"
    assert [p["agent"] for p in everything["peers"]] == names
    card_bytes = len(protocol.compact_json(CARD))
    monkeypatch.setattr(protocol, "PEERS_BUDGET_BYTES", 5 * card_bytes)
    seen, after, pages = [], None, 0
    while True:
        path = "/peers" if after is None else f"/peers?after={after}"
        code, page, _ = await client.get("agent00", path)
        assert code == 200 and 1 <= len(page["peers"]) <= 5
        assert all(p["card"] == CARD for p in page["peers"])
        seen += [p["agent"] for p in page["peers"]]
        pages += 1
        after = page.get("next")
        if after is None:
            break
        assert after == seen[-1]
    assert seen == names and pages == 3
    _, names_only, _ = await client.get("agent00", "/peers?cards=false")
    assert "next" not in names_only and all("card" not in p for p in names_only["peers"])
    assert [p["agent"] for p in names_only["peers"]] == names
    _, two, _ = await client.get("agent00", "/peers?cards=false&limit=2&after=agent03")
    assert [p["agent"] for p in two["peers"]] == ["agent04", "agent05"]
    assert two["next"] == "agent05"
    refused(await client.get("agent00", "/peers?cards=maybe"))
    assert "256" in refused(await client.get("agent00", "/peers?after=" + "x" * 257))


# -- v1.3: groups, roles and people (REACH §13, §15) ---------------------------------------


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
async def test_peers_lists_both_teams_when_the_config_names_only_one_kind():
    groups_only = team_broker(roles={})
    await groups_only.register("alice")
    answer = (await groups_only.get("alice", "/peers")).json
    assert answer["roles"] == [] and [g["name"] for g in answer["groups"]] == ["reviewers"]
    roles_only = team_broker(groups={})
    await roles_only.register("alice")
    answer = (await roles_only.get("alice", "/peers")).json
    assert answer["groups"] == [] and [r["name"] for r in answer["roles"]] == ["triage"]


@pytest_twisted.ensureDeferred
async def test_peers_without_groups_or_roles_keeps_the_v12_shape():
    b = Broker()
    await b.register("alice")
    assert set((await b.get("alice", "/peers")).json) == {"peers"}


@pytest_twisted.ensureDeferred
async def test_peers_marks_humans_and_only_them():
    broker = human_broker()
    await broker.register("alpha", "dana")
    reply = await broker.get("alpha", "/peers")
    assert reply.code == 200
    entries = {entry["agent"]: entry for entry in reply.json["peers"]}
    assert entries["dana"]["human"] is True
    assert "human" not in entries["alpha"]


@pytest_twisted.ensureDeferred
async def test_a_reload_makes_and_unmakes_people():
    broker = human_broker()
    await broker.register("alpha", "dana")
    broker.broker.configure(Policy.from_config(make_config(agents={
        "alpha": {"secret": ALICE, "human": True}, "dana": {"secret": HUMAN}})))
    reply = await broker.get("alpha", "/peers")
    assert [(p["agent"], p.get("human")) for p in reply.json["peers"]] == [
        ("alpha", True), ("dana", None)]
