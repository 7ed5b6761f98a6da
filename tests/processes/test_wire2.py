"""The v2/v3 wire through the real ``twistd -n relay`` process: the reference's wire
and the seed wire on one listener and one store, across restarts and SIGKILL."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, List

import pytest
import pytest_twisted

from tests.support.processes import BrokerProcess
from tests.support.v2_client import V2Client

pytestmark = pytest.mark.process

PERSISTENT = ("sqlite", "jsonl")


def started(tmp_path, **broker: Any) -> BrokerProcess:
    return BrokerProcess(str(tmp_path), **broker).start()


def client(broker: BrokerProcess, agent: str, key_id=None) -> V2Client:
    return V2Client(broker.url, agent, broker.secret, key_id)


@pytest.fixture
def brokers():
    running: List[BrokerProcess] = []
    yield running
    for broker in running:
        broker.kill()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("storage", ("memory",) + PERSISTENT)
async def test_a_conversation_across_the_wires(tmp_path, brokers, storage):
    broker = started(tmp_path, storage=storage)
    brokers.append(broker)
    with urllib.request.urlopen(broker.url + "/healthz", timeout=5) as answer:
        health = json.loads(answer.read())
    assert health["protocol_version"] == 3 and "agents" not in health
    alpha = client(broker, "alpha", key_id="legacy")  # v3
    sent = await alpha.send_request("beta", "question", topic="t")
    assert sent.code == 200, sent
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    code, pulled = broker.request("beta", "POST", "/v1/pull", {})
    (seen,) = pulled["messages"]
    assert seen["id"] == sent.json["message_id"] and seen["body"]["text"] == "question"
    code, acked = broker.request("beta", "POST", "/v1/ack", {
        "messageId": seen["id"], "leaseId": seen["leaseId"], "outcome": "completed",
        "reply": {"id": "answer-1", "body": {"text": "answer"}}})
    assert code == 200, acked
    (answer,) = await alpha.pull()
    assert (answer["body"], answer["parent_id"]) == ("answer", seen["id"])
    assert (await alpha.ack("answer-1", lease_token=answer["lease_token"])).code == 200
    # and the other way: the seed agent asks, a v2 agent (no key id) answers
    code, _ = broker.request("beta", "POST", "/messages",
                             {"id": "ask-2", "to": "alpha", "kind": "request",
                              "body": {"text": "yours?"}})
    assert code == 201
    v2 = client(broker, "alpha")
    (asked,) = await v2.pull()
    assert asked["body"] == "yours?"
    assert (await v2.send_reply("ask-2", "beta", "mine")).code == 200
    assert (await v2.ack("ask-2")).code == 200
    code, pulled = broker.request("beta", "POST", "/v1/pull", {})
    assert [m["body"]["text"] for m in pulled["messages"]] == ["mine"]
    code, statuses = broker.request("beta", "POST", "/v1/status", {"messageIds": ["ask-2"]})
    assert statuses["messages"][0]["status"] == "done"
    signed = await alpha.health(signed=True)
    assert signed.json["agents"] == ["alpha", "beta"]
    assert broker.stop() in (0, -15)
    assert "question" not in broker.log() and "yours?" not in broker.log()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("storage", PERSISTENT)
async def test_nothing_acknowledged_is_lost_on_restart_or_sigkill(tmp_path, brokers, storage):
    broker = started(tmp_path, storage=storage)
    brokers.append(broker)
    alpha, beta = client(broker, "alpha"), client(broker, "beta")
    ids = []
    for n in range(5):
        reply = await alpha.send_request("beta", f"m{n}", execution_mode="continue",
                                         session_ref="s", context="c")
        assert reply.code == 200
        ids.append(reply.json["message_id"])
    (first,) = await beta.pull(limit=1)
    assert (await beta.ack(first["message_id"], lease_token=first["lease_token"])).code == 200
    (held,) = await beta.pull(limit=1, lease_seconds=15)
    assert broker.stop() in (0, -15)
    broker.start()
    (entry,) = await alpha.status(ids[0])
    assert entry["status"] == "completed"
    again = await alpha.send_request("beta", "m0", idempotency_key="after-restart")
    assert again.json["created"] is True
    broker.kill()  # SIGKILL: every answered send and ack must survive
    broker.start()
    statuses = {e["message_id"]: e["status"] for e in await alpha.status(*ids)}
    assert statuses[ids[0]] == "completed" and statuses[held["message_id"]] == "leased"
    assert [statuses[i] for i in ids[2:]] == ["queued"] * 3
    rest = await beta.pull()
    assert [m["body"] for m in rest] == ["m2", "m3", "m4", "m0"]
    assert {(m["execution_mode"], m["session_ref"], m["context"]) for m in rest[:3]} == {
        ("continue", "s", "c")}
    repeat = await alpha.send_request("beta", "m0", idempotency_key="after-restart")
    assert (repeat.json["created"], repeat.json["message_id"]) == (
        False, again.json["message_id"])


@pytest_twisted.ensureDeferred
async def test_v2_failures_lock_the_agent_as_seed_failures_do(tmp_path, brokers):
    broker = BrokerProcess(str(tmp_path))
    with open(broker.config_path, "a") as config:
        config.write("security:\n  lockAfterFailures: 3\n")
    broker.start()
    brokers.append(broker)
    wrong = V2Client(broker.url, "alpha", "not-the-secret")
    codes = [(await wrong.request("POST", "/v1/pull", {})).code for _ in range(4)]
    assert codes == [401, 401, 401, 403]
    right = client(broker, "alpha")
    assert (await right.request("POST", "/v1/pull", {})).error_code == "locked"
    assert broker.request("alpha", "POST", "/v1/pull", {})[0] == 403  # on the seed wire too


def test_the_main_listener_answers_healthz_unsigned_only_with_the_basics(tmp_path, brokers):
    broker = started(tmp_path)
    brokers.append(broker)
    with urllib.request.urlopen(broker.url + "/healthz", timeout=5) as answer:
        assert set(json.loads(answer.read())) == {
            "ok", "protocol_version", "broker", "version", "storage", "signature_schemes"}
    assert broker.request("alpha", "GET", "/healthz")[0] == 404  # seed-signed: as before
    assert os.path.exists(broker.config_path)


@pytest.mark.postgres
@pytest_twisted.ensureDeferred
async def test_two_brokers_on_one_postgresql_serve_both_wires(tmp_path):
    from tests.processes.test_postgres_scaleout import start_pair

    a, b = start_pair(tmp_path, leaseSeconds=30)
    try:
        alpha_on_a, beta_on_b = client(a, "alpha"), client(b, "beta", key_id="legacy")
        first = await alpha_on_a.send_request("beta", "via a", idempotency_key="shared-key")
        # the same (origin, key) through the other broker finds the same message
        again = await client(b, "alpha").send_request("beta", "via b",
                                                      idempotency_key="shared-key")
        assert again.json == dict(first.json, created=False)
        (message,) = await beta_on_b.pull()
        assert await client(a, "beta").pull() == []  # leased once, fleet-wide
        assert (await beta_on_b.send_reply(message["message_id"], "alpha", "back")).code == 200
        assert (await client(a, "beta").ack(message["message_id"],
                                            lease_token=message["lease_token"])).code == 200
        assert b.request("gamma", "POST", "/register", {})[0] == 200
        code, sent = a.request("gamma", "POST", "/messages",
                               {"to": "alpha", "kind": "request", "body": {"text": "seed"}})
        assert code == 201, sent
        bodies = sorted(m["body"] for m in await client(b, "alpha").pull())
        assert bodies == ["back", "seed"]
        (entry,) = await alpha_on_a.status(message["message_id"])
        assert entry["status"] == "completed"
    finally:
        a.kill()
        b.kill()
