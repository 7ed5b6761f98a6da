"""``POST /v1/lease/renew`` (EXTENSIONS.md §1): a new deadline for a live lease, its checks
in order, and a waiting pull woken at the renewed deadline; and the renew of the v2/v3
wire (WIRE-V2).

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from relay.testing import START
from tests.support.api import assert_error, lease, two_agents
from tests.support.v2 import assert_v2_error, leased_request

# -- v1.2 (EXTENSIONS.md §1) ---------------------------------------------------------------


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


# -- the v2/v3 wire (WIRE-V2) --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_renew_extends_only_an_active_lease_of_the_caller(v2_broker):
    alpha, beta, request_id, message = await leased_request(v2_broker)
    token = message["lease_token"]
    assert_v2_error(await beta.renew(request_id, ""), 400, "bad_request")
    assert_v2_error(await beta.renew(request_id, "stale"), 409, "lease_mismatch")
    assert_v2_error(await alpha.renew(request_id, token), 409, "lease_mismatch")
    assert_v2_error(await beta.renew("unknown", token), 409, "lease_mismatch")
    v2_broker.advance(100)
    reply = await beta.renew(request_id, token, lease_seconds=5)
    assert reply.json == {"ok": True, "lease_until": START + 100 + 15}
    reply = await beta.renew(request_id, token)
    assert reply.json == {"ok": True, "lease_until": START + 100 + 600}
    assert (await beta.ack(request_id, lease_token=token)).code == 200
    assert_v2_error(await beta.renew(request_id, token), 409, "lease_mismatch")
