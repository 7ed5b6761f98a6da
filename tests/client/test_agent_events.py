"""The agent runtime woken by events (REACH §11) instead of long-polling, against the
in-memory broker (time is a Clock): it pulls when a message event comes, falls back to
pulling as before while the stream is down, never loses a message, and costs fewer
requests per message (the requests are counted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from relay.agent.receipts import ReceiptStore
from relay.agent.runtime import AgentService
from tests.support.client import Net

MESSAGES = 10
GAP_SECONDS = 30


class Handler:
    def __init__(self) -> None:
        self.calls: List[str] = []

    def __call__(self, message: Dict[str, Any]) -> Any:
        self.calls.append(message["id"])
        return "ok"


def runtime(net: Net, tmp_path: Path, handler: Handler, **kwargs: Any) -> AgentService:
    client = net.client("worker")
    tmp_path.mkdir(exist_ok=True)
    receipts = ReceiptStore.for_agent("worker", tmp_path, net.clock)
    service = AgentService(client, handler, clock=net.clock, receipts=receipts, **kwargs)
    service.startService()
    net.settle()
    return service


def pulls(net: Net) -> int:
    return sum(1 for method, path in net.http.paths() if path == "/v1/pull")


def streams(net: Net) -> int:
    return sum(1 for method, path in net.http.paths() if path.startswith("/v1/events"))


def elapse(net: Net, seconds: int) -> None:
    for _ in range(seconds):
        net.settle(1)


def send(net: Net, alpha: Any) -> str:
    return net.run(alpha.send("worker", {"text": "work"}, kind="request"))["id"]


def scenario(tmp_path: Path, use_events: bool) -> Dict[str, Any]:
    """Ten requests, one every 30 s, to a runtime; what it took."""
    net = Net()
    alpha = net.client("alpha")
    net.run(alpha.register())
    handler = Handler()
    service = runtime(net, tmp_path, handler, use_events=use_events)
    elapse(net, 5)
    before = pulls(net)
    sent = []
    for _ in range(MESSAGES):
        sent.append(send(net, alpha))
        elapse(net, GAP_SECONDS)
    outcome = {"handled": handler.calls == sent, "pulls": pulls(net) - before,
               "streams": streams(net), "net": net}
    d = service.stopService()
    net.settle()
    assert d.called
    return outcome


def test_woken_by_events_it_pulls_once_per_message(tmp_path: Path):
    polled = scenario(tmp_path / "poll", use_events=False)
    woken = scenario(tmp_path / "events", use_events=True)
    assert polled["handled"] and woken["handled"]
    assert polled["streams"] == 0 and woken["streams"] == 1
    # Long-polling (20 s) asks about 2.5 times per message 30 s apart; events once.
    assert woken["pulls"] == MESSAGES
    assert polled["pulls"] >= 2 * MESSAGES


def test_idle_it_pulls_only_at_the_resync_interval(tmp_path: Path):
    net = Net()
    service = runtime(net, tmp_path, Handler(), resync_interval=120)
    start = pulls(net)
    assert start == 1  # at once: the stream opened first
    elapse(net, 119)
    assert pulls(net) == start
    elapse(net, 1)
    assert pulls(net) == start + 1
    service.stopService()
    net.settle()


def test_while_the_stream_is_down_it_long_polls_and_loses_nothing(tmp_path: Path):
    net = Net()
    alpha = net.client("alpha")
    net.run(alpha.register())
    handler = Handler()
    service = runtime(net, tmp_path, handler)
    elapse(net, 2)
    first = send(net, alpha)
    net.settle()
    assert handler.calls == [first]
    # The broker closes its streams and refuses new ones (503 busy): the stream is
    # down, the runtime long-polls as without events.
    net.api.broker.streams.stop()
    net.settle()
    assert not service._events.connected
    opened = streams(net)
    before = pulls(net)
    second = send(net, alpha)
    net.settle()
    assert handler.calls == [first, second]
    elapse(net, 60)
    assert streams(net) > opened, "it keeps trying to open the stream"
    assert pulls(net) - before >= 3, "long polls, every 20 s at most"
    third = send(net, alpha)
    net.settle()
    assert handler.calls == [first, second, third]
    service.stopService()
    net.settle()


def test_a_message_sent_during_a_pull_is_pulled_next(tmp_path: Path):
    net = Net()
    alpha = net.client("alpha")
    net.run(alpha.register())
    handler = Handler()
    service = runtime(net, tmp_path, handler, concurrency=4)
    elapse(net, 2)
    # Two sends in one go: the first event wakes a pull; the second message becomes
    # deliverable while it is under way, and its event asks for another.
    first = net.start(alpha.send("worker", {"text": "a"}, kind="request"))
    second = net.start(alpha.send("worker", {"text": "b"}, kind="request"))
    net.settle()
    assert sorted(handler.calls) == sorted([first.result["id"], second.result["id"]])
    service.stopService()
    net.settle()


def test_what_was_queued_before_it_started_is_all_taken_one_by_one(tmp_path: Path):
    net = Net()
    alpha = net.client("alpha")
    net.run(alpha.register())
    net.run(net.client("worker").register())
    queued = [send(net, alpha) for _ in range(5)]  # no event of these reaches its stream
    handler = Handler()
    service = runtime(net, tmp_path, handler, concurrency=1)
    net.settle()
    assert handler.calls == queued
    assert pulls(net) == 6  # five full pages, then one that finds the queue empty
    service.stopService()
    net.settle()


class Slow:
    """A handler whose calls end when the test says."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.pending: List[Any] = []

    def __call__(self, message: Dict[str, Any]) -> Any:
        from twisted.internet import defer

        self.calls.append(message["id"])
        d: defer.Deferred = defer.Deferred()
        self.pending.append(d)
        return d

    def finish(self) -> None:
        self.pending.pop(0).callback("ok")


def test_messages_that_came_while_it_was_busy_are_all_pulled_one_by_one(tmp_path: Path):
    net = Net()
    alpha = net.client("alpha")
    net.run(alpha.register())
    handler = Slow()
    service = runtime(net, tmp_path, handler, concurrency=1)
    first = send(net, alpha)
    net.settle()
    assert handler.calls == [first]
    # three more while the only slot is taken: their events come, no pull can
    later = [send(net, alpha) for _ in range(3)]
    net.settle()
    for _ in range(4):
        handler.finish()
        net.settle()
    assert handler.calls == [first, *later], "none waits for the resync"
    service.stopService()
    net.settle()


def test_a_reset_after_a_long_outage_makes_it_pull_and_it_lost_nothing(tmp_path: Path):
    from twisted.internet import defer
    from twisted.internet.error import ConnectionRefusedError
    from twisted.logger import capturedLogs, formatEvent

    net = Net(eventRetentionSeconds=10, maxStreamsPerAgent=1)
    alpha = net.client("alpha")
    net.run(alpha.register())
    handler = Handler()
    with capturedLogs() as logged:
        service = runtime(net, tmp_path, handler)
        first = send(net, alpha)
        net.settle()
        # The broker closes the runtime's stream (a newer one of its agent), and the
        # stream cannot come back for a while: the runtime long-polls meanwhile.
        blocked = [True]
        real = net.http.request

        def request(method: str, url: str, **kwargs: Any) -> defer.Deferred:
            if "/v1/events" in url and blocked[0]:
                return defer.fail(ConnectionRefusedError())
            return real(method, url, **kwargs)

        other = net.client("worker").events()
        net.settle()
        net.http.request = request
        other.close()
        net.settle()
        second = send(net, alpha)
        net.settle()
        assert handler.calls == [first, second]
        elapse(net, 20)
        net.run(net.api.broker.sweep_expired())  # the events of both are past retention
        blocked[0] = False
        elapse(net, 31)  # the next try opens it again: its position is gone
        assert service._events.connected
        third = send(net, alpha)
        net.settle()
        assert handler.calls == [first, second, third]
        service.stopService()
        net.settle()
    text = "\n".join(formatEvent(event) for event in logged)
    assert "events reset; pulling to re-sync" in text
