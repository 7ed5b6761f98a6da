"""RelayClient: signing, request shapes, retries and backoff, error mapping.

These tests use a small scripted HTTP resource of their own (so they do not
depend on our broker) and a ``task.Clock`` for every delay; RelayClient against the
in-memory broker is tests/client/test_client.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from relay.client.client import RETRY_DELAYS_SECONDS, RelayClient, long_poll_limit
from relay.wire.errors import RelayError
from relay.wire.signing import auth_headers, sign, signing_string, verify

SECRET = "s3cret"
NOW = 1712345678

# --- signature vectors ------------------------------------------------------

# Computed outside Python with:
#   printf 'POST\n/messages?since=abc&limit=50\n1712345678\n{"id":"m-1",...}' \
#     | openssl dgst -sha256 -hmac s3cret
POST_VECTOR = (
    "POST",
    "/messages?since=abc&limit=50",
    NOW,
    '{"id":"m-1","to":"beta","body":{"text":"hi"}}',
    "a0c8e7281b46798bba844aec24a9fd9fa529441cb9bd8c86c110bccf41338fa7",
)
GET_VECTOR = (
    "GET",
    "/messages?since=abc&limit=50",
    NOW,
    "",
    "24974360f6984752c869e8c5711d92e9bfc706efaa5b9fbaacf33c7be14b6230",
)


@pytest.mark.parametrize("vector", [POST_VECTOR, GET_VECTOR])
def test_signature_vectors(vector: Tuple[str, str, int, str, str]) -> None:
    method, path, timestamp, body, expected = vector
    assert sign(SECRET, method, path, timestamp, body) == expected
    assert sign(SECRET.encode(), method, path, timestamp, body.encode()) == expected
    assert verify(SECRET, method, path, timestamp, body, expected)
    assert not verify(SECRET, method, path.split("?")[0], timestamp, body, expected)


def test_signature_matches_independent_hmac() -> None:
    body = '{"to":"beta","body":{"text":"héllo"}}'
    payload = f"POST\n/v1/pull?x=1\n{NOW}\n{body}".encode()
    expected = hmac.new(b"other", payload, hashlib.sha256).hexdigest()
    assert signing_string("post", "/v1/pull?x=1", NOW, body) == payload
    headers = auth_headers("other", "alpha", "POST", "/v1/pull?x=1", NOW, body)
    assert headers == {
        "X-Relay-Agent": "alpha",
        "X-Relay-Timestamp": str(NOW),
        "X-Relay-Signature": expected,
    }


# --- a scripted broker ------------------------------------------------------


class Recorded:
    def __init__(self, method: str, uri: str, headers: Dict[str, str], body: bytes) -> None:
        self.method = method
        self.uri = uri
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))

    def signature_ok(self, secret: str = SECRET) -> bool:
        return verify(
            secret,
            self.method,
            self.uri,
            int(self.headers["x-relay-timestamp"]),
            self.body,
            self.headers["x-relay-signature"],
        )


class ScriptedBroker(Resource):
    """Answers each request with the next scripted (status, document) pair."""

    isLeaf = True

    def __init__(self, script: List[Tuple[int, Any]]) -> None:
        super().__init__()
        self.script = list(script)
        self.requests: List[Recorded] = []

    def render(self, request: Any) -> bytes:
        headers = {
            name.decode().lower(): values[0].decode()
            for name, values in request.requestHeaders.getAllRawHeaders()
        }
        self.requests.append(
            Recorded(request.method.decode(), request.uri.decode(), headers, request.content.read())
        )
        status, document = self.script.pop(0)
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        if isinstance(document, bytes):
            return document
        return json.dumps(document).encode("utf-8")


# What a v1.1 broker answers to GET /: the scripted clients start with it known, so
# that each script holds only the requests under test.
V11_INFO = {"protocol": "1.0", "capabilities": {"leaseDelivery": True}}


def make_client(
    script: List[Tuple[int, Any]], clock: Optional[Clock] = None, **kwargs: Any
) -> Tuple[RelayClient, ScriptedBroker, Clock]:
    clock = clock or Clock()
    clock.advance(NOW)
    broker = ScriptedBroker(script)
    kwargs.setdefault("info", dict(V11_INFO))
    client = RelayClient(
        "http://broker.test:19121/", "alpha", SECRET, clock=clock, http=StubTreq(broker), **kwargs
    )
    return client, broker, clock


def result_of(d: defer.Deferred) -> Any:
    """The result of an already-fired Deferred (re-raising its failure)."""
    results: List[Any] = []
    d.addBoth(results.append)
    assert results, "Deferred has not fired"
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


def error_of(d: defer.Deferred) -> RelayError:
    with pytest.raises(RelayError) as info:
        result_of(d)
    return info.value


HANDSHAKE = {
    "protocol": "1.0",
    "broker": "dsh-agent-relay",
    "version": "0.3.0",
    "capabilities": {"leaseDelivery": True},
    "storage": "memory",
}


# --- handshake ----------------------------------------------------------------


def test_handshake_is_unsigned_and_kept() -> None:
    client, broker, _ = make_client([(200, HANDSHAKE)])
    assert result_of(client.handshake()) == HANDSHAKE
    assert client.info == HANDSHAKE
    (request,) = broker.requests
    assert (request.method, request.uri) == ("GET", "/")
    assert "x-relay-signature" not in request.headers
    assert client.long_poll_seconds is None


def test_handshake_tolerates_missing_capabilities_and_storage() -> None:
    client, _, _ = make_client([(200, {"protocol": "1.0"})])
    assert result_of(client.handshake()) == {"protocol": "1.0"}


@pytest.mark.parametrize("answer", [{"protocol": "2.0"}, {"broker": "x"}, ["1.0"]])
def test_handshake_refuses_other_protocols(answer: Any) -> None:
    client, _, _ = make_client([(200, answer)], info=None)
    error = error_of(client.handshake())
    assert error.code == "protocol_mismatch"
    assert "1.0" in error.message
    assert client.info is None


def test_long_poll_advertisement() -> None:
    assert long_poll_limit({"capabilities": {"longPoll": {"maxWaitSeconds": 20}}}) == 20
    assert long_poll_limit({"capabilities": {"longPoll": True}}) == 20
    assert long_poll_limit({"capabilities": {"longPoll": False}}) is None
    assert long_poll_limit({"capabilities": {}}) is None
    assert long_poll_limit({}) is None


# --- request shapes -----------------------------------------------------------


def test_every_request_is_signed_over_path_query_and_raw_body() -> None:
    client, broker, _ = make_client(
        [
            (200, {"ok": True, "agent": "alpha", "ts": NOW}),
            (200, {"peers": []}),
            (201, {"accepted": True, "id": "m-1", "duplicate": False}),
            (200, {"messages": [{"id": "m-9"}], "cursor": "m-9"}),
            (201, {"accepted": True, "id": "a-1"}),
            (200, {"messages": [], "count": 0}),
            (200, {"ok": True, "status": "done", "attempts": 1}),
            (200, {"messages": []}),
            (200, {"messages": [], "count": 0}),
            (200, {"messages": [], "count": 0}),
        ]
    )
    result_of(client.register())
    result_of(client.peers())
    result_of(client.send("beta", {"text": "héllo"}, message_id="m-1"))
    result_of(client.recv(limit=10))
    result_of(client.ack("m-9"))
    result_of(client.pull(limit=5, lease_seconds=60))
    result_of(client.ack_outcome("m-9", "L-1", "completed"))
    result_of(client.status(["m-1", "m-9"]))
    result_of(client.recent(limit=3))
    result_of(client.query(kind="request", from_="beta", limit=7))
    shapes = [(r.method, r.uri, r.json() if r.body else None) for r in broker.requests]
    assert shapes == [
        ("POST", "/register", {"agent": "alpha"}),
        ("GET", "/peers", None),
        (
            "POST",
            "/messages",
            {
                "id": "m-1",
                "from": "alpha",
                "to": "beta",
                "type": "message",
                "body": {"text": "héllo"},
                "replyTo": None,
                "ack": False,
            },
        ),
        ("GET", "/messages?limit=10", None),
        ("POST", "/messages/m-9/ack", {"status": "ok"}),
        ("POST", "/v1/pull", {"limit": 5, "leaseSeconds": 60}),
        (
            "POST",
            "/v1/ack",
            {"messageId": "m-9", "leaseId": "L-1", "outcome": "completed"},
        ),
        ("POST", "/v1/status", {"messageIds": ["m-1", "m-9"]}),
        ("POST", "/v1/recent", {"limit": 3}),
        ("POST", "/v1/messages/query", {"kind": "request", "from": "beta", "limit": 7}),
    ]
    for request in broker.requests:
        assert request.headers["x-relay-agent"] == "alpha"
        assert request.headers["x-relay-timestamp"] == str(NOW)
        assert request.signature_ok(), request.uri
        assert not request.signature_ok("wrong")
    assert broker.requests[2].headers["content-type"].startswith("application/json")


def test_send_full_envelope_fields() -> None:
    client, broker, _ = make_client([(201, {"accepted": True, "id": "r-1", "duplicate": False})])
    result_of(
        client.send(
            "beta",
            {"text": "answer"},
            message_id="r-1",
            kind="reply",
            reply_to="q-1",
            root_id="q-0",
            parent_id="q-1",
            ack=True,
        )
    )
    sent = broker.requests[0].json()
    assert sent["kind"] == "reply"
    assert (sent["replyTo"], sent["rootId"], sent["parentId"], sent["ack"]) == (
        "q-1",
        "q-0",
        "q-1",
        True,
    )


def test_send_generates_a_uuid_when_no_id_given() -> None:
    client, broker, _ = make_client(
        [(201, {"accepted": True, "duplicate": False}), (201, {"accepted": True})]
    )
    result_of(client.send("beta", {"text": "one"}))
    result_of(client.send("beta", {"text": "two"}))
    first, second = (r.json()["id"] for r in broker.requests)
    assert len(first) == 36 and first != second


def test_recv_keeps_and_sends_the_cursor_and_signs_the_query() -> None:
    client, broker, _ = make_client(
        [
            (200, {"messages": [{"id": "m 1/é"}], "cursor": "m 1/é"}),
            (200, {"messages": [], "cursor": None}),
            (200, {"messages": [], "cursor": None}),
        ]
    )
    result_of(client.recv())
    assert client.cursor == "m 1/é"
    result_of(client.recv(limit=50))
    assert client.cursor == "m 1/é"  # an empty page keeps the cursor
    result_of(client.recv())
    uris = [r.uri for r in broker.requests]
    assert uris[0] == "/messages"
    assert uris[1] == "/messages?since=m%201%2F%C3%A9&limit=50"
    for request in broker.requests:
        assert request.signature_ok()


def test_ack_receipt_error_carries_the_text_and_escapes_the_id() -> None:
    client, broker, _ = make_client([(201, {"accepted": True, "id": "x"})])
    result_of(client.ack("a/b", status="error", error="handler crashed"))
    assert broker.requests[0].uri == "/messages/a%2Fb/ack"
    assert broker.requests[0].json() == {"status": "error", "error": "handler crashed"}


def test_wait_is_only_sent_when_the_broker_advertised_long_poll() -> None:
    client, broker, _ = make_client(
        [
            (200, {"messages": [], "count": 0}),
            (200, {"protocol": "1.0", "capabilities": {"longPoll": {"maxWaitSeconds": 20}}}),
            (200, {"messages": [], "count": 0}),
            (200, {"messages": [], "cursor": None}),
        ]
    )
    result_of(client.pull(limit=1, wait=30))
    result_of(client.handshake())
    result_of(client.pull(limit=1, wait=30))
    result_of(client.recv(wait=5))
    assert broker.requests[0].json() == {"limit": 1}
    assert broker.requests[2].json() == {"limit": 1, "waitSeconds": 20}
    assert broker.requests[3].uri == "/messages?wait=5"


# --- errors and retries -----------------------------------------------------


def test_error_body_becomes_relay_error_without_retry() -> None:
    client, broker, _ = make_client(
        [(404, {"error": {"code": "no_such_agent", "message": "recipient never registered"}})]
    )
    error = error_of(client.send("ghost", {"text": "x"}))
    assert error == RelayError(404, "no_such_agent", "recipient never registered")
    assert len(broker.requests) == 1


def test_non_json_error_body_still_gives_relay_error() -> None:
    client, _, _ = make_client([(400, b"<html>bad</html>")])
    error = error_of(client.peers())
    assert (error.status, error.code) == (400, "http_error")


def test_non_json_success_is_a_bad_response() -> None:
    client, _, _ = make_client([(200, b"not json")])
    assert error_of(client.peers()).code == "bad_response"


BUSY = (503, {"error": {"code": "busy", "message": "internal broker error"}})
LIMITED = (429, {"error": {"code": "rate_limited", "message": "rate limit exceeded"}})
TIMEOUT = (408, {"error": {"code": "timeout", "message": "request timeout"}})


def test_send_retries_with_2_4_8_backoff_and_a_stable_id() -> None:
    client, broker, clock = make_client(
        [BUSY, LIMITED, TIMEOUT, (200, {"accepted": True, "id": "m-1", "duplicate": True})]
    )
    d = client.send("beta", {"text": "hi"})
    assert len(broker.requests) == 1
    for delay, seen in zip(RETRY_DELAYS_SECONDS, (2, 3, 4)):
        clock.advance(delay - 0.001)
        assert len(broker.requests) == seen - 1
        clock.advance(0.001)
        assert len(broker.requests) == seen
    assert result_of(d)["duplicate"] is True
    ids = {r.json()["id"] for r in broker.requests}
    assert len(ids) == 1
    # every attempt is re-signed with the time it was sent
    stamps = [int(r.headers["x-relay-timestamp"]) for r in broker.requests]
    assert stamps == [NOW, NOW + 2, NOW + 6, NOW + 14]
    assert all(r.signature_ok() for r in broker.requests)


def test_retries_stop_after_three() -> None:
    client, broker, clock = make_client([BUSY, BUSY, BUSY, BUSY, BUSY])
    d = client.register()
    clock.pump([2, 4, 8, 100])
    assert error_of(d) == RelayError(503, "busy", "internal broker error")
    assert len(broker.requests) == 4


class FailingHTTP:
    """A treq stand-in whose requests fail to connect, then succeed via ``then``."""

    def __init__(self, failures: int, then: Any) -> None:
        self.failures = failures
        self.then = then
        self.calls = 0

    def request(self, *args: Any, **kwargs: Any) -> defer.Deferred:
        self.calls += 1
        if self.calls <= self.failures:
            return defer.fail(ConnectionRefusedError("refused"))
        return self.then.request(*args, **kwargs)


def test_connection_failures_retry_then_succeed() -> None:
    clock = Clock()
    broker = ScriptedBroker([(200, {"peers": []})])
    http = FailingHTTP(2, StubTreq(broker))
    client = RelayClient("http://broker.test", "alpha", SECRET, clock=clock, http=http,
                          info=V11_INFO)
    d = client.peers()
    clock.pump([2, 4])
    assert result_of(d) == {"peers": []}
    assert http.calls == 3


def test_connection_failure_after_retries_is_status_0() -> None:
    clock = Clock()
    http = FailingHTTP(10, None)
    client = RelayClient("http://broker.test", "alpha", SECRET, clock=clock, http=http,
                          info=V11_INFO)
    d = client.peers()
    clock.pump([2, 4, 8])
    error = error_of(d)
    assert (error.status, error.code) == (0, "connection_error")
    assert "broker.test" in error.message
    assert http.calls == 4


class FailingWith:
    """A treq stand-in whose every request fails with ``failure()``."""

    def __init__(self, failure: Any) -> None:
        self.failure = failure
        self.calls = 0

    def request(self, *args: Any, **kwargs: Any) -> defer.Deferred:
        self.calls += 1
        return defer.fail(self.failure())


def test_a_host_name_that_does_not_resolve_fails_at_once() -> None:
    """It used to take 14 s of retries; a refused connection still retries."""
    from twisted.internet.error import DNSLookupError

    http = FailingWith(lambda: DNSLookupError("nowhere.test"))
    client = RelayClient("http://nowhere.test", "alpha", SECRET, clock=Clock(), http=http,
                          info=V11_INFO)
    error = error_of(client.peers())
    assert (error.code, http.calls) == ("connection_error", 1)
    assert "does not resolve" in error.message


def test_a_port_that_does_not_speak_http_fails_at_once() -> None:
    """A server that answers something other than HTTP (an SSH banner, say)."""
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseFailed

    class Garbled(Exception):
        pass

    http = FailingWith(lambda: ResponseFailed([Failure(Garbled("wrong number of parts"))]))
    client = RelayClient("http://127.0.0.1:22", "alpha", SECRET, clock=Clock(), http=http,
                          info=V11_INFO)
    error = error_of(client.peers())
    assert (error.code, http.calls) == ("connection_error", 1)
    assert "does not answer in HTTP" in error.message


def test_a_connection_lost_mid_answer_is_still_retried() -> None:
    from twisted.internet.error import ConnectionLost
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseFailed

    clock = Clock()
    http = FailingWith(lambda: ResponseFailed([Failure(ConnectionLost())]))
    client = RelayClient("http://broker.test", "alpha", SECRET, clock=clock, http=http,
                          info=V11_INFO)
    d = client.peers()
    clock.pump([2, 4, 8])
    assert error_of(d).code == "connection_error" and http.calls == 4


def test_the_ops_listener_is_recognised() -> None:
    """A client pointed at the dashboard's port used to say "HTTP 200 answer is not JSON"."""
    page = b'<!doctype html><script src="/static/dashboard.js" defer></script>'
    client, _, _ = make_client([(200, page)], info=None)
    client.broker_url = "http://127.0.0.1:19122"
    error = error_of(client.handshake())
    assert error.code == "ops_listener"
    assert error.message == (
        "http://127.0.0.1:19122 is the relay's ops listener (the dashboard), not the broker; "
        "the broker is at the address of broker.listen (with conf/relay.yaml and relay "
        "init's config, http://127.0.0.1:19121)")


class HangingHTTP:
    """A treq stand-in whose requests never answer; records cancellations."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.calls = 0

    def request(self, *args: Any, **kwargs: Any) -> defer.Deferred:
        self.calls += 1

        def cancel(d: defer.Deferred) -> None:
            self.cancelled += 1

        return defer.Deferred(cancel)


def test_a_request_that_never_answers_times_out_and_is_retried() -> None:
    clock = Clock()
    http = HangingHTTP()
    client = RelayClient("http://broker.test", "alpha", SECRET, clock=clock, http=http,
                          info=V11_INFO, timeout=5)
    d = client.register()
    clock.pump([5, 2, 5, 4, 5, 8, 5])
    error = error_of(d)
    assert (error.status, error.code) == (0, "connection_error")
    assert (http.calls, http.cancelled) == (4, 4)


def test_caller_cancellation_is_not_retried() -> None:
    clock = Clock()
    http = HangingHTTP()
    client = RelayClient("http://broker.test", "alpha", SECRET, clock=clock, http=http,
                          info=V11_INFO)
    d = client.pull(limit=1)
    d.cancel()
    with pytest.raises(defer.CancelledError):
        result_of(d)
    clock.pump([20, 20, 20])
    assert http.calls == 1
    assert not clock.getDelayedCalls()


def test_long_poll_gets_a_longer_timeout() -> None:
    clock = Clock()
    http = HangingHTTP()
    client = RelayClient(
        "http://broker.test", "alpha", SECRET, clock=clock, http=http, timeout=5, retry_delays=()
    )
    client.info = {"protocol": "1.0", "capabilities": {"longPoll": {"maxWaitSeconds": 20}}}
    d = client.pull(wait=20)
    clock.advance(5 + 20 + 9)
    assert not d.called
    clock.advance(1)
    assert error_of(d).code == "connection_error"


def test_rejects_non_http_urls() -> None:
    with pytest.raises(RelayError) as info:
        RelayClient("ftp://x", "alpha", SECRET, clock=Clock(), http=object())
    assert info.value.code == "bad_broker_url"


def test_an_ipv6_literal_broker_url_is_refused_with_the_reason() -> None:
    with pytest.raises(RelayError) as info:
        RelayClient("http://[::1]:8080", "alpha", SECRET, clock=Clock())
    assert info.value.code == "bad_broker_url" and "host name" in info.value.message


# --- against our in-memory broker ---------------------------------------------
