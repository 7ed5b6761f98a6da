"""Long-poll waiters: requests that wait until a message becomes deliverable.

A waiter is registered before its first look at the queue, so a message that
arrives during that look still wakes it (no lost wake-ups). Pulls consume
what they find, so a new message wakes one pulling waiter; v1.0 polls only
observe, so they are all woken. Waiting Deferreds are cancellable (Klein
cancels them when the client goes away) and all are answered when the broker
stops.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

log = Logger(namespace="relay.waiters")

MAX_WAITERS_PER_AGENT = 16
DEADLINE_RESOLUTION = 0.05
# The deadline heap is rebuilt once more than half of it, and more than this many
# keys, are stale.
STALE_COMPACT_MIN = 1024


def _key(agent: str, when: float) -> Tuple[float, str]:
    return math.ceil(when / DEADLINE_RESOLUTION) * DEADLINE_RESOLUTION, agent


class _Waiter:
    __slots__ = ("agent", "attempt", "found", "consume", "result", "woken", "busy", "deferred",
                 "timeout", "done")

    def __init__(self, agent, attempt, found, consume) -> None:
        self.agent = agent
        self.attempt = attempt
        self.found = found
        self.consume = consume
        self.result: Any = None
        self.woken = False
        self.busy = False
        self.done = False
        self.deferred: Optional[Deferred] = None
        self.timeout: Optional[IDelayedCall] = None


class Waiters:
    """The set of waiting requests, per agent."""

    def __init__(self, clock: IReactorTime, max_per_agent: int = MAX_WAITERS_PER_AGENT) -> None:
        self.clock = clock
        self.max_per_agent = max_per_agent
        self._by_agent: Dict[str, Deque[_Waiter]] = {}
        # Deadline wake-ups, keyed (time rounded up to DEADLINE_RESOLUTION, agent): a
        # heap of keys, each pushed once; a key is live while a held lease ends
        # then (counted) or a wake-up was asked for it (pinned). Keys of leases
        # acked early go stale in the heap and are dropped when it is mostly stale,
        # so memory follows the leases outstanding, not the leases ever granted.
        self._deadlines: List[Tuple[float, str]] = []
        self._in_heap: Set[Tuple[float, str]] = set()
        self._held: Dict[Tuple[float, str], int] = {}
        self._pinned: Set[Tuple[float, str]] = set()
        self._stale = 0
        self._deadline_call: Optional[IDelayedCall] = None
        self.stopped = False

    def count(self, agent: Optional[str] = None) -> int:
        """How many requests are waiting (for ``agent``, or in all)."""
        if agent is not None:
            return len(self._by_agent.get(agent, ()))
        return sum(len(q) for q in self._by_agent.values())

    def agents(self) -> List[str]:
        """The agents with a waiting request."""
        return list(self._by_agent)

    def wait_for(
        self,
        agent: str,
        attempt: Callable[[], Any],
        found: Callable[[Any], bool],
        wait_seconds: float,
        consume: bool = True,
    ) -> Deferred:
        """Run ``attempt`` until ``found(result)`` or ``wait_seconds`` pass.

        Fires with the first result that is found, or with the last (empty)
        one at the deadline. Without a wait, or when the agent already has
        too many waiters, ``attempt`` runs once.
        """
        queue = self._by_agent.get(agent)
        if wait_seconds <= 0 or self.stopped or (queue and len(queue) >= self.max_per_agent):
            return maybeDeferred(attempt)
        waiter = _Waiter(agent, attempt, found, consume)
        waiter.deferred = Deferred(lambda d: self._cancel(waiter))
        self._by_agent.setdefault(agent, deque()).append(waiter)
        waiter.timeout = self.clock.callLater(wait_seconds, self._finish, waiter)
        self._try(waiter)
        return waiter.deferred

    def wake(self, agent: str) -> None:
        """Something became deliverable to ``agent``: wake its waiters."""
        queue = self._by_agent.get(agent)
        if not queue:
            return
        for waiter in list(queue):
            if not waiter.consume:
                self._poke(waiter)
        for waiter in queue:
            if waiter.consume and not waiter.woken:
                self._poke(waiter)
                break

    def wake_at(self, agent: str, when: float) -> None:
        """Wake ``agent``'s waiters at ``when`` (a delay running out, a deadline set
        elsewhere), if any wait then."""
        key = _key(agent, when)
        self._revive(key)
        self._pinned.add(key)
        self._push(key)

    def hold(self, agent: str, deadline: float) -> None:
        """A lease of ``agent``'s ends at ``deadline``: wake its waiters then, unless
        every lease ending then is let go first."""
        key = _key(agent, deadline)
        self._revive(key)
        self._held[key] = self._held.get(key, 0) + 1
        self._push(key)

    def let_go(self, agent: str, deadline: float) -> None:
        """A lease :meth:`hold` heard of ended before ``deadline`` (or moved away)."""
        key = _key(agent, deadline)
        count = self._held.get(key)
        if count is None:
            return  # granted before this broker started, or learnt only as a deadline
        if count > 1:
            self._held[key] = count - 1
            return
        del self._held[key]
        if key not in self._pinned:
            self._stale += 1
            if self._stale > STALE_COMPACT_MIN and self._stale * 2 > len(self._deadlines):
                self._compact()

    def deadlines(self) -> int:
        """How many deadline wake-ups are pending (for tests and the curious)."""
        return len(self._deadlines) - self._stale

    def _push(self, key: Tuple[float, str]) -> None:
        if key in self._in_heap:
            return
        self._in_heap.add(key)
        heapq.heappush(self._deadlines, key)
        if self._deadlines[0] is key or self._deadline_call is None:
            self._schedule_deadline()

    def _live(self, key: Tuple[float, str]) -> bool:
        return key in self._held or key in self._pinned

    def _revive(self, key: Tuple[float, str]) -> None:
        """``key`` is about to be live: if it is stale in the heap, it no longer is."""
        if key in self._in_heap and not self._live(key):
            self._stale -= 1

    def _compact(self) -> None:
        self._deadlines = [key for key in self._deadlines if self._live(key)]
        heapq.heapify(self._deadlines)
        self._in_heap = set(self._deadlines)
        self._stale = 0
        self._schedule_deadline()

    def stop(self) -> None:
        """Answer every waiter with its last result and accept no new waits."""
        self.stopped = True
        for queue in list(self._by_agent.values()):
            for waiter in list(queue):
                self._finish(waiter)
        if self._deadline_call is not None and self._deadline_call.active():
            self._deadline_call.cancel()
        self._deadline_call = None

    # -- internals ------------------------------------------------------------

    def _schedule_deadline(self) -> None:
        if self._deadline_call is not None and self._deadline_call.active():
            self._deadline_call.cancel()
        self._deadline_call = None
        if not self._deadlines or self.stopped:
            return
        delay = max(0.0, self._deadlines[0][0] - self.clock.seconds())
        self._deadline_call = self.clock.callLater(delay, self._deadline_due)

    def _deadline_due(self) -> None:
        self._deadline_call = None
        now = self.clock.seconds()
        while self._deadlines and self._deadlines[0][0] <= now:
            key = heapq.heappop(self._deadlines)
            self._in_heap.discard(key)
            live = self._held.pop(key, None) is not None
            if key in self._pinned:
                self._pinned.discard(key)
                live = True
            if live:
                self.wake(key[1])
            else:
                self._stale -= 1
        self._schedule_deadline()

    def _poke(self, waiter: _Waiter) -> None:
        waiter.woken = True
        if not waiter.busy and not waiter.done:
            self._try(waiter)

    def _try(self, waiter: _Waiter) -> None:
        waiter.busy = True
        waiter.woken = False
        d = maybeDeferred(waiter.attempt)
        d.addCallbacks(
            lambda result: self._tried(waiter, result), lambda f: self._failed(waiter, f)
        )

    def _tried(self, waiter: _Waiter, result: Any) -> None:
        waiter.busy = False
        waiter.result = result
        if waiter.done:
            return
        if waiter.found(result):
            self._finish(waiter)
        elif waiter.woken:
            self._try(waiter)

    def _failed(self, waiter: _Waiter, failure) -> None:
        waiter.busy = False
        if waiter.done:
            return
        self._remove(waiter)
        waiter.deferred.errback(failure)

    def _remove(self, waiter: _Waiter) -> None:
        waiter.done = True
        if waiter.timeout is not None and waiter.timeout.active():
            waiter.timeout.cancel()
        queue = self._by_agent.get(waiter.agent)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            if not queue:
                del self._by_agent[waiter.agent]

    def _finish(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        if waiter.busy:
            # An attempt is running: answer with its result when it lands.
            waiter.found = lambda result: True
            if waiter.timeout is not None and waiter.timeout.active():
                waiter.timeout.cancel()
            return
        self._remove(waiter)
        waiter.deferred.callback(waiter.result)

    def _cancel(self, waiter: _Waiter) -> None:
        if not waiter.done:
            self._remove(waiter)


__all__ = ["Waiters", "CancelledError"]
