"""``POST /messages/<id>/ack``, the v1.0 receipt (seed §4): an ack envelope back to the
sender, only from the recipient, the id in the path as decoded, the routing ACL, and one
store operation.

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.support.api import Broker, assert_error, assert_json_headers, logged_store, two_agents

# -- v1.0 (seed §4) ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_receipt_stores_an_ack_envelope_for_the_sender():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1", ack=True)
    reply = await b.post("beta", "/messages/m1/ack", {"status": "ok"})
    assert reply.code == 201
    assert_json_headers(reply)
    assert reply.json["accepted"] is True
    (receipt,), _ = await b.poll("alpha")
    assert receipt["id"] == reply.json["id"]
    assert receipt["type"] == "ack" and receipt["replyTo"] == "m1"
    assert receipt["from"] == "beta" and receipt["to"] == "alpha"
    assert receipt["body"] == {"status": "ok"}


@pytest_twisted.ensureDeferred
async def test_receipt_with_error_status():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    reply = await b.post("beta", "/messages/m1/ack", {"status": "error", "error": "boom"})
    assert reply.code == 201
    (receipt,), _ = await b.poll("alpha")
    assert receipt["body"] == {"status": "error", "error": "boom"}


@pytest_twisted.ensureDeferred
async def test_receipt_with_empty_body_defaults_to_ok():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    assert (await b.post("beta", "/messages/m1/ack")).code == 201
    (receipt,), _ = await b.poll("alpha")
    assert receipt["body"] == {"status": "ok"}


@pytest_twisted.ensureDeferred
async def test_receipt_for_unknown_id_is_404():
    b = await two_agents()
    assert_error(await b.post("beta", "/messages/nope/ack", {"status": "ok"}),
                 404, "no_such_message")


@pytest_twisted.ensureDeferred
async def test_receipt_only_from_the_recipient():
    b = await two_agents()
    await b.register("gamma")
    await b.message("alpha", "beta", id="m1")
    assert_error(await b.post("gamma", "/messages/m1/ack", {}), 403, "forbidden")
    assert_error(await b.post("alpha", "/messages/m1/ack", {}), 403, "forbidden")
    assert (await b.poll("alpha"))[0] == []


@pytest.mark.parametrize("body", [{"status": "maybe"}, {"status": "error", "error": 5}, [],
                                  "ok"])
@pytest_twisted.ensureDeferred
async def test_receipt_rejects_malformed_bodies(body):
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    assert_error(await b.post("beta", "/messages/m1/ack", body), 400, "bad_request")
    assert (await b.poll("alpha"))[0] == []


@pytest_twisted.ensureDeferred
async def test_receipt_for_odd_ids():
    b = await two_agents()
    await b.message("alpha", "beta", id="with space")
    await b.message("alpha", "beta", id="a/b")
    assert (await b.post("beta", "/messages/with%20space/ack", {})).code == 201
    assert (await b.post("beta", "/messages/a/b/ack", {})).code == 201
    receipts, _ = await b.poll("alpha")
    assert sorted(r["replyTo"] for r in receipts) == ["a/b", "with space"]


@pytest_twisted.ensureDeferred
async def test_receipt_for_expired_message_is_404():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    b.clock.advance(8 * 86400)
    await b.broker.sweep_expired()
    assert_error(await b.post("beta", "/messages/m1/ack", {}), 404, "no_such_message")


@pytest_twisted.ensureDeferred
async def test_a_receipt_path_that_matches_only_once_decoded_stores_nothing():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    assert_error(await b.post("beta", "/messages/m1%2Fack", {}), 404, "not_found")
    assert (await b.poll("alpha"))[0] == [], "no receipt was stored"


@pytest_twisted.ensureDeferred
async def test_an_escaped_id_in_the_receipt_path_is_the_decoded_id():
    b = await two_agents()
    await b.message("alpha", "beta", id="sl/ash ü")
    reply = await b.post("beta", "/messages/sl%2Fash%20%C3%BC/ack", {})
    assert reply.code == 201, reply
    (receipt,), _ = await b.poll("alpha")
    assert receipt["replyTo"] == "sl/ash ü"


@pytest_twisted.ensureDeferred
async def test_a_receipt_is_one_store_operation():
    b = Broker(store=logged_store())
    await b.register("alpha", "beta")
    await b.message("alpha", "beta", id="m1")
    del b.store.operations[:]
    reply = await b.post("beta", "/messages/m1/ack", {"status": "ok"})
    assert reply.code == 201
    assert b.store.operations == ["settle"]
    del b.store.operations[:]
    assert_error(await b.post("alpha", "/messages/m1/ack", {"status": "ok"}), 403, "forbidden")
    assert_error(await b.post("beta", "/messages/m1/ack", {"status": "maybe"}), 400,
                 "bad_request")
    assert_error(await b.post("beta", "/messages/none/ack", {}), 404, "no_such_message")
    assert b.store.operations == ["settle"] * 3


# -- v1.1: the routing ACL -----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_acl_on_the_v10_ack_receipt():
    b = Broker(agents={"beta": {"allowed_targets": ["gamma"]}})
    await b.register("alpha", "beta", "gamma")
    await b.message("alpha", "beta", id="m1", ack=True)
    assert_error(await b.post("beta", "/messages/m1/ack", {"status": "ok"}), 403, "forbidden")
    assert (await b.poll("alpha"))[0] == [], "no receipt was stored"
