"""The SQLite backend (``broker.storage: sqlite``): the database ``dataDir/relay.db``.

The database is the source of truth: messages and peers live in indexed
tables (``sqlite-v4.sql``) and every operation reads and writes only the rows
it needs; no copy of the messages is kept in memory. The delivery rules are
those of :mod:`relay.rules.delivery`: a row is read, the rule applied to it, and
what changed written back.

Durability: statements run synchronously on the reactor thread (each costs
microseconds on an indexed table). Writes join one open transaction that is
committed at the end of the reactor turn, and the Deferred of every operation
of that turn fires only after that COMMIT (see :mod:`relay.store.grouped`):
a ``201`` means the message is in the database, and many requests share one
commit. ``broker.sync`` sets ``PRAGMA synchronous`` of the WAL journal:

- ``normal`` (default): a commit survives a killed broker process; a power
  loss may take back the last commits.
- ``full``: every commit is fsynced; a commit also survives a power loss.
- ``off``: no fsync at all; only for throwaway data.

Checkpoints (copying the WAL back into the database file, the only step that
fsyncs under ``normal``) run mostly in a worker thread: a :class:`Checkpointer`
runs a passive checkpoint on its own connection about once a second while
there are new commits. The automatic checkpoint of the main connection, which
alone can rewind the WAL under constant writes, waits for 8192 pages (32 MiB)
of WAL and then finds most of it copied already, so requests rarely wait for
the disk.

The names of registered agents are also kept in a set (one string per agent,
never messages), so the recipient check of a send costs no SQL.
Registrations (``is_registered``, ``peers``) are answered at once, even while
the heartbeat that recorded them is not yet committed.

Schema: a new database is created from the newest ``sqlite-vN.sql``; an
older one is backed up (``relay.db.vN.bak``) and brought forward by the
``sqlite-upgrade-to-vN.sql`` scripts in order; a database written by a newer
broker stops the start. When a new database is created and
``dataDir/messages.jsonl`` exists (the reference broker's file, or this
broker's jsonl backend), its messages and peers are imported in the same
transaction that creates the schema, so the import happens exactly once.
"""

from __future__ import annotations

import heapq
import json
import os
import sqlite3
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from relay.files.private import FreeSpace, private_file
from relay.rules import delivery
from relay.rules.config import SYNC_LEVELS, Config, Setting, check_keys, read_settings, table_keys
from relay.rules.delivery import PENDING, Message
from relay.rules.events import Event
from relay.store import columns, make_data_dir, off_the_reactor
from relay.store.grouped import GroupCommit
from relay.store.interface import QueueDepth
from relay.store.records import (
    RESPONSE_BUDGET_BYTES,
    Match,
    Records,
    RecordStore,
    RoleJoins,
)
from relay.wire.errors import ConfigError
from relay.wire.protocol import FAILED, KEEP_CARD, LEASED, STATUSES, STORED_STATUSES

log = Logger(namespace="relay.store.sqlite")

SCHEMA_VERSION = 9
DB_NAME = "relay.db"
JSONL_NAME = "messages.jsonl"
CHECKPOINT_SECONDS = 1.0
WAL_AUTOCHECKPOINT_PAGES = 8192
LISTING_CHUNK = 16
# The leased messages kept in memory for the settle that usually follows (ack, reply,
# nack): at most this many, and only those whose body's JSON text is at most
# LEASED_BODY_CHARS characters (its length is known; its UTF-8 size would be computed).
LEASED_KEPT = 1024
LEASED_BODY_CHARS = 8192
# The most events one run of retention removes (the sweep runs again soon).
EVENT_TRIM_BATCH = 20_000

COLUMNS = columns.names(columns.STORED, lead=("seq",))
_SELECT = f"SELECT {COLUMNS} FROM messages"
# What a row counts toward its recipient's inbox quota (delivery.Message.stored_bytes):
# the UTF-8 bytes of its body and of the envelope strings its sender chose.
_STORED_BYTES = ("(length(CAST(body AS BLOB)) + length(CAST(id AS BLOB)) "
                 "+ length(CAST(sender AS BLOB)) + length(CAST(recipient AS BLOB)) "
                 "+ ifnull(length(CAST(reply_to AS BLOB)), 0) "
                 "+ ifnull(length(CAST(root_id AS BLOB)), 0) "
                 "+ ifnull(length(CAST(parent_id AS BLOB)), 0))")
_STATE_COLUMNS = [column.name for column in columns.STATE]
# Variants of _INSERT and _SAVE_STATE kept per pattern of NULL values: at most this many.
NULL_PATTERNS = 256


def _insert_sql(nulls: Tuple[bool, ...]) -> str:
    values = ", ".join("NULL" if null else "?" for null in nulls)
    return f"INSERT OR IGNORE INTO messages ({COLUMNS}) VALUES ({values})"


def _save_sql(nulls: Tuple[bool, ...]) -> str:
    sets = ", ".join(f"{name} = {'NULL' if null else '?'}"
                     for name, null in zip(_STATE_COLUMNS, nulls))
    return f"UPDATE messages SET {sets} WHERE seq = ?"


_INSERT = _insert_sql((False,) * (1 + len(columns.STORED)))
_SAVE_STATE = _save_sql((False,) * len(_STATE_COLUMNS))


class NullsWritten:
    """A write statement with its NULL values written into the SQL rather than bound.

    Python's sqlite3 looks for an adapter for every bound ``None`` (two failed
    attribute lookups each); a message row holds about ten. One statement text per
    pattern of NULLs (a handful in practice) is prepared once and cached by the
    connection. The statement's WHERE clause never changes, so neither does its plan.
    """

    def __init__(self, build: Callable[[Tuple[bool, ...]], str]) -> None:
        self.build = build
        self.texts: Dict[Tuple[bool, ...], str] = {}

    def __call__(self, values: Sequence[Any], key_values: int) -> Tuple[str, List[Any]]:
        """The SQL and parameters for ``values``, whose last ``key_values`` are the
        WHERE clause's (bound as they are)."""
        cut = len(values) - key_values
        nulls = tuple([value is None for value in values[:cut]])
        sql = self.texts.get(nulls)
        if sql is None:
            sql = self.build(nulls)
            if len(self.texts) < NULL_PATTERNS:
                self.texts[nulls] = sql
        params = [value for value in values[:cut] if value is not None]
        params.extend(values[cut:])
        return sql, params


# Deliverable at ?: not held back and not past its TTL.
_DUE = "(not_before IS NULL OR not_before <= ?) AND (expires_at IS NULL OR expires_at > ?)"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"

# Every statement a primitive runs, by primitive; tests check their query plans.
STATEMENTS = {
    "insert": [_INSERT],
    "get": [f"{_SELECT} WHERE id = ?"],
    "seq_of": ["SELECT seq FROM messages WHERE id = ?"],
    "copies": [f"{_SELECT} WHERE sent_id = ? ORDER BY seq"],
    "save": [_SAVE_STATE],
    "queued": [
        f"{_SELECT} WHERE recipient = ? AND status = 'queued' AND seq > ? AND {_DUE} "
        "ORDER BY seq LIMIT ?",
        # by parent: the answers by parent id, then by reply-to, merged
        f"{_SELECT} WHERE parent_id = ? AND seq > ? AND recipient = ? AND status = 'queued' "
        f"AND {_DUE} ORDER BY seq LIMIT ?",
        f"{_SELECT} WHERE reply_to = ? AND seq > ? AND recipient = ? AND status = 'queued' "
        f"AND {_DUE} ORDER BY seq LIMIT ?",
    ],
    # REACH §14, a pull: one queue's messages above priority 0 by rank (their own
    # index), then its others in seq order (the inbox index, passing over at most the
    # few above 0 the first read returned); by parent, the queued answers to one
    # message (few) by rank, sorted after the parent or reply-to index found them.
    "ranked": [
        f"{_SELECT} INDEXED BY messages_urgent WHERE recipient = ? AND status = 'queued' "
        f"AND priority > 0 AND {_DUE} ORDER BY priority DESC, seq LIMIT ?",
        f"{_SELECT} WHERE recipient = ? AND status = 'queued' AND seq > 0 AND {_DUE} "
        "AND priority = 0 ORDER BY seq LIMIT ?",
        f"{_SELECT} INDEXED BY messages_parent WHERE parent_id = ? AND recipient = ? "
        f"AND status = 'queued' AND {_DUE} ORDER BY priority DESC, seq LIMIT ?",
        f"{_SELECT} INDEXED BY messages_reply_to WHERE reply_to = ? AND recipient = ? "
        f"AND status = 'queued' AND {_DUE} ORDER BY priority DESC, seq LIMIT ?",
    ],
    "card": ["SELECT card FROM peers WHERE agent = ?"],
    "recovered": [
        f"{_SELECT} INDEXED BY messages_recovery WHERE recipient = ? AND recovery = 1 "
        f"AND seq <= ? AND status = 'queued' AND {_DUE} ORDER BY seq LIMIT ?"
    ],
    "lapsed": [f"{_SELECT} WHERE status = 'leased' AND lease_until <= ?"],
    "held_due": [f"{_SELECT} INDEXED BY messages_held WHERE status = 'queued' "
                 "AND not_before IS NOT NULL AND not_before <= ? ORDER BY not_before LIMIT ?"],
    "thread": [
        f"{_SELECT} WHERE id = ? AND seq > ? AND (sender = ? OR recipient = ?) AND {_LIVE}",
        f"{_SELECT} WHERE root_id = ? AND seq > ? AND (sender = ? OR recipient = ?) AND {_LIVE} "
        "ORDER BY seq LIMIT ?",
    ],
    "expire": [
        "SELECT seq, created FROM messages WHERE seq > 0 ORDER BY seq LIMIT ?",
        # (the condition of the partial index messages_expiry, as it is written there)
        "SELECT seq, v2 FROM messages WHERE expires_at <= ? "
        "AND (v2 IS NULL OR status IN ('queued', 'leased')) LIMIT ?",
        f"{_SELECT} WHERE seq <= ? AND kind = 'request' AND status IN ('queued', 'leased')",
        f"{_SELECT} WHERE seq = ? AND kind = 'request' AND status IN ('queued', 'leased')",
        "INSERT INTO meta (key, value) SELECT 'last_seq', max(seq) FROM messages "
        "WHERE true ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
        "DELETE FROM messages WHERE seq <= ?",
        "DELETE FROM messages WHERE seq = ?",
        # the v2/v3 messages kept as expired, and those of them the age sweep removes
        f"{_SELECT} WHERE seq = ?",
        "SELECT count(*) FROM messages WHERE seq <= ? AND status = 'expired'",
    ],
    # the pending (queued or leased) messages whose usage leaves with an expiry
    "expired_usage": [
        f"SELECT recipient, {_STORED_BYTES} FROM messages "
        "WHERE seq <= ? AND status IN ('queued', 'leased')",
        f"SELECT recipient, {_STORED_BYTES} FROM messages "
        "WHERE seq = ? AND status IN ('queued', 'leased')",
    ],
    "register": [
        "INSERT INTO peers (agent, last_seen) VALUES (?, ?) "
        "ON CONFLICT (agent) DO UPDATE SET last_seen = excluded.last_seen",
        "INSERT INTO peers (agent, last_seen, card) VALUES (?, ?, ?) "
        "ON CONFLICT (agent) DO UPDATE SET last_seen = excluded.last_seen, card = excluded.card",
    ],
    # REACH §11: one row per event (its id chosen by the store), a stream's read, the
    # marks, and retention (oldest first, by the primary key).
    "events": [
        "INSERT INTO events (id, agent, at, type, data) VALUES (?, ?, ?, ?, ?)",
        "SELECT id, agent, type, data, at FROM events WHERE agent = ? AND id > ? "
        "ORDER BY id LIMIT ?",
        "SELECT key, value FROM meta WHERE key IN ('event_floor', 'last_event', "
        "'event_anchored_from')",
        "SELECT id, at FROM events WHERE id > ? ORDER BY id LIMIT ?",
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
        # from the old floor to the new one, all but each agent's newest (its
        # anchor), and the older anchors of the agents concerned
        "DELETE FROM events WHERE id > ? AND id <= ? AND EXISTS (SELECT 1 FROM events "
        "AS n WHERE n.agent = events.agent AND n.id > events.id AND n.id <= ?)",
        "SELECT max(id) FROM events",
        "SELECT max(id) FROM events WHERE agent = ? AND id <= ?",
        "DELETE FROM events WHERE id <= ? AND agent IN "
        "(SELECT agent FROM events WHERE id > ? AND id <= ?)",
    ],
    # REACH §12: one row per agent with a webhook
    "webhooks": [
        "INSERT INTO webhooks (agent, state) VALUES (?, ?) "
        "ON CONFLICT (agent) DO UPDATE SET state = excluded.state",
        "DELETE FROM webhooks WHERE agent = ?",
        "SELECT state FROM webhooks WHERE agent = ?",
    ],
    # One index seek per recipient (a loose scan of messages_inbox), then counts of
    # its queued, leased and failed ranges: done messages are never visited.
    "depths": [
        "SELECT recipient FROM messages WHERE recipient > ? ORDER BY recipient LIMIT 1",
        "SELECT status, count(*) FROM messages "
        "WHERE recipient = ? AND status IN ('queued', 'leased', 'failed') GROUP BY status",
        "SELECT count(*) FROM messages WHERE recipient = ? AND status = 'queued' "
        "AND not_before > ?",
        "SELECT created FROM messages WHERE recipient = ? AND status = 'queued' "
        "AND (not_before IS NULL OR not_before <= ?) ORDER BY seq LIMIT 1",
        # the counts with the settled messages too (the signed v2 /healthz)
        "SELECT status, count(*) FROM messages WHERE recipient = ? "
        "AND status IN ('queued', 'leased', 'failed', 'done', 'expired') GROUP BY status",
    ],
}

# The statements that sort what an index search found, not a queue: the queued
# answers to one message (a handful), ranked by priority after the parent or
# reply-to index found them. Every other statement reads in its index's order.
SORTS_FOUND = frozenset(STATEMENTS["ranked"][2:])

# Statements that read a whole table by design: the peers (at most broker.maxAgents
# rows; the forgetting runs once a minute), and the pending usage, read once when the
# store opens.
LISTINGS = (
    "SELECT agent, last_seen, card FROM peers ORDER BY agent",  # (and the roles joined)
    # (index 3, below) every webhook: one row per agent that has one
    f"SELECT recipient, count(*), sum({_STORED_BYTES}) FROM messages "
    "WHERE status IN ('queued', 'leased') GROUP BY recipient",
    "DELETE FROM peers WHERE last_seen < ? AND NOT EXISTS "
    "(SELECT 1 FROM messages WHERE recipient = peers.agent AND status <> 'expired') "
    "RETURNING agent",
    "SELECT agent, state FROM webhooks",
)


_BOX = {"inbox": "recipient = ?", "sent": "sender = ?", "all": "(recipient = ? OR sender = ?)"}
# How a listing finds its rows: by box and status, or, with a conversation filter,
# by the index of that filter (a few rows) whatever the box.
_LISTING_SOURCES = {
    "box": ("", "status = ?"),
    # the sent box: its index has no status, so it is read once, newest first;
    # its failed messages (the dead letters) have a partial index of their own
    "sender": ("", ""),
    "sender_failed": ("INDEXED BY messages_sent_failed", "status = 'failed'"),
    "id": ("", "id = ?"),
    "root": ("INDEXED BY messages_root", "root_id = ?"),
    "parent": ("INDEXED BY messages_parent", "parent_id = ?"),
    "reply_to": ("INDEXED BY messages_reply_to", "reply_to = ?"),
}


def _listing_statement(source: str, box: str, filters: Mapping[str, Optional[str]],
                       live: bool = True) -> Tuple[str, List[str]]:
    """The SELECT of a listing from ``source`` narrowed to ``box`` and the filters (and,
    when ``live``, to the messages whose TTL has not run out), and the names of its
    parameters after the source's own."""
    hint, where_source = _LISTING_SOURCES[source]
    where = [clause for clause in (where_source, _BOX[box]) if clause]
    names = ["agent"] * _BOX[box].count("?")
    status_in_source = where_source.startswith("status ")
    for name, clause in (("status", "status = ?"), ("from", "sender = ?"),
                         ("to", "recipient = ?"), ("kind", "kind = ?"),
                         ("rootId", "(id = ? OR root_id = ?)"),
                         ("parentId", "(parent_id = ? OR reply_to = ?)")):
        if filters.get(name) is not None and not (name == "status" and status_in_source):
            where.append(clause)
            names.extend([name] * clause.count("?"))
    if live:
        where.append(_LIVE)
        names.append("now")
    sql = f"{_SELECT} {hint} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?"
    return " ".join(sql.split()), names


STATEMENTS["listing"] = [
    _listing_statement(source, box, filters)[0]
    for box in ("inbox", "sent", "all")
    for source, filters in (("box", {}), ("box", {"kind": "request"}), ("box", {"from": "x"}),
                            ("box", {"to": "x"}), ("id", {"rootId": "r"}),
                            ("root", {"rootId": "r"}), ("parent", {"parentId": "p"}),
                            ("reply_to", {"parentId": "p", "status": "queued"}))
    if not (box != "inbox" and source == "box")  # the inbox index, status by status
] + [_listing_statement(source, "sent", filters)[0]
     for source, filters in (("sender", {}), ("sender", {"status": "done"}),
                             ("sender", {"kind": "request"}), ("sender", {"to": "x"}),
                             ("sender_failed", {"status": "failed"}),
                             ("sender_failed", {"status": "failed", "kind": "request"}))
] + [_listing_statement(source, box, filters, live=False)[0]  # listings with a match
     for source, box, filters in (("box", "inbox", {}), ("box", "inbox", {"status": "expired"}),
                                  ("sender", "sent", {}), ("root", "all", {"rootId": "r"}))]


def schema_script(version: int) -> str:
    """The SQL that creates a fresh database of schema ``version``."""
    return resources.files("relay.store").joinpath(f"sqlite-v{version}.sql").read_text("utf-8")


def upgrade_script(version: int) -> str:
    """The SQL that brings a database from ``version - 1`` to ``version``."""
    name = f"sqlite-upgrade-to-v{version}.sql"
    return resources.files("relay.store").joinpath(name).read_text("utf-8")


# A message as a row of COLUMNS and back; its state as the values of _SAVE_STATE.
_row = columns.row_writer(columns.STORED, lead=["message.seq or None"], int_booleans=True)
_message = columns.row_reader(int_booleans=True)
_state_row = columns.row_writer(columns.STATE, trail=["message.seq"], int_booleans=True)


def _newest(parts: List[List[Message]], limit: int) -> List[Message]:
    """The ``limit`` highest-seq messages of lists each sorted newest first."""
    merged = heapq.merge(*parts, key=lambda m: m.seq, reverse=True)
    return [m for _, m in zip(range(limit), merged)]


class Checkpointer:
    """Passive WAL checkpoints on a second connection, in a worker thread of
    ``reactor`` (inline when it has no threads, as a test clock).

    Runs every ``CHECKPOINT_SECONDS`` while ``commits`` grows; at most one
    checkpoint is in flight. The reactor thread only ever appends to the WAL.
    """

    def __init__(self, path: str, sync: str, reactor: IReactorTime,
                 commits: Callable[[], int]) -> None:
        self.reactor = reactor
        self.path = path
        self.sync = sync
        self.commits = commits
        self.checkpoints = 0
        self._seen = 0
        self._db: Optional[sqlite3.Connection] = None
        self._running: Optional[Deferred] = None
        self._loop = LoopingCall(self.tick)
        self._loop.clock = reactor

    def start(self) -> None:
        self._loop.start(CHECKPOINT_SECONDS, now=False)

    def tick(self) -> None:
        commits = self.commits()
        if self._running is not None or commits == self._seen:
            return
        self._seen = commits
        d = off_the_reactor(self.reactor, self._checkpoint)
        self._running = d

        def done(result: Any) -> None:
            self._running = None
            self.checkpoints += 1

        def failed(failure) -> None:
            self._running = None
            log.warn("sqlite checkpoint failed ({kind}); retrying later",
                     kind=failure.type.__name__)

        d.addCallbacks(done, failed)

    def _checkpoint(self) -> None:
        if self._db is None:
            self._db = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute(f"PRAGMA synchronous={self.sync.upper()}").fetchall()
        self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def stop(self) -> Deferred:
        """Stop ticking; fires once no checkpoint is running and its connection is closed."""
        if self._loop.running:
            self._loop.stop()
        running = self._running if self._running is not None else succeed(None)
        d = Deferred()
        running.addBoth(lambda _: d.callback(None))

        def close(_: Any) -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        d.addCallback(close)
        return d


class SQLiteRecords(Records):
    """The primitives as statements on one connection, inside the turn's transaction."""

    def __init__(self, db: sqlite3.Connection, commits: GroupCommit) -> None:
        super().__init__()
        self.db = db
        self.commits = commits
        # One cursor for every statement: a cursor per statement costs several
        # microseconds each on PyPy. Each result is read whole before the next.
        self.cursor = db.cursor()
        (last,) = db.execute(
            "SELECT max(coalesce((SELECT max(seq) FROM messages), 0), "
            "coalesce((SELECT value FROM meta WHERE key = 'last_seq'), 0))"
        ).fetchone()
        self.next_seq = last + 1
        self._insert = NullsWritten(_insert_sql)
        self._save = NullsWritten(_save_sql)
        self.registered = set()
        # REACH §13: role -> the agents whose card lists it (one broker writes this
        # database: kept here from the cards it reads at start and registers)
        self.joins = RoleJoins()
        for agent, _, card in db.execute(LISTINGS[0]).fetchall():
            self.registered.add(agent)
            if card is not None:
                self.joins.set_card(agent, json.loads(card))
        # recipient -> [pending messages, their body bytes], kept from here on
        self.pending: Dict[str, List[int]] = {}
        self._count_pending()
        # id -> a copy of a message as this connection last wrote it leased. A settle
        # finds its message here instead of reading the row back; the entry is taken
        # by that read, replaced or dropped by every write of the row, and the whole
        # map is dropped when a transaction is rolled back.
        self.leased: Dict[str, Message] = {}
        self._event_marks()

    def _event_marks(self) -> None:
        """Read the event floor and the next event id from the database."""
        marks = dict(self.db.execute(STATEMENTS["events"][2]).fetchall())
        (newest,) = self.db.execute(STATEMENTS["events"][6]).fetchone()
        self.event_floor = marks.get("event_floor", 0)
        self.last_event = max(newest or 0, marks.get("last_event", 0))
        # the floor of the first trim that kept anchors (None: none yet)
        self.events_anchored_from: Optional[int] = marks.get("event_anchored_from")

    def _begin(self) -> None:
        """Open the turn's transaction (if needed) before a write."""
        if not self.db.in_transaction:
            self.cursor.execute("BEGIN IMMEDIATE")
        self.commits.touch()

    def commit(self) -> None:
        if not self.db.in_transaction:
            return
        try:
            self.cursor.execute("COMMIT")
        except sqlite3.Error:
            if self.db.in_transaction:
                self.cursor.execute("ROLLBACK")
                self._count_pending()  # the counters followed what was rolled back
                self.leased.clear()
                self._event_marks()
            raise

    def _select(self, sql: str, *args: Any) -> List[Message]:
        return [_message(row) for row in self.cursor.execute(sql, args)]

    def _listed(self, sql: str, *args: Any) -> List[Message]:
        """:meth:`_select` for listings: rows are read a few at a time and the reading
        stops once they hold the response budget, so large bodies are never all
        loaded at once."""
        cursor = self.cursor.execute(sql, args)
        out: List[Message] = []
        total = 0
        while True:
            rows = cursor.fetchmany(LISTING_CHUNK)
            for row in rows:
                out.append(_message(row))
                total += len(row[6]) + 400
            if len(rows) < LISTING_CHUNK:
                return out
            if total > RESPONSE_BUDGET_BYTES:
                # A statement left unfinished holds a read snapshot (and on PyPy blocks
                # COMMIT): this rare early stop gets a cursor of its own.
                self.cursor.close()
                self.cursor = self.db.cursor()
                return out

    def _matched(self, sql: str, params: List[Any], limit: int, match: Match
                 ) -> List[Message]:
        """The first ``limit`` rows of a listing ``sql`` (its LIMIT unbounded) that
        ``match``, read a few at a time; stops at the response budget too."""
        cursor = self.cursor.execute(sql, (*params, -1))
        out: List[Message] = []
        total = 0
        while True:
            rows = cursor.fetchmany(LISTING_CHUNK)
            for row in rows:
                message = _message(row)
                if match(message):
                    out.append(message)
                    total += len(row[6]) + 400
                    if len(out) >= limit:
                        break
            if len(rows) < LISTING_CHUNK:
                return out
            if len(out) >= limit or total > RESPONSE_BUDGET_BYTES:
                self.cursor.close()  # left unfinished: as in _listed
                self.cursor = self.db.cursor()
                return out

    # -- Records ---------------------------------------------------------------------

    def insert(self, message: Message) -> bool:
        self._begin()
        message.seq = self.next_seq
        cursor = self.cursor.execute(*self._insert(_row(message), 0))
        if cursor.rowcount != 1:
            message.seq = 0
            return False
        self.next_seq += 1
        if message.status in PENDING:
            self._pending(message.to, 1, message.stored_bytes())
        return True

    def get(self, message_id: str) -> Optional[Message]:
        kept = self.leased.pop(message_id, None)
        if kept is not None:
            return kept
        # fetchall: a statement left unfinished (fetchone) blocks COMMIT on PyPy
        rows = self.cursor.execute(STATEMENTS["get"][0], (message_id,)).fetchall()
        return _message(rows[0]) if rows else None

    def seq_of(self, message_id: str) -> int:
        rows = self.cursor.execute(STATEMENTS["seq_of"][0], (message_id,)).fetchall()
        return rows[0][0] if rows else 0

    def copies(self, sent_id: str) -> List[Message]:
        return self._select(STATEMENTS["copies"][0], sent_id)

    def _count_pending(self) -> None:
        self.pending = {agent: [count, size or 0]
                        for agent, count, size in self.db.execute(LISTINGS[1]).fetchall()}

    def _pending(self, agent: str, count: int, size: int) -> None:
        entry = self.pending.setdefault(agent, [0, 0])
        entry[0] += count
        entry[1] += size
        if entry[0] <= 0:
            del self.pending[agent]

    def usage(self, agent: str) -> Tuple[int, int]:
        count, size = self.pending.get(agent, (0, 0))
        return count, size

    def agent_count(self) -> int:
        return len(self.registered)

    def forget(self, cutoff: float) -> List[str]:
        self._begin()
        gone = [row[0] for row in self.cursor.execute(LISTINGS[2], (int(cutoff),))]
        self.registered.difference_update(gone)
        self.joins.forget(gone)
        return gone

    def save(self, messages: Sequence[Message], befores: Sequence[Tuple[Any, ...]]) -> None:
        for message, before in zip(messages, befores):
            was, now = before[0] in PENDING, message.status in PENDING
            if was != now:
                self._pending(message.to, 1 if now else -1,
                              message.stored_bytes() if now else -message.stored_bytes())
        self._begin()
        if len(messages) == 1:
            self.cursor.execute(*self._save(_state_row(messages[0]), 1))
        else:
            by_text: Dict[str, List[List[Any]]] = {}
            for message in messages:
                sql, params = self._save(_state_row(message), 1)
                by_text.setdefault(sql, []).append(params)
            for sql, rows in by_text.items():
                self.cursor.executemany(sql, rows)
        self._keep_leased(messages)

    def _keep_leased(self, messages: Sequence[Message]) -> None:
        """Keep a copy of each message just written leased; forget the others."""
        leased = self.leased
        for message in messages:
            if (message.status == LEASED and len(message.body_json()) <= LEASED_BODY_CHARS
                    and (message.id in leased or len(leased) < LEASED_KEPT)):
                leased[message.id] = message.copy()
            else:
                leased.pop(message.id, None)

    def queued(self, agent: str, after_seq: int, limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        if parent_id is None:
            return self._listed(STATEMENTS["queued"][0], agent, after_seq, now, now, limit)
        parts = [self._listed(sql, parent_id, after_seq, agent, now, now, limit)
                 for sql in STATEMENTS["queued"][1:]]
        unique = {m.seq: m for m in parts[0] + parts[1]}
        return [unique[seq] for seq in sorted(unique)][:limit]

    def ranked(self, queues: Sequence[str], limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        urgent, normal, by_parent, by_reply_to = STATEMENTS["ranked"]
        found: Dict[int, Message] = {}
        for queue in queues:
            if parent_id is not None:
                for sql in (by_parent, by_reply_to):
                    for message in self._listed(sql, parent_id, queue, now, now, limit):
                        found[message.seq] = message
                continue
            first = self._listed(urgent, queue, now, now, limit)
            found.update((m.seq, m) for m in first)
            if len(first) < limit:
                found.update((m.seq, m) for m in self._listed(normal, queue, now, now,
                                                               limit - len(first)))
        return sorted(found.values(), key=delivery.rank)[:limit]

    def card(self, agent: str) -> Optional[Dict[str, Any]]:
        rows = self.cursor.execute(STATEMENTS["card"][0], (agent,)).fetchall()
        return json.loads(rows[0][0]) if rows and rows[0][0] is not None else None

    def joiners(self, role: str) -> List[str]:
        return self.joins.joiners(role)

    def recovered(self, agent: str, upto_seq: int, limit: int, now: float) -> List[Message]:
        return self._listed(STATEMENTS["recovered"][0], agent, upto_seq, now, now, limit)

    def held_due(self, now: float, limit: int) -> List[Message]:
        return self._select(STATEMENTS["held_due"][0], now, limit)

    def lapsed(self, now: float) -> List[Message]:
        return self._select(STATEMENTS["lapsed"][0], delivery.now_ms(now))

    def listing(self, agent: str, box: str, limit: int, filters: Mapping[str, Optional[str]],
                now: float, match: Optional[Match] = None) -> List[Message]:
        """Without a conversation filter the inbox index is read status by status and
        the sent-box index once, and the reads merged; with ``rootId`` (``parentId``)
        the root (parent and reply-to) index gives the few candidate rows. With
        ``match`` each read goes on until it holds ``limit`` messages that match."""
        if filters.get("rootId") is not None:
            reads = [("id", box, filters["rootId"]), ("root", box, filters["rootId"])]
        elif filters.get("parentId") is not None:
            reads = [("parent", box, filters["parentId"]),
                     ("reply_to", box, filters["parentId"])]
        else:
            status = filters.get("status")
            reads = []
            if box in ("inbox", "all"):
                every = STATUSES if match is None else STORED_STATUSES
                reads += [("box", "inbox", state)
                          for state in (every if status is None else (status,))]
            if box in ("sent", "all"):
                reads.append(("sender_failed" if status == FAILED else "sender", "sent", None))
        values = dict(filters, agent=agent, now=now)
        parts = []
        for source, name, key in reads:
            sql, names = _listing_statement(source, name, filters, match is None)
            keys = () if key is None else (key,)
            params = [*keys, *[values[n] for n in names]]
            if match is None:
                parts.append(self._listed(sql, *params, limit))
            else:
                parts.append(self._matched(sql, params, limit, match))
        unique = {m.seq: m for part in parts for m in part}
        return [unique[seq] for seq in sorted(unique, reverse=True)][:limit]

    def thread(self, agent: str, root_id: str, after_seq: int, limit: int,
               now: float) -> List[Message]:
        root = self._select(STATEMENTS["thread"][0], root_id, after_seq, agent, agent, now)
        rest = self._listed(STATEMENTS["thread"][1], root_id, after_seq, agent, agent, now,
                            limit)
        merged = sorted(root + [m for m in rest if m.id != root_id], key=lambda m: m.seq)
        return merged[:limit]

    def _forget_usage(self, sql: str, seq: int) -> None:
        for agent, size in self.cursor.execute(sql, (seq,)).fetchall():
            self._pending(agent, -1, -size)

    def expire(self, cutoff: float, now: float, batch: int
               ) -> Tuple[int, int, List[Message], List[Message]]:
        """Remove the oldest messages (in seq order) stored before ``cutoff``, then those
        whose TTL ran out (or return them, to be kept), up to ``batch`` in all."""
        last = None
        # Its own cursor, closed at once: this scan stops early, and a statement left
        # half-read would hold a read snapshot (and the WAL) until the next request.
        scan = self.db.cursor()
        try:
            for seq, created in scan.execute(STATEMENTS["expire"][0], (batch,)):
                if created >= cutoff:
                    break
                last = seq
        finally:
            scan.close()
        removed = counted = 0
        unprocessed: List[Message] = []
        kept: List[Message] = []
        if last is not None:
            unprocessed = self._select(STATEMENTS["expire"][2], last)
            self._forget_usage(STATEMENTS["expired_usage"][0], last)
            (gone_before,) = self.cursor.execute(STATEMENTS["expire"][8], (last,)).fetchone()
            self._begin()
            self.leased.clear()  # rare: a removed row is never found again
            self.cursor.execute(STATEMENTS["expire"][4])
            removed = self.cursor.execute(STATEMENTS["expire"][5], (last,)).rowcount
            counted = removed - gone_before
        room = batch - removed
        if room > 0:
            ttl = []
            for seq, v2 in self.cursor.execute(STATEMENTS["expire"][1], (now, room)).fetchall():
                if v2 is None:
                    ttl.append(seq)
                else:  # kept (as the index holds it: queued or leased)
                    kept.extend(self._select(STATEMENTS["expire"][7], seq))
            if ttl:
                for seq in ttl:
                    unprocessed.extend(self._select(STATEMENTS["expire"][3], seq))
                    self._forget_usage(STATEMENTS["expired_usage"][1], seq)
                self._begin()
                self.leased.clear()
                self.cursor.execute(STATEMENTS["expire"][4])
                self.cursor.executemany(STATEMENTS["expire"][6], [(seq,) for seq in ttl])
                removed += len(ttl)
                counted += len(ttl)
        return removed, counted, unprocessed, kept

    def append_event(self, agent: str, event_type: str, data: str, at: float) -> None:
        self._begin()
        self.last_event += 1
        self.cursor.execute(STATEMENTS["events"][0],
                            (self.last_event, agent, at, event_type, data))

    def events_after(self, agent: str, after: int, limit: int) -> List[Event]:
        return [Event(event_id, agent, event_type, data, at) for event_id, _, event_type, data, at
                in self.cursor.execute(STATEMENTS["events"][1], (agent, after, limit)).fetchall()]

    def event_marks(self, agent: str = "") -> Tuple[int, int]:
        return self.event_floor, self.last_event

    def trim_events(self, cutoff: float) -> int:
        """Takes at most EVENT_TRIM_BATCH events a run, the oldest first."""
        floor = 0
        taken = 0
        scan = self.db.cursor()  # stops early: closed at once, as in expire
        try:
            for event_id, at in scan.execute(STATEMENTS["events"][3],
                                             (self.event_floor, EVENT_TRIM_BATCH)):
                if at >= cutoff:
                    break
                floor = event_id
                taken += 1
        finally:
            scan.close()
        if not floor:
            return 0
        self._begin()
        marks = [("event_floor", floor), ("last_event", self.last_event)]
        if self.events_anchored_from is None:
            self.events_anchored_from = self.event_floor
            marks.append(("event_anchored_from", self.event_floor))
        self.cursor.executemany(STATEMENTS["events"][4], marks)
        old = self.event_floor
        self.cursor.execute(STATEMENTS["events"][8], (old, old, floor))
        self.cursor.execute(STATEMENTS["events"][5], (old, floor, floor))
        self.event_floor = max(self.event_floor, floor)
        return taken

    def kept_after(self, agent: str, floor: int) -> int:
        if self.events_anchored_from is None:
            return floor
        (anchor,) = self.cursor.execute(STATEMENTS["events"][7], (agent, floor)).fetchone()
        return min(floor, max(self.events_anchored_from, anchor or 0))

    def webhook_states(self) -> Dict[str, str]:
        return dict(self.cursor.execute(LISTINGS[3]).fetchall())

    def webhook_state(self, agent: str) -> Optional[str]:
        rows = self.cursor.execute(STATEMENTS["webhooks"][2], (agent,)).fetchall()
        return rows[0][0] if rows else None

    def put_webhook(self, agent: str, state: Optional[str]) -> None:
        self._begin()
        if state is None:
            self.cursor.execute(STATEMENTS["webhooks"][1], (agent,))
        else:
            self.cursor.execute(STATEMENTS["webhooks"][0], (agent, state))

    def depths(self, now: float, settled: Optional[Sequence[str]] = None
               ) -> List[QueueDepth]:
        next_recipient, counts, delayed, oldest, every = STATEMENTS["depths"]
        out = []
        agent = ""
        named = iter(settled or ())
        while True:
            if settled is None:
                rows = self.cursor.execute(next_recipient, (agent,)).fetchall()
                if not rows:
                    return out
                agent = rows[0][0]
            else:
                agent = next(named, None)
                if agent is None:
                    return out
                counts = every
            by_status = dict(self.cursor.execute(counts, (agent,)).fetchall())
            if not by_status and settled is None:
                continue
            held = 0
            if by_status.get("queued"):
                held = self.cursor.execute(delayed, (agent, now)).fetchall()[0][0]
            first = self.cursor.execute(oldest, (agent, now)).fetchall()
            out.append(QueueDepth(
                agent,
                queued=by_status.get("queued", 0) - held,
                leased=by_status.get("leased", 0),
                failed=by_status.get("failed", 0),
                delayed=held,
                oldest_queued=first[0][0] if first else None,
                done=by_status.get("done", 0),
                expired=by_status.get("expired", 0),
            ))

    def register(self, agent: str, now: float, card: Any = KEEP_CARD) -> None:
        self.registered.add(agent)
        self._begin()
        if card is KEEP_CARD:
            self.cursor.execute(STATEMENTS["register"][0], (agent, int(now)))
        else:
            self.joins.set_card(agent, card)
            text = None if card is None else json.dumps(card, separators=(",", ":"))
            self.cursor.execute(STATEMENTS["register"][1], (agent, int(now), text))

    def is_registered(self, agent: str) -> bool:
        return agent in self.registered

    def peers(self) -> List[Tuple[str, int, Optional[Dict[str, Any]]]]:
        return [(agent, seen, None if card is None else json.loads(card))
                for agent, seen, card in self.cursor.execute(LISTINGS[0])]


class SQLiteStore(RecordStore):
    """Messages and peers in one SQLite database, committed in groups."""

    name = "sqlite"

    def __init__(self, db: sqlite3.Connection, reactor: IReactorTime, path: str,
                 sync: str = "normal") -> None:
        self.db = db
        self.path = path
        commits = GroupCommit(reactor, self._commit, "sqlite")
        super().__init__(SQLiteRecords(db, commits), commits)
        self.checkpointer = Checkpointer(path, sync, reactor, lambda: commits.commits)
        self.checkpointer.start()
        self.space_left = FreeSpace(os.path.dirname(path), reactor)

    def _commit(self) -> None:
        self.records.commit()

    def peers(self) -> Deferred:
        """Answered at once: registrations are known before their commit."""
        try:
            return succeed(self.records.peers())
        except sqlite3.Error:
            return fail()

    def close(self) -> Deferred:
        """Commit what is pending, let a running checkpoint end, checkpoint, close."""
        self.commits.close()
        d = self.checkpointer.stop()

        def close(_: Any) -> None:
            try:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            except sqlite3.Error as e:
                log.warn("final sqlite checkpoint failed: {error}", error=str(e))
            self.db.close()

        d.addCallback(close)
        return d


# -- opening ---------------------------------------------------------------------


def _connect(path: str, sync: str) -> sqlite3.Connection:
    private_file(path)  # SQLite gives its -wal and -shm files the database's mode
    # Room for every statement text (listings, NULL patterns) prepared once.
    db = sqlite3.connect(path, isolation_level=None, cached_statements=512)
    try:
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError("broker.dataDir", f"{path}: the WAL journal is not available here")
        db.execute(f"PRAGMA synchronous={sync.upper()}")
        # The Checkpointer copies the WAL back in a worker thread; under constant
        # writes it never catches up with the newest frames, so the WAL is only
        # rewound by an automatic checkpoint on this connection, made rare and
        # cheap (mostly copied already) by a high threshold.
        db.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}").fetchall()
    except BaseException:
        db.close()
        raise
    return db


def _tables(db: sqlite3.Connection) -> Set[str]:
    rows = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    return {row[0] for row in rows}


def _import_jsonl(db: sqlite3.Connection, data_dir: str, now: float) -> None:
    """Copy the messages and peers of ``dataDir/messages.jsonl`` into the open transaction."""
    from relay.store.jsonl import read_log

    path = os.path.join(data_dir, JSONL_NAME)
    if not os.path.exists(path):
        return
    loaded = read_log(path, now)
    db.executemany(_INSERT, [_row(m) for m in loaded.messages])
    db.executemany(STATEMENTS["register"][1], [
        (agent, seen, None if agent not in loaded.cards
         else json.dumps(loaded.cards[agent], separators=(",", ":")))
        for agent, seen in sorted(loaded.peers.items())])
    db.execute(
        "INSERT INTO meta (key, value) VALUES ('last_seq', ?) "
        "ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
        (loaded.next_seq - 1,),
    )
    log.info(
        "imported {count} messages and {peers} peers from {path} ({skipped} unreadable lines)",
        count=len(loaded.messages),
        peers=len(loaded.peers),
        path=path,
        skipped=loaded.skipped,
    )


def _create(db: sqlite3.Connection, data_dir: str, now: float) -> None:
    db.executescript("BEGIN IMMEDIATE;\n" + schema_script(SCHEMA_VERSION))
    try:
        db.execute("INSERT INTO version (version) VALUES (?)", (SCHEMA_VERSION,))
        _import_jsonl(db, data_dir, now)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def upgrade(db: sqlite3.Connection, path: str, target: int = SCHEMA_VERSION,
            script: Callable[[int], str] = upgrade_script) -> int:
    """Bring the database at ``path`` to schema ``target``; returns the version found.

    Backs the database up first; refuses a database newer than ``target``.
    """
    (found,) = db.execute("SELECT version FROM version").fetchone()
    if found > target:
        raise ConfigError(
            "broker.dataDir",
            f"{path} has schema version {found}, newer than this broker's {target}: "
            "it was written by a newer relay; run that, or point broker.dataDir elsewhere",
        )
    if found < target:
        private_file(f"{path}.v{found}.bak")
        backup = sqlite3.connect(f"{path}.v{found}.bak")
        try:
            db.backup(backup)
        finally:
            backup.close()
        for version in range(found + 1, target + 1):
            db.executescript(f"BEGIN IMMEDIATE;\n{script(version)}\n")
            db.execute("UPDATE version SET version = ?", (version,))
            db.execute("COMMIT")
        log.info("upgraded {path} from schema version {old} to {new}",
                 path=path, old=found, new=target)
    return found


def open_database(path: str, data_dir: str, sync: str, now: float) -> sqlite3.Connection:
    """Open (creating or upgrading as needed) the relay database at ``path``."""
    db = _connect(path, sync)
    try:
        tables = _tables(db)
        if not tables:
            _create(db, data_dir, now)
        elif "version" not in tables:
            raise ConfigError("broker.dataDir", f"{path} is not a relay database (no version)")
        else:
            upgrade(db, path)
    except BaseException:
        db.close()
        raise
    return db


# The keys of ``broker.sqlite`` (see relay.rules.config.Setting); the section is read at start.
SETTINGS = (
    Setting("broker.sqlite", "sync", "sync", "choice", choices=SYNC_LEVELS, restart=True,
            default_from="sync"),
)


@dataclass(frozen=True)
class SQLiteOptions:
    """``broker.sqlite``: ``sync``."""

    sync: str


def parse_options(section: Mapping[str, Any], config: Config) -> SQLiteOptions:
    """Validate ``broker.sqlite`` (the IStoreFactory entry point)."""
    check_keys(section, "broker.sqlite", table_keys(SETTINGS), frozenset())
    values = read_settings(SETTINGS, section, config=config)
    return SQLiteOptions(sync=values["sync"])


def open_store(config: Config, options: SQLiteOptions, reactor: IReactorTime) -> SQLiteStore:
    """Open ``dataDir/relay.db`` (the IStoreFactory entry point); ConfigError if impossible.
    ``reactor`` times the group commits and checkpoints, and runs the checkpoints in
    its thread pool when it provides ``IReactorThreads``."""
    data_dir = make_data_dir(config.data_dir)
    path = os.path.join(data_dir, DB_NAME)
    try:
        db = open_database(path, data_dir, options.sync, reactor.seconds())
    except sqlite3.Error as e:
        raise ConfigError("broker.dataDir", f"cannot open database {path}: {e}") from None
    return SQLiteStore(db, reactor, path, options.sync)


__all__ = ["SQLiteStore", "open_store", "open_database", "parse_options", "upgrade",
           "SCHEMA_VERSION"]
