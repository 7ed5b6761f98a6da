"""RelayClient and the delivery extensions v1.2: each method against the in-memory
broker, the signed nonce, the cached handshake, request/reply and its fallbacks.

Time is a ``task.Clock``; HTTP goes to the broker's own site in memory.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import pytest
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
from relay.wire.signing import NONCE, sign
from tests.support.client import V11_INFO, Net, assert_v11_requests, failure_of, result_of


def pair(net: Net, **kwargs: Any) -> Tuple[RelayClient, RelayClient]:
    alpha, beta = net.client("alpha", **kwargs), net.client("beta", **kwargs)
    net.run(alpha.register())
    net.run(beta.register())
    return alpha, beta


def leased(net: Net, worker: RelayClient, **pull: Any) -> Dict[str, Any]:
    (message,) = net.run(worker.pull(limit=1, **pull))["messages"]
    return message


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
