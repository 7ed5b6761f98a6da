"""The client side of events (REACH §11, §12): the SSE reader, ``RelayClient.events``
against the in-memory broker (time is a Clock), and the webhook verifier for agents'
own servers."""

from __future__ import annotations

import json
from typing import Any, List

import pytest
from twisted.internet import defer

from relay.client import sse
from relay.client.sse import RelayEvent, SSEParser
from relay.client.webhook_receiver import WebhookRejected, verify
from relay.rules import hooks
from relay.rules.events import Event
from relay.wire.errors import RelayError
from tests.support.client import Net, failure_of

# -- reading the stream -----------------------------------------------------------------


def test_records_split_anywhere_give_the_same_events_and_comments_are_no_events():
    raw = (b": keepalive\n\nid: 7\nevent: message\ndata: {\"id\":\"m1\",\"from\":\"a\"}\n\n"
           b": keepalive\n\nid: 8\r\nevent: status\r\ndata: {\"id\":\"m0\",\"status\":\"done\"}"
           b"\r\n\r\nid: 9\revent: reset\rdata: {\"reason\":\"r\"}\r\r")
    expected = [RelayEvent("7", "message", {"id": "m1", "from": "a"}),
                RelayEvent("8", "status", {"id": "m0", "status": "done"}),
                RelayEvent("9", "reset", {"reason": "r"})]
    assert SSEParser().feed(raw) == expected
    for size in (1, 2, 3, 5, 7):
        parser = SSEParser()
        out: List[RelayEvent] = []
        for start in range(0, len(raw), size):
            out.extend(parser.feed(raw[start:start + size]))
        assert out == expected, size


def test_odd_records():
    parser = SSEParser()
    # data over two lines, a field without a space, unknown fields, no event type
    assert parser.feed(b'id:1\ndata: {"a":\ndata: 1}\nretry: 5\nx: y\n\n') == [
        RelayEvent("1", "message", {"a": 1})]
    # data that is no JSON object still counts, with empty data
    assert parser.feed(b"id: 2\nevent: message\ndata: [1]\n\n") == [
        RelayEvent("2", "message", {})]
    # a record without data or without an id is no event
    assert parser.feed(b"id: 3\nevent: message\n\nevent: message\ndata: {}\n\n") == []


def test_a_line_without_end_beyond_the_limit_is_refused():
    with pytest.raises(sse.StreamError):
        SSEParser().feed(b"data: " + b"x" * sse.MAX_LINE_BYTES)


def test_reconnect_delays():
    assert [sse.reconnect_delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


# -- RelayClient.events against the in-memory broker ---------------------------------


class Reader:
    """Reads the stream ``open_stream(on_state)`` gives into :attr:`events` until it
    ends."""

    def __init__(self, net: Net, open_stream: Any) -> None:
        self.events: List[RelayEvent] = []
        self.states: List[bool] = []
        self.stream = open_stream(self.states.append)
        self.done = defer.ensureDeferred(self._read())
        net.settle()

    async def _read(self) -> None:
        async for event in self.stream:
            self.events.append(event)

    def types(self) -> List[str]:
        return [event.type for event in self.events]


def two_agents(**broker: Any):
    net = Net(**broker)
    alpha, beta = net.client("alpha"), net.client("beta")
    net.run(alpha.register())
    net.run(beta.register())
    return net, alpha, beta


def send(net: Net, client: Any, to: str = "beta") -> str:
    return net.run(client.send(to, {"text": "never in an event"}))["id"]


def event_paths(net: Net) -> List[str]:
    return [path for method, path in net.http.paths() if path.startswith("/v1/events")]


def test_events_arrive_without_bodies_and_keepalives_keep_a_quiet_stream_open():
    net, alpha, beta = two_agents()
    reader = Reader(net, lambda s: beta.events(on_state=s))
    assert reader.stream.connected and reader.states == [True]
    sent = send(net, alpha)
    net.settle()
    (event,) = reader.events
    assert event.type == "message" and event.data["id"] == sent
    assert event.data["from"] == "alpha" and "never in an event" not in repr(event)
    assert reader.stream.last_id == event.id
    # keepalives come every 15 s: a minute of quiet is no lost stream
    for _ in range(12):
        net.settle(5)
    assert reader.stream.connections == 1 and event_paths(net) == ["/v1/events"]
    reader.stream.close()
    net.settle()
    assert reader.done.called and reader.states == [True]
    assert not reader.stream.connected


def test_a_stream_the_broker_closes_is_opened_again_after_the_last_event_read():
    net, alpha, beta = two_agents(maxStreamsPerAgent=1)
    reader = Reader(net, lambda s: beta.events(on_state=s))
    first = send(net, alpha)
    net.settle()
    # another stream of beta's closes this one (one stream per agent here)
    other = Reader(net, lambda s: net.client("beta").events(on_state=s))
    missed = [send(net, alpha), send(net, alpha)]
    net.settle(1)  # the reconnection delay; that stream closes the other in turn
    assert reader.stream.connections == 2
    assert [e.data["id"] for e in reader.events] == [first, *missed]
    assert len({e.id for e in reader.events}) == 3
    assert event_paths(net)[-1] == f"/v1/events?since={reader.events[0].id}"
    other.stream.close()
    reader.stream.close()
    net.settle()


class SilentBody:
    """A 200 answer whose body never brings a byte (a connection that died quietly)."""

    code = 200

    def __init__(self) -> None:
        self.stopped = False

    def deliverBody(self, protocol: Any) -> None:  # noqa: N802 (the interface's name)
        self.protocol = protocol
        protocol.makeConnection(self)

    def stopProducing(self) -> None:  # noqa: N802
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseFailed

        self.stopped = True
        self.protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionResetError())])))


def test_a_stream_gone_quiet_is_given_up_and_opened_again_where_it_was():
    net, alpha, beta = two_agents()
    silent = SilentBody()
    real = net.http.request

    def request(method: str, url: str, **kwargs: Any) -> defer.Deferred:
        if "/v1/events" in url and not silent.stopped:
            return defer.succeed(silent)
        return real(method, url, **kwargs)

    net.http.request = request
    reader = Reader(net, lambda s: beta.events(since="0", on_state=s))
    assert reader.stream.connected
    send(net, alpha)  # its event is not read: the connection is dead
    net.settle(34)
    assert reader.stream.connected and not silent.stopped
    net.settle(1)  # 2 x 15 s keepalive + 5 s without a byte
    assert silent.stopped and not reader.stream.connected
    net.settle(1)
    assert reader.stream.connected and reader.stream.connections == 2
    assert reader.types() == ["message"]
    reader.stream.close()
    net.settle()


def test_an_unknown_position_is_a_reset_given_to_the_caller():
    net, alpha, beta = two_agents()
    reader = Reader(net, lambda s: beta.events(since="999", on_state=s))
    assert reader.types() == ["reset"]
    assert "unknown" in reader.events[0].data["reason"]
    send(net, alpha)
    net.settle()
    assert reader.types() == ["reset", "message"]
    assert int(reader.events[1].id) > int(reader.events[0].id)
    reader.stream.close()
    net.settle()


def test_a_broker_without_events_is_a_clear_error_and_nothing_is_requested():
    net = Net(v11=True)
    beta = net.client("beta")
    reader = Reader(net, lambda s: beta.events(on_state=s))
    error = reader.done.result.value
    reader.done.addErrback(lambda _: None)
    assert isinstance(error, RelayError) and error.code == "unsupported"
    assert "events" in error.message and "REACH.md" in error.message
    assert event_paths(net) == []


def test_a_refused_signature_ends_the_stream_with_the_error():
    net = Net()
    impostor = net.client("beta")
    impostor._secret = "not the secret"
    reader = Reader(net, lambda s: impostor.events(on_state=s))
    error = reader.done.result.value
    reader.done.addErrback(lambda _: None)
    assert isinstance(error, RelayError) and error.status == 401
    assert len(event_paths(net)) == 1  # one try, and no retries of a refusal


def test_a_locked_agent_waits_out_the_lock_it_was_told_then_reads_on():
    net, alpha, beta = two_agents(security={"lockAfterFailures": 2, "lockMinutes": 2})
    impostor = net.client("beta")
    impostor._secret = "not the secret"
    for _ in range(2):
        failure_of(net.start(impostor.register()))
    waits: List[Any] = []
    stream = beta.events(on_wait=lambda error, seconds: waits.append((error.code, seconds)))
    done = defer.ensureDeferred(_read_all(stream, got := []))
    net.settle()
    assert waits == [("locked", 120.0)] and not done.called, "waiting, not ended"
    tries = len(event_paths(net))
    net.settle(119)
    assert len(event_paths(net)) == tries, "nothing asked before the lock runs out"
    net.settle(1)
    assert stream.connected
    sent = send(net, alpha)
    net.settle()
    assert [e.data["id"] for e in got] == [sent]
    stream.close()
    net.settle()


def test_the_wait_a_locked_answer_names():
    from relay.client.client import LOCKED_RETRY_SECONDS, locked_seconds

    def locked(text: str) -> RelayError:
        return RelayError(403, "locked", text)

    assert locked_seconds(locked("agent a is locked ...; try again in 5 min, or ...")) == 300
    assert locked_seconds(locked("agent a is locked ...; try again in 7 s, or ...")) == 7
    assert locked_seconds(locked("locked")) == LOCKED_RETRY_SECONDS
    assert locked_seconds(RelayError(403, "forbidden", "try again in 5 min")) is None


async def _read_all(stream: Any, into: List[RelayEvent]) -> None:
    async for event in stream:
        into.append(event)


# -- verifying a webhook ------------------------------------------------------------------

SECRET = "the-agent's-own-secret"
NOW = 1_800_000_000
URL = "http://127.0.0.1:8080/hooks/relay?team=a"


def webhook(event_type: str = "message", now: int = NOW, secret: str = SECRET):
    """The body and headers the broker sends (its own signing code)."""
    event = Event(41, "beta", event_type, '{"id":"m1","from":"alpha","kind":"request"}', now)
    body, raw_headers = hooks.request("beta", secret, URL, event, now)
    return body, {k.decode(): v.decode() for k, v in raw_headers.items()}


def test_a_broker_webhook_verifies_with_the_agents_own_secret():
    body, headers = webhook()
    event = verify(SECRET, "POST", "/hooks/relay?team=a", headers, body, NOW + 299,
                   agent="beta")
    assert event == RelayEvent("41", "message", {"id": "m1", "from": "alpha",
                                                 "kind": "request"})
    lower = {k.lower(): v for k, v in headers.items()}
    assert verify(SECRET, "post", "/hooks/relay?team=a", lower, body, NOW - 299) == event


@pytest.mark.parametrize(("change", "reason"), [
    ({"secret": "another secret"}, "does not match"),
    ({"target": "/hooks/relay"}, "does not match"),
    ({"target": "/hooks/relay?team=b"}, "does not match"),
    ({"body": b'{"id":"41","event":"message","data":{"id":"m2"}}'}, "does not match"),
    ({"now": NOW + 301}, "more than 300 s"),
    ({"now": NOW - 301}, "more than 300 s"),
    ({"method": "GET"}, "POST"),
    ({"agent": "alpha"}, "expected agent"),
    ({"drop": "X-Relay-Signature"}, "does not match"),
    ({"drop": "X-Relay-Timestamp"}, "X-Relay-Timestamp"),
    ({"header": ("X-Relay-Timestamp", "17e8")}, "X-Relay-Timestamp"),
    ({"header": ("X-Relay-Event-Id", "40")}, "X-Relay-Event-Id"),
])
def test_anything_else_is_rejected_naming_the_check(change, reason):
    body, headers = webhook()
    if "drop" in change:
        del headers[change["drop"]]
    if "header" in change:
        name, value = change["header"]
        headers[name] = value
    with pytest.raises(WebhookRejected) as info:
        verify(change.get("secret", SECRET), change.get("method", "POST"),
               change.get("target", "/hooks/relay?team=a"), headers,
               change.get("body", body), change.get("now", NOW), agent=change.get("agent"))
    assert reason in info.value.reason
    assert "alpha" not in info.value.reason or change.get("agent") == "alpha"


def test_a_signed_body_of_another_shape_is_rejected_without_showing_it():
    from relay.wire.signing import sign

    body = json.dumps({"id": 1, "secret words": True}).encode()
    headers = {"X-Relay-Timestamp": str(NOW),
               "X-Relay-Signature": sign(SECRET, "POST", "/h", NOW, body)}
    with pytest.raises(WebhookRejected) as info:
        verify(SECRET, "POST", "/h", headers, body, NOW)
    assert "secret words" not in str(info.value)
