"""Long-poll waiters: no lost wake-ups, one consumer per wake, cancellation, stop."""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock

from relay.waiters import Waiters


class Queue:
    """A tiny consumable queue standing in for a store."""

    def __init__(self) -> None:
        self.items = []
        self.attempts = 0

    def take(self):
        self.attempts += 1
        items, self.items = self.items, []
        return succeed(items)


def test_no_wait_runs_once():
    w, q = Waiters(Clock()), Queue()
    d = w.wait_for("beta", q.take, bool, 0)
    assert d.called and q.attempts == 1 and w.count() == 0


def test_found_at_once_does_not_wait():
    w, q = Waiters(Clock()), Queue()
    q.items = ["m"]
    results = []
    w.wait_for("beta", q.take, bool, 20).addCallback(results.append)
    assert results == [["m"]] and w.count() == 0


def test_wake_delivers_and_timeout_returns_empty():
    clock = Clock()
    w, q = Waiters(clock), Queue()
    results = []
    w.wait_for("beta", q.take, bool, 20).addCallback(results.append)
    assert results == [] and w.count("beta") == 1
    q.items = ["m"]
    w.wake("beta")
    assert results == [["m"]] and w.count() == 0
    w.wait_for("beta", q.take, bool, 20).addCallback(results.append)
    clock.advance(19.9)
    assert len(results) == 1
    clock.advance(0.1)
    assert results[1] == [] and w.count() == 0 and not clock.getDelayedCalls()


def test_wake_during_the_first_look_is_not_lost():
    clock = Clock()
    w, q = Waiters(clock), Queue()
    pending = Deferred()
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) == 1:
            return pending
        return q.take()

    results = []
    w.wait_for("beta", attempt, bool, 20).addCallback(results.append)
    q.items = ["m"]
    w.wake("beta")
    pending.callback([])
    assert results == [["m"]]


def test_one_consumer_per_wake_and_observers_all_woken():
    clock = Clock()
    w, q = Waiters(clock), Queue()
    got = {}
    for name in ("c1", "c2"):
        w.wait_for("beta", q.take, bool, 20).addCallback(lambda r, n=name: got.setdefault(n, r))
    observed = []
    w.wait_for("beta", lambda: succeed(list(q.items)), bool, 20, consume=False).addCallback(
        observed.append
    )
    q.items = ["m"]
    attempts_before = q.attempts
    w.wake("beta")
    assert got == {"c1": ["m"]}
    assert q.attempts == attempts_before + 1, "only one consumer looked"
    assert observed == [["m"]], "observers see the message without taking it"
    assert w.count("beta") == 1, "the second consumer is still waiting"


def test_cancel_removes_the_waiter():
    clock = Clock()
    w, q = Waiters(clock), Queue()
    d = w.wait_for("beta", q.take, bool, 20)
    d.addErrback(lambda f: f.trap(CancelledError))
    d.cancel()
    assert w.count() == 0 and not clock.getDelayedCalls()
    q.items = ["m"]
    w.wake("beta")
    assert q.items == ["m"], "a cancelled waiter takes nothing"


def test_waiters_per_agent_are_capped():
    clock = Clock()
    w, q = Waiters(clock, max_per_agent=2), Queue()
    w.wait_for("beta", q.take, bool, 20)
    w.wait_for("beta", q.take, bool, 20)
    third = w.wait_for("beta", q.take, bool, 20)
    assert third.called and w.count("beta") == 2


def test_wake_at_deadline():
    clock = Clock()
    w, q = Waiters(clock), Queue()
    results = []
    w.wait_for("beta", q.take, bool, 20).addCallback(results.append)
    w.wake_at("beta", clock.seconds() + 5)
    w.wake_at("beta", clock.seconds() + 5)
    q.items = ["expired"]
    clock.advance(4.9)
    assert results == []
    clock.advance(0.2)
    assert results == [["expired"]]


def test_stop_answers_everyone():
    clock = Clock()
    w, q = Waiters(clock), Queue()
    results = []
    for _ in range(3):
        w.wait_for("beta", q.take, bool, 20).addCallback(results.append)
    w.stop()
    assert results == [[], [], []] and w.count() == 0
    assert w.wait_for("beta", q.take, bool, 20).called
