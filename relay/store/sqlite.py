"""The SQLite backend (``broker.storage: sqlite``): the database ``dataDir/relay.db``.

The database is the source of truth: messages and peers live in indexed
tables (``sqlite-v2.sql``) and every operation reads and writes only the rows
it needs; no copy of the messages is kept in memory. The delivery rules are
those of :mod:`relay.delivery`: a row is read, the rule applied to it, and
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
import os
import sqlite3
from importlib import resources
from typing import Any, Callable, Iterable, List, Optional, Sequence, Set, Tuple

from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from relay import delivery, errors
from relay.config import Config
from relay.delivery import Message
from relay.errors import ConfigError
from relay.protocol import STATUSES
from relay.store import make_data_dir
from relay.store.grouped import GroupCommit
from relay.store.interface import IMessageStore

log = Logger(namespace="relay.store.sqlite")

SCHEMA_VERSION = 2
DB_NAME = "relay.db"
JSONL_NAME = "messages.jsonl"
EXPIRE_BATCH = 2000
CHECKPOINT_SECONDS = 1.0
WAL_AUTOCHECKPOINT_PAGES = 8192

COLUMNS = (
    "seq, id, sender, recipient, ts, type, body, reply_to, ack, kind, root_id, parent_id, "
    "status, attempts, lease_until, lease_id, error, created, recovery"
)
_SELECT = f"SELECT {COLUMNS} FROM messages"
_INSERT = (
    f"INSERT OR IGNORE INTO messages ({COLUMNS}) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SAVE_STATE = (
    "UPDATE messages SET status = ?, attempts = ?, lease_until = ?, lease_id = ?, error = ?, "
    "recovery = ? WHERE seq = ?"
)

# Every statement an operation runs, by operation; tests check their query plans.
STATEMENTS = {
    "add": [_INSERT],
    "find": [f"{_SELECT} WHERE id = ?"],
    "get_since": [
        "SELECT seq FROM messages WHERE id = ?",
        f"{_SELECT} WHERE recipient = ? AND recovery = 1 AND seq <= ? ORDER BY seq LIMIT ?",
        f"{_SELECT} WHERE recipient = ? AND status = 'queued' AND seq > ? ORDER BY seq LIMIT ?",
        _SAVE_STATE,
    ],
    "pull": [
        f"{_SELECT} WHERE recipient = ? AND status = 'queued' ORDER BY seq LIMIT ?",
        _SAVE_STATE,
    ],
    "ack": [f"{_SELECT} WHERE id = ?", _SAVE_STATE],
    "status": [
        "SELECT id, status, attempts, ts, sender, recipient, kind FROM messages WHERE id = ?"
    ],
    "sweep_leases": [
        f"{_SELECT} WHERE status = 'leased' AND lease_until <= ?",
        _SAVE_STATE,
    ],
    "sweep_expired": [
        "SELECT seq, created FROM messages WHERE seq > 0 ORDER BY seq LIMIT ?",
        "INSERT INTO meta (key, value) SELECT 'last_seq', max(seq) FROM messages "
        "WHERE true ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
        "DELETE FROM messages WHERE seq <= ?",
    ],
    "register": ["INSERT OR REPLACE INTO peers (agent, last_seen) VALUES (?, ?)"],
}

# Statements that return a whole table by design (the peers list is small).
LISTINGS = ("SELECT agent, last_seen FROM peers ORDER BY agent",)


def _query_statement(kind: Optional[str], status: Optional[str],
                     sender: Optional[str]) -> Tuple[str, List[str]]:
    """The SELECT of one agent's inbox narrowed by the filters, and the filters' names."""
    where = ["recipient = ?"]
    names = []
    if sender is not None:
        where.append("sender = ?")
        names.append("sender")
    if kind is not None:
        where.append("kind = ?")
        names.append("kind")
    if status is not None:
        where.append("status = ?")
        names.append("status")
    sql = f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?"
    return sql, names


STATEMENTS["recent"] = [_query_statement(None, "queued", None)[0]]
STATEMENTS["query"] = [
    _query_statement(kind, "queued", sender)[0]
    for kind in (None, "request")
    for sender in (None, "x")
]


def schema_script(version: int) -> str:
    """The SQL that creates a fresh database of schema ``version``."""
    return resources.files("relay.store").joinpath(f"sqlite-v{version}.sql").read_text("utf-8")


def upgrade_script(version: int) -> str:
    """The SQL that brings a database from ``version - 1`` to ``version``."""
    name = f"sqlite-upgrade-to-v{version}.sql"
    return resources.files("relay.store").joinpath(name).read_text("utf-8")


def _row(message: Message) -> Tuple[Any, ...]:
    return (
        message.seq or None,
        message.id,
        message.sender,
        message.to,
        message.ts,
        message.type,
        message.body_json(),
        message.reply_to,
        int(message.ack),
        message.kind,
        message.root_id,
        message.parent_id,
        message.status,
        message.attempts,
        message.lease_until,
        message.lease_id,
        message.error,
        message.created,
        int(message.recovery),
    )


def _message(row: Sequence[Any]) -> Message:
    return Message(
        seq=row[0],
        id=row[1],
        sender=row[2],
        to=row[3],
        ts=row[4],
        type=row[5],
        body_json=row[6],
        reply_to=row[7],
        ack=bool(row[8]),
        kind=row[9],
        root_id=row[10],
        parent_id=row[11],
        status=row[12],
        attempts=row[13],
        lease_until=row[14],
        lease_id=row[15],
        error=row[16],
        created=row[17],
        recovery=bool(row[18]),
    )


def _newest(parts: List[List[Message]], limit: int) -> List[Message]:
    """The ``limit`` highest-seq messages of lists each sorted newest first."""
    merged = heapq.merge(*parts, key=lambda m: m.seq, reverse=True)
    return [m for _, m in zip(range(limit), merged)]


def _state_row(message: Message) -> Tuple[Any, ...]:
    return (
        message.status,
        message.attempts,
        message.lease_until,
        message.lease_id,
        message.error,
        int(message.recovery),
        message.seq,
    )


class Checkpointer:
    """Passive WAL checkpoints on a second connection, in a worker thread.

    Runs every ``CHECKPOINT_SECONDS`` while ``commits`` grows; at most one
    checkpoint is in flight. The reactor thread only ever appends to the WAL.
    """

    def __init__(self, path: str, sync: str, clock: IReactorTime,
                 commits: Callable[[], int]) -> None:
        self.path = path
        self.sync = sync
        self.commits = commits
        self.checkpoints = 0
        self._seen = 0
        self._db: Optional[sqlite3.Connection] = None
        self._running: Optional[Deferred] = None
        self._loop = LoopingCall(self.tick)
        self._loop.clock = clock

    def start(self) -> None:
        self._loop.start(CHECKPOINT_SECONDS, now=False)

    def tick(self) -> None:
        commits = self.commits()
        if self._running is not None or commits == self._seen:
            return
        self._seen = commits
        from twisted.internet import reactor, threads

        d = threads.deferToThreadPool(reactor, reactor.getThreadPool(), self._checkpoint)
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


@implementer(IMessageStore)
class SQLiteStore:
    """Messages and peers in one SQLite database, committed in groups."""

    name = "sqlite"

    def __init__(self, db: sqlite3.Connection, clock: IReactorTime, path: str,
                 sync: str = "normal") -> None:
        self.db = db
        # One cursor for every statement: a cursor per statement costs several
        # microseconds each on PyPy. Each result is read whole before the next.
        self.cursor = db.cursor()
        self.path = path
        (last,) = db.execute(
            "SELECT max(coalesce((SELECT max(seq) FROM messages), 0), "
            "coalesce((SELECT value FROM meta WHERE key = 'last_seq'), 0))"
        ).fetchone()
        self.next_seq = last + 1
        self.registered = {row[0] for row in db.execute("SELECT agent FROM peers")}
        self.commits = GroupCommit(clock, self._commit, "sqlite")
        self.checkpointer = Checkpointer(path, sync, clock, lambda: self.commits.commits)
        self.checkpointer.start()

    # -- transactions ----------------------------------------------------------

    def _begin(self) -> None:
        """Open the turn's transaction (if needed) before a write."""
        if not self.db.in_transaction:
            self.cursor.execute("BEGIN IMMEDIATE")
        self.commits.touch()

    def _commit(self) -> None:
        if not self.db.in_transaction:
            return
        try:
            self.cursor.execute("COMMIT")
        except sqlite3.Error:
            if self.db.in_transaction:
                self.cursor.execute("ROLLBACK")
            raise

    def _save(self, messages: Sequence[Message]) -> None:
        self._begin()
        self.cursor.executemany(_SAVE_STATE, [_state_row(m) for m in messages])

    def _select(self, sql: str, *args: Any) -> List[Message]:
        return [_message(row) for row in self.cursor.execute(sql, args)]

    # -- operations (synchronous) ---------------------------------------------

    def _add(self, message: Message) -> bool:
        self._begin()
        message.seq = self.next_seq
        cursor = self.cursor.execute(_INSERT, _row(message))
        if cursor.rowcount != 1:
            message.seq = 0
            return False
        self.next_seq += 1
        return True

    def _find(self, message_id: str) -> Optional[Message]:
        row = self.cursor.execute(STATEMENTS["find"][0], (message_id,)).fetchone()
        return None if row is None else _message(row)

    def _expire_due(self, now: float) -> Set[str]:
        expired = self._select(STATEMENTS["sweep_leases"][0], delivery.now_ms(now))
        for message in expired:
            delivery.expire_lease(message)
        if expired:
            self._save(expired)
        return {m.to for m in expired}

    def _get_since(
        self, agent: str, since_id: Optional[str], limit: int, now: float
    ) -> Tuple[List[Message], Optional[str]]:
        self._expire_due(now)
        since_seq = 0
        if since_id:
            row = self.cursor.execute(STATEMENTS["get_since"][0], (since_id,)).fetchone()
            since_seq = row[0] if row is not None else 0
        out: List[Message] = []
        if since_seq:
            out = self._select(STATEMENTS["get_since"][1], agent, since_seq, limit)
        fresh = self._select(STATEMENTS["get_since"][2], agent, since_seq, limit - len(out))
        out.extend(fresh)
        marked = [m for m in out if m.recovery]
        for message in marked:
            message.recovery = False
        if marked:
            self._save(marked)
        cursor = fresh[-1].id if fresh else (since_id or None)
        return out, cursor

    def _pull(self, agent: str, limit: int, lease_seconds: int, now: float) -> List[Message]:
        self._expire_due(now)
        out = self._select(STATEMENTS["pull"][0], agent, limit)
        for message in out:
            delivery.lease(message, lease_seconds, now)
        if out:
            self._save(out)
        return out

    def _ack(
        self,
        message_id: str,
        agent: str,
        lease_id: str,
        outcome: str,
        error: Optional[str],
        now: float,
        max_attempts: int,
    ) -> dict:
        message = self._find(message_id)
        if message is None:
            raise errors.no_such_message()
        before = message.state()
        try:
            return delivery.settle(message, agent, lease_id, outcome, error, now, max_attempts)
        finally:
            if message.state() != before:
                self._save([message])

    def _status(self, message_ids: Iterable[str], agent: str) -> List[dict]:
        out = []
        sql = STATEMENTS["status"][0]
        for message_id in message_ids:
            row = self.cursor.execute(sql, (message_id,)).fetchone()
            if row is None or agent not in (row[4], row[5]):
                out.append(delivery.not_found_status(message_id))
            else:
                out.append(
                    {
                        "id": row[0],
                        "status": row[1],
                        "attempts": row[2],
                        "ts": row[3],
                        "from": row[4],
                        "to": row[5],
                        "kind": row[6],
                    }
                )
        return out

    def _recent(self, agent: str, limit: int) -> List[Message]:
        return self._inbox(agent, limit, None, None, None)

    def _inbox(self, agent: str, limit: int, kind: Optional[str], status: Optional[str],
               sender: Optional[str]) -> List[Message]:
        """The newest ``limit`` messages to ``agent`` that match the filters.

        The inbox index is by status: without a status filter, the newest of
        each status are read and merged.
        """
        if status is None:
            parts = [self._inbox(agent, limit, kind, s, sender) for s in STATUSES]
            return _newest(parts, limit)
        sql, names = _query_statement(kind, status, sender)
        values = {"sender": sender, "kind": kind, "status": status}
        return self._select(sql, agent, *[values[n] for n in names], limit)

    def _query(
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
        return self._inbox(agent, limit, kind, status, sender)

    def _expire_batch(self, cutoff: float, batch: int) -> int:
        """Remove the oldest messages (in seq order) stored before ``cutoff``, up to ``batch``."""
        last = None
        # Its own cursor, closed at once: this scan stops early, and a statement left
        # half-read would hold a read snapshot (and the WAL) until the next request.
        scan = self.db.cursor()
        try:
            for seq, created in scan.execute(STATEMENTS["sweep_expired"][0], (batch,)):
                if created >= cutoff:
                    break
                last = seq
        finally:
            scan.close()
        if last is None:
            return 0
        self._begin()
        self.cursor.execute(STATEMENTS["sweep_expired"][1])
        return self.cursor.execute(STATEMENTS["sweep_expired"][2], (last,)).rowcount

    def _register(self, agent: str, now: float) -> None:
        self.registered.add(agent)
        self._begin()
        self.cursor.execute(STATEMENTS["register"][0], (agent, int(now)))

    def _at_once(self, operation: Callable[..., Any], *args: Any) -> Deferred:
        try:
            return succeed(operation(*args))
        except Exception:
            return fail()

    # -- IMessageStore -----------------------------------------------------------

    def add(self, message: Message) -> Deferred:
        return self.commits.run(self._add, message)

    def find(self, message_id: str) -> Deferred:
        return self.commits.run(self._find, message_id)

    def get_since(self, agent: str, since_id: Optional[str], limit: int, now: float) -> Deferred:
        return self.commits.run(self._get_since, agent, since_id, limit, now)

    def pull(self, agent: str, limit: int, lease_seconds: int, now: float) -> Deferred:
        return self.commits.run(self._pull, agent, limit, lease_seconds, now)

    def ack(self, message_id, agent, lease_id, outcome, error, now, max_attempts) -> Deferred:
        return self.commits.run(
            self._ack, message_id, agent, lease_id, outcome, error, now, max_attempts
        )

    def status(self, message_ids, agent: str) -> Deferred:
        return self.commits.run(self._status, message_ids, agent)

    def recent(self, agent: str, limit: int) -> Deferred:
        return self.commits.run(self._recent, agent, limit)

    def query(self, agent, limit, kind, status, sender, recipient) -> Deferred:
        return self.commits.run(self._query, agent, limit, kind, status, sender, recipient)

    def register(self, agent: str, now: float) -> Deferred:
        return self.commits.run(self._register, agent, now)

    def is_registered(self, agent: str) -> bool:
        return agent in self.registered

    def peers(self) -> Deferred:
        sql = LISTINGS[0]
        return self._at_once(lambda: [tuple(row) for row in self.cursor.execute(sql)])

    def sweep_leases(self, now: float) -> Deferred:
        return self.commits.run(self._expire_due, now)

    @inlineCallbacks
    def sweep_expired(self, cutoff: float):
        """Removes in batches, one per reactor turn, so a large expiry never stalls requests."""
        total = 0
        while True:
            removed = yield self.commits.run(self._expire_batch, cutoff, EXPIRE_BATCH)
            total += removed
            if removed < EXPIRE_BATCH:
                return total

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
    db = sqlite3.connect(path, isolation_level=None)
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
    db.executemany(STATEMENTS["register"][0], sorted(loaded.peers.items()))
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


def open_store(config: Config, clock: IReactorTime) -> SQLiteStore:
    """Open ``dataDir/relay.db`` (the IStoreFactory entry point); ConfigError if impossible."""
    data_dir = make_data_dir(config.data_dir)
    path = os.path.join(data_dir, DB_NAME)
    try:
        db = open_database(path, data_dir, config.sync, clock.seconds())
    except sqlite3.Error as e:
        raise ConfigError("broker.dataDir", f"cannot open database {path}: {e}") from None
    return SQLiteStore(db, clock, path, config.sync)


__all__ = ["SQLiteStore", "open_store", "open_database", "upgrade", "SCHEMA_VERSION"]
