"""relay.testing's harness: its signed in-memory client serves through the broker's own
request class, under a plain twisted.web Site too, and its config signs with the shared
test secret."""

import pytest_twisted

from relay.testing import SECRET, make_api, make_config
from relay.wire.protocol import MAX_BODY_BYTES
from tests.support.api import sized_envelope


@pytest_twisted.ensureDeferred
async def test_signed_client_round_trip_and_body_limit():
    api, client, clock = make_api()
    assert (await client.post("beta", "/register", {}))[0] == 200
    status, body, _ = await client.post("alpha", "/messages", {"to": "beta", "body": {"t": "x"}})
    assert status == 201 and body["duplicate"] is False
    oversize = b'{"to":"beta","body":{"x":"' + b"a" * (1024 * 1024) + b'"}}'
    status, body, _ = await client.post("alpha", "/messages", raw=oversize)
    assert status == 400 and body["error"]["code"] == "bad_request"


@pytest_twisted.ensureDeferred
async def test_api_works_under_a_plain_site_body_limit_included():
    from relay.testing import make_api

    _, client, _ = make_api()
    for agent in ("alpha", "beta"):
        assert (await client.post(agent, "/register", {}))[0] == 200
    code, body, _ = await client.post("alpha", "/messages", {"to": "beta", "body": {"n": 1}})
    assert code == 201 and body["duplicate"] is False
    code, body, _ = await client.get("beta", "/messages?since=&limit=50")
    assert code == 200 and [m["body"] for m in body["messages"]] == [{"n": 1}]
    code, body, _ = await client.post("alpha", "/messages",
                                      raw=sized_envelope(MAX_BODY_BYTES + 1))
    assert (code, body["error"]["code"]) == (400, "bad_request")


def test_the_secret_of_the_tests_is_the_shared_one():
    assert make_config().secrets == (SECRET,)
