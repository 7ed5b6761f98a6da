"""SQLite-specific behaviour: query plans, schema versions, opening errors, jsonl import."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
from pathlib import Path
from typing import List

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.logger import capturedLogs

from relay.rules import delivery
from relay.rules.delivery import Message, notice_id
from relay.store import sqlite as backend
from relay.store.plugins import open_configured_store
from relay.testing import RULES, START, ack, make_config, new_message
from relay.wire.errors import ConfigError, RelayError
from relay.wire.protocol import DONE, LEASED, QUEUED
from tests.conftest import open_backend

LEASE = 60


def open_sqlite(path, **broker):
    return open_configured_store(make_config(storage="sqlite", dataDir=str(path), **broker),
                                 reactor)


def scans(db: sqlite3.Connection, sql: str) -> List[str]:
    """The query-plan steps of ``sql`` that visit a whole table or sort outside an index."""
    plan = db.execute("EXPLAIN QUERY PLAN " + sql, [None] * sql.count("?")).fetchall()
    details = [row[-1] for row in plan]
    # the few rows an index search found, then sorted (the traced SQL has its values)
    if any(sql.split(" WHERE ")[0] == found.split(" WHERE ")[0]
           for found in backend.SORTS_FOUND):
        assert any(d.startswith("SEARCH") and "INDEX" in d for d in details), details
        details = [d for d in details if d != "USE TEMP B-TREE FOR ORDER BY"]
    return [d for d in details if d.startswith("SCAN") or "TEMP B-TREE" in d]


@pytest_twisted.ensureDeferred
async def test_no_statement_scans_a_table(tmp_path):
    """Every statement the store runs is an index search (checked on its real SQL)."""
    store = open_sqlite(tmp_path)
    try:
        executed: List[str] = []
        for i in range(30):
            await store.add(new_message("alpha", f"agent{i % 3}", START + i, id=f"x{i}"), RULES)
        store.db.set_trace_callback(executed.append)
        await store.register("beta", START)
        store.is_registered("beta")
        await store.peers()
        await store.add(new_message("alpha", "beta", START, id="a"), RULES)
        await store.add(new_message("alpha", "beta", START, id="a"), RULES)
        await store.add(new_message("alpha", "beta", START, id="b", kind="request"), RULES)
        await store.find("a", START)
        (m,) = await store.pull("beta", 1, LEASE, START, RULES)
        with pytest.raises(RelayError):
            await ack(store, "a", "beta", "wrong", "completed", None, START, RULES)
        await ack(store, "a", "beta", m.lease_id, "retry", None, START, RULES)
        _, cursor = await store.poll("beta", None, 50, START, RULES)
        await store.pull("beta", 1, LEASE, START, RULES)
        await store.sweep_leases(START + LEASE, RULES)
        await store.poll("beta", cursor, 50, START + LEASE, RULES)
        await store.status(["a", "b", "zz"], "alpha", START, RULES)
        await store.recent("beta", 10, START, RULES)
        for sender, to in ((None, None), ("alpha", None), (None, "beta"), ("alpha", "beta"),
                           ("gamma", None), (None, "gamma")):
            for kind, status in ((None, None), ("request", None), (None, QUEUED)):
                filters = {"kind": kind, "status": status, "from": sender, "to": to}
                await store.query("beta", 10, filters, START, RULES)
        # v1.2: renew, every outcome, requeue, cancel, reply, delay, TTL, threads, boxes, cards
        await store.register("beta", START, {"skills": ["x"]})
        await store.add(new_message("alpha", "beta", START, id="c", kind="request",
                                    rootId="b", ttl_seconds=5), RULES)
        await store.add(new_message("alpha", "beta", START, id="d", delay_seconds=5), RULES)
        (m,) = await store.pull("beta", 1, LEASE, START + LEASE, RULES)
        await store.settle(m.id, delivery.renew("beta", m.lease_id, 30), START + LEASE, RULES)
        reply = {"id": "rep", "body": {}, "kind": "reply", "ack": False}
        await store.settle(m.id, delivery.ack("beta", m.lease_id, "completed", None, RULES,
                                              reply=reply), START + LEASE, RULES)
        await store.pull("alpha", 5, LEASE, START + LEASE, RULES, "a")
        for outcome in ("release", "reject"):
            (m,) = await store.pull("beta", 1, LEASE, START + LEASE, RULES)
            await store.settle(m.id, delivery.ack("beta", m.lease_id, outcome, None, RULES, None),
                               START + LEASE, RULES)
        await store.settle(m.id, delivery.requeue("alpha"), START + LEASE, RULES)
        await store.settle(m.id, delivery.cancel("alpha", None), START + LEASE, RULES)
        await store.thread("alpha", "b", None, 10, START, RULES)
        await store.thread("alpha", "b", "a", 10, START, RULES)
        for box in ("inbox", "sent", "all"):
            for filters in ({}, {"rootId": "b"}, {"parentId": "a"}, {"status": "failed"}):
                await store.query("alpha", 10, dict(filters, box=box), START, RULES)
        await store.poll("beta", None, 50, START + 10, RULES)
        await store.sweep_expired(START + 5, START + 10, RULES)
        store.db.set_trace_callback(None)
        statements = {s for s in executed if s.split()[0].upper() not in ("BEGIN", "COMMIT")}
        statements -= set(backend.LISTINGS)
        assert len(statements) > 15
        for sql in statements:
            assert scans(store.db, sql) == [], sql
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_declared_statements_use_indexes(tmp_path):
    store = open_sqlite(tmp_path)
    try:
        for name, statements in backend.STATEMENTS.items():
            for sql in statements:
                assert scans(store.db, sql) == [], (name, sql)
    finally:
        await store.close()


def plan_of(db: sqlite3.Connection, sql: str) -> str:
    return " | ".join(row[-1] for row in db.execute("EXPLAIN QUERY PLAN " + sql,
                                                    [None] * sql.count("?")))


@pytest.mark.parametrize(("lookup", "index"), [
    ("pull by parent id", "messages_parent"), ("pull by reply-to", "messages_reply_to"),
    ("thread by root", "messages_root"), ("query of the sent box", "messages_outbox"),
    ("dead letters of the sent box", "messages_sent_failed"),
    ("query by root", "messages_root"), ("query by parent", "messages_parent"),
    ("TTL sweep", "messages_expiry"), ("v1.0 recovery", "messages_recovery"),
])
def test_the_v12_lookups_use_their_indexes(tmp_path, lookup, index):
    statements = {
        "pull by parent id": backend.STATEMENTS["queued"][1],
        "pull by reply-to": backend.STATEMENTS["queued"][2],
        "thread by root": backend.STATEMENTS["thread"][1],
        "query of the sent box": backend._listing_statement("sender", "sent", {})[0],
        "dead letters of the sent box": backend._listing_statement(
            "sender_failed", "sent", {"status": "failed"})[0],
        "query by root": backend._listing_statement("root", "inbox", {"rootId": "r"})[0],
        "query by parent": backend._listing_statement("parent", "all", {"parentId": "p"})[0],
        "TTL sweep": backend.STATEMENTS["expire"][1],
        "v1.0 recovery": backend.STATEMENTS["recovered"][0],
    }
    db = sqlite3.connect(":memory:")
    db.executescript(backend.schema_script(backend.SCHEMA_VERSION))
    assert f"INDEX {index} " in plan_of(db, statements[lookup])


@pytest_twisted.ensureDeferred
async def test_new_database_has_the_schema_version_and_wal(tmp_path):
    store = open_sqlite(tmp_path, sync="full")
    try:
        assert os.path.exists(tmp_path / "relay.db")
        assert store.db.execute("SELECT version FROM version").fetchall() == [
            (backend.SCHEMA_VERSION,)
        ]
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    finally:
        await store.close()
    store = open_sqlite(tmp_path)
    try:
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_newer_schema_stops_the_start(tmp_path):
    await open_sqlite(tmp_path).close()
    db = sqlite3.connect(tmp_path / "relay.db")
    db.execute("UPDATE version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(ConfigError) as e:
        open_sqlite(tmp_path)
    assert e.value.key == "broker.dataDir"
    assert str(tmp_path / "relay.db") in e.value.reason and "99" in e.value.reason
    assert "newer" in e.value.reason


SCHEMAS = Path(__file__).parent / "schemas"


def old_schema(version: int) -> str:
    """The schema script a past release created new databases from, kept here."""
    return (SCHEMAS / f"sqlite-v{version}.sql").read_text("utf-8")


def schema_dump(db: sqlite3.Connection) -> List[tuple]:
    """The schema of ``db``: each table's columns (as SQLite describes them, so an
    ``ALTER TABLE ADD COLUMN`` and a ``CREATE TABLE`` that mean the same compare
    equal) and rowid kind, and every index's SQL without comments, by name."""
    out: List[tuple] = []
    rows = db.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                      "ORDER BY name").fetchall()
    for kind, name, sql in rows:
        if kind == "table":
            columns = tuple(db.execute(f"PRAGMA table_xinfo({name})").fetchall())
            without_rowid = sql.rstrip().upper().endswith("WITHOUT ROWID")
            out.append((kind, name, columns, without_rowid))
        else:
            out.append((kind, name, " ".join(re.sub(r"--[^\n]*", "", sql).split())))
    return out


def version_1_database(path: str) -> None:
    """A database as the first release of the relay created it, holding one message."""
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(old_schema(1))
    db.execute("INSERT INTO version (version) VALUES (1)")
    message = new_message("alpha", "beta", START, id="kept")
    message.seq = 1
    columns = backend.COLUMNS.split(", ")[:19]  # the columns of schemas 1 and 2
    db.execute(f"INSERT INTO messages ({', '.join(columns)}) VALUES ({', '.join('?' * 19)})",
               backend._row(message)[:19])
    db.execute("INSERT INTO peers VALUES ('beta', 1)")
    db.close()


def test_upgrade_applies_scripts_in_order_after_a_backup(tmp_path):
    path = str(tmp_path / "relay.db")
    version_1_database(path)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("INSERT INTO peers VALUES ('alpha', 1)")
    scripts = {
        2: "ALTER TABLE peers ADD COLUMN note TEXT;",
        3: "UPDATE peers SET note = 'v3';",
    }
    assert backend.upgrade(db, path, target=3, script=scripts.__getitem__) == 1
    assert db.execute("SELECT version FROM version").fetchone()[0] == 3
    assert db.execute("SELECT agent, note FROM peers ORDER BY agent").fetchall() == [
        ("alpha", "v3"), ("beta", "v3")]
    db.close()
    backup = sqlite3.connect(path + ".v1.bak")
    assert backup.execute("SELECT version FROM version").fetchone()[0] == 1
    backup.close()


@pytest_twisted.ensureDeferred
async def test_a_version_1_database_is_brought_to_the_newest_version(tmp_path):
    """Version 2 dropped the per-sender index; version 3 brought one back, by status;
    version 4 keys it without the status."""
    version_1_database(str(tmp_path / "relay.db"))
    store = open_sqlite(tmp_path)
    try:
        (version,) = store.db.execute("SELECT version FROM version").fetchone()
        assert version == backend.SCHEMA_VERSION
        indexes = {row[0]: row[1] for row in store.db.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index'")}
        assert "(sender, seq)" in indexes["messages_outbox"]
        assert (await store.find("kept", START)).body == {"text": "hello"}
        assert store.is_registered("beta").result is True
        await store.add(new_message("alpha", "beta", START, id="after"), RULES)
        leased = await store.pull("beta", 10, LEASE, START, RULES)
        assert [m.id for m in leased] == ["kept", "after"]
    finally:
        await store.close()
    assert os.path.exists(str(tmp_path / "relay.db.v1.bak"))


@pytest_twisted.ensureDeferred
async def test_an_upgraded_database_has_the_schema_of_a_new_one(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    version_1_database(str(tmp_path / "old" / "relay.db"))
    for name in ("old", "new"):
        await open_sqlite(tmp_path / name).close()
    dumps = []
    for name in ("old", "new"):
        db = sqlite3.connect(tmp_path / name / "relay.db")
        dumps.append(schema_dump(db))
        assert db.execute("SELECT version FROM version").fetchall() == [(backend.SCHEMA_VERSION,)]
        db.close()
    assert dumps[0] == dumps[1]
    assert any(entry[1] == "messages_inbox" for entry in dumps[0])
    assert any(entry[1] == "messages_root" for entry in dumps[0])


V2_DATABASE = SCHEMAS / "relay-v2.db"  # written by the release with schema 2


async def backed_up_and_like_a_new_database(tmp_path: Path, old_version: int) -> None:
    """Check the upgrade of ``tmp_path/relay.db`` from ``old_version``: the backup holds
    the old version and the upgraded schema is that of a new database."""
    backup = sqlite3.connect(tmp_path / f"relay.db.v{old_version}.bak")
    assert backup.execute("SELECT version FROM version").fetchone()[0] == old_version
    backup.close()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    await open_sqlite(fresh).close()
    upgraded, new = (sqlite3.connect(p) for p in (tmp_path / "relay.db", fresh / "relay.db"))
    assert schema_dump(upgraded) == schema_dump(new)
    upgraded.close()
    new.close()


@pytest_twisted.ensureDeferred
async def test_a_real_version_2_database_is_upgraded_after_a_backup(tmp_path):
    shutil.copy(V2_DATABASE, tmp_path / "relay.db")
    store = open_sqlite(tmp_path)
    try:
        (version,) = store.db.execute("SELECT version FROM version").fetchone()
        assert version == backend.SCHEMA_VERSION
        found = {i: await store.find(f"v2-{i}", START) for i in range(6)}
        assert [found[i].status for i in range(6)] == [
            DONE, "failed", LEASED, QUEUED, QUEUED, QUEUED]
        assert found[1].error == "busy" and found[1].attempts == 1
        assert found[0].body == {"n": 0, "text": "hé ☃"}
        assert all(m.deliveries == 0 and m.not_before is None and m.expires_at is None
                   for m in found.values()), "v1.2 fields take their defaults"
        assert await store.peers() == [("alpha", int(START), None),
                                       ("beta", int(START) + 1, None)]
        # the lease taken before the upgrade still acks; the thread index works
        (entry,) = await store.status(["v2-2"], "alpha", START, RULES)
        assert entry["status"] == LEASED and entry["deliveries"] == 0
        result = await ack(store, "v2-2", "beta", found[2].lease_id, "completed", None, START)
        assert result["status"] == DONE
        thread, _ = await store.thread("alpha", "root-1", None, 50, START, RULES)
        assert [m.id for m in thread] == ["v2-1", "v2-2", "v2-3", "v2-4", "v2-5", "v2-reply"]
        await store.register("beta", START + 2, {"skills": ["sql"]})
        assert (await store.peers())[1][2] == {"skills": ["sql"]}
    finally:
        await store.close()
    await backed_up_and_like_a_new_database(tmp_path, 2)


def written_btrees(db: sqlite3.Connection, sql: str) -> List[str]:
    """The tables and indexes ``sql`` opens for writing, by name (from its bytecode)."""
    roots = {root: name for name, root in db.execute(
        "SELECT name, rootpage FROM sqlite_master WHERE rootpage")}
    program = db.execute("EXPLAIN " + sql, [None] * sql.count("?")).fetchall()
    return sorted({roots[row[3]] for row in program if row[1] == "OpenWrite"})


def test_a_lease_or_a_settle_leaves_the_id_and_sent_box_indexes_alone():
    """A pull and an ack change only a message's delivery state: their UPDATE writes
    the row and the indexes keyed by that state (the partial ones only for a row
    they hold), not the indexes a new message enters by its id or sender (each
    written index is a page per commit)."""
    db = sqlite3.connect(":memory:")
    db.executescript(backend.schema_script(backend.SCHEMA_VERSION))
    assert written_btrees(db, backend.STATEMENTS["save"][0]) == [
        "messages", "messages_expiry", "messages_held", "messages_inbox", "messages_leases",
        "messages_recovery", "messages_sent_failed", "messages_urgent"]
    assert {"messages_outbox", "sqlite_autoindex_messages_1"} <= set(
        written_btrees(db, backend.STATEMENTS["insert"][0]))


V3_COLUMNS = 24


def version_3_database(path: str) -> List[Message]:
    """A database as the schema-3 releases created it, holding messages of two
    senders in every status."""
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(old_schema(3))
    db.execute("INSERT INTO version (version) VALUES (3)")
    messages = []
    for seq in range(1, 13):
        message = new_message("alpha" if seq % 3 else "gamma", "beta", START + seq,
                              id=f"v3-{seq}", kind="request" if seq % 2 else "message")
        message.seq = seq
        message.status = (QUEUED, LEASED, DONE, "failed")[seq % 4]
        if message.status == LEASED:
            message.lease_id, message.lease_until = f"lease-{seq}", int(START + 60) * 1000
        messages.append(message)
        # the columns of schema 3: those before the group copies' (schema 6)
        row = backend._row(message)[:V3_COLUMNS]
        db.execute(f"INSERT INTO messages ({', '.join(backend.COLUMNS.split(', ')[:V3_COLUMNS])}) "
                   f"VALUES ({', '.join('?' * len(row))})", row)
    db.execute("INSERT INTO peers (agent, last_seen) VALUES ('beta', ?)", (int(START),))
    db.close()
    return messages


@pytest_twisted.ensureDeferred
async def test_a_version_3_database_is_upgraded_and_its_sent_box_reads_the_same(tmp_path):
    stored = version_3_database(str(tmp_path / "relay.db"))
    store = open_sqlite(tmp_path)
    try:
        (version,) = store.db.execute("SELECT version FROM version").fetchone()
        assert version == backend.SCHEMA_VERSION
        for sender in ("alpha", "gamma"):
            for filters in ({}, {"status": QUEUED}, {"status": LEASED}, {"status": DONE},
                            {"status": "failed"}, {"kind": "request"}, {"to": "beta"}):
                listed = await store.query(sender, 50, dict(filters, box="sent"), START,
                                           RULES)
                expected = [m.id for m in reversed(stored) if m.sender == sender
                            and all(getattr(m, k) == v for k, v in filters.items())]
                assert [m.id for m in listed] == expected, (sender, filters)
                assert expected or filters, "every sender has sent messages"
            newest = await store.query(sender, 2, {"box": "sent"}, START, RULES)
            assert [m.id for m in newest] == [m.id for m in reversed(stored)
                                             if m.sender == sender][:2]
        everything = await store.query("alpha", 50, {"box": "all"}, START, RULES)
        assert [m.id for m in everything] == [m.id for m in reversed(stored)
                                             if m.sender == "alpha"]
        beta_all = await store.query("beta", 50, {"box": "all", "status": DONE}, START, RULES)
        assert [m.id for m in beta_all] == [m.id for m in reversed(stored) if m.status == DONE]
        (leased,) = [m for m in stored if m.status == LEASED][:1]
        result = await ack(store, leased.id, "beta", leased.lease_id, "completed", None, START)
        assert result["status"] == DONE
        done = await store.query(leased.sender, 50, {"box": "sent", "status": DONE}, START,
                                 RULES)
        assert leased.id in [m.id for m in done]
    finally:
        await store.close()
    await backed_up_and_like_a_new_database(tmp_path, 3)


V8_COLUMNS = 29  # every column but the completion time (schema 9)


def version_8_database(path: str) -> List[Message]:
    """A database as the schema-8 releases created it: seed-wire and v2/v3 messages in
    every status, with and without a TTL, a role message held by a member."""
    from relay.wire.v2 import views

    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(old_schema(8))
    db.execute("INSERT INTO version (version) VALUES (8)")
    messages = []
    for seq in range(1, 17):
        v2 = seq % 2 == 0
        message = new_message("alpha", "beta", START + seq, id=f"v8-{seq}",
                              kind="request" if seq % 3 else "message",
                              ttl_seconds=600 if seq % 4 < 2 else None)
        message.seq = seq
        message.status = (QUEUED, LEASED, DONE, "failed")[(seq // 2) % 4]
        if v2:
            message.v2 = views.v2_meta("continue", f"ref-{seq}", seq % 3 == 0)
        if message.status == LEASED:
            message.lease_id, message.lease_until = f"lease-{seq}", int(START + 60) * 1000
            message.deliveries = 1
        if seq == 16:
            message.to, message.holder, message.priority = "role:triage", "dan", 4
        messages.append(message)
        row = backend._row(message)[:V8_COLUMNS]
        db.execute(f"INSERT INTO messages ({', '.join(backend.COLUMNS.split(', ')[:V8_COLUMNS])}) "
                   f"VALUES ({', '.join('?' * len(row))})", row)
    db.execute("INSERT INTO peers (agent, last_seen) VALUES ('beta', ?)", (int(START),))
    db.close()
    return messages


@pytest_twisted.ensureDeferred
async def test_a_version_8_database_is_upgraded_with_nothing_lost(tmp_path):
    """Schema 9 adds the completion time (none for the messages stored before) and
    keeps the v2/v3 messages past their TTL out of the expiry index once expired."""
    from relay.store.jsonl import snapshot_record
    from relay.wire.protocol import EXPIRED

    stored = version_8_database(str(tmp_path / "relay.db"))
    store = open_sqlite(tmp_path)
    try:
        (version,) = store.db.execute("SELECT version FROM version").fetchone()
        assert version == backend.SCHEMA_VERSION
        for message in stored:
            found = await store.find(message.id, START, True)
            assert snapshot_record(found) == snapshot_record(message), message.id
            assert found.state()[:10] == message.state()[:10], message.id
            assert found.completed_at is None
        later = START + 620  # past every TTL
        swept = await store.sweep_expired(START - 1, later, RULES)
        ttl = [m for m in stored if m.expires_at is not None]
        removed = [m for m in ttl if m.v2 is None]
        kept = [m for m in ttl if m.v2 is not None and m.status in (QUEUED, LEASED)]
        assert swept == len(removed) + len(kept) and removed and kept
        for message in ttl:
            found = await store.find(message.id, later, True)
            if message.v2 is None:
                assert found is None, message.id
            else:
                assert found.status == (EXPIRED if message in kept else message.status)
        assert await store.sweep_expired(START - 1, later + 60, RULES) == 0
        leased = [m for m in stored if m.status == LEASED and m.expires_at is None
                  and m.to == "beta"][0]
        await ack(store, leased.id, "beta", leased.lease_id, "completed", None, START + 30)
        assert (await store.find(leased.id, START + 30)).completed_at == START + 30
    finally:
        await store.close()
    await backed_up_and_like_a_new_database(tmp_path, 8)


def test_unopenable_database_names_the_path(tmp_path):
    (tmp_path / "relay.db").write_bytes(b"this is not a database, just text " * 100)
    with pytest.raises(ConfigError) as e:
        open_sqlite(tmp_path)
    assert e.value.key == "broker.dataDir" and str(tmp_path / "relay.db") in e.value.reason


def test_foreign_database_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "relay.db")
    db.execute("CREATE TABLE other (x)")
    db.close()
    with pytest.raises(ConfigError) as e:
        open_sqlite(tmp_path)
    assert "not a relay database" in e.value.reason


def test_uncreatable_data_dir_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as e:
        open_sqlite(blocker / "data")
    assert e.value.key == "broker.dataDir" and str(blocker / "data") in e.value.reason


def reference_lines() -> List[str]:
    """A reference broker messages.jsonl: v1.0 lines, a rewrite, a v1.1 line, junk."""
    def env(i, **extra):
        e = {"id": f"r{i}", "from": "alpha", "to": "beta", "ts": "2024-04-05T19:14:38.000Z",
             "type": "message", "body": {"text": f"ref {i}"}, "replyTo": None, "ack": False}
        e.update(extra)
        return e

    return [
        json.dumps({"seq": 1, "message": env(1)}),
        json.dumps({"seq": 2, "message": env(2)}),
        "{not json",
        json.dumps({"seq": 3, "message": env(3, kind="request", status="leased", attempts=1,
                                             leaseUntil=int(START * 1000) + 5000)}),
        json.dumps({"seq": 2, "message": env(2, status="done", kind="message")}),
        json.dumps({"seq": 4, "message": env(4, status="failed", attempts=4, error="boom")}),
    ]


@pytest_twisted.ensureDeferred
async def test_imports_a_reference_jsonl_once(tmp_path):
    (tmp_path / "messages.jsonl").write_text("\n".join(reference_lines()) + "\n")
    with capturedLogs() as events:
        store = open_sqlite(tmp_path)
    try:
        imported = [e for e in events if "imported" in e.get("log_format", "")]
        assert len(imported) == 1 and imported[0]["count"] == 4
        assert "ref 1" not in repr(events)
        r1, r2, r3, r4 = [await store.find(f"r{i}", START) for i in range(1, 5)]
        assert (r1.status, r1.seq, r1.body) == (QUEUED, 1, {"text": "ref 1"})
        assert r1.created == 1712344478.0 and r1.ts == "2024-04-05T19:14:38.000Z"
        assert r2.status == DONE
        assert (r3.status, r3.kind, r3.attempts, r3.lease_until) == (
            LEASED, "request", 1, int(START * 1000) + 5000)
        assert (r4.status, r4.error) == ("failed", "boom")
        assert await store.sweep_expired(START + 10**7, START + 10**7, RULES) == 4
        # r3, a request still leased, expired unprocessed: its notice took seq 5
        assert (await store.find(notice_id("r3"), START)).seq == 5
        fresh = new_message("alpha", "beta", START, id="new")
        await store.add(fresh, RULES)
        assert fresh.seq == 6
    finally:
        await store.close()
    with capturedLogs() as events:
        store = open_sqlite(tmp_path)
    try:
        assert not [e for e in events if "imported" in e.get("log_format", "")]
        assert await store.find("r1", START) is None, "an emptied database does not re-import"
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_imports_the_jsonl_backends_own_log(tmp_path):
    jsonl = open_backend("jsonl", tmp_path)
    await jsonl.register("beta", START)
    await jsonl.add(new_message("alpha", "beta", START, id="j1"), RULES)
    await jsonl.add(new_message("alpha", "beta", START, id="j2"), RULES)
    (leased,) = await jsonl.pull("beta", 1, LEASE, START, RULES)
    await jsonl.close()
    store = open_sqlite(tmp_path)
    try:
        assert store.is_registered("beta").result is True
        j1 = await store.find("j1", START)
        assert (j1.status, j1.lease_id) == (LEASED, leased.lease_id)
        assert (await store.find("j2", START)).status == QUEUED
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_results_wait_for_one_shared_commit(tmp_path):
    store = open_sqlite(tmp_path)
    try:
        other = sqlite3.connect(tmp_path / "relay.db")
        before = store.commits.commits
        ds = [store.add(new_message("alpha", "beta", START, id=f"g{i}"), RULES) for i in range(20)]
        assert not any(d.called for d in ds), "no 201 before the commit"
        assert other.execute("SELECT count(*) FROM messages").fetchone()[0] == 0
        for d in ds:
            assert await d is True
        assert store.commits.commits == before + 1
        assert other.execute("SELECT count(*) FROM messages").fetchone()[0] == 20
        other.close()
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_an_expiry_sweep_leaves_no_read_open(tmp_path):
    """The sweep stops reading at the first message still alive; a half-read statement
    would hold a read snapshot and keep the WAL from being checkpointed while idle."""
    store = open_sqlite(tmp_path)
    try:
        for i in range(10):
            await store.add(new_message("alpha", "beta", START + i, id=f"m{i}"), RULES)
        assert await store.sweep_expired(START + 3, START + 3, RULES) == 3
        assert await store.sweep_expired(START + 3, START + 3, RULES) == 0
        other = sqlite3.connect(tmp_path / "relay.db", isolation_level=None)
        try:
            busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            other.close()
        assert busy == 0
    finally:
        await store.close()


def test_nulls_are_written_into_the_statement_not_bound():
    """A row's None values become NULL literals; the WHERE values stay bound."""
    save = backend.NullsWritten(backend._save_sql)
    sql, params = save(("done", 2, None, None, "boom", 0, 3, None, None, None, 9.5, None,
                        41), 1)
    assert params == ["done", 2, "boom", 0, 3, 9.5, 41]
    assert "lease_until = NULL, lease_id = NULL" in sql and "error = ?" in sql
    assert sql.endswith("WHERE seq = ?")
    assert sql.count("?") == len(params)
    assert save(("done", 2, None, None, "boom", 0, 3, None, None, None, 9.5, None, 42),
                1)[0] is sql
    nothing_null = save(("queued", 0, 1, "l", "e", 1, 0, 1.0, "r", "m", 2.0, 3.0, 7), 1)[0]
    assert nothing_null == backend._SAVE_STATE


def test_the_statement_texts_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(backend, "NULL_PATTERNS", 2)
    insert = backend.NullsWritten(backend._insert_sql)
    width = len(backend.COLUMNS.split(","))
    for hole in range(5):
        row = tuple(None if i == hole + 1 else i for i in range(width))
        sql, params = insert(row, 0)
        assert sql.count("NULL") == 1 and len(params) == width - 1
    assert len(insert.texts) == 2


@pytest_twisted.ensureDeferred
async def test_fields_without_a_value_are_stored_as_null(tmp_path):
    """NULLs written into the SQL read back as None, and a value set later is stored."""
    store = open_sqlite(tmp_path)
    try:
        await store.add(new_message("alpha", "beta", START, id="n1"), RULES)
        row = store.db.execute(
            "SELECT typeof(reply_to), typeof(lease_until), typeof(lease_id), typeof(error), "
            "typeof(not_before), typeof(expires_at) FROM messages WHERE id = 'n1'").fetchone()
        assert set(row) == {"null"}
        (m,) = await store.pull("beta", 1, LEASE, START, RULES)
        assert store.db.execute("SELECT typeof(lease_id), typeof(lease_until) FROM messages "
                                "WHERE id = 'n1'").fetchone() == ("text", "integer")
        await ack(store, "n1", "beta", m.lease_id, "completed", None, START, RULES)
        found = await store.find("n1", START)
        assert (found.status, found.lease_id, found.lease_until) == (DONE, None, None)
    finally:
        await store.close()


# -- the leased messages kept in memory ------------------------------------------------


class FailingCommit:
    """The store's cursor, except that COMMIT fails as on a full disk."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.cursor = cursor

    def execute(self, sql: str, *args):
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.cursor.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.cursor, name)


async def one_leased(tmp_path: Path, **fields):
    """A sqlite store holding message ``a`` from alpha to beta, leased by beta at START,
    and that lease."""
    store = open_sqlite(tmp_path)
    try:
        await store.add(new_message("alpha", "beta", START, id="a", **fields), RULES)
        (m,) = await store.pull("beta", 1, LEASE, START, RULES)
    except BaseException:
        await store.close()
        raise
    return store, m


@pytest_twisted.ensureDeferred
async def test_an_ack_after_a_pull_reads_no_row_and_is_stored(tmp_path):
    store, m = await one_leased(tmp_path)
    try:
        executed: List[str] = []
        store.db.set_trace_callback(executed.append)
        await ack(store, "a", "beta", m.lease_id, "completed", None, START + 1, RULES)
        store.db.set_trace_callback(None)
        assert [s for s in executed if s.startswith("SELECT")] == []
    finally:
        await store.close()
    store = open_sqlite(tmp_path)
    try:
        assert (await store.find("a", START + 2)).status == DONE
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_kept_message_is_the_message_its_row_holds(tmp_path):
    store, _ = await one_leased(tmp_path, kind="request", rootId="r",
                                body={"text": "h\u00e9", "n": [1.5, None]})
    try:
        kept = await store.find("a", START + 1)  # the copy kept by the lease
        assert "a" not in store.records.leased
        read = await store.find("a", START + 1)  # the row
        assert kept is not read
        assert kept.envelope_json("beta", START + 1) == read.envelope_json("beta", START + 1)
        assert (kept.seq, kept.state(), kept.created) == (read.seq, read.state(), read.created)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_lease_given_again_refuses_the_old_lease_id(tmp_path):
    store, first = await one_leased(tmp_path)
    try:
        (second,) = await store.pull("beta", 1, LEASE, START + LEASE + 1, RULES)
        assert second.lease_id != first.lease_id
        with pytest.raises(RelayError):
            await ack(store, "a", "beta", first.lease_id, "completed", None,
                      START + LEASE + 2, RULES)
        await ack(store, "a", "beta", second.lease_id, "completed", None,
                  START + LEASE + 3, RULES)
        assert (await store.find("a", START + LEASE + 4)).status == DONE
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_rolled_back_renewal_is_not_remembered(tmp_path):
    """A commit that fails undoes the renewal on disk; the copy kept in memory goes
    with it, so the next read sees the lease as it is stored."""
    store, m = await one_leased(tmp_path)
    try:
        records = store.records
        cursor, records.cursor = records.cursor, FailingCommit(records.cursor)
        renewal = store.settle("a", delivery.renew("beta", m.lease_id, 10 * LEASE),
                               START + 1, RULES)
        with pytest.raises(sqlite3.OperationalError):
            await renewal
        records.cursor = cursor
        assert records.leased == {}
        found = await store.find("a", START + 2)
        assert (found.status, found.lease_until) == (LEASED, m.lease_until)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_leased_message_removed_by_the_sweep_cannot_be_acked(tmp_path):
    store, m = await one_leased(tmp_path)
    try:
        assert await store.sweep_expired(START + 5, START + 5, RULES) == 1
        with pytest.raises(RelayError) as raised:
            await ack(store, "a", "beta", m.lease_id, "completed", None, START + 6, RULES)
        assert raised.value.code == "no_such_message"
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_the_leased_messages_kept_are_bounded(tmp_path, monkeypatch):
    """Neither a large body nor more than LEASED_KEPT messages are kept; their acks
    read the row back."""
    monkeypatch.setattr(backend, "LEASED_KEPT", 2)
    store = open_sqlite(tmp_path)
    try:
        big = {"text": "x" * backend.LEASED_BODY_CHARS}
        await store.add(new_message("alpha", "beta", START, id="big", body=big), RULES)
        for i in range(3):
            await store.add(new_message("alpha", "beta", START, id=f"s{i}"), RULES)
        leases = await store.pull("beta", 10, LEASE, START, RULES)
        assert sorted(store.records.leased) == ["s0", "s1"]
        for m in leases:
            await ack(store, m.id, "beta", m.lease_id, "completed", None, START + 1, RULES)
        assert store.records.leased == {}
        for m in leases:
            assert (await store.find(m.id, START + 2)).status == DONE
    finally:
        await store.close()


def test_a_store_opened_on_a_clock_checkpoints_on_that_clock(tmp_path):
    """The store's time and threads are the reactor it is opened on: on a clock without
    threads, the checkpoint runs inline when the clock says so, never on the global
    reactor's thread pool."""
    from twisted.internet.task import Clock

    clock = Clock()
    clock.advance(START)
    store = open_configured_store(make_config(storage="sqlite", dataDir=str(tmp_path)), clock)
    try:
        d = store.add(new_message("alpha", "beta", START, id="m"), RULES)
        clock.advance(0)  # the group commit
        assert d.result is True
        assert store.checkpointer.checkpoints == 0
        clock.advance(backend.CHECKPOINT_SECONDS)
        assert store.checkpointer.checkpoints == 1
    finally:
        store.close()
        clock.advance(0)
