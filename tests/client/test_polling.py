"""The one poll loop (agent runtime, ``relay watch``) and the inbox drain (``relay recv``),
driven by a Clock and scripted broker answers."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock

from relay.client.polling import MIN_HELD_SECONDS, drain, poll
from relay.wire.errors import RelayError

Message = Dict[str, Any]
# One scripted answer: messages, a RelayError, or (seconds the broker holds it, messages).
Answer = Union[List[Message], RelayError, Tuple[float, List[Message]]]

INTERVAL = 2.0


class Broker:
    """Answers fetches from a script, on a Clock; records when and how it was asked."""

    def __init__(self, clock: Clock, answers: Sequence[Answer]) -> None:
        self.clock = clock
        self.answers = list(answers)
        self.asked: List[Tuple[float, Optional[float]]] = []
        self.delivered: List[Tuple[float, List[str]]] = []
        self.errors: List[str] = []

    def running(self) -> bool:
        return bool(self.answers)

    async def fetch(self, wait: Optional[float]) -> List[Message]:
        self.asked.append((self.clock.seconds(), wait))
        answer = self.answers.pop(0)
        if isinstance(answer, RelayError):
            raise answer
        if isinstance(answer, tuple):
            held, messages = answer
            d: defer.Deferred = defer.Deferred()
            self.clock.callLater(held, d.callback, messages)
            return await d
        return answer

    async def deliver(self, messages: Sequence[Message]) -> None:
        self.delivered.append((self.clock.seconds(), [m["id"] for m in messages]))


def run(broker: Broker, wait: Optional[float], *, until: float = 100.0) -> defer.Deferred:
    d = defer.Deferred.fromCoroutine(
        poll(
            broker.fetch,
            broker.deliver,
            clock=broker.clock,
            wait=wait,
            interval=INTERVAL,
            running=broker.running,
            on_error=lambda error: broker.errors.append(error.code),
        )
    )
    while broker.clock.seconds() < until and not d.called:
        broker.clock.advance(0.5)
    assert d.called, "the loop did not finish"
    return d


def test_without_long_poll_empty_answers_are_spaced_by_the_interval() -> None:
    broker = Broker(Clock(), [[], [], [{"id": "m1"}], []])
    run(broker, wait=None)
    assert broker.asked == [(0.0, None), (2.0, None), (4.0, None), (4.0, None)]
    assert broker.delivered == [(0.0, []), (2.0, []), (4.0, ["m1"]), (4.0, [])]


def test_messages_are_fetched_again_at_once() -> None:
    broker = Broker(Clock(), [[{"id": "a"}], [{"id": "b"}], [{"id": "c"}]])
    run(broker, wait=None)
    assert [when for when, _ in broker.asked] == [0.0, 0.0, 0.0]
    assert [ids for _, ids in broker.delivered] == [["a"], ["b"], ["c"]]


def test_a_held_long_poll_is_asked_again_without_waiting() -> None:
    broker = Broker(Clock(), [(20.0, []), (5.0, [{"id": "m1"}]), (20.0, [])])
    run(broker, wait=20.0)
    assert broker.asked == [(0.0, 20.0), (20.0, 20.0), (25.0, 20.0)]
    assert broker.delivered[-1] == (45.0, [])


def test_an_empty_long_poll_answered_at_once_waits_the_interval() -> None:
    quick = MIN_HELD_SECONDS / 2
    broker = Broker(Clock(), [(quick, []), (quick, [])])
    run(broker, wait=20.0)
    assert [when for when, _ in broker.asked] == [0.0, quick + INTERVAL]


def test_a_failure_is_reported_then_retried_after_the_interval() -> None:
    broker = Broker(
        Clock(), [RelayError(0, "connection_error", "down"), RelayError(503, "busy", ""), []]
    )
    run(broker, wait=20.0)
    assert broker.errors == ["connection_error", "busy"]
    assert [when for when, _ in broker.asked] == [0.0, 2.0, 4.0]
    assert broker.delivered == [(4.0, [])]


def test_other_exceptions_end_the_loop() -> None:
    clock = Clock()

    async def fetch(wait: Optional[float]) -> List[Message]:
        raise KeyError("bug")

    async def deliver(messages: Sequence[Message]) -> None:
        raise AssertionError("nothing to deliver")

    d = defer.Deferred.fromCoroutine(
        poll(fetch, deliver, clock=clock, wait=None, interval=INTERVAL,
             running=lambda: True, on_error=lambda error: None)
    )
    failures: List[Any] = []
    d.addErrback(failures.append)
    assert failures and failures[0].check(KeyError)


def test_the_loop_stops_when_running_turns_false() -> None:
    clock = Clock()
    fetched: List[float] = []

    async def fetch(wait: Optional[float]) -> List[Message]:
        fetched.append(clock.seconds())
        return []

    async def deliver(messages: Sequence[Message]) -> None:
        pass

    d = defer.Deferred.fromCoroutine(
        poll(fetch, deliver, clock=clock, wait=None, interval=INTERVAL,
             running=lambda: len(fetched) < 3, on_error=lambda error: None)
    )
    clock.pump([INTERVAL] * 5)
    assert d.called and fetched == [0.0, 2.0, 4.0]


def test_the_sleep_can_be_replaced() -> None:
    clock = Clock()
    sleeps: List[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def fetch(wait: Optional[float]) -> List[Message]:
        if len(sleeps) == 1:
            raise RelayError(0, "connection_error", "down")
        return []

    async def deliver(messages: Sequence[Message]) -> None:
        pass

    d = defer.Deferred.fromCoroutine(
        poll(fetch, deliver, clock=clock, wait=None, interval=INTERVAL,
             running=lambda: len(sleeps) < 3, on_error=lambda error: None, sleep=sleep)
    )
    assert d.called and sleeps == [INTERVAL] * 3
    assert not clock.getDelayedCalls()


# -- drain ------------------------------------------------------------------------


def pages(*script: List[str]) -> Tuple[Any, List[int]]:
    remaining = [[{"id": i} for i in page] for page in script]
    calls: List[int] = []

    async def fetch_page() -> List[Message]:
        calls.append(1)
        return remaining.pop(0) if remaining else []

    return fetch_page, calls


def drained(fetch_page: Any, max_pages: int) -> List[Any]:
    d = defer.Deferred.fromCoroutine(drain(fetch_page, max_pages))
    result: List[Any] = []
    d.addCallback(result.append)
    assert result, "drain did not finish"
    return [m["id"] for m in result[0]]


def test_drain_reads_until_an_empty_page() -> None:
    fetch_page, calls = pages(["a", "b"], ["c"], [], ["never"])
    assert drained(fetch_page, 10) == ["a", "b", "c"]
    assert len(calls) == 3


def test_drain_stops_at_a_page_of_messages_already_seen() -> None:
    fetch_page, calls = pages(["a", "b"], ["b", "c"], ["c", "a"], ["d"])
    assert drained(fetch_page, 10) == ["a", "b", "c"]
    assert len(calls) == 3


@pytest.mark.parametrize("max_pages, expected", [(1, ["a"]), (2, ["a", "b"])])
def test_drain_reads_at_most_max_pages(max_pages: int, expected: List[str]) -> None:
    fetch_page, calls = pages(["a"], ["b"], ["c"])
    assert drained(fetch_page, max_pages) == expected
    assert len(calls) == max_pages
