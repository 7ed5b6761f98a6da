"""The agent runtime's receipts: the reply sent for each completed request, kept a day.

A receipt is written before its reply is sent, so a request delivered again
(a lost ack, a restart) gets the same reply re-sent instead of being handled
twice (spec §5.1, "Receipts"). The receipts of one agent live in a small
SQLite file, ``~/.dsh-agent-relay-receipts-<hash>.sqlite3`` (mode 0600), the
hash derived from the agent name. Each ``put`` is one short transaction in
write-ahead-log mode: it costs the same however many receipts are held, and
a receipt whose ``put`` has returned survives the process being killed.

Earlier releases kept the receipts in one JSON document,
``~/.dsh-agent-relay-receipts-<hash>.json``, rewritten on every reply; that
file is read once, its receipts moved into the SQLite file, and removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.files.private import PRIVATE_MODE, read_json

RECEIPT_TTL_SECONDS = 24 * 60 * 60
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS receipts (
    request_id TEXT PRIMARY KEY,
    at REAL NOT NULL,
    entry TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS receipts_by_age ON receipts (at);
"""

Receipt = Dict[str, Any]


def _stem(agent: str, home: Path) -> Path:
    digest = hashlib.sha256(agent.encode("utf-8")).hexdigest()[:16]
    return Path(home) / f".dsh-agent-relay-receipts-{digest}"


def receipts_path(agent: str, home: Path) -> Path:
    """``~/.dsh-agent-relay-receipts-<hash>.sqlite3``, the hash derived from the agent name."""
    return _stem(agent, home).with_suffix(".sqlite3")


def legacy_receipts_path(agent: str, home: Path) -> Path:
    """``~/.dsh-agent-relay-receipts-<hash>.json``, the receipts file of earlier releases."""
    return _stem(agent, home).with_suffix(".json")


class ReceiptStore:
    """Completed replies by request id, on disk for ``ttl`` seconds.

    Each receipt holds the reply envelope exactly as sent (its id included),
    so a replay is idempotent at the broker.

    :param path: the SQLite file, created with mode 0600 when missing.
    :param clock: the time source for the receipts' age.
    :param legacy_path: a receipts file of the earlier JSON format to move
        into ``path`` and remove, when it exists.
    """

    log = Logger()

    def __init__(
        self,
        path: Path,
        clock: IReactorTime,
        ttl: float = RECEIPT_TTL_SECONDS,
        legacy_path: Optional[Path] = None,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._ttl = ttl
        try:
            self._db = self._open()
        except sqlite3.OperationalError:
            raise  # locked, read-only, disk full: not a reason to drop the receipts
        except sqlite3.DatabaseError as error:
            aside = self.path.with_name(self.path.name + ".unreadable")
            self.log.warn(
                "receipts file {path} is unreadable ({error}); moved to {aside}, starting empty",
                path=str(self.path),
                error=str(error),
                aside=str(aside),
            )
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
            self._db = self._open()
        if legacy_path is not None:
            self._migrate(Path(legacy_path))
        with self._db:
            self._db.execute("DELETE FROM receipts WHERE at < ?", (self._oldest(),))

    @classmethod
    def for_agent(
        cls, agent: str, home: Path, clock: IReactorTime, ttl: float = RECEIPT_TTL_SECONDS
    ) -> ReceiptStore:
        """The receipts of ``agent`` in ``home``, with those of an earlier release moved in."""
        return cls(
            receipts_path(agent, home), clock, ttl, legacy_path=legacy_receipts_path(agent, home)
        )

    def _open(self) -> sqlite3.Connection:
        # SQLite gives the -wal and -shm files the mode of the database file.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_MODE))
        db = sqlite3.connect(str(self.path))
        try:
            db.execute("PRAGMA journal_mode=WAL").fetchall()  # unread rows block COMMIT on PyPy
            # In WAL mode, NORMAL makes a commit durable against a crash of
            # this process without an fsync per commit.
            db.execute("PRAGMA synchronous=NORMAL")
            with db:
                db.executescript(_SCHEMA)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _migrate(self, legacy: Path) -> None:
        try:
            loaded = read_json(legacy)
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            self.log.warn("receipts file {path} is unreadable; dropping it", path=str(legacy))
            loaded = {}
        entries = loaded.get("receipts") if isinstance(loaded, dict) else None
        if not isinstance(entries, dict):
            entries = {}
        oldest = self._oldest()
        rows: List[Tuple[str, float, str]] = []
        for request_id, entry in entries.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("reply"), dict)):
                continue
            at = entry.get("at")
            if not isinstance(at, (int, float)) or isinstance(at, bool) or at < oldest:
                continue
            facts = {key: value for key, value in entry.items() if key != "at"}
            rows.append((str(request_id), float(at), json.dumps(facts, ensure_ascii=False)))
        with self._db:
            # A receipt already in the new file is newer than the old file's copy.
            self._db.executemany(
                "INSERT OR IGNORE INTO receipts (request_id, at, entry) VALUES (?, ?, ?)", rows
            )
        legacy.unlink()
        self.log.info(
            "moved {count} receipts from {legacy} to {path}",
            count=len(rows),
            legacy=str(legacy),
            path=str(self.path),
        )

    def _oldest(self) -> float:
        return self._clock.seconds() - self._ttl

    def get(self, request_id: str) -> Optional[Receipt]:
        """The receipt for ``request_id`` (``{"at", "reply", ...}``), unless expired."""
        # fetchall: a statement left unfinished (fetchone) blocks COMMIT on PyPy
        rows = self._db.execute(
            "SELECT at, entry FROM receipts WHERE request_id = ? AND at >= ?",
            (request_id, self._oldest()),
        ).fetchall()
        if not rows:
            return None
        return {"at": rows[0][0], **json.loads(rows[0][1])}

    def put(self, request_id: str, reply: Dict[str, Any]) -> Receipt:
        """Persist the reply for ``request_id`` (before it is sent); the new receipt."""
        now = self._clock.seconds()
        with self._db:
            self._db.execute("DELETE FROM receipts WHERE at < ?", (now - self._ttl,))
            self._db.execute(
                "INSERT OR REPLACE INTO receipts (request_id, at, entry) VALUES (?, ?, ?)",
                (request_id, now, json.dumps({"reply": reply}, ensure_ascii=False)),
            )
        return {"at": now, "reply": reply}

    def mark(self, request_id: str, **facts: Any) -> None:
        """Record more facts about a receipt (e.g. that the v1.0 receipt went out)."""
        receipt = self.get(request_id)
        if receipt is None:
            return
        receipt.update(facts)
        del receipt["at"]
        with self._db:
            self._db.execute(
                "UPDATE receipts SET entry = ? WHERE request_id = ?",
                (json.dumps(receipt, ensure_ascii=False), request_id),
            )

    def __len__(self) -> int:
        ((count,),) = self._db.execute(
            "SELECT COUNT(*) FROM receipts WHERE at >= ?", (self._oldest(),)
        ).fetchall()
        return count

    def close(self) -> None:
        """Close the file; the store cannot be used afterwards."""
        self._db.close()
