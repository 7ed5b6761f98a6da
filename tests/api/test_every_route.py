"""What every route of the main listener holds to, on both wires: a signed request
(seed §3, §6: signature over the query and the body, skew, lockout, rate limit,
per-agent secrets; EXTENSIONS.md §9 nonces; WIRE-V2 keys), ids bounded at 256
characters wherever they are read, and no route for any other path or method.

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from relay.testing import START, make_api, make_config
from relay.wire.protocol import MAX_BODY_BYTES
from relay.wire.signing import auth_headers
from tests.support.api import Broker, assert_error, refused, registered, two_agents
from tests.support.v2 import assert_v2_error

# -- signed requests (seed §3, §6) ---------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [("POST", "/register"), ("GET", "/peers"),
                                              ("POST", "/messages"), ("GET", "/messages"),
                                              ("POST", "/messages/x/ack"), ("POST", "/v1/pull"),
                                              ("POST", "/v1/ack"), ("POST", "/v1/status"),
                                              ("POST", "/v1/recent"),
                                              ("POST", "/v1/messages/query")])
@pytest_twisted.ensureDeferred
async def test_every_endpoint_but_root_needs_auth(method, path):
    b = await two_agents()
    assert_error(await b.send(method, path, b"{}"), 401, "unauthenticated")
    assert_error(await b.request("alpha", method, path, {}, secret="wrong"),
                 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_signature_covers_the_query_string():
    b = await two_agents()
    headers = b.signed_headers("beta", "GET", "/messages?limit=1", b"")
    assert_error(await b.send("GET", "/messages?limit=2", headers=headers),
                 401, "unauthenticated")
    assert (await b.send("GET", "/messages?limit=1", headers=headers)).code == 200


@pytest_twisted.ensureDeferred
async def test_signature_covers_the_body():
    b = await two_agents()
    headers = b.signed_headers("alpha", "POST", "/messages", b'{"to":"beta"}')
    assert_error(await b.send("POST", "/messages", b'{"to": "beta"}', headers),
                 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_skew_at_http_level():
    b = await two_agents()
    now = int(b.clock.seconds())
    assert (await b.get("alpha", "/peers", timestamp=now - 300)).code == 200
    assert (await b.get("alpha", "/peers", timestamp=now + 300)).code == 200
    assert_error(await b.get("alpha", "/peers", timestamp=now - 301), 401, "unauthenticated")
    assert_error(await b.get("alpha", "/peers", timestamp=now + 301), 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_lockout_at_http_level():
    b = await two_agents()
    for _ in range(5):
        assert_error(await b.get("alpha", "/peers", secret="wrong"), 401, "unauthenticated")
    assert_error(await b.get("alpha", "/peers"), 403, "locked")
    assert (await b.get("beta", "/peers")).code == 200, "only the failing agent is locked"
    b.clock.advance(300)
    assert (await b.get("alpha", "/peers")).code == 200


@pytest_twisted.ensureDeferred
async def test_rate_limit_at_http_level():
    b = Broker(rateLimitLoopback=3)
    for _ in range(2):
        assert (await b.post("alpha", "/register", {})).code == 200
    assert_error(await b.get("beta", "/peers", secret="wrong"), 401, "unauthenticated")
    assert_error(await b.post("alpha", "/register", {}), 429, "rate_limited")
    assert_error(await b.get("beta", "/nope"), 429, "rate_limited")
    assert_error(await b.get(None, "/"), 429, "rate_limited")
    b.clock.advance(120)
    assert (await b.post("alpha", "/register", {})).code == 200


@pytest_twisted.ensureDeferred
async def test_requests_refused_for_size_and_get_root_count_toward_the_limit():
    b = Broker(rateLimitLoopback=3)
    too_big = b"x" * (MAX_BODY_BYTES + 1)
    assert_error(await b.post("alpha", "/messages", raw=too_big), 400, "bad_request")
    assert (await b.get(None, "/")).code == 200
    assert_error(await b.post(None, "/messages", raw=too_big), 400, "bad_request")
    assert_error(await b.get(None, "/"), 429, "rate_limited")


@pytest_twisted.ensureDeferred
async def test_per_agent_secrets_and_unknown_agent():
    b = Broker(agents={"alpha": {"secret": "a-secret-0123456789"},
                       "beta": {"secret": "b-secret-0123456789"}})
    b.secrets.update(alpha="a-secret-0123456789", beta="b-secret-0123456789")
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/register", {}, secret="b-secret-0123456789"),
                 401, "unauthenticated")
    assert_error(await b.post("gamma", "/register", {}), 401, "unknown_agent")


@pytest_twisted.ensureDeferred
async def test_an_encoded_root_needs_authentication():
    b = Broker()
    assert_error(await b.send("GET", "/%2F"), 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_a_captured_request_with_a_nonce_cannot_be_replayed_or_reassigned():
    _, client, clock = make_api(security={"requireNonce": True})
    raw = json.dumps({"limit": 1}).encode()
    ts = int(clock.seconds())
    nonce = "n0nce-for-the-replay-test"

    def headers(agent: str, nonce: str):
        return dict(auth_headers(client.secret, agent, "POST", "/v1/pull", ts, raw, nonce),
                    **{"Content-Type": "application/json"})

    captured = headers("beta", nonce)
    assert (await client.request(None, "POST", "/v1/pull", raw=raw, headers=captured))[0] == 200
    code, body, _ = await client.request(None, "POST", "/v1/pull", raw=raw, headers=captured)
    assert (code, body["error"]["code"]) == (401, "unauthenticated"), "a replay"
    swapped = dict(headers("beta", "another-n0nce-value-1"), **{"X-Relay-Agent": "gamma"})
    assert (await client.request(None, "POST", "/v1/pull", raw=raw, headers=swapped))[0] == 401
    code, _, _ = await client.post("beta", "/v1/pull", {"limit": 1})
    assert code == 401, "requireNonce: a request without a nonce is refused"


# -- ids are bounded on every route --------------------------------------------------------


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


# -- no route (seed §6) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nope"), ("POST", "/nope"), ("GET", "/v1/nope"), ("DELETE", "/messages"),
     ("PUT", "/register"), ("GET", "/register"), ("POST", "/peers"), ("GET", "/v1/pull"),
     ("GET", "/messages/m1/ack"), ("POST", "/"), ("DELETE", "/"), ("GET", "/messages/"),
     ("POST", "/messages/m1"), ("PATCH", "/v1/ack"), ("GET", "/v1/status"),
     ("GET", "/%2F"), ("POST", "/v1/%70ull"), ("POST", "/%72egister"), ("GET", "//peers"),
     ("POST", "//messages"), ("POST", "//v1/pull"), ("POST", "//messages/m1/ack"),
     ("GET", "//"), ("POST", "/messages/m1%2Fack"), ("POST", "/messages/m1%2fack"),
     ("POST", "/messages%2Fm1/ack"), ("POST", "/messages/m1/%61ck"),
     ("POST", "/messages/m1/ack%2F")],
)
@pytest_twisted.ensureDeferred
async def test_unknown_route_or_wrong_method_is_404_not_found(method, path):
    b = await two_agents()
    raw = b"" if method in ("GET", "DELETE") else b"{}"
    reply = await b.request("alpha", method, path, raw=raw)
    assert_error(reply, 404, "not_found")
    assert method in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_head_on_a_signed_get_route_is_no_route():
    """A HEAD would run the poll and drop its page: no route, and the once-delivery
    of an expired lease (spec §5.1) is still there for the GET."""
    b = Broker()
    await b.register("alpha", "beta")
    sent = await b.message("alpha", "beta")
    _, cursor = await b.poll("beta")
    await b.pull("beta", leaseSeconds=1)
    b.advance(2)
    for path in (f"/messages?since={cursor}", "/peers"):
        reply = await b.request("beta", "HEAD", path)
        assert reply.code == 404 and not reply.raw, (path, reply)
    messages, _ = await b.poll("beta", f"?since={cursor}")
    assert [m["id"] for m in messages] == [sent]


# -- the v2/v3 wire (WIRE-V2) --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_unknown_routes_and_unsigned_requests(v2_broker):
    alpha = v2_broker.client("alpha")
    assert_v2_error(await alpha.request("POST", "/v1/thread", {}), 404, "not_found")
    assert_v2_error(await alpha.request("GET", "/v1/pull"), 404, "not_found")
    assert_v2_error(await alpha.request("POST", "/v1/pull", {}, signed=False,
                                        headers={"X-Agent-Relay-Agent": "alpha"}), 401,
                    "unauthenticated")
    assert_v2_error(await alpha.request("POST", "/v1/pull", {}, timestamp=int(START) - 301),
                    401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_v2_requests_count_toward_the_rate_limit(v2_brokers):
    broker = v2_brokers(rateLimitLoopback=3)
    alpha = broker.client("alpha")
    codes = [(await alpha.request("POST", "/v1/pull", {})).code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    assert (await alpha.health()).code == 429


@pytest_twisted.ensureDeferred
async def test_v3_signs_with_a_key_of_the_keyring(v2_brokers):
    broker = v2_brokers(config=make_config(agents={
        "alpha": {"secret": "alpha-secret-0123456789",
                  "keys": {"k2": {"secret": "second-key-0123456789"},
                           "old": {"secret": "old-key-0123456789", "notAfter": START - 1}}},
        "beta": {"secret": "beta-secret-0123456789"}}))
    v3 = broker.client("alpha", "second-key-0123456789", key_id="k2")
    assert (await v3.send_request("beta", "v3")).code == 200
    legacy = broker.client("alpha", "alpha-secret-0123456789", key_id="legacy")
    assert (await legacy.send_request("beta", "v3 legacy")).code == 200
    v2 = broker.client("alpha", "alpha-secret-0123456789")
    assert (await v2.send_request("beta", "v2")).code == 200
    assert_v2_error(await broker.client("alpha", "old-key-0123456789", key_id="old").request(
        "POST", "/v1/pull", {}), 401, "unknown_key")
    assert_v2_error(await broker.client("alpha", "x", key_id="nope").request(
        "POST", "/v1/pull", {}), 401, "unknown_key")
    assert_v2_error(await broker.client("zed", "x").request("POST", "/v1/pull", {}), 401,
                    "unknown_agent")
    beta = broker.client("beta", "beta-secret-0123456789")
    assert [m["body"] for m in await beta.pull()] == ["v3", "v3 legacy", "v2"]


@pytest_twisted.ensureDeferred
async def test_paths_werkzeug_would_bend_are_no_route(v2_brokers):
    broker = v2_brokers()
    alpha = broker.client("alpha")
    assert_v2_error(await alpha.request("POST", "//v1/pull", {}), 404, "not_found")
    assert_v2_error(await alpha.request("POST", "/v1/pull", {}, signed=False, headers={
        "X-Agent-Relay-Agent": "alpha"}), 401, "unauthenticated")



@pytest_twisted.ensureDeferred
async def test_an_integer_beyond_a_double_is_400_as_1e400_is(v2_broker):
    """``10**400`` written out is refused like ``1e400`` (docs/PROTOCOL.md, JSON), on
    both wires: stored it would be Infinity to a JavaScript reader, and the v2 wire's
    ``Number()`` reading raised on it (a 503)."""
    alpha = v2_broker.client("alpha")
    huge = "1" + "0" * 400
    for text in (huge, "-" + huge, "1e400"):
        for path, raw in (
                ("/v1/pull", '{"limit":%s}'), ("/v1/pull", '{"lease_seconds":%s}'),
                ("/v1/messages/query", '{"since":%s}'), ("/v1/messages/query", '{"limit":%s}'),
                ("/v1/recent", '{"limit":%s}'), ("/v1/admin/status", '{"limit":%s}'),
                ("/v1/lease/renew", '{"message_id":"m","lease_token":"t","lease_seconds":%s}'),
                ("/v1/messages", '{"origin":"alpha","target":"beta","kind":"request",'
                                 '"body":"b","idempotency_key":"k","ttl_seconds":%s}')):
            reply = await alpha.request("POST", path, raw=(raw % text).encode())
            assert_v2_error(reply, 400, "bad_request")
    b = await two_agents()
    reply = await b.request("alpha", "POST", "/messages",
                            raw=b'{"to":"beta","body":{"n":' + huge.encode() + b"}}")
    assert_error(reply, 400, "bad_request")
    assert "double" in reply.json["error"]["message"]
    just_in = str(int(1.7e308))
    assert (await b.request("alpha", "POST", "/messages",
                            raw=b'{"to":"beta","body":{"n":' + just_in.encode() + b"}}")
            ).code == 201
