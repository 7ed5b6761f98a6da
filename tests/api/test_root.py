"""``GET /`` and ``GET /healthz``: the handshake of each wire, unsigned, and every
capability a broker advertises (seed §4, EXTENSIONS.md, REACH §11-§15, WIRE-V2).

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted

from relay import __version__
from relay.rules import delivery
from relay.testing import START, make_config
from tests.support.api import Broker, assert_json_headers
from tests.support.teams import human_broker
from tests.support.v2 import assert_v2_error, swept

# -- v1.0: GET / (seed §4) -----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_root_needs_no_auth_and_reports_the_protocol():
    b = Broker()
    reply = await b.get(None, "/")
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json["protocol"] == "1.0"
    assert reply.json["broker"] == "dsh-agent-relay"
    assert reply.json["version"] == __version__
    assert reply.json["storage"] == "memory"
    caps = reply.json["capabilities"]
    for name in ("leaseDelivery", "requestReply", "filteredQuery"):
        assert caps[name] is True


@pytest_twisted.ensureDeferred
async def test_root_ignores_auth_headers_even_when_wrong():
    b = Broker()
    reply = await b.get("alpha", "/", secret="wrong")
    assert reply.code == 200 and reply.json["protocol"] == "1.0"


@pytest_twisted.ensureDeferred
async def test_head_on_root_is_not_an_error():
    b = Broker()
    reply = await b.send("HEAD", "/")
    assert reply.code == 200


# -- v1.2: the extensions' capabilities (EXTENSIONS.md) ------------------------------------


@pytest_twisted.ensureDeferred
async def test_capabilities_are_advertised_as_listed():
    b = Broker(maxDeliveries=7, notifyFailures=False, messageTtlDays=2)
    capabilities = (await b.get(None, "/")).json["capabilities"]
    assert {key: capabilities[key] for key in (
        "leaseRenew", "ackOutcomes", "retryAfter", "deadLetters", "replyInAck", "pullFilter",
        "threads", "messageTtl", "delayedDelivery", "peerCards", "signedNonce")} == {
        "leaseRenew": True,
        "ackOutcomes": ["completed", "retry", "release", "reject"],
        "retryAfter": {"maxSeconds": 43200},
        "deadLetters": {"maxDeliveries": 7, "failureNotices": False},
        "replyInAck": True,
        "pullFilter": True,
        "threads": True,
        "messageTtl": {"maxSeconds": 172800},
        "delayedDelivery": {"maxSeconds": 86400},
        "peerCards": True,
        "signedNonce": {"required": False},
    }
    assert capabilities["leaseDelivery"] is True  # the v1.1 keys stay
    required = Broker(security={"requireNonce": True})
    assert (await required.get(None, "/")).json["capabilities"]["signedNonce"] == {
        "required": True}


# -- v1.3: events, groups, roles and priority, people (REACH §11, §13-§15) -----------------


@pytest_twisted.ensureDeferred
async def test_the_capability():
    b = Broker(eventRetentionSeconds=120)
    reply = await b.get(None, "/")
    assert reply.json["capabilities"]["events"] == {"retentionSeconds": 120,
                                                    "keepaliveSeconds": 15}


@pytest_twisted.ensureDeferred
async def test_capabilities_advertise_groups():
    assert (await Broker().get(None, "/")).json["capabilities"]["groups"] is True


@pytest_twisted.ensureDeferred
async def test_capabilities_advertise_roles_and_priority(role_broker):
    capabilities = (await role_broker.get(None, "/")).json["capabilities"]
    assert capabilities["roles"] is True
    assert capabilities["priority"] == {"max": 9}


@pytest_twisted.ensureDeferred
async def test_capabilities_name_the_inbox():
    reply = await human_broker().get(None, "/")
    assert reply.json["capabilities"]["humans"] == {"inbox": "/inbox/"}


# -- the v2/v3 wire: GET /healthz (WIRE-V2) ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_healthz_unsigned_names_the_broker_only(v2_broker):
    reply = await v2_broker.client("alpha").health()
    assert reply.code == 200
    assert reply.json == {"ok": True, "protocol_version": 3, "broker": "dsh-agent-relay",
                          "version": reply.json["version"], "storage": v2_broker.store.name,
                          "signature_schemes": ["v2", "v3"]}


@pytest_twisted.ensureDeferred
async def test_healthz_signed_adds_the_roster(v2_broker):
    alpha = v2_broker.client("alpha")
    await alpha.send_request("beta", "one")
    await v2_broker.client("beta").pull()
    reply = await alpha.health(signed=True)
    assert reply.code == 200
    assert reply.json["agents"] == ["alpha", "beta"]
    assert reply.json["queues"] == {
        "alpha": {"queued": 0, "leased": 0, "completed": 0, "failed": 0, "expired": 0,
                  "oldest_queued_at": None},
        "beta": {"queued": 0, "leased": 1, "completed": 0, "failed": 0, "expired": 0,
                 "oldest_queued_at": None}}
    assert set(reply.json["last_pull_at"]) == {"beta"}
    assert reply.json["counters"] == {"messages_created": 1, "pulls": 1}


@pytest_twisted.ensureDeferred
async def test_healthz_whose_signature_fails_is_the_public_answer(v2_brokers):
    """PROTOCOL-V2 §5: /healthz is liveness without auth. The reference's clients sign
    it and read a failure as "broker down" (the dsh plugin then starts a broker of its
    own, relay-agent.mjs exits): a bad signature, a stale timestamp, an unknown agent
    or key, an expired key or a locked agent get what an unsigned request gets."""
    alpha_secret, old_key = "alpha-secret-0123456789", "old-key-0123456789"
    broker = v2_brokers(config=make_config(agents={
        "alpha": {"secret": alpha_secret,
                  "keys": {"old": {"secret": old_key, "notAfter": START - 1}}},
        "beta": {"secret": "beta-secret-0123456789"}}))
    public = (await broker.client("alpha").health()).json
    assert "agents" not in public
    signed = await broker.client("alpha", alpha_secret).health(signed=True)
    assert signed.json["agents"] == ["alpha", "beta"]
    stale = int(broker.clock.seconds()) - 3600
    for client, timestamp in ((broker.client("alpha", "a-wrong-secret-0123"), None),
                              (broker.client("alpha", alpha_secret), stale),
                              (broker.client("nobody", alpha_secret), None),
                              (broker.client("alpha", alpha_secret, key_id="nope"), None),
                              (broker.client("alpha", old_key, key_id="old"), None)):
        reply = await client.request("GET", "/healthz", timestamp=timestamp)
        assert (reply.code, reply.json) == (200, public), (client.agent, client.key_id)
    wrong = broker.client("beta", "a-wrong-secret-0123")
    while (await wrong.request("POST", "/v1/recent", {})).code != 403:  # on any route
        pass
    beta = broker.client("beta", "beta-secret-0123456789")
    reply = await beta.health(signed=True)
    assert (reply.code, reply.json) == (200, public)
    assert_v2_error(await beta.request("POST", "/v1/recent", {}), 403, "locked")


@pytest_twisted.ensureDeferred
async def test_healthz_counts_each_agents_messages_in_every_state(v2_broker):
    alpha, beta = v2_broker.client("alpha"), v2_broker.client("beta")
    ids = [(await alpha.send_request("beta", f"m{n}", ttl_seconds=60)).json["message_id"]
           for n in range(4)]
    first, _, _ = await beta.pull(limit=3)
    assert (await beta.ack(ids[0], lease_token=first["lease_token"])).code == 200
    assert (await beta.ack(ids[1], outcome="retry")).code == 200
    v2_broker.advance(61)
    for message_id in ids[1:]:
        await swept(v2_broker, alpha, delivery.notice_id(message_id))
    reply = await alpha.health(signed=True)
    # ids[0] completed; ids[1] (released), ids[2] (leased), ids[3] (queued) expired
    assert reply.json["queues"]["beta"] == {"queued": 0, "leased": 0, "completed": 1,
                                            "failed": 0, "expired": 3,
                                            "oldest_queued_at": None}
    assert reply.json["queues"]["alpha"]["queued"] == 3  # the notices
    assert reply.json["counters"] == {"messages_created": 4, "pulls": 1}
