"""The worker threads of the postgres store, each with its own connection, and the
run of one operation in one transaction (retried when another broker won a race)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any, Callable, Optional, Sequence, Set, Tuple

from twisted.internet.defer import Deferred
from twisted.python.threadpool import ThreadPool

from relay.store import records as ops
from relay.store.postgres.records import Conflict, PostgresRecords
from relay.store.postgres.statements import CHANNEL, STATEMENTS
from relay.wire import errors
from relay.wire.errors import RelayError

STATEMENT_TIMEOUT_MS = 5000
MAX_TRIES = 8

# Connection settings the broker needs; any of them set in the dsn wins.
CONNECTION_DEFAULTS = {
    "application_name": "dsh-agent-relay",
    "connect_timeout": "3",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "3",
    "keepalives_count": "3",
    "tcp_user_timeout": "5000",
}


class Unavailable(Exception):
    """The database cannot be reached or did not answer in time."""



def conninfo_with_defaults(dsn: str) -> str:
    """``dsn`` with :data:`CONNECTION_DEFAULTS` for what it does not set."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    given = conninfo_to_dict(dsn)
    merged = dict(CONNECTION_DEFAULTS)
    merged.update({k: str(v) for k, v in given.items()})
    return make_conninfo("", **merged)


def connect(conninfo: str, autocommit: bool = False):
    """A new connection with the broker's session settings."""
    import psycopg

    conn = psycopg.connect(conninfo, autocommit=autocommit)
    try:
        conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        conn.execute("SET idle_in_transaction_session_timeout = 60000")
        if not autocommit:
            conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


class Outcome:
    __slots__ = ("result", "error", "changes", "registered", "commit_seconds")

    def __init__(self, result: Any, error: Optional[BaseException], records: PostgresRecords,
                 commit_seconds: float) -> None:
        self.result = result
        self.error = error
        self.changes = records.changes
        self.registered = records.registered
        self.commit_seconds = commit_seconds


class Job:
    __slots__ = ("deferred", "abandoned", "timeout")

    def __init__(self) -> None:
        self.deferred = Deferred()
        self.abandoned = False
        self.timeout = None


class Connections:
    """Worker threads, each with its own connection, (re)opened when needed."""

    def __init__(self, conninfo: str, size: int, token: str) -> None:
        import psycopg

        self.psycopg = psycopg
        self.conninfo = conninfo
        self.token = token
        self.threads = ThreadPool(minthreads=0, maxthreads=size, name="relay-postgres")
        self.local = threading.local()
        self.lock = threading.Lock()
        self.open: Set[Any] = set()

    def _connection(self) -> Tuple[Any, bool]:
        conn = getattr(self.local, "conn", None)
        if conn is not None and not conn.closed:
            return conn, False
        try:
            conn = connect(self.conninfo)
        except self.psycopg.Error as e:
            raise Unavailable(failure_reason(e)) from None
        self.local.conn = conn
        with self.lock:
            self.open.add(conn)
        return conn, True

    def _drop(self, conn: Any) -> None:
        self.local.conn = None
        with self.lock:
            self.open.discard(conn)
        with contextlib.suppress(self.psycopg.Error):
            conn.close()

    def interact(self, job: Optional[Job], operation: Callable[..., Any],
                 args: Sequence[Any]) -> Optional[Outcome]:
        """Run ``operation(records, *args)`` in one transaction (in a worker thread)."""
        psycopg = self.psycopg
        fresh_retry = True
        for attempt in range(MAX_TRIES):
            if job is not None and job.abandoned:
                return None
            conn, fresh = self._connection()
            committing = False
            try:
                with conn.cursor() as cursor:
                    records = PostgresRecords(cursor)
                    try:
                        result, error = operation(records, *args), None
                    except RelayError as e:
                        # What the operation changed before refusing stays (a lapsed
                        # lease found by a refused ack is released).
                        result, error = None, e
                    records.finish()
                    payload = records.notification(self.token)
                    if payload is not None:
                        cursor.execute(STATEMENTS["notify"], (CHANNEL, payload))
                    committing = True
                    started = time.monotonic()
                    conn.commit()
                return Outcome(result, error, records, time.monotonic() - started)
            except (Conflict, ops.Raced, psycopg.errors.TransactionRollback):
                # another broker won a race, or PostgreSQL broke a deadlock: run it again
                self._rollback(conn)
                if attempt + 1 < MAX_TRIES:
                    _pause(attempt)
            except psycopg.OperationalError as e:
                if conn.broken or conn.closed:
                    self._drop(conn)
                    # Nothing was committed unless the COMMIT was sent: run it again
                    # once on a new connection (the old one may have been cut while idle).
                    if not committing and not fresh and fresh_retry:
                        fresh_retry = False
                        continue
                else:
                    self._rollback(conn)
                raise Unavailable(failure_reason(e)) from None
            except psycopg.DataError:
                self._rollback(conn)
                raise errors.bad_request(
                    "a field holds a value this store cannot keep (such as U+0000 in text)"
                ) from None
            except BaseException:
                self._rollback(conn)
                raise
        raise Unavailable("too many conflicting writes")

    def _rollback(self, conn: Any) -> None:
        try:
            conn.rollback()
        except self.psycopg.Error:
            self._drop(conn)

    def close(self) -> None:
        """Stop the threads (after their current work) and close every connection."""
        self.threads.stop()
        with self.lock:
            conns, self.open = list(self.open), set()
        for conn in conns:
            with contextlib.suppress(self.psycopg.Error):
                conn.close()


def _pause(attempt: int) -> None:
    """A short random pause between retries of a conflicting write."""
    threading.Event().wait(random.uniform(0, 0.002 * (attempt + 1)))


def failure_reason(error: BaseException) -> str:
    """The first line of a driver error (never a query or its parameters)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
