"""Webhooks (REACH §12): the pure decisions, and the delivery loop over a memory
store with a task.Clock and a receiver in memory."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple
from urllib.parse import urlsplit

import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.web.client import ResponseNeverReceived

from relay.broker.webhooks import HookSettings, WebhookDelivery, http_poster
from relay.rules import hooks
from relay.rules.events import Event
from relay.rules.hooks import HookState
from relay.store.memory import MemoryStore
from relay.testing import RULES, START, make_config, new_message
from relay.wire import errors
from relay.wire.protocol import KEEP_CARD
from relay.wire.signing import verify
from tests.support.api import Broker

AGENT_SECRET = "beta-own-secret-0123456789"

# -- pure -------------------------------------------------------------------------------


def test_backoff_doubles_up_to_300_seconds():
    assert [hooks.backoff(n) for n in range(1, 12)] == [
        1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_a_failed_try_retries_then_skips_then_disables():
    state = HookState(url="http://127.0.0.1:1/", acked=3)
    assert hooks.failed(state, 4, START, max_attempts=3, disable_after=5) == ("retry", 1)
    assert state.failing_since == START
    assert hooks.failed(state, 4, START + 1, 3, 5) == ("retry", 2)
    assert hooks.failed(state, 4, START + 3, 3, 5) == ("skip", 0)
    assert state.acked == 4 and state.tries == 0 and state.failures == 3
    assert hooks.failed(state, 5, START + 4, 3, 5) == ("retry", 1)
    assert hooks.failed(state, 5, START + 5, 3, 5) == ("disable", 0)
    assert state.disabled and state.failing_since == START
    hooks.enabled(state, "http://127.0.0.1:2/")
    assert not state.disabled and state.failures == 0 and state.failing_since is None
    hooks.delivered(state, 5, START + 9)
    assert state.acked == 5 and state.last_delivered == START + 9
    assert HookState.from_json(state.to_json()) == state


@pytest.mark.parametrize("body", [
    {"webhook": "http://127.0.0.1:1/"}, {"webhook": {}}, {"webhook": {"url": 5}},
    {"webhook": {"url": "ftp://127.0.0.1/"}}, {"webhook": {"url": "http://"}},
    {"webhook": {"url": "http://127.0.0.1:1/" + "x" * 2048}},
    {"webhook": {"url": "http://127.0.0.1:1/", "secret": "x"}},
    # a port that is not a number 1..65535, no host: nothing could ever be sent there
    {"webhook": {"url": "http://127.0.0.1:abc/"}}, {"webhook": {"url": "http://127.0.0.1:0/"}},
    {"webhook": {"url": "http://127.0.0.1:65536/"}}, {"webhook": {"url": "http://:80/"}},
    # past a webhookAllow prefix by its text, to another host (userinfo)
    {"webhook": {"url": "http://127.0.0.1:1@127.0.0.2:8080/hook"}},
    {"webhook": {"url": "http://localhost:@169.254.169.254/latest/meta-data/"}},
    {"webhook": {"url": "http://[::1]:1@[::ffff:169.254.169.254]/"}},
])
def test_a_bad_webhook_is_400(body):
    with pytest.raises(errors.RelayError) as caught:
        hooks.parse_webhook(body, KEEP_CARD)
    assert caught.value.status == 400


def test_the_webhook_of_a_register_body():
    assert hooks.parse_webhook({}, KEEP_CARD) is KEEP_CARD
    assert hooks.parse_webhook({"webhook": None}, KEEP_CARD) is None
    url = "https://hooks.example/in?x=1"
    assert hooks.parse_webhook({"webhook": {"url": url}}, KEEP_CARD) == url
    with pytest.raises(errors.RelayError) as caught:
        hooks.check_url(url, ("http://127.0.0.1:",))
    assert caught.value.status == 400 and "broker.webhookAllow" in caught.value.message
    hooks.check_url(url, ("https://hooks.example/",))


def test_the_request_is_signed_with_the_agents_own_secret():
    event = Event(7, "beta", "message", '{"id":"m1"}', START)
    body, headers = hooks.request("beta", AGENT_SECRET, "http://127.0.0.1:9/in/x?q=1",
                                  event, int(START))
    assert json.loads(body) == {"id": "7", "event": "message", "data": {"id": "m1"}}
    assert headers[b"X-Relay-Event-Id"] == b"7" and headers[b"X-Relay-Agent"] == b"beta"
    signature = headers[b"X-Relay-Signature"].decode()
    assert verify(AGENT_SECRET, "POST", "/in/x?q=1", int(START), body, signature)
    assert not verify("another-secret-0123456789", "POST", "/in/x?q=1", int(START), body,
                      signature)


@pytest.mark.parametrize("url, target", [
    ("http://127.0.0.1:9/in x?q=a b", "/in%20x?q=a%20b"),
    ("http://127.0.0.1:9/\u00e9t\u00e9?q=\u00fc", "/%C3%A9t%C3%A9?q=%C3%BC"),
    ("http://127.0.0.1:9/in?q=a%20b", "/in?q=a%20b"),
    ("http://127.0.0.1:9?q=1#frag", "/?q=1"),
    ("http://[::1]:9/in", "/in"),
])
def test_the_signature_covers_the_request_target_as_sent(url, target):
    """The receiver verifies over the path and query of its request line: a URL
    that goes out percent-encoded is signed as it goes out (REACH §12)."""
    event = Event(7, "beta", "message", '{"id":"m1"}', START)
    body, headers = hooks.request("beta", AGENT_SECRET, url, event, int(START))
    wire = urlsplit(hooks.wire_url(url))
    assert wire.path + (f"?{wire.query}" if wire.query else "") == target
    assert hooks.wire_url(hooks.wire_url(url)) == hooks.wire_url(url)
    assert verify(AGENT_SECRET, "POST", target, int(START), body,
                  headers[b"X-Relay-Signature"].decode())


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("host, interface", [("127.0.0.1", "127.0.0.1"), ("[::1]", "\\:\\:1")])
async def test_the_poster_reaches_every_default_prefix_with_the_signed_target(host, interface):
    """http_poster sends to an IPv6 literal (``http://[::1]:`` is a default
    ``webhookAllow`` prefix) and puts on the request line the target the signature
    covers."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import serverFromString
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    got: List[Tuple[bytes, bytes, bytes]] = []

    class Record(Resource):
        isLeaf = True

        def render_POST(self, request: Any) -> bytes:
            got.append((request.uri, request.content.read(),
                        request.getHeader(b"X-Relay-Signature")))
            request.setResponseCode(204)
            return b""

    port = await serverFromString(reactor, f"tcp6:0:interface={interface}"
                                  if host.startswith("[") else
                                  f"tcp:0:interface={interface}").listen(Site(Record()))
    try:
        url = f"http://{host}:{port.getHost().port}/in x/\u00e9?q=a b"
        event = Event(7, "beta", "message", '{"id":"m1"}', START)
        body, headers = hooks.request("beta", AGENT_SECRET, url, event, int(START))
        assert await http_poster(reactor)(url, headers, body) == 204
        [(target, received, signature)] = got
        assert target == b"/in%20x/%C3%A9?q=a%20b" and received == body
        assert verify(AGENT_SECRET, "POST", target.decode(), int(START), received,
                      signature.decode())
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("stall", ["status", "body"])
async def test_a_receiver_that_does_not_answer_in_time_is_one_failed_try(stall):
    """No 2xx within the deadline (for the status or the rest of the body) fails the
    try once: the request is not sent again at once, as for a dropped connection;
    the backoff decides when the next try goes."""
    import time

    from twisted.internet import reactor
    from twisted.internet.endpoints import serverFromString
    from twisted.web.resource import Resource
    from twisted.web.server import NOT_DONE_YET, Site

    got: List[Any] = []

    class Stall(Resource):
        isLeaf = True

        def render_POST(self, request: Any) -> Any:
            got.append(request)
            if stall == "body":
                request.setHeader(b"Content-Length", b"10")
                request.write(b"12345")  # the status and half the body, then nothing
            return NOT_DONE_YET

    port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(Site(Stall()))
    try:
        url = f"http://127.0.0.1:{port.getHost().port}/in"
        event = Event(7, "beta", "message", '{"id":"m1"}', START)
        body, headers = hooks.request("beta", AGENT_SECRET, url, event, int(START))
        started = time.monotonic()
        with pytest.raises((CancelledError, ResponseNeverReceived)):
            await http_poster(reactor, timeout=0.5)(url, headers, body)
        assert time.monotonic() - started < 2
        assert len(got) == 1
    finally:
        for request in got:
            request.channel.transport.abortConnection()
        await port.stopListening()


# -- the loop ---------------------------------------------------------------------------


class Receiver:
    """Answers each POST with the next of ``codes`` (then 200), at once or when told."""

    def __init__(self, codes: Tuple[int, ...] = (), hold: bool = False) -> None:
        self.codes = list(codes)
        self.hold = hold
        self.got: List[Tuple[str, Dict[bytes, bytes], Dict[str, Any]]] = []
        self.waiting: List[Deferred] = []

    def __call__(self, url: str, headers: Dict[bytes, bytes], body: bytes) -> Deferred:
        self.got.append((url, headers, json.loads(body)))
        code = self.codes.pop(0) if self.codes else 200
        if self.hold:
            d: Deferred = Deferred()
            self.waiting.append(d)
            return d.addCallback(lambda _: code)
        return succeed(code)

    def ids(self) -> List[str]:
        return [body["data"]["id"] for _, _, body in self.got]


def delivery(receiver: Receiver, clock=None, store=None, **broker: Any):
    from twisted.internet.task import Clock

    clock = clock or Clock()
    if clock.seconds() == 0:
        clock.advance(START)
    config = make_config(agents={"beta": {"secret": AGENT_SECRET},
                                 "alpha": {"secret": "alpha-secret-0123456789"}}, **broker)
    store = store or MemoryStore()
    service = WebhookDelivery(store, clock, receiver, HookSettings.from_config(config),
                              config.secret)
    service.startService()
    return service, store, clock


async def send(store, clock, count: int, to: str = "beta") -> List[str]:
    ids = []
    for _ in range(count):
        message = new_message("alpha", to, clock.seconds())
        await store.add(message, RULES)
        ids.append(message.id)
    return ids


@pytest_twisted.ensureDeferred
async def test_events_go_in_order_one_at_a_time_signed_from_the_present():
    receiver = Receiver(hold=True)
    service, store, clock = delivery(receiver)
    await send(store, clock, 1)  # before the webhook: not sent
    await service.register("beta", "http://127.0.0.1:8/hook", KEEP_CARD)
    ids = await send(store, clock, 3)
    assert len(receiver.got) == 1, "one request at a time per agent"
    for _ in range(3):
        receiver.waiting.pop(0).callback(None)
    assert receiver.ids() == ids
    url, headers, body = receiver.got[0]
    assert url == "http://127.0.0.1:8/hook" and body["event"] == "message"
    assert verify(AGENT_SECRET, "POST", "/hook", int(headers[b"X-Relay-Timestamp"]),
                  json.dumps(body, separators=(",", ":")).encode(),
                  headers[b"X-Relay-Signature"].decode())
    assert service.health()["beta"]["lastDelivered"] == START
    assert "127.0.0.1" not in repr(service.health())


@pytest_twisted.ensureDeferred
async def test_a_receiver_that_fails_is_retried_with_backoff_then_skipped():
    receiver = Receiver(codes=(500, 503, 500, 404))
    service, store, clock = delivery(receiver, webhookMaxAttempts=3)
    await service.register("beta", "http://127.0.0.1:8/", KEEP_CARD)
    first, second = await send(store, clock, 2)
    assert receiver.ids() == [first]
    clock.advance(0.9)
    assert receiver.ids() == [first]
    clock.advance(0.1)  # 1 s after the first failure
    assert receiver.ids() == [first, first]
    clock.advance(1.9)
    assert len(receiver.got) == 2
    clock.advance(0.1)  # 2 s after the second: the third and last try, then skipped
    assert receiver.ids() == [first, first, first, second]
    clock.advance(1)  # the 404 of the second event is retried like any failure
    assert receiver.ids() == [first, first, first, second, second]
    assert service.health()["beta"]["failingSince"] is None
    assert service.pending() == []


@pytest_twisted.ensureDeferred
async def test_failures_in_a_row_disable_the_webhook_until_it_is_registered_again():
    receiver = Receiver(codes=(500,) * 4)
    service, store, clock = delivery(receiver, webhookMaxAttempts=2, webhookDisableAfter=4)
    await service.register("beta", "http://127.0.0.1:8/", KEEP_CARD)
    first, second, third = await send(store, clock, 3)
    for _ in range(10):
        clock.advance(300)
    # the first skipped after its two tries, the second's two tries disable the webhook
    assert receiver.ids() == [first, first, second, second]
    assert service.shown("beta") == {"url": "http://127.0.0.1:8/", "disabled": True}
    assert service.health()["beta"]["disabled"] is True
    (fourth,) = await send(store, clock, 1)
    assert len(receiver.got) == 4, "a disabled webhook sends nothing"
    await service.register("beta", "http://127.0.0.1:8/", KEEP_CARD)
    assert service.shown("beta") == {"url": "http://127.0.0.1:8/"}
    assert receiver.ids()[4:] == [second, third, fourth]  # from where it stopped


@pytest_twisted.ensureDeferred
async def test_a_narrower_allow_list_stops_deliveries_and_a_wider_one_resumes():
    receiver = Receiver()
    service, store, clock = delivery(receiver)
    await service.register("beta", "http://localhost:8/", KEEP_CARD)
    await send(store, clock, 1)
    assert len(receiver.got) == 1
    narrow = make_config(webhookAllow=["http://127.0.0.1:"],
                         agents={"beta": {"secret": AGENT_SECRET},
                                 "alpha": {"secret": "alpha-secret-0123456789"}})
    service.configure(HookSettings.from_config(narrow), narrow.secret)
    later = await send(store, clock, 2)
    clock.advance(600)
    assert len(receiver.got) == 1, "never sent to a URL outside the list in force"
    wide = make_config(agents={"beta": {"secret": AGENT_SECRET},
                               "alpha": {"secret": "alpha-secret-0123456789"}})
    service.configure(HookSettings.from_config(wide), wide.secret)
    assert receiver.ids()[1:] == later


@pytest_twisted.ensureDeferred
async def test_at_most_webhook_concurrency_requests_in_flight():
    receiver = Receiver(hold=True)
    service, store, clock = delivery(receiver, webhookConcurrency=2)
    for agent in ("beta", "gamma", "delta"):
        await service.register(agent, "http://127.0.0.1:8/" + agent, KEEP_CARD)
        await send(store, clock, 1, to=agent)
    assert len(receiver.got) == 2
    receiver.waiting.pop(0).callback(None)
    assert len(receiver.got) == 3


@pytest_twisted.ensureDeferred
async def test_delivery_resumes_after_a_restart_from_the_last_acknowledged_event():
    receiver = Receiver()
    service, store, clock = delivery(receiver)
    await service.register("beta", "http://127.0.0.1:8/", KEEP_CARD)
    await send(store, clock, 1)
    service.stopService()
    missed = await send(store, clock, 2)
    again = Receiver()
    delivery(again, clock=clock, store=store)
    assert again.ids() == missed


@pytest_twisted.ensureDeferred
async def test_config_wins_and_removal_stops():
    receiver = Receiver()
    service, store, clock = delivery(receiver)
    configured = make_config(agents={"beta": {"secret": AGENT_SECRET,
                                              "webhook": {"url": "http://127.0.0.1:9/cfg"}},
                                     "alpha": {"secret": "alpha-secret-0123456789"}})
    service.configure(HookSettings.from_config(configured), configured.secret)
    await service.register("beta", "http://127.0.0.1:8/own", KEEP_CARD)
    await send(store, clock, 1)
    assert [url for url, _, _ in receiver.got] == ["http://127.0.0.1:9/cfg"]
    assert service.shown("beta") == {"url": "http://127.0.0.1:9/cfg"}
    await service.register("gamma", "http://127.0.0.1:8/g", KEEP_CARD)
    await service.register("gamma", None, KEEP_CARD)
    assert service.shown("gamma") is None
    await send(store, clock, 1, to="gamma")
    assert len(receiver.got) == 1


# -- through the API ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_register_sets_shows_and_refuses_webhooks():
    b = Broker(agents={"beta": {"secret": AGENT_SECRET},
                       "alpha": {"secret": "alpha-secret-0123456789"}})
    b.secrets = {"beta": AGENT_SECRET, "alpha": "alpha-secret-0123456789"}
    reply = await b.post("beta", "/register", {"webhook": {"url": "http://127.0.0.1:8/h"}})
    assert reply.code == 200 and reply.json["webhook"] == {"url": "http://127.0.0.1:8/h"}
    reply = await b.post("beta", "/register", {})
    assert reply.json["webhook"] == {"url": "http://127.0.0.1:8/h"}
    refused = await b.post("beta", "/register", {"webhook": {"url": "http://example.com/"}})
    assert refused.code == 400 and "broker.webhookAllow" in refused.json["error"]["message"]
    peers = await b.get("alpha", "/peers")
    assert "127.0.0.1:8" not in peers.raw.decode()
    reply = await b.post("beta", "/register", {"webhook": None})
    assert "webhook" not in reply.json
    assert (await b.post("alpha", "/register", {})).json == {
        "ok": True, "agent": "alpha", "ts": int(b.clock.seconds())}
    info = await b.get(None, "/")
    assert info.json["capabilities"]["webhooks"] == {"maxAttempts": 12}


@pytest_twisted.ensureDeferred
async def test_events_past_retention_are_skipped_and_the_receiver_gets_a_reset():
    from twisted.logger import capturedLogs

    receiver = Receiver(codes=(500,))
    service, store, clock = delivery(receiver)
    await service.register("beta", "http://127.0.0.1:8/", KEEP_CARD)
    (old,) = await send(store, clock, 1)
    assert receiver.ids() == [old]
    clock.advance(0.5)
    await store.trim_events(clock.seconds())  # retention removes it before its retry
    with capturedLogs() as logs:
        clock.advance(0.5)
    assert [e["log_format"] for e in logs if "retention" in e["log_format"]]
    assert [body["event"] for _, _, body in receiver.got] == ["message", "reset"]
    _, headers, reset = receiver.got[1]
    assert "eventRetentionSeconds" in reset["data"]["reason"], "it re-syncs by pulling"
    assert headers[b"X-Relay-Event-Id"] == reset["id"].encode()
    assert verify(AGENT_SECRET, "POST", "/", int(headers[b"X-Relay-Timestamp"]),
                  json.dumps(reset, separators=(",", ":")).encode(),
                  headers[b"X-Relay-Signature"].decode())
    (new,) = await send(store, clock, 1)
    assert [body["data"].get("id") for _, _, body in receiver.got] == [old, None, new]
    assert int(receiver.got[2][2]["id"]) > int(reset["id"])


@pytest_twisted.ensureDeferred
async def test_a_busy_agents_events_are_read_from_the_store_a_batch_at_a_time():
    receiver = Receiver(hold=True)
    service, store, clock = delivery(receiver)
    await service.register("beta", "http://127.0.0.1:8/hook", KEEP_CARD)
    reads = []
    events = store.events

    def counted(agent, position, limit):
        reads.append((agent, position, limit))
        return events(agent, position, limit)

    store.events = counted
    ids = await send(store, clock, 10)
    for _ in range(10):
        receiver.waiting.pop(0).callback(None)
    assert receiver.ids() == ids, "in order, each once"
    assert len(reads) <= 3, "not a read per event"
    more = await send(store, clock, 2)
    for _ in range(2):
        receiver.waiting.pop(0).callback(None)
    assert receiver.ids() == ids + more


@pytest_twisted.ensureDeferred
async def test_an_event_recorded_while_a_read_is_under_way_is_not_missed():
    # A read of the store may have started before an event's change committed (on
    # PostgreSQL, another broker's send is told by a notification after its commit):
    # the page it answers lacks the event, and the event's kick came while busy.
    receiver = Receiver()
    service, store, clock = delivery(receiver)
    await service.register("beta", "http://127.0.0.1:8/hook", KEEP_CARD)
    events = store.events
    held: List[Tuple[Deferred, Any]] = []

    async def stale(agent, position, limit):
        page = await events(agent, position, limit)  # read before the send
        later: Deferred = Deferred()
        held.append((later, page))
        return await later

    store.events = lambda *args: Deferred.fromCoroutine(stale(*args))
    service.kick("beta")
    assert len(held) == 1 and not held[0][1].events
    store.events = events
    (sent,) = await send(store, clock, 1)  # its kick finds the agent busy
    later, page = held.pop()
    later.callback(page)
    assert receiver.ids() == [sent], "the event is delivered without another send"
