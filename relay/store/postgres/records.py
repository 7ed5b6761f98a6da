"""The :class:`relay.store.records.Records` primitives as statements of one
transaction, the notification a transaction sends and what a broker hears in one,
and the operations that differ on this store."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from relay.rules import delivery
from relay.rules.delivery import Changes, Message, Rules
from relay.rules.events import Event
from relay.store import columns
from relay.store import records as ops
from relay.store.interface import QueueDepth
from relay.store.postgres.statements import (
    EVENT_TRIM_BATCH,
    FILTERS,
    INSERT,
    LOCK_CLASS_EVENTS,
    LOCK_CLASS_RECIPIENT,
    MATCH_PAGE,
    SAVE,
    STATEMENTS,
    listing_statement,
)
from relay.store.records import Records
from relay.wire.protocol import EXPIRED, KEEP_CARD, QUEUED

NOTIFY_BYTES = 7900  # PostgreSQL's limit is 8000 bytes per payload


# A row of COLUMNS as a Message; a message's values of the INSERT and of a save.
_message = columns.row_reader(skip=1)
_insert_values = columns.row_writer(columns.STORED)
_state_values = columns.row_writer(columns.STATE)


class Conflict(Exception):
    """A row changed under this transaction (another broker won a race): run it again."""



# -- the primitives --------------------------------------------------------------------


class PostgresRecords(Records):
    """The :class:`Records` primitives as statements of one transaction (one cursor).

    Remembers the ``version`` of every row it hands out; :meth:`save` writes a
    row only at that version and raises :class:`Conflict` otherwise.
    """

    def __init__(self, cursor: Any) -> None:
        super().__init__()
        self.cursor = cursor
        self.versions: Dict[int, int] = {}
        self.registered: Set[str] = set()
        self.notice: Dict[str, Any] = {}
        # events of this transaction, written by finish() in one statement
        self.new_events: List[Tuple[str, str, str, float]] = []

    def _rows(self, sql: str, params: Sequence[Any]) -> List[Message]:
        self.cursor.execute(sql, params)
        out = []
        for row in self.cursor.fetchall():
            self.versions[row[0]] = row[1]
            out.append(_message(row))
        return out

    def insert(self, message: Message) -> bool:
        params = [LOCK_CLASS_RECIPIENT, message.to, *_insert_values(message)]
        self.cursor.execute(INSERT, params)
        row = self.cursor.fetchone()
        if row is None:
            return False
        message.seq = row[0]
        self.versions[row[0]] = 0
        return True

    def get(self, message_id: str) -> Optional[Message]:
        found = self._rows(STATEMENTS["get"], (message_id,))
        return found[0] if found else None

    def seq_of(self, message_id: str) -> int:
        self.cursor.execute(STATEMENTS["seq_of"], (message_id,))
        row = self.cursor.fetchone()
        return 0 if row is None else row[0]

    def copies(self, sent_id: str) -> List[Message]:
        return self._rows(STATEMENTS["copies"], (sent_id,))

    def _usage_changed(self, deltas: Mapping[str, List[int]]) -> None:
        changed = sorted(agent for agent, (count, size) in deltas.items() if count or size)
        if changed:
            self.cursor.execute(STATEMENTS["usage_delta"], (
                changed, [deltas[a][0] for a in changed], [deltas[a][1] for a in changed]))

    def usage(self, agent: str) -> Tuple[int, int]:
        self.cursor.execute(STATEMENTS["usage"], (LOCK_CLASS_RECIPIENT, agent))
        row = self.cursor.fetchone()
        return (0, 0) if row is None or row[0] is None else (row[0], row[1])

    def agent_count(self) -> int:
        self.cursor.execute(STATEMENTS["agent_count"])
        return self.cursor.fetchone()[0]

    def forget(self, cutoff: float) -> List[str]:
        self.cursor.execute(STATEMENTS["forget"], (int(cutoff),))
        gone = sorted(row[0] for row in self.cursor.fetchall())
        if gone:
            self.cursor.execute(STATEMENTS["forget_usage"], (gone,))
            self.notice["forgot"] = 1
        return gone

    def save(self, messages: Sequence[Message], befores: Sequence[Tuple[Any, ...]]) -> None:
        if not messages:
            return
        deltas: Dict[str, List[int]] = {}
        for message, before in zip(messages, befores):
            was, now = before[0] in delivery.PENDING, message.status in delivery.PENDING
            if was != now:
                sign = 1 if now else -1
                entry = deltas.setdefault(message.to, [0, 0])
                entry[0] += sign
                entry[1] += sign * message.stored_bytes()
        self._usage_changed(deltas)
        seqs = [m.seq for m in messages]
        values: List[List[Any]] = [seqs, [self.versions[s] for s in seqs]]
        states = [_state_values(m) for m in messages]
        values.extend([state[i] for state in states] for i in range(len(columns.STATE)))
        self.cursor.execute(SAVE, values)
        if self.cursor.rowcount != len(messages):
            raise Conflict()
        for seq in seqs:
            self.versions[seq] += 1

    def claim(self, agent: str, queues: Sequence[str], limit: int, lease_seconds: float,
              now: float, rules: Rules, parent_id: Optional[str] = None) -> List[Message]:
        """Lease up to ``limit`` deliverable messages of ``queues`` to ``agent`` (with
        ``parent_id``: those answering it) in the order of :func:`relay.rules.delivery.rank`,
        in one statement: the state :func:`relay.rules.delivery.lease` gives; notes their
        deadlines."""
        until = delivery.now_ms(now) + int(lease_seconds * 1000)
        lease_ids = [delivery.new_lease_id() for _ in range(limit)]
        params = {"agent": agent, "queues": list(queues), "limit": limit,
                  "lease_ids": lease_ids, "until": until, "now": now, "parent": parent_id}
        sql = STATEMENTS["claim" if parent_id is None else "claim_parent"]
        claimed = sorted(self._rows(sql, params), key=delivery.rank)
        queued = (QUEUED,) + (None,) * (len(columns.STATE) - 1)
        for message in claimed:
            ops.note(self, queued, message, now, rules)
        return claimed

    def ranked(self, queues: Sequence[str], limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        sql = STATEMENTS["ranked" if parent_id is None else "ranked_parent"]
        params = {"queues": list(queues), "limit": limit, "now": now, "parent": parent_id}
        return self._rows(sql, params)

    def card(self, agent: str) -> Optional[Dict[str, Any]]:
        self.cursor.execute(STATEMENTS["card"], (agent,))
        row = self.cursor.fetchone()
        return None if row is None or row[0] is None else json.loads(row[0])

    def joiners(self, role: str) -> List[str]:
        self.cursor.execute(STATEMENTS["joiners"], (role,))
        return [row[0] for row in self.cursor.fetchall()]

    def queued(self, agent: str, after_seq: int, limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        params = {"agent": agent, "after": after_seq, "limit": limit, "now": now,
                  "parent": parent_id}
        return self._rows(STATEMENTS["queued" if parent_id is None else "queued_parent"],
                          params)

    def recovered(self, agent: str, upto_seq: int, limit: int, now: float) -> List[Message]:
        params = {"agent": agent, "upto": upto_seq, "limit": limit, "now": now}
        return self._rows(STATEMENTS["recovered"], params)

    def lapsed(self, now: float) -> List[Message]:
        return self._rows(STATEMENTS["lapsed"], (delivery.now_ms(now),))

    def held_due(self, now: float, limit: int) -> List[Message]:
        return self._rows(STATEMENTS["held_due"], (now, limit))

    def listing(self, agent: str, box: str, limit: int, filters: Mapping[str, Optional[str]],
                now: float, match: Optional[ops.Match] = None) -> List[Message]:
        params: Dict[str, Any] = {name: filters.get(name) for name, _ in FILTERS}
        params.update(agent=agent, limit=limit, now=now)
        if match is None:
            return self._rows(listing_statement(box, filters), params)
        sql = listing_statement(box, filters, match=True)
        params.update(limit=MATCH_PAGE, before=2**62)
        out: List[Message] = []
        size = 0
        while len(out) < limit and size <= ops.RESPONSE_BUDGET_BYTES:
            page = self._rows(sql, params)
            for message in page:
                if match(message):
                    out.append(message)
                    size += message.size()
                    if len(out) >= limit:
                        break
            if len(page) < MATCH_PAGE:
                break
            params["before"] = page[-1].seq
        return out

    def thread(self, agent: str, root_id: str, after_seq: int, limit: int,
               now: float) -> List[Message]:
        params = {"agent": agent, "root": root_id, "after": after_seq, "limit": limit,
                  "now": now}
        return self._rows(STATEMENTS["thread"], params)

    def expire(self, cutoff: float, now: float, batch: int
               ) -> Tuple[int, int, List[Message], List[Message]]:
        """Remove up to ``batch`` messages stored before ``cutoff`` or past their TTL
        (but return the v2/v3 ones still queued or leased, to be kept)."""
        removed = self._rows(STATEMENTS["expire"], (cutoff, now, batch))
        room = batch - len(removed)
        kept = self._rows(STATEMENTS["expire_kept"], (now, cutoff, room)) if room > 0 else []
        deltas: Dict[str, List[int]] = {}
        for message in removed:
            if message.status in delivery.PENDING:
                entry = deltas.setdefault(message.to, [0, 0])
                entry[0] -= 1
                entry[1] -= message.stored_bytes()
        self._usage_changed(deltas)
        unprocessed = [m for m in removed
                       if m.kind == "request" and m.status in ("queued", "leased")]
        counted = sum(1 for m in removed if m.status != EXPIRED)
        return (len(removed), counted, sorted(unprocessed, key=lambda m: m.seq),
                sorted(kept, key=lambda m: m.seq))

    def depths(self, now: float, settled: Optional[Sequence[str]] = None
               ) -> List[QueueDepth]:
        if settled is None:
            self.cursor.execute(STATEMENTS["depths"], {"now": now})
        else:
            self.cursor.execute(STATEMENTS["depths_settled"], {"now": now,
                                                              "agents": list(settled)})
        found: Dict[str, Dict[str, Any]] = {agent: {"agent": agent} for agent in settled or ()}
        for agent, status, held, count, oldest in self.cursor.fetchall():
            entry = found.setdefault(agent, {"agent": agent})
            if status == "queued" and held:
                entry["delayed"] = count
            else:
                entry[status] = count
                if status == "queued":
                    entry["oldest_queued"] = oldest
        return [QueueDepth(**found[agent]) for agent in sorted(found)]

    def register(self, agent: str, now: float, card: Any = KEEP_CARD) -> None:
        if card is KEEP_CARD:
            self.cursor.execute(STATEMENTS["register"], (agent, int(now)))
        else:
            text = None if card is None else json.dumps(card, separators=(",", ":"))
            self.cursor.execute(STATEMENTS["register_card"], (agent, int(now), text))
        self.registered.add(agent)

    def is_registered(self, agent: str) -> bool:
        """Asks the shared table; an agent found is remembered as registered."""
        self.cursor.execute(STATEMENTS["is_registered"], (agent,))
        if self.cursor.fetchone() is None:
            return False
        self.registered.add(agent)
        return True

    def peers(self) -> List[Tuple[str, int, Optional[Dict[str, Any]]]]:
        self.cursor.execute(STATEMENTS["peers"])
        return [(agent, seen, None if card is None else json.loads(card))
                for agent, seen, card in self.cursor.fetchall()]

    def append_event(self, agent: str, event_type: str, data: str, at: float) -> None:
        self.new_events.append((agent, at, event_type, data))

    def finish(self) -> None:
        """Write the events the operation recorded, each agent's under its lock."""
        if not self.new_events:
            return
        for agent in sorted({e[0] for e in self.new_events}):
            self.cursor.execute(STATEMENTS["event_lock"], (LOCK_CLASS_EVENTS, agent))
        self.cursor.execute(STATEMENTS["event_insert"],
                            [list(column) for column in zip(*self.new_events)])
        self.new_events = []

    def events_after(self, agent: str, after: int, limit: int) -> List[Event]:
        self.cursor.execute(STATEMENTS["events_after"], (agent, after, limit))
        return [Event(event_id, agent, event_type, data, at)
                for event_id, event_type, data, at in self.cursor.fetchall()]

    def event_marks(self, agent: str = "") -> Tuple[int, int]:
        """The floor, and the newest committed id of ``agent``'s (at least the floor):
        ids other brokers hold uncommitted are not passed over."""
        self.cursor.execute(STATEMENTS["event_marks"], (agent,))
        floor, last = self.cursor.fetchone()
        return floor, max(floor, last)

    def trim_events(self, cutoff: float) -> int:
        self.cursor.execute(STATEMENTS["event_trim"], {"cutoff": cutoff,
                                                       "limit": EVENT_TRIM_BATCH})
        row = self.cursor.fetchone()
        return 0 if row is None else row[0]

    def kept_after(self, agent: str, floor: int) -> int:
        self.cursor.execute(STATEMENTS["event_kept_after"], (agent, floor))
        anchored, anchor = self.cursor.fetchone()
        if anchored is None:
            return floor
        return min(floor, max(anchored, anchor))

    def webhook_states(self) -> Dict[str, str]:
        self.cursor.execute(STATEMENTS["webhooks"])
        return dict(self.cursor.fetchall())

    def webhook_state(self, agent: str) -> Optional[str]:
        """Locked until the operation ends: another broker's change waits for it."""
        self.cursor.execute(STATEMENTS["webhook_lock"], (agent,))
        row = self.cursor.fetchone()
        return None if row is None else row[0]

    def put_webhook(self, agent: str, state: Optional[str]) -> None:
        if state is None:
            self.cursor.execute(STATEMENTS["webhook_drop"], (agent,))
        else:
            self.cursor.execute(STATEMENTS["webhook_put"], (agent, state))

    def notification(self, token: str) -> Optional[str]:
        """The payload that tells other brokers what this transaction changed, or None."""
        if not self.changes and not self.notice:
            return None
        body: Dict[str, Any] = {"b": token}
        if self.changes.ready:
            body["r"] = sorted(self.changes.ready)
        if self.changes.events:
            body["e"] = sorted(self.changes.events)
        if self.changes.hooks:
            body["w"] = sorted(self.changes.hooks)
        due = self.changes.due.union(self.changes.held)  # other brokers' waiters too
        if due:
            body["d"] = sorted([when, agent] for when, agent in due)
        body.update(self.notice)
        payload = json.dumps(body, separators=(",", ":"))
        if len(payload.encode("utf-8")) > NOTIFY_BYTES:
            # Too many agents for one notification: every broker looks for itself.
            slim = {k: v for k, v in body.items() if k not in ("r", "d", "e", "w")}
            payload = json.dumps(dict(slim, all=1), separators=(",", ":"))
        return payload


def heard(payload: str) -> Tuple[Optional[str], Changes, bool, Dict[str, Any]]:
    """``(sender token, changes, look at everything, the rest)`` of a notification."""
    try:
        body = json.loads(payload)
    except ValueError:
        return None, Changes(), False, {}
    if not isinstance(body, dict):
        return None, Changes(), False, {}
    changes = Changes()
    for agent in body.pop("r", ()):
        if isinstance(agent, str):
            changes.ready.add(agent)
    for agent in body.pop("e", ()):
        if isinstance(agent, str):
            changes.events.add(agent)
    for agent in body.pop("w", ()):
        if isinstance(agent, str):
            changes.hooks.add(agent)
    for pair in body.pop("d", ()):
        if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (int, float))
                and isinstance(pair[1], str)):
            changes.due.add((float(pair[0]), pair[1]))
    return body.pop("b", None), changes, bool(body.pop("all", False)), body


# -- the operations that differ here ----------------------------------------------------


def pull(records: PostgresRecords, agent: str, limit: int, lease_seconds: float, now: float,
         rules: Rules, parent_id: Optional[str] = None,
         role: Optional[str] = None) -> List[Message]:
    """Release lapsed leases (the rules of relay.rules.delivery), then claim from the agent's
    queues (:func:`relay.store.records.queues`) in one statement."""
    ops.release_lapsed(records, now, rules)
    found = ops.queues(records, agent, rules, role)
    return records.claim(agent, found, limit, lease_seconds, now, rules, parent_id)


def is_registered(records: PostgresRecords, agent: str) -> bool:
    return records.is_registered(agent)


def upcoming_deadlines(records: PostgresRecords, now: float) -> Set[Tuple[float, str]]:
    """``(when, agent)`` of each agent's next lease deadline and next delay's end."""
    records.cursor.execute(STATEMENTS["upcoming"], {"now": now, "now_ms": delivery.now_ms(now)})
    return {(float(when), agent) for agent, when in records.cursor.fetchall()}


def every_waiting_agent(records: PostgresRecords, now: float) -> Set[str]:
    """Agents with queued messages or lapsed leases (when notifications may have been lost)."""
    records.cursor.execute(STATEMENTS["queued_agents"])
    agents = {row[0] for row in records.cursor.fetchall()}
    records.cursor.execute(STATEMENTS["lapsed_agents"], (delivery.now_ms(now),))
    agents.update(row[0] for row in records.cursor.fetchall())
    return agents
