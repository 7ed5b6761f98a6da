"""The agent's receipt store: persistence, expiry, privacy, crash durability, and the
move from the JSON receipts file of earlier releases."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from relay.agent.receipts import (
    RECEIPT_TTL_SECONDS,
    ReceiptStore,
    legacy_receipts_path,
    receipts_path,
)
from tests.support import REPO

NOW = 1_700_000_000.0


def clock_at(seconds: float = NOW) -> Clock:
    clock = Clock()
    clock.advance(seconds)
    return clock


def reply(reply_id: str) -> Dict[str, Any]:
    return {"id": reply_id, "to": "alpha", "body": {"text": "x"}, "replyTo": "q"}


def files(directory: Path) -> Dict[str, int]:
    """The files in ``directory`` and their permission bits."""
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in sorted(directory.iterdir())}


def test_paths_are_per_agent_and_stable(tmp_path: Path) -> None:
    one = receipts_path("alpha", tmp_path)
    assert one == receipts_path("alpha", tmp_path)
    assert one != receipts_path("beta", tmp_path)
    assert one.parent == tmp_path
    assert one.name.startswith(".dsh-agent-relay-receipts-") and one.suffix == ".sqlite3"
    assert "alpha" not in one.name
    legacy = legacy_receipts_path("alpha", tmp_path)
    assert legacy.with_suffix("") == one.with_suffix("") and legacy.suffix == ".json"


def test_receipts_persist_expire_after_a_day_and_are_private(tmp_path: Path) -> None:
    clock = clock_at()
    path = tmp_path / "receipts.sqlite3"
    store = ReceiptStore(path, clock)
    assert store.get("q1") is None
    assert store.put("q1", reply("r1")) == {"at": NOW, "reply": reply("r1")}
    store.mark("q1", receiptSent=True)
    store.mark("unknown", receiptSent=True)
    assert len(store) == 1
    assert files(tmp_path) == {
        "receipts.sqlite3": 0o600,
        "receipts.sqlite3-shm": 0o600,
        "receipts.sqlite3-wal": 0o600,
    }

    reopened = ReceiptStore(path, clock)
    assert reopened.get("q1") == {"at": NOW, "reply": reply("r1"), "receiptSent": True}
    assert reopened.get("unknown") is None

    clock.advance(RECEIPT_TTL_SECONDS - 1)
    assert reopened.get("q1") is not None
    clock.advance(2)
    assert reopened.get("q1") is None and len(reopened) == 0
    reopened.put("q2", reply("r2"))
    store.close()
    reopened.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert [row[0] for row in db.execute("SELECT request_id FROM receipts")] == ["q2"]


def test_a_second_put_replaces_the_receipt(tmp_path: Path) -> None:
    clock = clock_at()
    store = ReceiptStore(tmp_path / "r.sqlite3", clock)
    store.put("q", reply("first"))
    store.mark("q", receiptSent=True)
    clock.advance(5)
    store.put("q", reply("second"))
    assert store.get("q") == {"at": NOW + 5, "reply": reply("second")}


@pytest.mark.process
def test_a_receipt_survives_sigkill_right_after_put_returns(tmp_path: Path) -> None:
    path = tmp_path / "receipts.sqlite3"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        from twisted.internet.task import Clock
        from relay.agent.receipts import ReceiptStore

        clock = Clock()
        clock.advance({NOW!r})
        store = ReceiptStore(Path(sys.argv[1]), clock)
        store.put("q1", {{"id": "r1", "to": "alpha", "body": {{}}}})
        store.put("q2", {{"id": "r2", "to": "alpha", "body": {{}}}})
        store.mark("q2", receiptSent=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        cwd=str(REPO),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == -9, done.stderr.decode()
    store = ReceiptStore(path, clock_at())
    first, second = store.get("q1"), store.get("q2")
    assert first is not None and first["reply"]["id"] == "r1"
    assert second is not None and second["reply"]["id"] == "r2" and second["receiptSent"] is True


def write_legacy(path: Path, receipts: Dict[str, Any]) -> None:
    """A receipts file as earlier releases wrote it."""
    path.write_text(json.dumps({"version": 1, "receipts": receipts}), encoding="utf-8")
    path.chmod(0o600)


def test_the_old_json_receipts_are_moved_in_and_the_old_file_removed(tmp_path: Path) -> None:
    legacy = legacy_receipts_path("worker", tmp_path)
    write_legacy(
        legacy,
        {
            "fresh": {"at": NOW - 60, "reply": reply("r-fresh"), "receiptSent": True},
            "expired": {"at": NOW - RECEIPT_TTL_SECONDS - 1, "reply": reply("r-expired")},
            "no-reply": {"at": NOW},
            "no-time": {"reply": reply("r-no-time")},
        },
    )
    with capturedLogs() as events:
        store = ReceiptStore.for_agent("worker", tmp_path, clock_at())
    assert store.path == receipts_path("worker", tmp_path)
    assert store.get("fresh") == {
        "at": NOW - 60,
        "reply": reply("r-fresh"),
        "receiptSent": True,
    }
    assert [store.get(key) for key in ("expired", "no-reply", "no-time")] == [None] * 3
    assert len(store) == 1
    assert not legacy.exists()
    assert [e["count"] for e in events if "count" in e] == [1]
    store.put("new", reply("r-new"))
    assert ReceiptStore.for_agent("worker", tmp_path, clock_at()).get("new") is not None


def test_a_receipt_already_moved_is_not_overwritten_by_the_old_file(tmp_path: Path) -> None:
    """A crash between moving the receipts in and removing the old file moves them again."""
    store = ReceiptStore.for_agent("worker", tmp_path, clock_at())
    store.put("q", reply("r1"))
    store.mark("q", receiptSent=True)
    write_legacy(legacy_receipts_path("worker", tmp_path), {"q": {"at": NOW, "reply": reply("r1")}})
    again = ReceiptStore.for_agent("worker", tmp_path, clock_at())
    assert again.get("q") == {"at": NOW, "reply": reply("r1"), "receiptSent": True}


@pytest.mark.parametrize("content", ["{broken", "[1, 2]", '{"receipts": []}'])
def test_an_unusable_old_file_is_dropped(tmp_path: Path, content: str) -> None:
    legacy = legacy_receipts_path("worker", tmp_path)
    legacy.write_text(content, encoding="utf-8")
    store = ReceiptStore.for_agent("worker", tmp_path, clock_at())
    assert len(store) == 0 and not legacy.exists()


def test_an_unreadable_database_is_set_aside_and_the_store_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "receipts.sqlite3"
    path.write_bytes(b"this is not a database, it only has the right name" * 100)
    with capturedLogs() as events:
        store = ReceiptStore(path, clock_at())
    assert len(store) == 0
    assert any("unreadable" in e.get("log_format", "") for e in events)
    aside = tmp_path / "receipts.sqlite3.unreadable"
    assert aside.read_bytes().startswith(b"this is not a database")
    store.put("q", reply("r"))
    assert ReceiptStore(path, clock_at()).get("q") is not None
