"""The in-memory store: nothing survives a restart; every operation is indexed.

Also the base of the jsonl backend, which keeps this state in memory and
appends every change to its log.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Set, Tuple

from twisted.internet.defer import Deferred, fail, succeed
from zope.interface import implementer

from relay import delivery, errors
from relay.delivery import Message
from relay.protocol import LEASED, QUEUED
from relay.store.interface import IMessageStore


class MemoryState:
    """Messages and peers with the indexes each operation needs.

    Plain synchronous methods; :class:`MemoryStore` wraps them in Deferreds.
    ``changed`` is called with every message whose state changed, so a
    persistent subclass can record it.
    """

    def __init__(self) -> None:
        self.next_seq = 1
        self.by_id: Dict[str, Message] = {}
        self.by_seq: Dict[int, Message] = {}
        self.inbox: Dict[str, Deque[int]] = {}
        self.queued: Dict[str, List[int]] = {}
        self.recovery: Dict[str, Set[int]] = {}
        self.leases: List[Tuple[int, int, str]] = []
        self.peer_seen: Dict[str, int] = {}

    # -- bookkeeping -------------------------------------------------------

    def changed(self, message: Message) -> None:
        """Hook: ``message``'s delivery state changed."""

    def _enqueue(self, message: Message) -> None:
        insort(self.queued.setdefault(message.to, []), message.seq)
        if message.recovery:
            self.recovery.setdefault(message.to, set()).add(message.seq)

    def _dequeue(self, message: Message) -> None:
        queue = self.queued.get(message.to)
        if queue:
            i = bisect_right(queue, message.seq) - 1
            if i >= 0 and queue[i] == message.seq:
                del queue[i]
            if not queue:
                del self.queued[message.to]
        marks = self.recovery.get(message.to)
        if marks is not None:
            marks.discard(message.seq)
            if not marks:
                del self.recovery[message.to]

    def _track_lease(self, message: Message) -> None:
        heapq.heappush(self.leases, (message.lease_until, message.seq, message.lease_id))

    def insert(self, message: Message) -> None:
        """Index a message that already has its seq and state (used when loading)."""
        self.by_id[message.id] = message
        self.by_seq[message.seq] = message
        self.inbox.setdefault(message.to, deque()).append(message.seq)
        if message.status == QUEUED:
            self._enqueue(message)
        elif message.status == LEASED:
            self._track_lease(message)
        self.next_seq = max(self.next_seq, message.seq + 1)

    # -- operations ----------------------------------------------------------

    def add(self, message: Message) -> bool:
        if message.id in self.by_id:
            return False
        message.seq = self.next_seq
        self.insert(message)
        return True

    def get_since(
        self, agent: str, since_id: Optional[str], limit: int, now: float
    ) -> Tuple[List[Message], Optional[str]]:
        self.expire_due(now)
        since = self.by_id.get(since_id) if since_id else None
        since_seq = since.seq if since is not None else 0
        out: List[Message] = []
        marks = self.recovery.get(agent)
        if marks and since_seq:
            for seq in sorted(s for s in marks if s <= since_seq)[:limit]:
                out.append(self.by_seq[seq])
        queue = self.queued.get(agent, ())
        start = bisect_right(queue, since_seq) if queue else 0
        fresh = [self.by_seq[seq] for seq in queue[start : start + limit - len(out)]]
        out.extend(fresh)
        for message in out:
            if message.recovery:
                message.recovery = False
                self.recovery[agent].discard(message.seq)
                self.changed(message)
        if marks is not None and not marks:
            self.recovery.pop(agent, None)
        cursor = fresh[-1].id if fresh else (since_id or None)
        return out, cursor

    def pull(self, agent: str, limit: int, lease_seconds: int, now: float) -> List[Message]:
        self.expire_due(now)
        queue = self.queued.get(agent)
        if not queue:
            return []
        out = [self.by_seq[seq] for seq in queue[:limit]]
        for message in out:
            self._dequeue(message)
            delivery.lease(message, lease_seconds, now)
            self._track_lease(message)
            self.changed(message)
        return out

    def ack(
        self,
        message_id: str,
        agent: str,
        lease_id: str,
        outcome: str,
        error: Optional[str],
        now: float,
        max_attempts: int,
    ) -> dict:
        message = self.by_id.get(message_id)
        if message is None:
            raise errors.no_such_message()
        was_leased = message.status == LEASED
        try:
            result = delivery.settle(message, agent, lease_id, outcome, error, now, max_attempts)
        finally:
            if was_leased and message.status != LEASED:
                if message.status == QUEUED:
                    self._enqueue(message)
                self.changed(message)
        return result

    def status(self, message_ids: Iterable[str], agent: str) -> List[dict]:
        out = []
        for message_id in message_ids:
            message = self.by_id.get(message_id)
            if message is None or agent not in (message.sender, message.to):
                out.append(delivery.not_found_status(message_id))
            else:
                out.append(message.status_entry())
        return out

    def recent(self, agent: str, limit: int) -> List[Message]:
        seqs = self.inbox.get(agent, ())
        out = []
        for seq in reversed(seqs):
            out.append(self.by_seq[seq])
            if len(out) >= limit:
                break
        return out

    def query(
        self,
        agent: str,
        limit: int,
        kind: Optional[str],
        status: Optional[str],
        sender: Optional[str],
        recipient: Optional[str],
    ) -> List[Message]:
        if recipient is not None and recipient != agent:
            return []  # the inbox holds only messages to ``agent``
        out = []
        for seq in reversed(self.inbox.get(agent, ())):
            message = self.by_seq[seq]
            if (
                (kind is None or message.kind == kind)
                and (status is None or message.status == status)
                and (sender is None or message.sender == sender)
            ):
                out.append(message)
                if len(out) >= limit:
                    break
        return out

    def expire_due(self, now: float) -> Set[str]:
        """Release every lease past its deadline; returns the agents concerned."""
        agents: Set[str] = set()
        deadline = delivery.now_ms(now)
        leases = self.leases
        while leases and leases[0][0] <= deadline:
            _, seq, lease_id = heapq.heappop(leases)
            message = self.by_seq.get(seq)
            if message is None or message.status != LEASED or message.lease_id != lease_id:
                continue
            delivery.expire_lease(message)
            self._enqueue(message)
            self.changed(message)
            agents.add(message.to)
        return agents

    def sweep_expired(self, cutoff: float) -> List[Message]:
        """Remove the messages stored before ``cutoff``, oldest first; returns them."""
        removed = []
        for message in self.by_seq.values():
            if message.created >= cutoff:
                break
            removed.append(message)
        for message in removed:
            del self.by_seq[message.seq]
            del self.by_id[message.id]
            seqs = self.inbox[message.to]
            seqs.popleft()
            if not seqs:
                del self.inbox[message.to]
            if message.status == QUEUED:
                self._dequeue(message)
        return removed

    def register(self, agent: str, now: float) -> None:
        self.peer_seen[agent] = int(now)

    def peers(self) -> List[Tuple[str, int]]:
        return sorted(self.peer_seen.items())


def _call(f, *args) -> Deferred:
    try:
        return succeed(f(*args))
    except errors.RelayError:
        return fail()


@implementer(IMessageStore)
class MemoryStore:
    """Everything in memory; the store of tests and of ``persist: false``."""

    name = "memory"

    def __init__(self, state: Optional[MemoryState] = None) -> None:
        self.state = state if state is not None else MemoryState()

    def add(self, message: Message) -> Deferred:
        return _call(self.state.add, message)

    def find(self, message_id: str) -> Deferred:
        return succeed(self.state.by_id.get(message_id))

    def get_since(self, agent: str, since_id: Optional[str], limit: int, now: float) -> Deferred:
        return _call(self.state.get_since, agent, since_id, limit, now)

    def pull(self, agent: str, limit: int, lease_seconds: int, now: float) -> Deferred:
        return _call(self.state.pull, agent, limit, lease_seconds, now)

    def ack(self, message_id, agent, lease_id, outcome, error, now, max_attempts) -> Deferred:
        return _call(
            self.state.ack, message_id, agent, lease_id, outcome, error, now, max_attempts
        )

    def status(self, message_ids, agent: str) -> Deferred:
        return _call(self.state.status, message_ids, agent)

    def recent(self, agent: str, limit: int) -> Deferred:
        return _call(self.state.recent, agent, limit)

    def query(self, agent, limit, kind, status, sender, recipient) -> Deferred:
        return _call(self.state.query, agent, limit, kind, status, sender, recipient)

    def register(self, agent: str, now: float) -> Deferred:
        return _call(self.state.register, agent, now)

    def is_registered(self, agent: str) -> bool:
        return agent in self.state.peer_seen

    def peers(self) -> Deferred:
        return _call(self.state.peers)

    def sweep_leases(self, now: float) -> Deferred:
        return _call(self.state.expire_due, now)

    def sweep_expired(self, cutoff: float) -> Deferred:
        return _call(lambda: len(self.state.sweep_expired(cutoff)))

    def close(self) -> Deferred:
        return succeed(None)


def open_store(config, clock) -> MemoryStore:
    """Open an empty memory store (the IStoreFactory entry point)."""
    return MemoryStore()
