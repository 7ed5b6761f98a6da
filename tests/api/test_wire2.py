"""The v2/v3 wire (WIRE-V2, the reference's PROTOCOL-V2 §5) in memory, on every backend:
each endpoint's good and bad requests, and conversations across the two wires."""

from __future__ import annotations

import pytest
import pytest_twisted

from relay.rules import delivery
from relay.testing import SECRET, START, make_config
from relay.wire.v2 import views
from tests.support.v2 import V2Broker


@pytest.fixture
def broker(store):
    b = V2Broker(store=store)
    yield b
    b.stop()


@pytest.fixture
def memory_broker():
    def make(**kw):
        made.append(V2Broker(**kw))
        return made[-1]

    made = []
    yield make
    for b in made:
        b.stop()


def assert_error(reply, status: int, code: str) -> None:
    assert reply.code == status, reply
    assert set(reply.json) == {"error"} and set(reply.json["error"]) == {"code", "message"}
    assert reply.json["error"]["code"] == code, reply
    assert reply.json["error"]["message"]


async def swept(broker, client, message_id: str, stored: bool = True) -> None:
    """Sweep, and wait until ``message_id`` is stored (or gone): on PostgreSQL a sweep
    the clock started may hold the rows (SKIP LOCKED) until its commit."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    await broker.broker.sweep_expired()
    for _ in range(500):
        (entry,) = await client.status(message_id)
        if (entry["status"] != "not_found") == stored:
            return
        await deferLater(reactor, 0.01)
    raise AssertionError(f"{message_id} is {'not ' if stored else ''}stored")


async def leased_request(broker, sender="alpha", to="beta", body="hello", **fields):
    a, b = broker.client(sender), broker.client(to)
    sent = await a.send_request(to, body, **fields)
    assert sent.code == 200, sent
    (message,) = await b.pull()
    return a, b, sent.json["message_id"], message


# -- GET /healthz ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_healthz_unsigned_names_the_broker_only(broker):
    reply = await broker.client("alpha").health()
    assert reply.code == 200
    assert reply.json == {"ok": True, "protocol_version": 3, "broker": "dsh-agent-relay",
                          "version": reply.json["version"], "storage": broker.store.name,
                          "signature_schemes": ["v2", "v3"]}


@pytest_twisted.ensureDeferred
async def test_healthz_signed_adds_the_roster(broker):
    alpha = broker.client("alpha")
    await alpha.send_request("beta", "one")
    await broker.client("beta").pull()
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
    assert_error(await broker.client("alpha", secret="nope").health(signed=True), 401,
                 "unauthenticated")


# -- POST /v1/messages -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_send_is_idempotent_per_sender_and_key(broker):
    alpha = broker.client("alpha")
    first = await alpha.send_request("beta", "hello", idempotency_key="k-1")
    assert first.code == 200
    assert first.json == {"message_id": views.message_id_for("alpha", "k-1"), "created": True,
                          "protocol_version": 3}
    again = await alpha.send_request("beta", "other text", idempotency_key="k-1")
    assert again.json == dict(first.json, created=False)
    other = await broker.client("gamma").send_request("beta", "hello", idempotency_key="k-1")
    assert other.json["created"] is True and other.json["message_id"] != first.json[
        "message_id"]
    assert len(await broker.client("beta").pull()) == 2


@pytest_twisted.ensureDeferred
async def test_send_refusals(broker):
    alpha = broker.client("alpha")
    base = alpha.request_payload("beta", "hello")
    cases = [
        (dict(base, origin="gamma"), 403, "forbidden"),
        (dict(base, kind="note"), 400, "bad_request"),
        (dict(base, body="   "), 400, "bad_request"),
        (dict(base, body="x" * 48001), 400, "bad_request"),
        (dict(base, idempotency_key=""), 400, "bad_request"),
        (dict(base, allow_shared_write="yes"), 400, "bad_request"),
        (dict(base, execution_mode="admin"), 400, "bad_request"),
        (dict(base, execution_mode="write"), 403, "forbidden"),
        (dict(base, kind="reply"), 400, "bad_request"),
        (dict(base, kind="reply", parent_id="nope"), 404, "no_such_message"),
        (dict(base, target="no such agent!"), 400, "bad_request"),
        (dict(base, body={"text": "an object"}), 400, "bad_request"),
    ]
    for payload, status, code in cases:
        assert_error(await alpha.request("POST", "/v1/messages", payload), status, code)
    for raw in (b"", b"not json", b"[1]", b"{"):
        assert_error(await alpha.request("POST", "/v1/messages", raw=raw), 400, "bad_request")
    assert await broker.client("beta").pull() == []


@pytest_twisted.ensureDeferred
async def test_send_limits_and_clamps(broker):
    alpha = broker.client("alpha")
    longest = "😀" * 48000  # code points, not UTF-16 units nor bytes
    assert (await alpha.send_request("beta", longest)).code == 200
    short = await alpha.send_request("beta", "ttl", ttl_seconds=5, topic="t" * 300,
                                     session_ref="s" * 400)
    long = await alpha.send_request("beta", "ttl", ttl_seconds=10**9)
    default = await alpha.send_request("beta", "ttl", ttl_seconds="soon")
    pulled = {m["message_id"]: m for m in await broker.client("beta").pull()}
    assert pulled[short.json["message_id"]]["expires_at"] == START + 60
    assert len(pulled[short.json["message_id"]]["topic"]) == 200
    assert len(pulled[short.json["message_id"]]["session_ref"]) == 300
    assert pulled[long.json["message_id"]]["expires_at"] == START + 3600
    assert pulled[default.json["message_id"]]["expires_at"] == START + 3600
    (first,) = [m for m in pulled.values() if m["body"] == longest]
    assert first["execution_mode"] == "read"


@pytest_twisted.ensureDeferred
async def test_a_reply_inherits_from_its_request(broker):
    alpha, beta, request_id, message = await leased_request(
        broker, execution_mode="continue", session_ref="s-1", topic="plans", context="c",
        root_id="root-given")
    assert (message["root_id"], message["context"], message["topic"]) == (
        "root-given", "c", "plans")
    assert_error(await broker.client("gamma").send_reply(request_id, "alpha", "x"), 403,
                 "forbidden")
    assert_error(await beta.send_reply(request_id, "gamma", "x"), 403, "forbidden")
    reply = await beta.send_reply(request_id, "alpha", "done", topic="ignored",
                                  execution_mode="write", allow_shared_write=True)
    assert reply.code == 200
    (answer,) = await alpha.pull()
    assert answer == {
        "message_id": reply.json["message_id"], "root_id": "root-given",
        "parent_id": request_id, "origin": "beta", "target": "alpha", "kind": "reply",
        "body": "done", "session_ref": "s-1", "created_at": START,
        "expires_at": START + 3600, "execution_mode": "continue", "topic": "plans",
        "lease_token": answer["lease_token"], "lease_until": START + 600}


@pytest_twisted.ensureDeferred
async def test_write_mode_is_closed_unless_granted(memory_broker):
    broker = memory_broker(config=make_config(agents={
        "alpha": {"allowed_targets": ["beta"], "allowed_write_targets": ["beta"]},
        "beta": {"allowed_targets": ["alpha"]}}))
    alpha, beta = broker.client("alpha"), broker.client("beta")
    assert (await alpha.send_request("beta", "w", execution_mode="write",
                                     allow_shared_write=True)).code == 200
    assert_error(await alpha.send_request("gamma", "r"), 403, "forbidden")
    assert_error(await beta.send_request("alpha", "w", execution_mode="write"), 403,
                 "forbidden")
    assert (await beta.send_request("alpha", "c", execution_mode="continue")).code == 200
    (message,) = await beta.pull()
    assert message["allow_shared_write"] is True and message["execution_mode"] == "write"


# -- POST /v1/pull -------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pull_clamps_its_limit_and_lease(broker):
    alpha, beta = broker.client("alpha"), broker.client("beta")
    for n in range(10):
        await alpha.send_request("beta", f"m{n}")
    first = await beta.pull(limit=50, lease_seconds=1)
    assert [m["body"] for m in first] == [f"m{n}" for n in range(8)]
    assert {m["lease_until"] for m in first} == {START + 15}
    second = await beta.pull(limit=0, lease_seconds=10**6)
    assert [m["body"] for m in second] == ["m8"] and second[0]["lease_until"] == START + 3600
    assert [m["body"] for m in await beta.pull(limit="2")] == ["m9"]
    assert await beta.pull() == []
    for body, code in (({"limit": "many"}, 400), ({"lease_seconds": "long"}, 400),
                       ({"agent": "alpha"}, 403)):
        reply = await beta.request("POST", "/v1/pull", body)
        assert reply.code == code, reply


@pytest_twisted.ensureDeferred
async def test_a_lapsed_lease_is_pulled_again_with_one_more_attempt(broker):
    alpha, beta, request_id, message = await leased_request(broker)
    broker.advance(601)
    (again,) = await beta.pull()
    assert again["message_id"] == request_id and again["lease_token"] != message["lease_token"]
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("leased", 2)


# -- POST /v1/ack and /v1/lease/renew ---------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ack_with_and_without_the_lease_token(broker):
    alpha, beta, request_id, message = await leased_request(broker)
    assert_error(await beta.ack(request_id, lease_token="stale"), 409, "lease_mismatch")
    assert_error(await alpha.ack(request_id), 403, "forbidden")
    assert_error(await beta.ack("unknown-id"), 403, "forbidden")
    assert_error(await beta.ack(""), 400, "bad_request")
    assert_error(await beta.ack(request_id, outcome="maybe"), 400, "bad_request")
    assert_error(await beta.ack(request_id, agent="alpha"), 403, "forbidden")
    reply = await beta.ack(request_id, lease_token=message["lease_token"])
    assert (reply.code, reply.json) == (200, {"ok": True})
    assert_error(await beta.ack(request_id), 400, "bad_request")  # not leased any more
    assert_error(await beta.ack(request_id, lease_token=message["lease_token"]), 409,
                 "lease_mismatch")
    (entry,) = await alpha.status(request_id)
    assert entry["status"] == "completed"


@pytest_twisted.ensureDeferred
async def test_retry_requeues_then_fails_with_a_notice(memory_broker):
    broker = memory_broker(maxDeliveries=2)
    alpha, beta, request_id, message = await leased_request(broker)
    assert (await beta.ack(request_id, outcome="retry", error="e" * 400)).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["last_error"]) == ("queued", "e" * 300)
    (again,) = await beta.pull()
    assert (await beta.ack(request_id, outcome="retry", error="gave up")).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("failed", 2)
    (notice,) = await alpha.pull()
    assert notice["message_id"] == delivery.notice_id(request_id)
    assert notice["kind"] == "reply" and notice["parent_id"] == request_id
    assert notice["body"].startswith("[Relay] Your relay message was not delivered")
    assert "attempts: 2/2" in notice["body"] and "hello" in notice["body"]


@pytest_twisted.ensureDeferred
async def test_a_retry_fails_a_request_pulled_max_attempts_times(memory_broker):
    """The reference's rule (store-v2.js; its lifecycle test with maxAttempts 1): the
    pull counted the attempt, so a retry of a message pulled maxAttempts times fails it."""
    broker = memory_broker(maxAttempts=1)
    alpha, beta, request_id, _ = await leased_request(broker)
    assert (await beta.ack(request_id, outcome="retry", error="no")).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("failed", 1)
    (notice,) = await alpha.pull()
    assert "attempts: 1/1" in notice["body"]


@pytest_twisted.ensureDeferred
async def test_the_third_retry_fails_by_default(memory_broker):
    broker = memory_broker()
    alpha, beta, request_id, _ = await leased_request(broker)
    for _ in range(2):
        assert (await beta.ack(request_id, outcome="retry")).code == 200
        (entry,) = await alpha.status(request_id)
        assert entry["status"] == "queued"
        (again,) = await beta.pull()
        assert again["message_id"] == request_id
    assert (await beta.ack(request_id, outcome="retry")).code == 200
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["attempts"]) == ("failed", 3)
    (notice,) = await alpha.pull()
    assert "attempts: 3/3" in notice["body"]


@pytest_twisted.ensureDeferred
async def test_a_role_member_on_the_v2_wire_holds_renews_and_acks_a_role_message(
        memory_broker):
    """REACH §13 on the v2 wire: a member's pull leases from its roles, and only the
    member holding the lease renews or acks it."""
    broker = memory_broker(agents={"alpha": {}, "dan": {}, "erin": {}},
                           roles={"triage": {"members": ["dan", "erin"]}})
    await broker.register("alpha")
    message_id = await broker.message("alpha", "role:triage", kind="request")
    dan, erin = broker.client("dan"), broker.client("erin")
    (leased,) = await dan.pull()
    assert leased["message_id"] == message_id and leased["lease_token"]
    token = leased["lease_token"]
    assert (await dan.renew(message_id, token)).code == 200
    assert_error(await erin.ack(message_id, lease_token=token), 403, "forbidden")
    (seen,) = await dan.status(message_id)
    assert seen["status"] == "leased"
    assert (await dan.ack(message_id, lease_token=token)).code == 200
    (entry,) = await broker.status("alpha", message_id)
    assert (entry["status"], entry["completedBy"]) == ("done", "dan")


@pytest_twisted.ensureDeferred
async def test_renew_extends_only_an_active_lease_of_the_caller(broker):
    alpha, beta, request_id, message = await leased_request(broker)
    token = message["lease_token"]
    assert_error(await beta.renew(request_id, ""), 400, "bad_request")
    assert_error(await beta.renew(request_id, "stale"), 409, "lease_mismatch")
    assert_error(await alpha.renew(request_id, token), 409, "lease_mismatch")
    assert_error(await beta.renew("unknown", token), 409, "lease_mismatch")
    broker.advance(100)
    reply = await beta.renew(request_id, token, lease_seconds=5)
    assert reply.json == {"ok": True, "lease_until": START + 100 + 15}
    reply = await beta.renew(request_id, token)
    assert reply.json == {"ok": True, "lease_until": START + 100 + 600}
    assert (await beta.ack(request_id, lease_token=token)).code == 200
    assert_error(await beta.renew(request_id, token), 409, "lease_mismatch")


# -- reads ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_status_recent_and_query(broker):
    alpha, beta = broker.client("alpha"), broker.client("beta")
    one = (await alpha.send_request("beta", "one", topic="alpha-topic")).json["message_id"]
    broker.advance(1)
    two = (await alpha.send_request("beta", "two")).json["message_id"]
    broker.advance(1)
    theirs = (await broker.client("gamma").send_request("beta", "x")).json["message_id"]
    entries = await alpha.status(one, theirs, "nope", "")
    assert [e["status"] for e in entries] == ["queued", "not_found", "not_found"]
    assert set(entries[0]) == {"message_id", "origin", "target", "kind", "status",
                               "attempts", "last_error", "created_at", "expires_at",
                               "completed_at", "topic"}
    assert entries[0]["topic"] == "alpha-topic"
    assert len(await alpha.status(*[one] * 150)) == 100
    assert_error(await alpha.request("POST", "/v1/status", {"message_ids": "x"}), 400,
                 "bad_request")
    recent = await alpha.recent()
    assert [e["message_id"] for e in recent] == [two, one] and "body" not in recent[0]
    assert [e["message_id"] for e in await alpha.recent(limit=1)] == [two]
    found = await alpha.query(topic="alpha")
    assert [(e["message_id"], e["body"]) for e in found] == [(one, "one")]
    assert [e["message_id"] for e in await alpha.query(since=START + 1)] == [two]
    assert [e["message_id"] for e in await alpha.query(message_id=theirs)] == []
    assert [e["message_id"] for e in await beta.query(origin="gamma")] == [theirs]
    assert [e["message_id"] for e in await beta.query(status="completed")] == []
    assert len(await beta.query(kind="request", limit=2)) == 2
    assert_error(await alpha.request("POST", "/v1/messages/query", {"since": "yesterday"}),
                 400, "bad_request")
    assert_error(await alpha.request("POST", "/v1/recent", {"agent": "beta"}), 403,
                 "forbidden")


@pytest_twisted.ensureDeferred
async def test_the_completion_time_is_shown_in_epoch_seconds(memory_broker):
    broker = memory_broker(maxAttempts=1)
    alpha, beta, done_id, message = await leased_request(broker)
    failing = (await alpha.send_request("beta", "fails")).json["message_id"]
    (entry,) = await alpha.status(done_id)
    assert (entry["status"], entry["completed_at"]) == ("leased", None)
    broker.advance(12.5)
    assert (await beta.ack(done_id, lease_token=message["lease_token"])).code == 200
    (other,) = await beta.pull()
    broker.advance(1)
    assert (await beta.ack(failing, outcome="retry", error="no")).code == 200
    done, failed = await alpha.status(done_id, failing)
    assert (done["status"], done["completed_at"]) == ("completed", START + 12.5)
    assert (failed["status"], failed["completed_at"]) == ("failed", START + 13.5)
    recent = {e["message_id"]: e["completed_at"] for e in await alpha.recent()}
    assert (recent[failing], recent[done_id]) == (START + 13.5, START + 12.5)
    (found,) = await alpha.query(message_id=done_id)
    assert found["completed_at"] == START + 12.5


@pytest_twisted.ensureDeferred
async def test_an_expired_request_reads_expired_on_v2_and_is_gone_on_the_seed_wire(broker):
    alpha, beta = broker.client("alpha"), broker.client("beta")
    late = (await alpha.send_request("beta", "too late", ttl_seconds=60)).json["message_id"]
    await broker.register("alpha")
    broker.advance(61)  # (which starts the broker's own sweeps, too)
    (entry,) = await alpha.status(late)
    assert (entry["status"], entry["completed_at"]) == ("expired", None)  # swept or not
    await swept(broker, alpha, delivery.notice_id(late))
    (entry,) = await alpha.status(late)
    assert (entry["status"], entry["attempts"], entry["expires_at"]) == (
        "expired", 0, START + 60)
    assert await broker.status("alpha", late) == [
        {"id": late, "status": "not_found", "attempts": 0}]  # the seed wire's answer
    assert (await broker.get("alpha", f"/messages/{late}")).code == 404
    assert [e["message_id"] for e in await alpha.query(status="expired")] == [late]
    assert [e["message_id"] for e in await alpha.recent()] == [delivery.notice_id(late), late]
    (stuck,) = await beta.admin_status()
    assert (stuck["message_id"], stuck["status"]) == (late, "expired")
    (notice,) = await alpha.pull()
    assert notice["parent_id"] == late and "expired in the queue" in notice["body"]
    # the recipient puts it back: it lives its TTL again and is delivered
    assert (await beta.requeue(late)).json == {"ok": True, "message_id": late}
    (again,) = await beta.pull()
    assert (again["message_id"], again["expires_at"]) == (late, START + 61 + 60)
    assert (await beta.ack(late, lease_token=again["lease_token"])).code == 200
    (entry,) = await alpha.status(late)
    assert (entry["status"], entry["completed_at"]) == ("completed", START + 61)


@pytest_twisted.ensureDeferred
async def test_healthz_counts_each_agents_messages_in_every_state(broker):
    alpha, beta = broker.client("alpha"), broker.client("beta")
    ids = [(await alpha.send_request("beta", f"m{n}", ttl_seconds=60)).json["message_id"]
           for n in range(4)]
    first, _, _ = await beta.pull(limit=3)
    assert (await beta.ack(ids[0], lease_token=first["lease_token"])).code == 200
    assert (await beta.ack(ids[1], outcome="retry")).code == 200
    broker.advance(61)
    for message_id in ids[1:]:
        await swept(broker, alpha, delivery.notice_id(message_id))
    reply = await alpha.health(signed=True)
    # ids[0] completed; ids[1] (released), ids[2] (leased), ids[3] (queued) expired
    assert reply.json["queues"]["beta"] == {"queued": 0, "leased": 0, "completed": 1,
                                            "failed": 0, "expired": 3,
                                            "oldest_queued_at": None}
    assert reply.json["queues"]["alpha"]["queued"] == 3  # the notices
    assert reply.json["counters"] == {"messages_created": 4, "pulls": 1}


@pytest_twisted.ensureDeferred
async def test_terminal_v2_messages_are_kept_past_their_ttl_until_retention(broker):
    alpha, beta, request_id, message = await leased_request(broker)
    assert (await beta.ack(request_id, lease_token=message["lease_token"])).code == 200
    broker.advance(3601)
    await swept(broker, alpha, request_id)
    (entry,) = await alpha.status(request_id)
    assert (entry["status"], entry["completed_at"]) == ("completed", START)
    assert_error(await beta.requeue(request_id), 403, "forbidden")  # completed
    assert await broker.status("alpha", request_id) == [
        {"id": request_id, "status": "not_found", "attempts": 0}]
    broker.advance(7 * 86400)  # messageTtlDays
    await swept(broker, alpha, request_id, stored=False)


@pytest_twisted.ensureDeferred
async def test_query_answers_up_to_its_limit_however_many_newer_messages_differ(broker):
    alpha = broker.client("alpha")
    wanted = [(await alpha.send_request("beta", f"needle {n}", topic="needle")).json[
        "message_id"] for n in range(3)]
    for n in range(205):
        assert (await alpha.send_request("beta", f"hay {n}")).code == 200
    found = await alpha.query(topic="needle", limit=3)
    assert [e["message_id"] for e in found] == wanted[::-1]
    assert len(await alpha.query(kind="request", limit=100)) == 100
    assert [e["message_id"] for e in await alpha.query(topic="needle", status="queued",
                                                       limit=2)] == wanted[:0:-1]
    assert await alpha.query(status="nonsense") == [] and await alpha.query(kind="note") == []


# -- admin ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_admin_status_requeue_and_cancel(broker):
    alpha, beta, request_id, message = await leased_request(broker, body="b" * 200)
    (stuck,) = await beta.admin_status()
    assert stuck["message_id"] == request_id and stuck["status"] == "leased"
    assert stuck["body_preview"] == "b" * 120
    assert await alpha.admin_status() == []
    assert_error(await alpha.requeue(request_id), 403, "forbidden")
    assert_error(await beta.requeue("unknown"), 404, "no_such_message")
    assert_error(await beta.requeue(""), 400, "bad_request")
    assert (await beta.requeue(request_id)).json == {"ok": True, "message_id": request_id}
    assert_error(await beta.requeue(request_id), 404, "no_such_message")  # queued already
    assert_error(await beta.cancel(request_id), 403, "forbidden")
    assert (await alpha.cancel(request_id)).json == {"ok": True, "message_id": request_id}
    assert_error(await alpha.cancel(request_id), 404, "no_such_message")
    assert await beta.pull() == []
    (entry,) = await alpha.status(request_id)
    assert entry["status"] == "completed"


@pytest_twisted.ensureDeferred
async def test_admin_agents_may_requeue_and_cancel_anything(memory_broker):
    broker = memory_broker(security={"admin_agents": ["ops"]})
    alpha, beta, request_id, message = await leased_request(broker)
    ops = broker.client("ops")
    assert (await beta.ack(request_id)).code == 200
    assert (await ops.requeue(request_id)).code == 200  # a completed one too
    assert (await ops.cancel(request_id)).code == 200


# -- the rails of the seed wire -------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_unknown_routes_and_unsigned_requests(broker):
    alpha = broker.client("alpha")
    assert_error(await alpha.request("POST", "/v1/thread", {}), 404, "not_found")
    assert_error(await alpha.request("GET", "/v1/pull"), 404, "not_found")
    assert_error(await alpha.request("POST", "/v1/pull", {}, signed=False,
                                     headers={"X-Agent-Relay-Agent": "alpha"}), 401,
                 "unauthenticated")
    assert_error(await alpha.request("POST", "/v1/pull", {}, timestamp=int(START) - 301),
                 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_v2_requests_count_toward_the_rate_limit(memory_broker):
    broker = memory_broker(rateLimitLoopback=3)
    alpha = broker.client("alpha")
    codes = [(await alpha.request("POST", "/v1/pull", {})).code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    assert (await alpha.health()).code == 429


@pytest_twisted.ensureDeferred
async def test_v3_signs_with_a_key_of_the_keyring(memory_broker):
    broker = memory_broker(config=make_config(agents={
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
    assert_error(await broker.client("alpha", "old-key-0123456789", key_id="old").request(
        "POST", "/v1/pull", {}), 401, "unknown_key")
    assert_error(await broker.client("alpha", "x", key_id="nope").request(
        "POST", "/v1/pull", {}), 401, "unknown_key")
    assert_error(await broker.client("zed", "x").request("POST", "/v1/pull", {}), 401,
                 "unknown_agent")
    beta = broker.client("beta", "beta-secret-0123456789")
    assert [m["body"] for m in await beta.pull()] == ["v3", "v3 legacy", "v2"]


# -- across the wires -----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_v2_agent_asks_and_a_seed_agent_answers(broker):
    alpha = broker.client("alpha")
    sent = await alpha.send_request("beta", "ünïcode?", topic="t", context="ctx",
                                    execution_mode="continue", session_ref="s")
    request_id = sent.json["message_id"]
    await broker.register("beta")
    (seen,) = await broker.pull("beta")
    assert seen["id"] == request_id and seen["kind"] == "request"
    assert seen["body"] == {"text": "ünïcode?", "topic": "t", "context": "ctx",
                            "executionMode": "continue", "sessionRef": "s"}
    reply = await broker.post("beta", "/v1/ack", {
        "messageId": request_id, "leaseId": seen["leaseId"], "outcome": "completed",
        "reply": {"id": "answer-1", "body": {"text": "yes"}}})
    assert reply.code == 200, reply
    (answer,) = await alpha.pull()
    assert (answer["message_id"], answer["parent_id"], answer["root_id"], answer["body"]) == (
        "answer-1", request_id, seen["rootId"], "yes")
    assert answer["kind"] == "reply" and answer["execution_mode"] == "read"
    assert (await alpha.ack("answer-1")).code == 200
    (entry,) = await broker.status("alpha", "answer-1")
    assert entry["status"] == "done"


@pytest_twisted.ensureDeferred
async def test_a_seed_agent_asks_and_a_v2_agent_answers(broker):
    await broker.register("alpha")
    beta = broker.client("beta")
    assert await beta.pull() == []  # which registers beta for the seed wire
    request_id = await broker.message("alpha", "beta", kind="request",
                                      body={"text": "plain", "n": 1})
    plain_id = await broker.message("alpha", "beta", body={"text": "just text"})
    first, second = await beta.pull()
    assert first["body"] == '{"n":1,"text":"plain"}' and first["kind"] == "request"
    assert second["body"] == "just text" and second["message_id"] == plain_id
    assert first["root_id"] == request_id and first["parent_id"] is None
    reply = await beta.send_reply(request_id, "alpha", "the answer")
    assert reply.code == 200
    assert (await beta.ack(request_id, lease_token=first["lease_token"])).code == 200
    (answer,) = await broker.pull("alpha")
    assert answer["id"] == reply.json["message_id"]
    assert answer["body"] == {"text": "the answer", "executionMode": "read"}
    assert (answer["parentId"], answer["replyTo"], answer["rootId"]) == (
        request_id, request_id, request_id)
    (entry,) = await broker.status("alpha", request_id)
    assert entry["status"] == "done"


@pytest_twisted.ensureDeferred
async def test_each_sender_gets_the_notice_of_its_own_wire(memory_broker):
    broker = memory_broker(maxDeliveries=1)
    alpha = broker.client("alpha")
    v2_request = (await alpha.send_request("beta", "from v2")).json["message_id"]
    await broker.register("gamma", "beta")
    seed_request = await broker.message("gamma", "beta", kind="request",
                                        body={"text": "from seed"})
    beta = broker.client("beta")
    for message in await beta.pull():
        assert (await beta.ack(message["message_id"], outcome="retry")).code == 200
    (v2_notice,) = await alpha.pull()
    assert v2_notice["parent_id"] == v2_request
    assert "from v2" in v2_notice["body"] and v2_notice["body"].startswith("[Relay]")
    (seed_notice,) = await broker.pull("gamma")
    assert seed_notice["body"]["relayNotice"]["messageId"] == seed_request
    assert seed_notice["body"]["relayNotice"]["event"] == "failed"


@pytest_twisted.ensureDeferred
async def test_a_v2_agent_is_registered_for_the_seed_wire(broker):
    await broker.register("gamma")
    reply = await broker.post("gamma", "/messages", {"to": "alpha", "body": {"text": "x"}})
    assert reply.code == 404 and reply.error_code == "no_such_agent"
    await broker.client("alpha").pull()
    assert (await broker.post("gamma", "/messages", {"to": "alpha",
                                                     "body": {"text": "x"}})).code == 201
    peers = (await broker.get("gamma", "/peers")).json["peers"]
    assert [p["agent"] for p in peers] == ["alpha", "gamma"]


def test_requests_are_counted_per_wire():
    from relay.broker.counters import Counters

    counters = Counters()
    for route, code in (("v2_pull", 200), ("v2_pull", 401), ("v2_send", 200), ("pull", 200),
                        ("unmatched", 404)):
        counters.http_answered(route, code, 0.001)
    assert counters.requests_by_wire() == {"seed": 2, "v2": 3}


def test_the_secret_of_the_tests_is_the_shared_one():
    assert make_config().secrets == (SECRET,)


@pytest_twisted.ensureDeferred
async def test_paths_werkzeug_would_bend_are_no_route(memory_broker):
    broker = memory_broker()
    alpha = broker.client("alpha")
    assert_error(await alpha.request("POST", "//v1/pull", {}), 404, "not_found")
    assert_error(await alpha.request("POST", "/v1/pull", {}, signed=False, headers={
        "X-Agent-Relay-Agent": "alpha"}), 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_v2_messages_are_events_of_their_recipient(memory_broker):
    broker = memory_broker()
    alpha = broker.client("alpha")
    sent = (await alpha.send_request("beta", "evented")).json["message_id"]
    page = await broker.store.events("beta", 0, 10)
    assert [json_data(e)["id"] for e in page.events] == [sent]
    assert "evented" not in repr([e.data for e in page.events])  # ids, never bodies


def json_data(event):
    import json

    return json.loads(event.data)


@pytest_twisted.ensureDeferred
async def test_notify_failed_to_sender_false_sends_v2_senders_no_notice(memory_broker):
    broker = memory_broker(maxDeliveries=1, notifyFailedToSender=False)
    alpha = broker.client("alpha")
    await alpha.send_request("beta", "from v2")
    await broker.register("gamma", "beta")
    seed_request = await broker.message("gamma", "beta", kind="request",
                                        body={"text": "from seed"})
    beta = broker.client("beta")
    for message in await beta.pull():
        assert (await beta.ack(message["message_id"], outcome="retry")).code == 200
    assert await alpha.pull() == []
    (seed_notice,) = await broker.pull("gamma")  # broker.notifyFailures still holds
    assert seed_notice["body"]["relayNotice"]["messageId"] == seed_request
