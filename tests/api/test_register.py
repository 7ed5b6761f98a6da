"""``POST /register``: the heartbeat, its body, the peer card (EXTENSIONS.md §8) and the
roles a card joins (REACH §13), the cap on agents; and a v2/v3 agent's first request,
which registers it for the seed wire.

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from relay.testing import START, make_api
from tests.support.api import Broker, assert_error, assert_json_headers, two_agents

# -- v1.0 (seed §4) ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_register_returns_agent_and_seconds():
    b = Broker()
    reply = await b.post("alpha", "/register", {"agent": "alpha"})
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json == {"ok": True, "agent": "alpha", "ts": int(b.clock.seconds())}


@pytest_twisted.ensureDeferred
async def test_register_without_body():
    b = Broker()
    reply = await b.post("alpha", "/register")
    assert reply.code == 200 and reply.json["agent"] == "alpha"


@pytest_twisted.ensureDeferred
async def test_register_body_agent_must_match_header():
    b = Broker()
    assert_error(await b.post("alpha", "/register", {"agent": "beta"}), 400, "bad_request")
    assert (await b.store.peers()) == []


@pytest_twisted.ensureDeferred
async def test_register_body_must_be_an_object():
    b = Broker()
    assert_error(await b.post("alpha", "/register", ["alpha"]), 400, "bad_request")
    assert_error(await b.post("alpha", "/register", raw=b"{nope"), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_registrations_are_capped_at_max_agents():
    _, client, _ = make_api(maxAgents=2)
    assert (await client.post("a1", "/register", {}))[0] == 200
    assert (await client.post("a2", "/register", {}))[0] == 200
    code, body, _ = await client.post("a3", "/register", {})
    assert code == 403 and body["error"]["code"] == "forbidden"
    assert "broker.maxAgents" in body["error"]["message"]
    assert (await client.post("a1", "/register", {}))[0] == 200, "a known agent is welcome"
    _, peers, _ = await client.get("a1", "/peers")
    assert [p["agent"] for p in peers["peers"]] == ["a1", "a2"]


# -- v1.2: peer cards (EXTENSIONS.md §8) ---------------------------------------------------


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


# -- v1.3: a card joins open roles (REACH §13) ---------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_card_joins_an_open_role_only(role_broker):
    for roles, why in ((["audit"], "not open"), (["nope"], "no role")):
        reply = await role_broker.post("zed", "/register", {"card": {"roles": roles}})
        assert_error(reply, 400, "bad_request")
        assert why in reply.json["error"]["message"]
    assert_error(await role_broker.post("zed", "/register", {"card": {"roles": "triage"}}), 400,
                 "bad_request")
    assert (await role_broker.post("zed", "/register", {"card": {"roles": ["triage"]}})).code == 200
    await role_broker.message("alpha", "role:triage", id="t")
    (leased,) = await role_broker.pull("zed")
    assert leased["id"] == "t"
    peers = (await role_broker.get("zed", "/peers")).json
    assert [p["card"] for p in peers["peers"] if p["agent"] == "zed"] == [{"roles": ["triage"]}]
    # REACH §13: /peers lists a role's members, those that joined by their card too
    assert peers["roles"] == [{"name": "audit", "members": ["erin"]},
                              {"name": "triage", "members": ["dan", "erin", "zed"]}]


# -- the v2/v3 wire ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_v2_agent_is_registered_for_the_seed_wire(v2_broker):
    await v2_broker.register("gamma")
    reply = await v2_broker.post("gamma", "/messages", {"to": "alpha", "body": {"text": "x"}})
    assert reply.code == 404 and reply.error_code == "no_such_agent"
    await v2_broker.client("alpha").pull()
    assert (await v2_broker.post("gamma", "/messages", {"to": "alpha",
                                                        "body": {"text": "x"}})).code == 201
    peers = (await v2_broker.get("gamma", "/peers")).json["peers"]
    assert [p["agent"] for p in peers] == ["alpha", "gamma"]
