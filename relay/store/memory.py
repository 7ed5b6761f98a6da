"""The in-memory store: nothing survives a restart; every primitive is indexed.

Also the base of the jsonl backend, which keeps these records in memory and
appends every change to its log.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import replace
from itertools import chain, islice
from typing import (
    Any,
    Deque,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from relay.rules import delivery
from relay.rules.delivery import PENDING, Message
from relay.rules.events import Event
from relay.store.interface import QueueDepth
from relay.store.records import Match, Records, RecordStore, RoleJoins
from relay.wire.errors import ConfigError
from relay.wire.protocol import DONE, EXPIRED, FAILED, KEEP_CARD, LEASED, QUEUED, REQUEST_KIND

# The states whose messages are counted per agent (QueueDepth); the settled ones are
# reported only when asked for.
_COUNTED = (QUEUED, LEASED, FAILED, DONE, EXPIRED)
_UNSETTLED = (QUEUED, LEASED, FAILED)


# The most keys a chunk of a SortedKeys holds before it is cut in two halves.
CHUNK_KEYS = 1024


class SortedKeys:
    """Keys kept in order (a queue's seqs, or its ``(-priority, seq)`` ranks), as a
    sorted list would keep them, in chunks of at most :data:`CHUNK_KEYS`.

    Taking a key out of a queue's middle (a pull by priority takes from anywhere in
    seq order) moves only the rest of its chunk, not the rest of the queue: the cost
    of an insert or a removal does not grow with the queue's length.
    """

    __slots__ = ("chunks", "lasts", "size")

    def __init__(self) -> None:
        self.chunks: List[List[Any]] = []
        self.lasts: List[Any] = []  # the last key of each chunk
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __iter__(self) -> Iterator[Any]:
        return chain.from_iterable(self.chunks)

    def __contains__(self, key: Any) -> bool:
        i = bisect_left(self.lasts, key)
        if i == len(self.lasts):
            return False
        chunk = self.chunks[i]
        return chunk[bisect_left(chunk, key)] == key

    def first(self) -> Any:
        """The smallest key (the set is not empty)."""
        return self.chunks[0][0]

    def after(self, key: Any) -> Iterator[Any]:
        """The keys above ``key``, in order."""
        chunks = self.chunks
        i = bisect_right(self.lasts, key)
        if i == len(chunks):
            return iter(())
        chunk = chunks[i]
        return chain(islice(chunk, bisect_right(chunk, key), None),
                     chain.from_iterable(islice(chunks, i + 1, None)))

    def add(self, key: Any) -> None:
        """Insert ``key`` in its place."""
        chunks, lasts = self.chunks, self.lasts
        self.size += 1
        if not chunks:
            chunks.append([key])
            lasts.append(key)
            return
        i = bisect_left(lasts, key)
        if i == len(lasts):  # the newest message: the usual case
            i -= 1
            chunk = chunks[i]
            chunk.append(key)
            lasts[i] = key
        else:
            chunk = chunks[i]
            insort(chunk, key)
        if len(chunk) > CHUNK_KEYS:
            half = len(chunk) // 2
            chunks[i:i + 1] = [chunk[:half], chunk[half:]]
            lasts[i:i + 1] = [chunk[half - 1], chunk[-1]]

    def discard(self, key: Any) -> bool:
        """Take ``key`` out; False when it is not there."""
        chunks, lasts = self.chunks, self.lasts
        i = bisect_left(lasts, key)
        if i == len(lasts):
            return False
        chunk = chunks[i]
        j = bisect_left(chunk, key)
        if chunk[j] != key:
            return False
        del chunk[j]
        self.size -= 1
        if not chunk:
            del chunks[i], lasts[i]
            return True
        lasts[i] = chunk[-1]
        # a chunk emptied by scattered removals joins its neighbour, so the chunks
        # stay few however the queue was taken from
        if (len(chunk) < CHUNK_KEYS // 4 and i + 1 < len(chunks)
                and len(chunk) + len(chunks[i + 1]) <= CHUNK_KEYS // 2):
            chunk.extend(chunks[i + 1])
            lasts[i] = lasts[i + 1]
            del chunks[i + 1], lasts[i + 1]
        return True


class MemoryRecords(Records):
    """Messages and peers with the index each primitive needs.

    The records keep their own copies of the messages: what :meth:`get` and the
    listings hand out, and what :meth:`insert` and :meth:`save` receive, stay the
    caller's. Queued messages held back by ``not_before`` wait in a heap and join
    their recipient's queue when due. Heap entries (leases, delays, TTLs) count
    only while they still match the message, so a deadline that moved leaves a
    stale entry that is skipped; per-agent sequence lists may hold the seqs of
    removed messages, which are skipped too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.next_seq = 1
        self.by_id: Dict[str, Message] = {}
        self.by_seq: Dict[int, Message] = {}
        self.inbox_seqs: Dict[str, Deque[int]] = {}
        self.outbox_seqs: Dict[str, Deque[int]] = {}
        self.queued_seqs: Dict[str, SortedKeys] = {}
        # REACH §14: per recipient, (-priority, seq) of its queued messages above
        # priority 0 that no delay holds back, in the order a pull leases them
        self.urgent: Dict[str, SortedKeys] = {}
        self.recovery_seqs: Dict[str, Set[int]] = {}
        self.parents: Dict[str, Set[int]] = {}  # parent_id and reply_to values
        self.roots: Dict[str, Set[int]] = {}
        self.sent_ids: Dict[str, Set[int]] = {}  # REACH §13: the copies of a group send
        self.leases: List[Tuple[int, int, str]] = []
        self.delayed: List[Tuple[float, int]] = []
        # (not_before, seq) of queued messages held back: release_due clears them
        self.holds: List[Tuple[float, int]] = []
        self.expiries: List[Tuple[float, int]] = []
        self.peer_seen: Dict[str, int] = {}
        self.cards: Dict[str, Dict[str, Any]] = {}
        # REACH §13: role -> the agents whose card lists it
        self.joins = RoleJoins()
        # agent -> status -> how many of its messages are in that (counted) state, and
        # agent -> how many of its queued messages wait in the delayed heap
        self.depth: Dict[str, Dict[str, int]] = {}
        self.held: Dict[str, int] = {}
        # agent -> UTF-8 bytes of the bodies of its pending (queued or leased) messages
        self.pending_bytes: Dict[str, int] = {}
        # REACH §11: every kept event in id order, each agent's in id order, the
        # highest id given and the highest removed by retention
        self.event_log: Deque[Event] = deque()
        self.agent_events: Dict[str, List[Event]] = {}
        self.agent_event_ids: Dict[str, List[int]] = {}
        self.last_event = 0
        self.event_floor = 0
        # agent -> the id of its newest event retention removed; the floor before
        # the first trim that kept them (None: none yet)
        self.event_anchors: Dict[str, int] = {}
        self.events_anchored_from: Optional[int] = None
        # REACH §12: agent -> its webhook state (JSON text)
        self.hooks: Dict[str, str] = {}

    # -- indexes -----------------------------------------------------------------------

    def _index(self, message: Message, lease_moved: bool = True) -> None:
        """Enter ``message`` (a stored copy) in the indexes of its delivery state."""
        if message.status == QUEUED:
            if message.not_before is not None:
                heapq.heappush(self.delayed, (message.not_before, message.seq))
                heapq.heappush(self.holds, (message.not_before, message.seq))
                self._tally(self.held, message.to, 1)
            else:
                self._queue(message.to, message.seq, message.priority)
            if message.recovery:
                self.recovery_seqs.setdefault(message.to, set()).add(message.seq)
        elif message.status == LEASED and lease_moved:
            heapq.heappush(self.leases, (message.lease_until, message.seq, message.lease_id))

    def _unindex(self, message: Message) -> None:
        """Leave the queue indexes (heap entries go stale on their own)."""
        if message.status != QUEUED:
            return
        # (an empty SortedKeys is never kept, and its size is read as an attribute:
        # its truth would be a Python-level call on every lease)
        queue = self.queued_seqs.get(message.to)
        promoted = queue is not None and queue.discard(message.seq)
        if promoted and not queue.size:
            del self.queued_seqs[message.to]
        if promoted and message.priority:
            ranks = self.urgent[message.to]
            ranks.discard((-message.priority, message.seq))
            if not ranks.size:
                del self.urgent[message.to]
        if message.not_before is not None and not promoted:
            self._tally(self.held, message.to, -1)
        marks = self.recovery_seqs.get(message.to)
        if marks is not None:
            marks.discard(message.seq)
            if not marks:
                del self.recovery_seqs[message.to]

    def _queue(self, agent: str, seq: int, priority: int) -> None:
        """Enter a deliverable queued message in its recipient's queue indexes."""
        queue = self.queued_seqs.get(agent)
        if queue is None:
            queue = self.queued_seqs[agent] = SortedKeys()
        queue.add(seq)
        if priority:
            ranks = self.urgent.get(agent)
            if ranks is None:
                ranks = self.urgent[agent] = SortedKeys()
            ranks.add((-priority, seq))

    @staticmethod
    def _tally(counts: Dict[str, int], key: str, delta: int) -> None:
        left = counts.get(key, 0) + delta
        if left:
            counts[key] = left
        else:
            counts.pop(key, None)

    def _count(self, message: Message, status: str, delta: int) -> None:
        agent = message.to
        if status in _COUNTED:
            counts = self.depth.setdefault(agent, {})
            self._tally(counts, status, delta)
            if not counts:
                del self.depth[agent]
        if status in PENDING:
            self._tally(self.pending_bytes, agent, delta * message.stored_bytes())

    def load(self, message: Message) -> None:
        """Index a message that already has its seq and state (when replaying a log)."""
        seq = message.seq
        self.by_id[message.id] = message
        self.by_seq[seq] = message
        self.inbox_seqs.setdefault(message.to, deque()).append(seq)
        self.outbox_seqs.setdefault(message.sender, deque()).append(seq)
        for value in {message.parent_id, message.reply_to} - {None}:
            self.parents.setdefault(value, set()).add(seq)
        if message.root_id is not None:
            self.roots.setdefault(message.root_id, set()).add(seq)
        if message.sent_id is not None:
            self.sent_ids.setdefault(message.sent_id, set()).add(seq)
        if message.expires_at is not None:
            heapq.heappush(self.expiries, (message.expires_at, seq))
        self._index(message)
        self._count(message, message.status, 1)
        self.next_seq = max(self.next_seq, seq + 1)

    def _promote(self, now: float) -> None:
        """Move the delayed messages that are due into their recipients' queues."""
        heap = self.delayed
        while heap and heap[0][0] <= now:
            when, seq = heapq.heappop(heap)
            message = self.by_seq.get(seq)
            if message is None or message.status != QUEUED or message.not_before != when:
                continue
            queue = self.queued_seqs.get(message.to)
            if queue is None or seq not in queue:
                self._queue(message.to, seq, message.priority)
                self._tally(self.held, message.to, -1)

    def _live(self, seqs: Iterable[int], now: float) -> Iterable[Message]:
        """The stored messages of ``seqs`` that still exist and have not expired."""
        by_seq = self.by_seq
        for seq in seqs:
            message = by_seq.get(seq)
            if message is not None and not delivery.expired(message, now):
                yield message

    # -- hooks of a subclass that records every change ---------------------------------

    def inserted(self, stored: Message) -> None:
        """``stored`` was added."""

    def saved(self, stored: Message) -> None:
        """The delivery state of ``stored`` changed."""

    def removed(self, messages: List[Message], through: int) -> None:
        """The expiry sweep removed ``messages``: every message up to seq ``through``
        (0: none by age) and the others of the list (their TTL ran out)."""

    def forgotten(self, agents: List[str]) -> None:
        """``agents`` were forgotten (offline for long, no messages addressed to them)."""

    def registered(self, agent: str, card_changed: bool) -> None:
        """``agent`` sent a heartbeat (with a new card or none, when ``card_changed``)."""

    def evented(self, event: Event) -> None:
        """``event`` was recorded."""

    def trimmed(self, floor: int, anchors: Dict[str, int]) -> None:
        """Retention removed every event up to id ``floor``; ``anchors`` are the
        newest removed of each agent concerned."""

    def hooked(self, agent: str) -> None:
        """The webhook state of ``agent`` changed."""

    def webhook_states(self) -> Dict[str, str]:
        return dict(self.hooks)

    def webhook_state(self, agent: str) -> Optional[str]:
        return self.hooks.get(agent)

    def put_webhook(self, agent: str, state: Optional[str]) -> None:
        if state is None:
            self.hooks.pop(agent, None)
        else:
            self.hooks[agent] = state
        self.hooked(agent)

    # -- events ------------------------------------------------------------------------

    def load_event(self, event: Event) -> None:
        """Keep an event that already has its id (when replaying a log)."""
        self.event_log.append(event)
        self.agent_events.setdefault(event.agent, []).append(event)
        self.agent_event_ids.setdefault(event.agent, []).append(event.id)
        self.last_event = max(self.last_event, event.id)

    def append_event(self, agent: str, event_type: str, data: str, at: float) -> None:
        # load_event, for a new id (the hot path of every send and settle)
        self.last_event = event_id = self.last_event + 1
        event = Event(event_id, agent, event_type, data, at)
        self.event_log.append(event)
        kept = self.agent_events.get(agent)
        if kept is None:
            self.agent_events[agent] = [event]
            self.agent_event_ids[agent] = [event_id]
        else:
            kept.append(event)
            self.agent_event_ids[agent].append(event_id)
        self.evented(event)

    def events_after(self, agent: str, after: int, limit: int) -> List[Event]:
        ids = self.agent_event_ids.get(agent)
        if not ids or ids[-1] <= after:
            return []
        start = bisect_right(ids, after)
        return self.agent_events[agent][start:start + limit]

    def event_marks(self, agent: str = "") -> Tuple[int, int]:
        return self.event_floor, self.last_event

    def drop_events(self, floor: int) -> Dict[str, int]:
        """Forget the events up to id ``floor``; returns the newest removed of each
        agent concerned (its anchor now)."""
        log = self.event_log
        gone: Dict[str, int] = {}
        anchors: Dict[str, int] = {}
        while log and log[0].id <= floor:
            event = log.popleft()
            gone[event.agent] = gone.get(event.agent, 0) + 1
            anchors[event.agent] = event.id
        for agent, how_many in gone.items():
            kept = self.agent_events[agent]
            if how_many >= len(kept):
                del self.agent_events[agent], self.agent_event_ids[agent]
            else:
                del kept[:how_many], self.agent_event_ids[agent][:how_many]
        self.event_anchors.update(anchors)
        if self.events_anchored_from is None:
            self.events_anchored_from = self.event_floor
        self.event_floor = max(self.event_floor, floor)
        return anchors

    def trim_events(self, cutoff: float) -> int:
        floor = 0
        for event in self.event_log:
            if event.at >= cutoff:
                break
            floor = event.id
        if not floor:
            return 0
        before = len(self.event_log)
        anchors = self.drop_events(floor)
        self.trimmed(floor, anchors)
        return before - len(self.event_log)

    def kept_after(self, agent: str, floor: int) -> int:
        if self.events_anchored_from is None:
            return floor
        return min(floor, max(self.events_anchored_from, self.event_anchors.get(agent, 0)))

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

    def copies(self, sent_id: str) -> List[Message]:
        by_seq = self.by_seq
        seqs = self.sent_ids.get(sent_id, ())
        return [by_seq[s].copy() for s in sorted(seqs) if s in by_seq]

    def save(self, messages: Sequence[Message], befores: Sequence[Tuple[Any, ...]]) -> None:
        for message in messages:
            stored = self.by_seq[message.seq]
            old, new = stored.state(), message.state()
            if old == new:
                continue
            self._unindex(stored)
            if old[0] != new[0]:
                self._count(stored, old[0], -1)
                self._count(stored, new[0], 1)
            stored.set_state(new)
            self._index(stored, lease_moved=old[0] != LEASED or old[2:4] != new[2:4])
            if old[11] != new[11] and stored.expires_at is not None:
                heapq.heappush(self.expiries, (stored.expires_at, stored.seq))
            self.saved(stored)

    def queued(self, agent: str, after_seq: int, limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        self._promote(now)
        if parent_id is not None:
            candidates: Iterable[int] = sorted(
                s for s in self.parents.get(parent_id, ()) if s > after_seq)
        else:
            queue = self.queued_seqs.get(agent)
            if queue is None:
                return []
            candidates = queue.after(after_seq) if after_seq else iter(queue)
        out = []
        for message in self._live(candidates, now):
            if message.to == agent and delivery.deliverable(message, now):
                out.append(message.copy())
                if len(out) >= limit:
                    break
        return out

    def ranked(self, queues: Sequence[str], limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        self._promote(now)
        found: List[Message] = []
        if parent_id is not None:
            wanted = set(queues)
            found = [m for m in self._live(self.parents.get(parent_id, ()), now)
                     if m.to in wanted and delivery.deliverable(m, now)]
        else:
            for queue in queues:
                found += self._ranked_queue(queue, limit, now)
        found.sort(key=delivery.rank)
        return [m.copy() for m in found[:limit]]

    def _ranked_queue(self, agent: str, limit: int, now: float) -> List[Message]:
        """The first ``limit`` deliverable messages of one queue by rank: those above
        priority 0 from their index, then the others in sequence order (skipping at
        most the few above 0 already taken)."""
        out: List[Message] = []
        urgent = (seq for _, seq in self.urgent.get(agent, ()))
        for message in self._live(urgent, now):
            if delivery.deliverable(message, now):
                out.append(message)
                if len(out) >= limit:
                    return out
        for message in self._live(self.queued_seqs.get(agent, ()), now):
            if not message.priority and delivery.deliverable(message, now):
                out.append(message)
                if len(out) >= limit:
                    break
        return out

    def card(self, agent: str) -> Optional[Dict[str, Any]]:
        return _copy_card(self.cards.get(agent))

    def joiners(self, role: str) -> List[str]:
        return self.joins.joiners(role)

    def recovered(self, agent: str, upto_seq: int, limit: int, now: float) -> List[Message]:
        marks = self.recovery_seqs.get(agent)
        if not marks:
            return []
        out = []
        for message in self._live(sorted(s for s in marks if s <= upto_seq), now):
            if delivery.deliverable(message, now):
                out.append(message.copy())
                if len(out) >= limit:
                    break
        return out

    def held_due(self, now: float, limit: int) -> List[Message]:
        out: List[Message] = []
        heap = self.holds
        while heap and heap[0][0] <= now and len(out) < limit:
            when, seq = heapq.heappop(heap)
            message = self.by_seq.get(seq)
            if message is not None and message.status == QUEUED and message.not_before == when:
                out.append(message.copy())
        return out

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
        return [self.by_seq[seq].copy() for seq in live]

    def _box(self, agent: str, box: str) -> Iterable[int]:
        """``agent``'s box, newest first."""
        inbox = reversed(self.inbox_seqs.get(agent, ()))
        if box == "inbox":
            return inbox
        outbox = reversed(self.outbox_seqs.get(agent, ()))
        if box == "sent":
            return outbox
        return heapq.merge(inbox, outbox, reverse=True)

    def listing(self, agent: str, box: str, limit: int, filters: Mapping[str, Optional[str]],
                now: float, match: Optional[Match] = None) -> List[Message]:
        kind, status, sender = filters.get("kind"), filters.get("status"), filters.get("from")
        recipient = filters.get("to")
        root_id, parent_id = filters.get("rootId"), filters.get("parentId")
        if root_id is not None:
            candidates: Iterable[int] = sorted(self._thread_seqs(root_id), reverse=True)
        elif parent_id is not None:
            candidates = sorted(self.parents.get(parent_id, ()), reverse=True)
        else:
            candidates = self._box(agent, box)
        out = []
        found = (self._live(candidates, now) if match is None else
                 (m for m in map(self.by_seq.get, candidates) if m is not None))
        for message in found:
            in_box = (message.to == agent if box == "inbox" else
                      message.sender == agent if box == "sent" else
                      agent in (message.to, message.sender))
            if (
                in_box
                and (kind is None or message.kind == kind)
                and (status is None or message.status == status)
                and (sender is None or message.sender == sender)
                and (recipient is None or message.to == recipient)
                and (root_id is None or root_id in (message.id, message.root_id))
                and (parent_id is None or parent_id in (message.parent_id, message.reply_to))
                and (match is None or match(message))
            ):
                out.append(message.copy())
                if len(out) >= limit:
                    break
        return out

    def _thread_seqs(self, root_id: str) -> Set[int]:
        seqs = set(self.roots.get(root_id, ()))
        root = self.by_id.get(root_id)
        if root is not None:
            seqs.add(root.seq)
        return seqs

    def thread(self, agent: str, root_id: str, after_seq: int, limit: int,
               now: float) -> List[Message]:
        seqs = sorted(s for s in self._thread_seqs(root_id) if s > after_seq)
        out = []
        for message in self._live(seqs, now):
            if agent in (message.sender, message.to):
                out.append(message.copy())
                if len(out) >= limit:
                    break
        return out

    def expire(self, cutoff: float, now: float, batch: int
               ) -> Tuple[int, int, List[Message], List[Message]]:
        removed: List[Message] = []
        through = 0
        for message in self.by_seq.values():
            if message.created >= cutoff or len(removed) >= batch:
                break
            removed.append(message)
            through = message.seq
        seen = {m.seq for m in removed}
        kept: List[Message] = []
        heap = self.expiries
        while heap and heap[0][0] <= now and len(removed) + len(kept) < batch:
            when, seq = heapq.heappop(heap)
            message = self.by_seq.get(seq)
            if message is None or seq in seen or message.expires_at != when:
                continue
            if not delivery.outlives_ttl(message):
                removed.append(message)
                seen.add(seq)
            elif message.status in PENDING:
                kept.append(message.copy())
        for message in removed:
            self._remove(message)
        if removed:
            self.removed(removed, through)
        counted = sum(1 for m in removed if m.status != EXPIRED)
        unprocessed = [m.copy() for m in removed
                       if m.kind == REQUEST_KIND and m.status in PENDING]
        return len(removed), counted, unprocessed, kept

    def _remove(self, message: Message) -> None:
        del self.by_seq[message.seq]
        del self.by_id[message.id]
        self._unindex(message)
        self._count(message, message.status, -1)
        for index, key in ((self.inbox_seqs, message.to), (self.outbox_seqs, message.sender)):
            seqs = index[key]
            while seqs and seqs[0] not in self.by_seq:
                seqs.popleft()
            if not seqs:
                del index[key]
        for index, keys in ((self.parents, {message.parent_id, message.reply_to}),
                            (self.roots, {message.root_id}), (self.sent_ids, {message.sent_id})):
            for key in keys - {None}:
                seqs = index.get(key)
                if seqs is not None:
                    seqs.discard(message.seq)
                    if not seqs:
                        del index[key]

    def depths(self, now: float, settled: Optional[Sequence[str]] = None
               ) -> List[QueueDepth]:
        self._promote(now)
        out = []
        for agent in sorted(self.depth) if settled is None else settled:
            counts = self.depth.get(agent, {})
            if settled is None and not any(status in counts for status in _UNSETTLED):
                continue
            held = self.held.get(agent, 0)
            queue = self.queued_seqs.get(agent)
            depth = QueueDepth(
                agent,
                queued=counts.get(QUEUED, 0) - held,
                leased=counts.get(LEASED, 0),
                failed=counts.get(FAILED, 0),
                delayed=held,
                oldest_queued=self.by_seq[queue.first()].created if queue else None,
            )
            if settled is not None:
                depth = replace(depth, done=counts.get(DONE, 0), expired=counts.get(EXPIRED, 0))
            out.append(depth)
        return out

    def register(self, agent: str, now: float, card: Any = KEEP_CARD) -> None:
        self.peer_seen[agent] = int(now)
        if card is not KEEP_CARD:
            if card is None:
                self.cards.pop(agent, None)
            else:
                self.cards[agent] = dict(card)
            self.joins.set_card(agent, card)
        self.registered(agent, card is not KEEP_CARD)

    def is_registered(self, agent: str) -> bool:
        return agent in self.peer_seen

    def usage(self, agent: str) -> Tuple[int, int]:
        counts = self.depth.get(agent, {})
        return (counts.get(QUEUED, 0) + counts.get(LEASED, 0),
                self.pending_bytes.get(agent, 0))

    def agent_count(self) -> int:
        return len(self.peer_seen)

    def forget(self, cutoff: float) -> List[str]:
        by_seq = self.by_seq
        gone = [agent for agent, seen in self.peer_seen.items()
                if seen < cutoff and not any(s in by_seq and by_seq[s].status != EXPIRED
                                             for s in self.inbox_seqs.get(agent, ()))]
        for agent in gone:
            del self.peer_seen[agent]
            self.cards.pop(agent, None)
        self.joins.forget(gone)
        if gone:
            self.forgotten(gone)
        return gone

    def peers(self) -> List[Tuple[str, int, Optional[Dict[str, Any]]]]:
        return [(agent, seen, _copy_card(self.cards.get(agent)))
                for agent, seen in sorted(self.peer_seen.items())]


def _copy_card(card: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if card is None:
        return None
    out = dict(card)
    for key in ("skills", "roles"):
        if key in out:
            out[key] = list(out[key])
    return out


class MemoryStore(RecordStore):
    """Everything in memory; the store of tests and of ``persist: false``."""

    name = "memory"

    def __init__(self, records: Optional[MemoryRecords] = None) -> None:
        super().__init__(records if records is not None else MemoryRecords())


def parse_options(section: Mapping[str, Any], config) -> None:
    """The memory backend has no options of its own."""
    for key in section:
        raise ConfigError(f"broker.memory.{key}", "unknown key (the memory backend has no options)")


def open_store(config, options, reactor) -> MemoryStore:
    """Open an empty memory store (the IStoreFactory entry point); it needs no reactor."""
    return MemoryStore()
