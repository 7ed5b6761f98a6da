"""``GET /v1/events`` (REACH §11): the streams of an agent's events in order, resuming by
``since`` or ``Last-Event-ID``, resets, keepalives, the limits, slow readers and clients
that go away; the events a v2/v3 send makes.

In memory, time on a ``task.Clock``. The rules that make the events are
tests/rules/test_events.py.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import pytest_twisted
from twisted.internet.task import Clock

from relay.broker.loopback import connect, disconnect
from relay.rules import events
from relay.testing import SECRET, START, build_site, make_config
from relay.wire.signing import sign
from tests.support.api import Broker, assert_error


def records(raw: bytes) -> Tuple[int, List[Dict[str, Any]]]:
    """(keepalives, SSE records) of a stream's bytes."""
    keepalives = 0
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block:
            continue
        if block == ": keepalive":
            keepalives += 1
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append({"id": fields["id"], "event": fields["event"],
                    "data": json.loads(fields["data"])})
    return keepalives, out


class FakeRequest:
    """What a stream uses of a request, recorded."""

    def __init__(self) -> None:
        from twisted.web.http_headers import Headers

        self.responseHeaders = Headers()
        self.written: List[bytes] = []
        self.producer: Any = None

    def setResponseCode(self, code: int) -> None:
        self.code = code

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert streaming and self.producer is None
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None


def json_data(event):
    import json

    return json.loads(event.data)


# -- v1.3 (REACH §11) ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_stream_carries_the_events_in_order_and_closes_for_a_newer_one():
    b = Broker(maxStreamsPerAgent=1)
    await b.register("alpha", "beta")
    stream = b.get("beta", "/v1/events")
    assert not stream.called, "the stream stays open"
    first = await b.message("alpha", "beta", body={"text": "not in the stream"})
    second = await b.message("alpha", "beta")
    (pulled,) = await b.pull("beta", limit=1)
    b.flush()
    newer = b.get("beta", "/v1/events")  # closes the oldest stream of beta
    b.flush()
    reply = await stream
    assert not newer.called
    assert reply.code == 200
    assert reply.header("content-type") == "text/event-stream"
    assert reply.header("cache-control") == "no-store"
    assert b"not in the stream" not in reply.raw
    keepalives, got = records(reply.raw)
    assert [(r["event"], r["data"]["id"]) for r in got] == [("message", first),
                                                           ("message", second)]
    assert int(got[0]["id"]) < int(got[1]["id"])
    assert pulled["id"] == first
    b.broker.stop()
    b.flush()


@pytest_twisted.ensureDeferred
async def test_resume_by_since_or_last_event_id_gives_exactly_what_followed():
    b = Broker(maxStreamsPerAgent=1)
    await b.register("alpha", "beta")
    ids = [await b.message("alpha", "beta") for _ in range(4)]
    page = await b.broker.store.events("beta", 0, 10)
    marks = [e.id for e in page.events]

    async def replayed(**kw) -> List[Dict[str, Any]]:
        stream = b.get("beta", kw.pop("path", "/v1/events"), **kw)
        b.get("beta", "/v1/events")  # closes it
        b.flush()
        return records((await stream).raw)[1]

    got = await replayed(path=f"/v1/events?since={marks[1]}")
    assert [r["data"]["id"] for r in got] == ids[2:]
    got = await replayed(headers={"Last-Event-ID": str(marks[2])})
    assert [r["data"]["id"] for r in got] == ids[3:]
    # the query wins over the header
    got = await replayed(path=f"/v1/events?since={marks[0]}",
                         headers={"Last-Event-ID": str(marks[2])})
    assert [r["data"]["id"] for r in got] == ids[1:]
    # nothing: the present
    assert await replayed() == []
    b.broker.stop()
    b.flush()


@pytest_twisted.ensureDeferred
async def test_an_unknown_or_expired_id_is_a_reset_then_the_stream_goes_on():
    b = Broker(maxStreamsPerAgent=1, eventRetentionSeconds=60)
    await b.register("alpha", "beta")
    await b.message("alpha", "beta")
    stream = b.get("beta", "/v1/events?since=999")
    later = await b.message("alpha", "beta")
    b.get("beta", "/v1/events")
    b.flush()
    got = records((await stream).raw)[1]
    assert got[0]["event"] == "reset" and got[0]["data"] == {"reason": "unknown event id"}
    assert [r["data"]["id"] for r in got[1:]] == [later]
    assert int(got[1]["id"]) > int(got[0]["id"])

    b.clock.advance(120)
    await b.broker.sweep_expired()  # events older than eventRetentionSeconds leave
    stream = b.get("beta", "/v1/events?since=1")
    b.get("beta", "/v1/events")
    b.flush()
    (reset,) = records((await stream).raw)[1]
    assert reset["event"] == "reset" and "eventRetentionSeconds" in reset["data"]["reason"]
    b.broker.stop()
    b.flush()


@pytest_twisted.ensureDeferred
async def test_a_keepalive_at_least_every_15_seconds_from_one_timer():
    b = Broker(maxStreamsPerAgent=1)
    await b.register("alpha", "beta", "gamma")
    stream = b.get("beta", "/v1/events")
    other = b.get("gamma", "/v1/events")
    calls = len(b.clock.getDelayedCalls())
    for _ in range(4):
        b.advance(15)
    assert len(b.clock.getDelayedCalls()) == calls, "no timer per stream"
    b.get("beta", "/v1/events")
    b.flush()
    keepalives, got = records((await stream).raw)
    assert keepalives == 1 + 4 and got == []  # one as it opens, then one per 15 s
    b.broker.stop()
    b.flush()
    assert records((await other).raw)[0] == 5
    assert not [c for c in b.clock.getDelayedCalls() if "keepalive" in repr(c.func)]


@pytest_twisted.ensureDeferred
async def test_the_limits_per_agent_and_in_all():
    b = Broker(maxStreamsPerAgent=2, maxStreams=3)
    await b.register("alpha", "beta", "gamma")
    one, two = b.get("beta", "/v1/events"), b.get("beta", "/v1/events")
    b.flush()
    assert not one.called and not two.called
    three = b.get("beta", "/v1/events")
    b.flush()
    assert (await one).code == 200 and not two.called and not three.called
    assert b.broker.event_streams() == {"beta": 2}
    four = b.get("gamma", "/v1/events")
    refused = await b.get("alpha", "/v1/events")
    assert_error(refused, 503, "busy")
    assert "broker.maxStreams" in refused.json["error"]["message"]
    assert b.broker.event_streams() == {"beta": 2, "gamma": 1}
    b.broker.stop()
    b.flush()
    for d in (two, three, four):
        assert (await d).code == 200


@pytest_twisted.ensureDeferred
async def test_head_is_no_route_and_the_stream_is_signed():
    b = Broker()
    await b.register("beta")
    head = await b.request("beta", "HEAD", "/v1/events")
    assert head.code == 404 and head.raw == b"" and b.broker.event_streams() == {}
    assert_error(await b.get(None, "/v1/events"), 401, "unauthenticated")
    assert b.broker.event_streams() == {}


def test_a_client_that_goes_away_leaves_the_table():
    clock = Clock()
    clock.advance(START)
    site = build_site(make_config(), clock)
    broker = site.resource.api.broker
    protocol, transport = connect(site)
    ts = int(START)
    protocol.dataReceived(
        b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: beta\r\n"
        b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n\r\n"
        % (ts, sign(SECRET, "GET", "/v1/events", ts, b"").encode()))
    clock.advance(0)
    head = transport.take()
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b": keepalive\n\n\r\n")
    assert broker.event_streams() == {"beta": 1}
    disconnect(protocol)
    assert broker.event_streams() == {}
    clock.advance(events.KEEPALIVE_SECONDS)
    assert transport.take() == b""


@pytest_twisted.ensureDeferred
async def test_a_delayed_message_reaches_the_stream_when_it_becomes_deliverable():
    b = Broker(maxStreamsPerAgent=1)
    await b.register("alpha", "beta")
    stream = b.get("beta", "/v1/events")
    reply = await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": 30})
    assert reply.code == 201
    b.advance(29)
    assert (await b.broker.store.events("beta", 0, 10)).events == []
    b.advance(1)
    b.get("beta", "/v1/events")
    b.flush()
    (event,) = records((await stream).raw)[1]
    assert event["event"] == "message" and event["data"]["id"] == reply.json["id"]
    assert len(await b.pull("beta")) == 1, "the event says there is something to pull"
    b.broker.stop()
    b.flush()


@pytest_twisted.ensureDeferred
async def test_a_client_that_reads_slowly_pauses_its_stream_without_losing_events():
    b = Broker()
    await b.register("alpha", "beta")
    request = FakeRequest()
    b.broker.streams.open("beta", request, None)
    stream = request.producer
    assert request.written == [events.KEEPALIVE]
    stream.pauseProducing()  # the transport's buffer is full
    ids = [await b.message("alpha", "beta") for _ in range(3)]
    b.clock.advance(events.KEEPALIVE_SECONDS)
    assert request.written == [events.KEEPALIVE], "nothing more while paused"
    stream.resumeProducing()
    got = records(b"".join(request.written))[1]
    assert [r["data"]["id"] for r in got] == ids
    b.broker.stop()
    assert request.producer is None, "unregistered when the stream ends"


@pytest_twisted.ensureDeferred
async def test_keepalives_are_spread_over_the_seconds_of_their_period():
    # Ten thousand streams written in one turn of the reactor every 15 s would hold
    # up every event of that instant: each second takes a fifteenth of them.
    b = Broker(maxStreamsPerAgent=100)
    await b.register("beta")
    requests = [FakeRequest() for _ in range(45)]
    for request in requests:
        b.broker.streams.open("beta", request, None)
    per_second = []
    for _ in range(events.KEEPALIVE_SECONDS):
        before = sum(len(r.written) for r in requests)
        b.clock.advance(1)
        per_second.append(sum(len(r.written) for r in requests) - before)
    assert per_second == [3] * events.KEEPALIVE_SECONDS
    assert all(r.written == [events.KEEPALIVE] * 2 for r in requests), "one each per 15 s"
    b.clock.advance(events.KEEPALIVE_SECONDS * 2)  # a reactor late by 30 s: each gets one
    assert all(len(r.written) == 3 for r in requests)
    b.broker.stop()


@pytest_twisted.ensureDeferred
async def test_a_stream_from_the_present_carries_what_follows_its_answer():
    # The store's read of "the present" may run after the client saw the answer's
    # headers and sent (a database read on a thread): the stream's position is
    # taken before its headers go out, so what the client causes then is on it.
    from twisted.internet.defer import Deferred

    b = Broker()
    await b.register("alpha", "beta")
    store = b.broker.store
    events_of = store.events
    held: List[Deferred] = []

    def slow(agent, position, limit):
        later: Deferred = Deferred()
        later.addCallback(lambda _: events_of(agent, position, limit))
        held.append(later)
        return later

    store.events = slow
    request = FakeRequest()
    done = b.broker.streams.open("beta", request, None)
    sent = None
    if request.written:  # the client saw the headers: it sends now
        sent = await b.message("alpha", "beta")
    held.pop(0).callback(None)
    store.events = events_of
    if sent is None:
        assert request.written == [events.KEEPALIVE], "the headers go out once placed"
        sent = await b.message("alpha", "beta")
    while held:
        held.pop(0).callback(None)
    got = records(b"".join(request.written))[1]
    assert [r["data"]["id"] for r in got] == [sent]
    b.broker.stop()
    assert done.called


@pytest_twisted.ensureDeferred
async def test_a_stream_whose_present_cannot_be_read_is_503():
    from twisted.internet.defer import fail

    b = Broker()
    await b.register("beta")
    b.broker.store.events = lambda *args: fail(OSError("disk gone"))
    request = FakeRequest()
    done = b.broker.streams.open("beta", request, None)
    failure = []
    done.addErrback(failure.append)
    assert failure and failure[0].value.status == 503
    assert request.written == [] and b.broker.event_streams() == {}


# -- the v2/v3 wire (WIRE-V2) --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_v2_messages_are_events_of_their_recipient(v2_brokers):
    broker = v2_brokers()
    alpha = broker.client("alpha")
    sent = (await alpha.send_request("beta", "evented")).json["message_id"]
    page = await broker.store.events("beta", 0, 10)
    assert [json_data(e)["id"] for e in page.events] == [sent]
    assert "evented" not in repr([e.data for e in page.events])  # ids, never bodies
