"""The in-memory store: nothing survives a restart; every primitive is indexed.

Also the base of the jsonl backend, which keeps these records in memory and
appends every change to its log.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from collections import deque
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from relay import delivery
from relay.delivery import Message
from relay.errors import ConfigError
from relay.protocol import FAILED, LEASED, QUEUED
from relay.store.interface import QueueDepth
from relay.store.records import Records, RecordStore

# The states whose messages are counted per agent (QueueDepth).
_COUNTED = (QUEUED, LEASED, FAILED)


class MemoryRecords(Records):
    """Messages and peers with the index each primitive needs.

    The records keep their own copies of the messages: what :meth:`get` and the
    listings hand out, and what :meth:`insert` and :meth:`save` receive, stay the
    caller's. The lease heap holds ``(deadline, seq, lease id)``; an entry counts
    only while it still matches the message, so a deadline that moved leaves a
    stale entry that is skipped.
    """

    def __init__(self) -> None:
        super().__init__()
        self.next_seq = 1
        self.by_id: Dict[str, Message] = {}
        self.by_seq: Dict[int, Message] = {}
        self.inbox_seqs: Dict[str, Deque[int]] = {}
        self.queued_seqs: Dict[str, List[int]] = {}
        self.recovery_seqs: Dict[str, Set[int]] = {}
        self.leases: List[Tuple[int, int, str]] = []
        self.peer_seen: Dict[str, int] = {}
        # agent -> status -> how many of its messages are in that (counted) state
        self.depth: Dict[str, Dict[str, int]] = {}

    # -- indexes -----------------------------------------------------------------------

    def _index(self, message: Message, lease_moved: bool = True) -> None:
        """Enter ``message`` (a stored copy) in the indexes of its delivery state."""
        if message.status == QUEUED:
            insort(self.queued_seqs.setdefault(message.to, []), message.seq)
            if message.recovery:
                self.recovery_seqs.setdefault(message.to, set()).add(message.seq)
        elif message.status == LEASED and lease_moved:
            heapq.heappush(self.leases, (message.lease_until, message.seq, message.lease_id))

    def _unindex(self, message: Message) -> None:
        """Leave the queue indexes (lease heap entries go stale on their own)."""
        if message.status != QUEUED:
            return
        queue = self.queued_seqs.get(message.to)
        if queue:
            i = bisect_right(queue, message.seq) - 1
            if i >= 0 and queue[i] == message.seq:
                del queue[i]
            if not queue:
                del self.queued_seqs[message.to]
        marks = self.recovery_seqs.get(message.to)
        if marks is not None:
            marks.discard(message.seq)
            if not marks:
                del self.recovery_seqs[message.to]

    def _count(self, agent: str, status: str, delta: int) -> None:
        if status not in _COUNTED:
            return
        counts = self.depth.setdefault(agent, {})
        left = counts.get(status, 0) + delta
        if left:
            counts[status] = left
        else:
            counts.pop(status, None)
            if not counts:
                del self.depth[agent]

    def load(self, message: Message) -> None:
        """Index a message that already has its seq and state (when replaying a log)."""
        self.by_id[message.id] = message
        self.by_seq[message.seq] = message
        self.inbox_seqs.setdefault(message.to, deque()).append(message.seq)
        self._index(message)
        self._count(message.to, message.status, 1)
        self.next_seq = max(self.next_seq, message.seq + 1)

    # -- hooks of a subclass that records every change ---------------------------------

    def inserted(self, stored: Message) -> None:
        """``stored`` was added."""

    def saved(self, stored: Message) -> None:
        """The delivery state of ``stored`` changed."""

    def removed(self, messages: List[Message]) -> None:
        """The TTL sweep removed ``messages`` (the oldest, in seq order)."""

    def registered(self, agent: str) -> None:
        """``agent`` sent a heartbeat."""

    def _copies(self, seqs) -> List[Message]:
        by_seq = self.by_seq
        return [by_seq[seq].copy() for seq in seqs]

    # -- Records ---------------------------------------------------------------------

    def insert(self, message: Message) -> bool:
        if message.id in self.by_id:
            return False
        message.seq = self.next_seq
        stored = message.copy()
        self.load(stored)
        self.inserted(stored)
        return True

    def get(self, message_id: str) -> Optional[Message]:
        message = self.by_id.get(message_id)
        return None if message is None else message.copy()

    def seq_of(self, message_id: str) -> int:
        message = self.by_id.get(message_id)
        return 0 if message is None else message.seq

    def save(self, messages: Sequence[Message]) -> None:
        for message in messages:
            stored = self.by_seq[message.seq]
            old, new = stored.state(), message.state()
            if old == new:
                continue
            self._unindex(stored)
            if old[0] != new[0]:
                self._count(stored.to, old[0], -1)
                self._count(stored.to, new[0], 1)
            (stored.status, stored.attempts, stored.lease_until, stored.lease_id,
             stored.error, stored.recovery) = new
            self._index(stored, lease_moved=old[0] != LEASED or old[2:4] != new[2:4])
            self.saved(stored)

    def queued(self, agent: str, after_seq: int, limit: int) -> List[Message]:
        queue = self.queued_seqs.get(agent)
        if not queue:
            return []
        start = bisect_right(queue, after_seq) if after_seq else 0
        return self._copies(queue[start : start + limit])

    def recovered(self, agent: str, upto_seq: int, limit: int) -> List[Message]:
        marks = self.recovery_seqs.get(agent)
        if not marks:
            return []
        return self._copies(sorted(s for s in marks if s <= upto_seq)[:limit])

    def lapsed(self, now: float) -> List[Message]:
        deadline = delivery.now_ms(now)
        heap = self.leases
        live: Dict[int, Tuple[int, int, str]] = {}
        while heap and heap[0][0] <= deadline:
            entry = heapq.heappop(heap)
            until, seq, lease_id = entry
            message = self.by_seq.get(seq)
            if (message is not None and message.status == LEASED
                    and message.lease_id == lease_id and message.lease_until == until):
                live[seq] = entry
        # Live entries stay until the release is saved: a lease is never left untracked.
        for entry in live.values():
            heapq.heappush(heap, entry)
        return self._copies(live)

    def inbox(self, agent: str, limit: int, filters: Mapping[str, Optional[str]]) -> List[Message]:
        kind, status, sender = filters.get("kind"), filters.get("status"), filters.get("from")
        out = []
        for seq in reversed(self.inbox_seqs.get(agent, ())):
            message = self.by_seq[seq]
            if (
                (kind is None or message.kind == kind)
                and (status is None or message.status == status)
                and (sender is None or message.sender == sender)
            ):
                out.append(message.copy())
                if len(out) >= limit:
                    break
        return out

    def expire(self, cutoff: float, batch: int) -> int:
        """Remove up to ``batch`` messages stored before ``cutoff``, oldest first."""
        removed: List[Message] = []
        for message in self.by_seq.values():
            if message.created >= cutoff or len(removed) >= batch:
                break
            removed.append(message)
        for message in removed:
            del self.by_seq[message.seq]
            del self.by_id[message.id]
            seqs = self.inbox_seqs[message.to]
            seqs.popleft()
            if not seqs:
                del self.inbox_seqs[message.to]
            self._unindex(message)
            self._count(message.to, message.status, -1)
        if removed:
            self.removed(removed)
        return len(removed)

    def depths(self) -> List[QueueDepth]:
        out = []
        for agent in sorted(self.depth):
            counts = self.depth[agent]
            queue = self.queued_seqs.get(agent)
            out.append(QueueDepth(
                agent,
                queued=counts.get(QUEUED, 0),
                leased=counts.get(LEASED, 0),
                failed=counts.get(FAILED, 0),
                oldest_queued=self.by_seq[queue[0]].created if queue else None,
            ))
        return out

    def register(self, agent: str, now: float) -> None:
        self.peer_seen[agent] = int(now)
        self.registered(agent)

    def is_registered(self, agent: str) -> bool:
        return agent in self.peer_seen

    def peers(self) -> List[Tuple[str, int]]:
        return sorted(self.peer_seen.items())


class MemoryStore(RecordStore):
    """Everything in memory; the store of tests and of ``persist: false``."""

    name = "memory"

    def __init__(self, records: Optional[MemoryRecords] = None) -> None:
        super().__init__(records if records is not None else MemoryRecords())


def parse_options(section: Mapping[str, Any], config) -> None:
    """The memory backend has no options of its own."""
    for key in section:
        raise ConfigError(f"broker.memory.{key}", "unknown key (the memory backend has no options)")


def open_store(config, options, clock) -> MemoryStore:
    """Open an empty memory store (the IStoreFactory entry point)."""
    return MemoryStore()
