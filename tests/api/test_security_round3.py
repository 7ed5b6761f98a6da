"""Regression tests for the findings of the third attack run (docs/SECURITY.md),
against the broker's HTTP API in memory, time driven by a ``task.Clock``."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import pytest_twisted

from relay.testing import make_api
from relay.wire.protocol import MAX_ID_CHARS, notice_id


async def registered(*agents: str, **broker: Any):
    api, client, clock = make_api(**broker)
    for agent in agents:
        assert (await client.post(agent, "/register", {}))[0] == 200
    return api, client, clock


def refused(answer, status: int = 400, code: str = "bad_request") -> str:
    """The message of an error answer, after checking its status and uniform body."""
    got, body, _ = answer
    assert got == status, body
    assert set(body) == {"error"} and body["error"]["code"] == code
    return body["error"]["message"]


# -- ids and references are bounded; the quota counts them ------------------------------


@pytest.mark.parametrize("field", ["id", "replyTo", "rootId", "parentId", "to"])
@pytest_twisted.ensureDeferred
async def test_an_id_or_reference_over_256_characters_is_400(field):
    _, client, _ = await registered("alpha", "beta")
    at_limit: Dict[str, Any] = {"to": "beta", field: "x" * MAX_ID_CHARS}
    if field == "to":
        at_limit["to"] = "beta"
    else:
        assert (await client.post("alpha", "/messages", at_limit))[0] == 201
    over = {"to": "beta", field: "y" * (MAX_ID_CHARS + 1)}
    message = refused(await client.post("alpha", "/messages", over))
    assert field in message and "256" in message


@pytest.mark.parametrize("path,body", [
    ("/v1/status", {"messageIds": ["x" * 257]}),
    ("/v1/messages/query", {"parentId": "x" * 257}),
    ("/v1/pull", {"parentId": "x" * 257}),
    ("/v1/thread", {"rootId": "x" * 257}),
    ("/v1/requeue", {"messageId": "x" * 257}),
    ("/v1/cancel", {"messageId": "x" * 257}),
    ("/v1/lease/renew", {"messageId": "m", "leaseId": "x" * 257}),
    ("/v1/ack", {"messageId": "m", "leaseId": "l", "outcome": "completed",
                 "reply": {"id": "x" * 257}}),
    ("/v1/ack", {"messageId": "m", "leaseId": "l", "outcome": "reject", "error": "e" * 1001}),
])
@pytest_twisted.ensureDeferred
async def test_every_id_field_of_every_route_is_bounded(path, body):
    _, client, _ = await registered("alpha")
    assert "256" in refused(await client.post("alpha", path, body)) or path == "/v1/ack"


@pytest_twisted.ensureDeferred
async def test_ids_in_the_path_and_the_query_string_are_bounded():
    _, client, _ = await registered("alpha")
    assert "since" in refused(await client.get("alpha", "/messages?since=" + "x" * 257))
    assert (await client.get("alpha", "/messages?since=" + "x" * 256))[0] == 200
    path = "/messages/" + "x" * 257 + "/ack"
    assert "256" in refused(await client.post("alpha", path, {}))
    assert (await client.post("alpha", "/messages/" + "x" * 256 + "/ack", {}))[0] == 404


@pytest_twisted.ensureDeferred
async def test_the_inbox_byte_quota_counts_ids_and_references():
    _, client, _ = await registered("alpha", "beta", inboxMaxBytes=2100)
    for i in range(2):
        envelope = {"to": "beta", "id": f"{i}" + "i" * 255, "rootId": "r" * 256,
                    "parentId": "p" * 256, "replyTo": "t" * 256}
        assert (await client.post("alpha", "/messages", envelope))[0] == 201
    envelope = {"to": "beta", "id": "2" + "i" * 255, "rootId": "r" * 256}
    message = refused(await client.post("alpha", "/messages", envelope), 429, "inbox_full")
    assert "beta" in message


# -- the failure notices' ids are reserved ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_no_one_can_take_the_id_of_a_failure_notice_first():
    _, client, _ = await registered("alpha", "beta", "mallory")
    request = {"to": "beta", "id": "q1", "kind": "request"}
    assert (await client.post("alpha", "/messages", request))[0] == 201
    squat = {"to": "alpha", "id": notice_id("q1"), "kind": "reply", "parentId": "q1"}
    message = refused(await client.post("mallory", "/messages", squat))
    assert "reserved" in message
    _, pulled, _ = await client.post("beta", "/v1/pull", {"limit": 1})
    (leased,) = pulled["messages"]
    in_reply = {"messageId": leased["id"], "leaseId": leased["leaseId"],
                "outcome": "completed", "reply": {"id": notice_id("q9")}}
    assert "reserved" in refused(await client.post("beta", "/v1/ack", in_reply))
    reject = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": "reject"}
    assert (await client.post("beta", "/v1/ack", reject))[0] == 200
    _, answers, _ = await client.post("alpha", "/v1/pull", {"parentId": "q1"})
    (notice,) = answers["messages"]
    assert notice["id"] == notice_id("q1") and notice["from"] == "beta"
    assert notice["body"]["relayNotice"]["event"] == "failed"


# -- requeue ------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_requeueing_a_message_its_sender_cancelled_is_refused_with_the_reason():
    _, client, _ = await registered("alpha", "beta")
    assert (await client.post("alpha", "/messages", {"to": "beta", "id": "c1"}))[0] == 201
    assert (await client.post("alpha", "/v1/cancel", {"messageId": "c1"}))[0] == 200
    message = refused(await client.post("beta", "/v1/requeue", {"messageId": "c1"}),
                      403, "forbidden")
    assert "cancelled" in message and "sender" in message
    assert (await client.post("alpha", "/v1/requeue", {"messageId": "c1"}))[0] == 200


# -- /peers is bounded ----------------------------------------------------------------------


CARD = {"description": "d" * 2000, "skills": ["s" * 100] * 50}


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


def test_the_client_pages_through_peers_and_relay_peers_lists_them_all(monkeypatch):
    from relay.wire import protocol
    from tests.support.client import Net

    net = Net()
    names = [f"agent{i:02d}" for i in range(7)]
    clients = {name: net.client(name) for name in names}
    for client in clients.values():
        net.run(client.register(card=CARD))
    monkeypatch.setattr(protocol, "PEERS_BUDGET_BYTES", 3 * len(protocol.compact_json(CARD)) + 300)
    first = net.run(clients["agent00"].peers())
    assert len(first["peers"]) == 3 and first["next"] == "agent02"
    everyone = net.run(clients["agent00"].all_peers())
    assert [p["agent"] for p in everyone["peers"]] == names and "next" not in everyone
    paths = [path for _, path in net.http.paths() if path.startswith("/peers")]
    assert paths[-3:] == ["/peers", "/peers?after=agent02", "/peers?after=agent05"]
