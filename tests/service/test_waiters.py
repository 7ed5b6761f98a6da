"""Long-poll waiters: no lost wake-ups, one consumer per wake, cancellation, stop."""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock

from relay.broker.waiters import Waiters


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


def one_waiting(results=None):
    """``(clock, waiters, queue)`` with one pull of beta's waiting 20 s (its first
    look done: ``queue.attempts == 1``); what it fires with goes to ``results``."""
    clock = Clock()
    w, q = Waiters(clock), Queue()
    d = w.wait_for("beta", q.take, bool, 20)
    if results is not None:
        d.addCallback(results.append)
    return clock, w, q


def test_wake_at_deadline():
    results = []
    clock, w, q = one_waiting(results)
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




def test_a_held_lease_wakes_at_its_deadline():
    results = []
    clock, w, q = one_waiting(results)
    w.hold("beta", clock.seconds() + 5)
    q.items = ["lapsed"]
    clock.advance(5.1)
    assert results == [["lapsed"]] and w.deadlines() == 0


def test_a_lease_let_go_wakes_nobody_unless_another_ends_then():
    clock, w, q = one_waiting()
    w.hold("beta", 5)
    w.hold("beta", 5)
    w.let_go("beta", 5)
    clock.advance(5.1)
    assert q.attempts == 2, "one of two leases ending at 5 is still held"
    w.hold("beta", 10)
    w.let_go("beta", 10)
    w.let_go("beta", 10)  # more let-goes than holds (a lease from before a restart)
    w.let_go("gamma", 10)
    clock.advance(5)
    assert q.attempts == 2 and w.deadlines() == 0


def test_a_delay_at_a_let_go_deadline_still_wakes():
    clock, w, q = one_waiting()
    w.hold("beta", 5)
    w.wake_at("beta", 5)
    w.let_go("beta", 5)
    clock.advance(5.1)
    assert q.attempts == 2


def test_deadlines_kept_follow_the_leases_outstanding():
    """Leases acked long before their deadline leave nothing behind: the heap is
    rebuilt once mostly stale, and what is left still wakes on time."""
    clock, w, q = one_waiting()
    for i in range(10_000):
        w.hold(f"agent-{i % 500}", 600 + i * 0.01)
        w.let_go(f"agent-{i % 500}", 600 + i * 0.01)
    w.hold("beta", 7)
    assert w.deadlines() == 1
    assert len(w._deadlines) <= 2 * 1024 + 2, "stale keys are dropped, not kept to their deadline"
    clock.advance(7.1)
    assert q.attempts == 2


def test_a_stale_deadline_held_again_counts_once():
    clock = Clock()
    w = Waiters(clock)
    w.hold("beta", 5)
    w.let_go("beta", 5)
    assert w.deadlines() == 0
    w.hold("beta", 5)
    assert w.deadlines() == 1
    clock.advance(6)
    assert w.deadlines() == 0 and w._stale == 0
