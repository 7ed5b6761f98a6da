"""RelayClient against the in-memory broker: every method of every version, the
signed nonce and the cached handshake, request/reply and its fallbacks on a v1.1 broker,
groups, roles and priorities (REACH §13, §14), asking a person (§15), and peers page by
page.

Time is a ``task.Clock``; HTTP goes to the broker's own site in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import pytest_twisted
from twisted.internet import defer
from twisted.internet.task import Clock

from relay.client.client import (
    REQUEST_GRACE_SECONDS,
    RelayClient,
    RequestFailed,
    RequestTimeout,
    advertises,
    answer_of,
    failure_notices,
    notice_of,
    question_body,
)
from relay.rules.delivery import notice_id
from relay.testing import SECRET
from relay.testing import SECRET as TEST_SECRET
from relay.wire.errors import RelayError
from relay.wire.signing import NONCE, sign
from tests.support.cli import Terminal
from tests.support.client import (
    V11_INFO,
    Net,
    assert_v11_requests,
    failure_of,
    relay_stub,
    result_of,
)
from tests.support.teams import REVIEWERS, TRIAGE_ROLES, TRIAGE_TEAM


def pair(net: Net, **kwargs: Any) -> Tuple[RelayClient, RelayClient]:
    alpha, beta = net.client("alpha", **kwargs), net.client("beta", **kwargs)
    net.run(alpha.register())
    net.run(beta.register())
    return alpha, beta


def leased(net: Net, worker: RelayClient, **pull: Any) -> Dict[str, Any]:
    (message,) = net.run(worker.pull(limit=1, **pull))["messages"]
    return message


def broker_clients(**broker: Any) -> Tuple[RelayClient, RelayClient, Any, Clock]:
    """Two RelayClients (alpha, beta) sharing one in-memory broker and clock."""
    from relay.testing import make_api

    api, _, clock = make_api(**broker)
    stub = relay_stub(api.resource(), clock)

    def client(agent: str) -> RelayClient:
        return RelayClient("http://127.0.0.1:19121", agent, TEST_SECRET, clock=clock, http=stub)

    return client("alpha"), client("beta"), stub, clock


# -- every method of v1.0 and v1.1 ---------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_every_method_against_the_memory_broker() -> None:
    alpha, beta, stub, clock = broker_clients()
    info = await alpha.handshake()
    assert info["protocol"] == "1.0"
    assert (await alpha.register())["agent"] == "alpha"
    await beta.register()
    peers = (await alpha.peers())["peers"]
    assert [(p["agent"], p["online"]) for p in peers] == [("alpha", True), ("beta", True)]

    # v1.0: send, recv with the cursor, receipt
    sent = await alpha.send("beta", {"text": "one"}, ack=True)
    assert (sent["accepted"], sent["duplicate"]) == (True, False)
    again = await alpha.send("beta", {"text": "one"}, message_id=sent["id"], ack=True)
    assert (again["id"], again["duplicate"]) == (sent["id"], True)
    inbox = await beta.recv(limit=10)
    assert [m["id"] for m in inbox["messages"]] == [sent["id"]]
    assert beta.cursor == sent["id"]
    assert (await beta.recv())["messages"] == []
    second = await alpha.send("beta", {"text": "two"})
    assert [m["id"] for m in (await beta.recv())["messages"]] == [second["id"]]
    await beta.ack(sent["id"])
    receipts = (await alpha.recv())["messages"]
    assert [(m["type"], m["replyTo"], m["from"]) for m in receipts] == [("ack", sent["id"], "beta")]

    # v1.1: request, pull, reply, ack, status, recent, query
    request = await alpha.send("beta", {"text": "q"}, kind="request")
    leased = (await beta.pull(limit=10, lease_seconds=60))["messages"]
    mine = {m["id"]: m for m in leased}
    assert request["id"] in mine and mine[request["id"]]["leaseId"]
    lease = mine[request["id"]]["leaseId"]
    reply = await beta.send(
        "alpha",
        {"text": "a"},
        kind="reply",
        reply_to=request["id"],
        parent_id=request["id"],
        root_id=request["id"],
    )
    done = await beta.ack_outcome(request["id"], lease, "completed")
    assert (done["ok"], done["status"]) == (True, "done")
    status = (await alpha.status([request["id"], "nope"]))["messages"]
    assert [s["status"] for s in status if s["id"] == request["id"]] == ["done"]
    recent = (await alpha.recent(limit=5))["messages"]
    assert reply["id"] in [m["id"] for m in recent]
    found = (await alpha.query(kind="reply", from_="beta"))["messages"]
    assert [m["id"] for m in found] == [reply["id"]]
    assert found[0]["parentId"] == request["id"]

    # errors come back as RelayError with the spec's codes
    with pytest.raises(RelayError) as info_:
        await alpha.send("ghost", {"text": "x"})
    assert (info_.value.status, info_.value.code) == (404, "no_such_agent")
    with pytest.raises(RelayError) as info_:
        await beta.ack_outcome(request["id"], lease, "completed")
    assert (info_.value.status, info_.value.code) == (409, "not_leased")
    with pytest.raises(RelayError) as info_:
        await alpha.ack("no-such-id")
    assert info_.value.code == "no_such_message"
    wrong = RelayClient("http://127.0.0.1:19121", "alpha", "wrong", clock=clock, http=stub)
    with pytest.raises(RelayError) as info_:
        await wrong.peers()
    assert (info_.value.status, info_.value.code) == (401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_long_poll_against_the_memory_broker() -> None:
    alpha, beta, stub, clock = broker_clients()
    await alpha.handshake()
    await beta.handshake()
    assert beta.long_poll_seconds == 20
    await alpha.register()
    await beta.register()

    waiting = beta.pull(limit=5, wait=10)
    assert not waiting.called
    sent = await alpha.send("beta", {"text": "wake up"}, kind="request")
    stub.flush()
    answer = await waiting
    assert [m["id"] for m in answer["messages"]] == [sent["id"]]

    idle = beta.recv(wait=10)
    clock.advance(9)
    stub.flush()
    assert not idle.called
    clock.advance(1)
    stub.flush()
    assert (await idle)["messages"] == []


# -- the handshake and the nonce ------------------------------------------------------


def test_the_first_signed_request_makes_the_handshake_once_for_concurrent_calls() -> None:
    net = Net()
    alpha = net.client("alpha")
    first, second = alpha.register(), alpha.peers()
    net.settle()
    result_of(first), result_of(second)
    net.run(alpha.peers())
    assert net.http.paths() == [("GET", "/"), ("POST", "/register"), ("GET", "/peers"),
                                ("GET", "/peers")]
    assert alpha.advertises("leaseRenew") and alpha.signs_nonce


def test_a_nonce_on_every_request_when_advertised_and_fresh_per_attempt() -> None:
    net = Net()
    alpha = net.client("alpha")
    net.run(alpha.register())
    net.http.drop_answers = 1
    d = net.start(alpha.peers())
    net.settle(2)  # the first answer is lost: the client retries after 2 s
    result_of(d)
    signed = [i for i, (_, path, _, _) in enumerate(net.http.requests) if path != "/"]
    nonces = [net.http.header(i, "X-Relay-Nonce") for i in signed]
    stamps = [net.http.header(i, "X-Relay-Timestamp") for i in signed]
    assert len(nonces) == 3 and len(set(nonces)) == 3
    assert all(NONCE.match(nonce) for nonce in nonces)
    assert stamps[1] != stamps[2], "the retry is signed with a fresh timestamp"
    method, path, headers, raw = net.http.requests[signed[2]]
    stamp = int(stamps[2])
    expected = sign(SECRET, method, path, stamp, raw, "alpha", nonces[2])
    assert headers["X-Relay-Signature"] == [expected], "agent and nonce are signed"


def test_no_nonce_when_the_broker_does_not_advertise_it() -> None:
    net = Net()
    alpha = net.client("alpha", info=V11_INFO)
    net.run(alpha.register())
    assert net.http.paths() == [("POST", "/register")]
    assert net.http.header(0, "X-Relay-Nonce") is None
    assert net.http.bodies("/register") == [{"agent": "alpha"}]


def test_a_broker_that_requires_nonces_serves_the_client() -> None:
    net = Net(security={"requireNonce": True})
    alpha, beta = pair(net)
    sent = net.run(alpha.send("beta", {"text": "hi"}))
    assert net.run(beta.pull())["messages"][0]["id"] == sent["id"]


def test_a_stale_handshake_is_refreshed_after_a_401() -> None:
    """A broker that started to require nonces after the handshake (a restart with
    another config): the 401 makes the client handshake again and sign with one."""
    net = Net(security={"requireNonce": True})
    alpha = net.client("alpha", info=V11_INFO)
    assert net.run(alpha.register())["agent"] == "alpha"
    assert net.http.paths() == [("POST", "/register"), ("GET", "/"), ("POST", "/register")]
    assert net.http.header(2, "X-Relay-Nonce")


def test_a_401_that_no_handshake_explains_is_reported() -> None:
    net = Net()
    wrong = RelayClient("http://127.0.0.1:19121", "alpha", "another-secret-0123456789",
                        clock=net.clock, http=net.http)
    error = failure_of(net.start(wrong.peers()))
    assert (error.status, error.code) == (401, "unauthenticated")
    assert net.http.paths() == [("GET", "/"), ("GET", "/peers"), ("GET", "/")]


# -- one method per extension -----------------------------------------------------------


def test_renew_release_reject_and_retry_after() -> None:
    net = Net()
    alpha, beta = pair(net)
    sent = net.run(alpha.send("beta", {"text": "job"}))["id"]
    message = leased(net, beta, lease_seconds=30)
    net.settle(20)
    renewed = net.run(beta.renew(sent, message["leaseId"], 30))
    assert renewed["leaseId"] == message["leaseId"]
    net.settle(20)
    released = net.run(beta.release(sent, message["leaseId"], after=2.5))
    assert (released["status"], released["attempts"]) == ("queued", 0)
    assert net.http.bodies("/v1/ack")[-1]["retryAfterSeconds"] == 3, "rounded up"
    assert net.run(beta.pull())["messages"] == []
    net.settle(3)
    message = leased(net, beta)
    retried = net.run(beta.retry(sent, message["leaseId"], "upstream busy", after=10))
    assert (retried["status"], retried["attempts"]) == ("queued", 1)
    net.settle(10)
    message = leased(net, beta)
    rejected = net.run(beta.reject(sent, message["leaseId"], "not valid"))
    assert rejected["status"] == "failed"
    (entry,) = net.run(alpha.status([sent]))["messages"]
    assert (entry["status"], entry["error"], entry["deliveries"]) == ("failed", "not valid", 3)
    error = failure_of(net.start(beta.renew(sent, message["leaseId"])))
    assert (error.status, error.code) == (409, "not_leased")


def test_requeue_cancel_and_dead_letters() -> None:
    net = Net()
    alpha, beta = pair(net)
    sent = net.run(alpha.send("beta", {"text": "job"}))["id"]
    net.run(beta.reject(sent, leased(net, beta)["leaseId"]))
    dead = net.run(beta.query(status="failed"))["messages"]
    assert [m["id"] for m in dead] == [sent]
    assert net.run(alpha.query(status="failed", box="sent"))["count"] == 1
    assert net.run(beta.requeue(sent)) == {"ok": True, "status": "queued", "attempts": 0}
    cancelled = net.run(alpha.cancel(sent, "superseded"))
    assert cancelled["status"] == "failed"
    (entry,) = net.run(alpha.status([sent]))["messages"]
    assert entry["error"] == "superseded"
    assert net.http.bodies("/v1/cancel") == [{"messageId": sent, "reason": "superseded"}]


def test_send_with_ttl_and_delay_and_the_envelope_fields() -> None:
    net = Net()
    alpha, beta = pair(net)
    net.run(alpha.send("beta", {"text": "later"}, message_id="d1", ttl_seconds=600,
                       delay_seconds=59.2))
    assert {k: net.http.bodies("/messages")[0][k] for k in ("ttlSeconds", "delaySeconds")} == {
        "ttlSeconds": 600, "delaySeconds": 60}
    (view,) = net.run(beta.recent())["messages"]
    assert "notBefore" in view and "expiresAt" in view
    assert net.run(beta.pull())["messages"] == []
    net.settle(60)
    assert [m["id"] for m in net.run(beta.pull())["messages"]] == ["d1"]
    net.run(alpha.send("beta", {"text": "now"}, delay_seconds=0))
    assert "delaySeconds" not in net.http.bodies("/messages")[-1], "0 is no delay"


def test_register_with_a_card_keeps_and_removes_it() -> None:
    net = Net()
    alpha, beta = pair(net)
    card = {"description": "reviews diffs", "skills": ["review"]}
    net.run(beta.register(card=card))
    net.run(beta.register())
    peers = {p["agent"]: p for p in net.run(alpha.peers())["peers"]}
    assert peers["beta"]["card"] == card
    net.run(beta.register(card=None))
    assert "card" not in {p["agent"]: p for p in net.run(alpha.peers())["peers"]}["beta"]
    assert net.http.bodies("/register")[-3:] == [
        {"agent": "beta", "card": card}, {"agent": "beta"}, {"agent": "beta", "card": None}]


def test_pull_by_parent_and_thread() -> None:
    net = Net()
    alpha, beta = pair(net)
    net.run(beta.send("alpha", {"text": "unrelated"}, message_id="u"))
    net.run(alpha.send("beta", {"text": "q"}, message_id="q", kind="request"))
    net.run(beta.send("alpha", {"text": "a"}, message_id="a", kind="reply", reply_to="q",
                      parent_id="q", root_id="q"))
    answer = net.run(alpha.pull(parent_id="q"))["messages"]
    assert [m["id"] for m in answer] == ["a"]
    thread = net.run(alpha.thread("q"))
    assert [m["id"] for m in thread["messages"]] == ["q", "a"] and thread["cursor"] == "a"
    assert net.run(alpha.thread("q", since="a"))["messages"] == []
    replies = net.run(alpha.query(box="all", root_id="q", parent_id="q"))["messages"]
    assert [m["id"] for m in replies] == ["a"]
    (entry,) = net.run(alpha.status(["u"]))["messages"]
    assert entry["status"] == "queued", "the pull by parent left the other message alone"


def test_the_atomic_reply_has_a_client_chosen_id_and_a_retry_is_a_duplicate() -> None:
    net = Net()
    alpha, beta = pair(net)
    sent = net.run(alpha.send("beta", {"text": "q"}, kind="request"))["id"]
    message = leased(net, beta)
    net.http.drop_answers = 1
    d = net.start(beta.complete(sent, message["leaseId"], reply={"body": {"text": "42"}}))
    net.settle(2)
    answer = result_of(d)
    first, again = net.http.bodies("/v1/ack")
    assert first == again and first["reply"]["id"]
    assert answer == {"ok": True, "status": "done", "attempts": 0,
                      "replyId": first["reply"]["id"], "duplicate": True}
    replies = net.run(alpha.pull(parent_id=sent))["messages"]
    assert [(m["id"], m["body"]) for m in replies] == [(first["reply"]["id"], {"text": "42"})]


@pytest.mark.parametrize("call", [
    lambda c: c.renew("m", "l"),
    lambda c: c.release("m", "l"),
    lambda c: c.reject("m", "l"),
    lambda c: c.retry("m", "l", after=5),
    lambda c: c.complete("m", "l", reply={"body": {}}),
    lambda c: c.requeue("m"),
    lambda c: c.cancel("m"),
    lambda c: c.thread("m"),
    lambda c: c.pull(parent_id="m"),
    lambda c: c.query(box="sent"),
    lambda c: c.send("beta", {}, ttl_seconds=5),
    lambda c: c.send("beta", {}, delay_seconds=5),
    lambda c: c.register(card={}),
])
def test_a_v11_broker_gets_no_v12_request(call: Any) -> None:
    net = Net()
    alpha = net.client("alpha", info=V11_INFO)
    error = failure_of(net.start(call(alpha)))
    assert (error.status, error.code) == (0, "unsupported")
    assert error.message.startswith("the broker lacks ")
    assert net.http.requests == []


def test_capability_readers() -> None:
    info = {"capabilities": {"leaseRenew": True, "signedNonce": {"required": False},
                             "threads": False, "deadLetters": {"failureNotices": True}}}
    assert advertises(info, "leaseRenew") and advertises(info, "signedNonce")
    assert not advertises(info, "threads") and not advertises(info, "peerCards")
    assert not advertises({"capabilities": []}, "leaseRenew")
    assert failure_notices(info) and not failure_notices(V11_INFO)
    assert notice_of({"body": {"relayNotice": {"event": "failed"}}}) == {"event": "failed"}
    assert notice_of({"body": {"text": "hi"}}) is None


# -- request / reply --------------------------------------------------------------------


def answer_when_asked(net: Net, worker: RelayClient, body: Dict[str, Any]) -> Dict[str, Any]:
    """The worker leases the request and completes it with an atomic reply."""
    message = leased(net, worker)
    assert message["kind"] == "request"
    net.run(worker.complete(message["id"], message["leaseId"], reply={"body": body}))
    return message


def test_request_waits_with_long_pulls_by_parent_and_touches_nothing_else() -> None:
    net = Net()
    alpha, beta = pair(net)
    net.run(beta.send("alpha", {"text": "unrelated"}, message_id="u"))
    d = net.start(alpha.request("beta", {"text": "2 + 2?"}, timeout=30))
    net.settle(5)
    assert not d.called
    request = answer_when_asked(net, beta, {"text": "4"})
    net.settle()
    reply = result_of(d)
    assert (reply["body"], reply["parentId"], reply["from"]) == ({"text": "4"}, request["id"],
                                                               "beta")
    pulls = net.http.bodies("/v1/pull")
    waits = [p for p in pulls if p.get("parentId") == request["id"]]
    assert waits[0] == {"limit": 1, "leaseSeconds": 60, "parentId": request["id"],
                        "waitSeconds": 20}
    statuses = {e["id"]: e["status"] for e in net.run(alpha.status(["u", reply["id"]]))["messages"]}
    assert statuses == {"u": "queued", reply["id"]: "done"}, "the answer is acknowledged"
    sent = net.http.bodies("/messages")[-1]
    assert (sent["kind"], sent["to"], sent["ack"]) == ("request", "beta", False)


def test_request_registers_the_asker_first() -> None:
    net = Net()
    beta = net.client("beta")
    net.run(beta.register())
    alpha = net.client("alpha")
    d = net.start(alpha.request("beta", {"text": "hi"}, timeout=10))
    answer_when_asked(net, beta, {"text": "hello"})
    net.settle()
    assert result_of(d)["body"] == {"text": "hello"}
    assert ("POST", "/register") in net.http.paths()[:4]


def test_a_rejected_request_raises_with_the_notice() -> None:
    net = Net()
    alpha, beta = pair(net)
    d = net.start(alpha.request("beta", {"text": "bad"}, timeout=30))
    message = leased(net, beta)
    net.run(beta.reject(message["id"], message["leaseId"], "cannot parse"))
    net.settle()
    error = failure_of(d, RequestFailed)
    assert (error.code, error.event, error.error, error.request_id) == (
        "request_failed", "failed", "cannot parse", message["id"])
    assert error.notice["deliveries"] == 1
    assert error.message == f"request {message['id']} to beta failed: cannot parse"
    (entry,) = net.run(alpha.status([notice_id(message["id"])]))["messages"]
    assert entry["status"] == "done", "the notice is acknowledged"


def test_a_request_that_expires_raises_expired() -> None:
    net = Net(messageTtlDays=1)
    alpha, beta = pair(net)
    d = net.start(alpha.request("beta", {"text": "soon"}, timeout=60, ttl_seconds=5))
    net.settle(5)
    net.run(net.api.broker.sweep_expired())
    net.settle()
    error = failure_of(d, RequestFailed)
    assert (error.event, error.error) == ("expired", "expired unprocessed")


def test_request_times_out_within_its_bound() -> None:
    net = Net()
    alpha, beta = pair(net)
    d = net.start(alpha.request("beta", {"text": "anyone?"}, timeout=25))
    net.settle(20)
    assert not d.called
    net.settle(5)
    error = failure_of(d, RequestTimeout)
    assert (error.code, error.timeout) == ("request_timeout", 25)
    assert error.message == f"no answer from beta to request {error.request_id} within 25 s"
    waits = [p.get("waitSeconds") for p in net.http.bodies("/v1/pull")]
    assert waits == [20, 5], "the last long poll ends at the deadline"
    assert not net.clock.getDelayedCalls()
    # the answer can still be awaited
    later = net.start(alpha.await_reply(error.request_id, 10))
    answer_when_asked(net, beta, {"text": "late"})
    net.settle()
    assert result_of(later)["body"] == {"text": "late"}


def test_a_broker_that_does_not_answer_cannot_hold_request_past_its_bound() -> None:
    class Silent:
        def request(self, *args: Any, **kwargs: Any) -> defer.Deferred:
            return defer.Deferred()

    clock = Clock()
    info = {"protocol": "1.0", "capabilities": {"pullFilter": True}}
    alpha = RelayClient("http://127.0.0.1:19121", "alpha", SECRET, clock=clock, http=Silent(),
                        info=info)
    d = alpha.request("beta", {}, timeout=5)
    clock.advance(5 + REQUEST_GRACE_SECONDS - 0.01)
    assert not d.called
    clock.advance(0.01)
    assert failure_of(d, RequestTimeout).timeout == 5
    assert not clock.getDelayedCalls()


def test_cancelling_a_request_stops_it() -> None:
    net = Net()
    alpha, beta = pair(net)
    d = net.start(alpha.request("beta", {"text": "never mind"}, timeout=30))
    d.cancel()
    failure_of(d, defer.CancelledError)
    net.settle()
    assert not net.clock.getDelayedCalls()


def test_without_failure_notices_the_status_tells_of_a_failure() -> None:
    net = Net(notifyFailures=False)
    alpha, beta = pair(net)
    d = net.start(alpha.request("beta", {"text": "bad"}, timeout=60))
    message = leased(net, beta)
    net.run(beta.reject(message["id"], message["leaseId"], "poison"))
    net.settle(20)
    error = failure_of(d, RequestFailed)
    assert (error.event, error.error, error.notice) == ("failed", "poison", None)


# -- request against a v1.1 broker ------------------------------------------------------------


def v11_pair(net: Net) -> Tuple[RelayClient, RelayClient]:
    """alpha believes the broker is v1.1; beta, the worker, answers as a v1.1 worker does."""
    alpha = net.client("alpha", info=V11_INFO)
    beta = net.client("beta", info=V11_INFO)
    net.run(beta.register())
    return alpha, beta


def test_on_a_v11_broker_request_polls_read_only_and_leases_nothing() -> None:
    net = Net()
    alpha, beta = v11_pair(net)
    net.run(alpha.register())
    net.run(beta.send("alpha", {"text": "unrelated"}, message_id="u"))
    d = net.start(alpha.request("beta", {"text": "2 + 2?"}, timeout=30, poll_interval=1))
    for _ in range(5):
        net.settle(1)
    (message,) = net.run(beta.pull())["messages"]
    net.run(beta.send("alpha", {"text": "4"}, message_id="r", kind="reply",
                      reply_to=message["id"], parent_id=message["id"]))
    net.run(beta.ack_outcome(message["id"], message["leaseId"], "completed"))
    net.settle(1)
    assert result_of(d)["id"] == "r"
    asked = [(m, p) for m, p, headers, _ in net.http.requests
             if headers.get("X-Relay-Agent") == ["alpha"]]
    assert {path for _, path in asked} == {"/register", "/messages", "/v1/messages/query",
                                           "/v1/status"}
    assert net.http.bodies("/v1/messages/query")[0] == {"kind": "reply", "from": "beta",
                                                         "limit": 200}
    assert_v11_requests(net.http.requests)
    statuses = {e["id"]: e["status"] for e in net.run(alpha.status(["u", "r"]))["messages"]}
    assert statuses == {"u": "queued", "r": "queued"}, "nothing leased, nothing completed"


@pytest.mark.parametrize("notices", [False, True])
def test_on_a_v11_broker_a_failed_request_is_seen_in_its_status(notices: bool) -> None:
    net = Net(maxAttempts=0, notifyFailures=notices)
    alpha, beta = v11_pair(net)
    d = net.start(alpha.request("beta", {"text": "bad"}, timeout=30, poll_interval=1))
    (message,) = net.run(beta.pull())["messages"]
    net.run(beta.ack_outcome(message["id"], message["leaseId"], "retry", "broken"))
    for _ in range(5):  # without notices, /v1/status is asked every fifth look
        net.settle(1)
    error = failure_of(d, RequestFailed)
    assert (error.event, error.error) == ("failed", "broken")
    assert (error.notice is not None) == notices, "a notice the query finds tells it too"


def test_on_a_v11_broker_the_status_is_asked_every_fifth_look() -> None:
    """Each look used to ask /v1/status too: a minute's wait cost 62 requests of the
    budget every local client shares (31 looks, 31 statuses); now 38."""
    net = Net()
    alpha, _ = v11_pair(net)
    net.run(alpha.register())
    d = net.start(alpha.request("beta", {"text": "2 + 2?"}, timeout=60))
    for _ in range(70):
        net.settle(1)
    failure_of(d, RequestTimeout)
    paths = [path for _, path, headers, _ in net.http.requests
             if headers.get("X-Relay-Agent") == ["alpha"]]
    looks, statuses = paths.count("/v1/messages/query"), paths.count("/v1/status")
    assert looks == 31 and statuses == 7, (looks, statuses)


def test_a_broker_without_any_way_to_wait_is_refused_clearly() -> None:
    net = Net()
    alpha = net.client("alpha", info={"protocol": "1.0"})
    error = failure_of(net.start(alpha.await_reply("q", 5)))
    assert error.code == "unsupported" and "pullFilter" in error.message


# -- asking a person (REACH §15) ------------------------------------------------------------


def test_ask_sends_the_question_and_fires_with_the_persons_answer() -> None:
    net = Net()
    alpha, person = pair(net)
    d = net.start(alpha.ask("beta", "Ship 2.1 today?", ("ship it", "wait a day"), timeout=30))
    message = leased(net, person)
    assert (message["kind"], message["body"]) == (
        "request", {"question": "Ship 2.1 today?", "options": ["ship it", "wait a day"]})
    net.run(person.complete(message["id"], message["leaseId"],
                          reply={"body": {"answer": "wait a day"}}))
    net.settle()
    reply = result_of(d)
    assert answer_of(reply) == "wait a day" and reply["from"] == "beta"
    assert answer_of({"body": {"answer": 4}}) is None
    assert answer_of({"body": {"text": "x"}}) is None


@pytest.mark.parametrize("question, options, says", [
    ("", None, "non-empty string"),
    ("  ", ["a"], "non-empty string"),
    ("q?", [], "give 1 to 10 options, not 0"),
    ("q?", [str(i) for i in range(11)], "give 1 to 10 options, not 11"),
    ("q?", ["a", 2], "every option must be a non-empty string"),
    ("q?", ["a", "a"], "must differ"),
])
def test_question_body_refuses_what_the_page_cannot_show(question, options, says) -> None:
    with pytest.raises(ValueError, match=says):
        question_body(question, options)
    assert question_body("q?") == {"question": "q?"}


CARD = {"description": "d" * 2000, "skills": ["s" * 100] * 50}


@pytest.fixture
def triage_net() -> Net:
    return Net(agents=TRIAGE_TEAM, roles=TRIAGE_ROLES)


# -- groups (REACH §13) --------------------------------------------------------------------


def test_send_to_a_group_returns_the_copies_and_status_lists_them() -> None:
    net = Net(**REVIEWERS)
    alice, bob = net.client("alice"), net.client("bob")
    sent = net.run(alice.send("group:reviewers", {"text": "please review"}, message_id="g1"))
    assert sent["id"] == "g1" and sent["duplicate"] is False
    assert [c["to"] for c in sent["copies"]] == ["bob", "carol"]
    again = net.run(alice.send("group:reviewers", {"text": "please review"}, message_id="g1"))
    assert again == dict(sent, duplicate=True)
    (leased,) = net.run(bob.pull())["messages"]
    assert (leased["id"], leased["via"]) == (sent["copies"][0]["id"], "group:reviewers")
    (entry,) = net.run(alice.status(["g1"]))["messages"]
    assert entry == {"id": "g1", "via": "group:reviewers", "copies": [
        dict(sent["copies"][0], status="leased"), dict(sent["copies"][1], status="queued")]}


def test_an_unknown_group_is_a_relay_error() -> None:
    net = Net(**REVIEWERS)
    error = failure_of(net.start(net.client("alice").send("group:nobody", {})))
    assert (error.status, error.code) == (404, "no_such_agent")


def test_a_broker_without_groups_is_told_before_anything_is_sent() -> None:
    net = Net(v11=True, **REVIEWERS)
    error = failure_of(net.start(net.client("alice").send("group:reviewers", {})))
    assert isinstance(error, RelayError) and "groups" in str(error)
    assert ("POST", "/messages") not in net.http.paths()


def test_a_request_to_a_group_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    net = Net(**REVIEWERS)
    error = failure_of(net.start(net.client("alice").request("group:reviewers", {}, 5)))
    assert error.code == "bad_request" and "per copy" in str(error)
    assert ("POST", "/messages") not in net.http.paths()
    term = Terminal(tmp_path, **REVIEWERS)
    asked = term("alice", "ask", "group:reviewers", "anyone?", "--timeout", "5")
    assert asked.status == 1 and "per copy" in asked.err


# -- roles and priority (REACH §13, §14) ---------------------------------------------------


def test_the_client_sends_with_a_priority_and_to_a_role(triage_net: Net) -> None:
    alpha, dan = triage_net.client("alpha"), triage_net.client("dan")
    triage_net.run(dan.register())
    triage_net.run(alpha.send("dan", {"n": 1}, message_id="plain"))
    triage_net.run(alpha.send("dan", {"n": 2}, message_id="urgent", priority=7))
    triage_net.run(alpha.send("role:triage", {"n": 3}, message_id="work", priority=3))
    sent = [b for b in triage_net.http.bodies("/messages")]
    assert [b.get("priority") for b in sent] == [None, 7, 3]
    pulled = triage_net.run(dan.pull(limit=10))["messages"]
    assert [m["id"] for m in pulled] == ["urgent", "work", "plain"]
    assert pulled[1]["to"] == "role:triage"
    done = triage_net.run(dan.complete("work", pulled[1]["leaseId"], reply={"body": {"ok": 1},
                                                                            "priority": 5}))
    assert done["status"] == "done"
    (entry,) = triage_net.run(alpha.status(["work"]))["messages"]
    assert entry["completedBy"] == "dan"


def test_the_client_pulls_from_one_role(triage_net: Net) -> None:
    alpha, erin = triage_net.client("alpha"), triage_net.client("erin")
    triage_net.run(erin.register())
    triage_net.run(alpha.send("erin", {}, message_id="own"))
    triage_net.run(alpha.send("role:triage", {}, message_id="work"))
    assert [m["id"] for m in triage_net.run(erin.pull(role="triage"))["messages"]] == ["work"]
    assert triage_net.http.bodies("/v1/pull")[-1]["role"] == "triage"
    with pytest.raises(RelayError) as e:
        triage_net.run(erin.pull(role="nobody"))
    assert e.value.code == "no_such_agent"


def test_the_client_checks_a_priority_before_sending(triage_net: Net) -> None:
    alpha = triage_net.client("alpha")
    for bad in (10, -1, True, 1.5):
        with pytest.raises(ValueError):
            alpha.send("dan", {}, priority=bad)


def test_a_v11_broker_is_not_asked_for_priorities_or_roles() -> None:
    net = Net(v11=True)
    alpha = net.client("alpha")
    for call in (lambda: alpha.send("beta", {}, priority=4),
                 lambda: alpha.send("role:triage", {}),
                 lambda: alpha.pull(role="triage")):
        with pytest.raises(RelayError) as e:
            net.run(call())
        assert e.value.code == "unsupported"
    assert net.http.bodies("/messages") == [] and net.http.bodies("/v1/pull") == []


# -- peers, page by page -------------------------------------------------------------------


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
