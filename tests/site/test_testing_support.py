"""relay.testing's signed in-memory client serves through the broker's own request class."""

import pytest_twisted

from relay.testing import make_api


@pytest_twisted.ensureDeferred
async def test_signed_client_round_trip_and_body_limit():
    api, client, clock = make_api()
    assert (await client.post("beta", "/register", {}))[0] == 200
    status, body, _ = await client.post("alpha", "/messages", {"to": "beta", "body": {"t": "x"}})
    assert status == 201 and body["duplicate"] is False
    oversize = b'{"to":"beta","body":{"x":"' + b"a" * (1024 * 1024) + b'"}}'
    status, body, _ = await client.post("alpha", "/messages", raw=oversize)
    assert status == 400 and body["error"]["code"] == "bad_request"
