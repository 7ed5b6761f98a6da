"""jsonl-specific behaviour: damaged lines, the reference format, compaction, fsync grouping."""

from __future__ import annotations

import errno
import json
import os
from typing import Any, Dict, List

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from relay.store import jsonl as backend
from relay.store.grouped import GroupCommit
from relay.store.plugins import open_configured_store
from relay.testing import RULES, START, ack, make_config, make_rules, new_message
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED

LEASE = 60
MARKER = "body-marker-7f3a"


def open_jsonl(path, **broker) -> backend.JsonlStore:
    return open_configured_store(make_config(storage="jsonl", dataDir=str(path), **broker),
                                 reactor)


def lines(path) -> List[bytes]:
    return (path / "messages.jsonl").read_bytes().splitlines()


async def snapshot(store) -> Dict[str, Any]:
    state = store.records
    return {
        "messages": {
            m.id: (m.seq, backend.snapshot_record(m)["message"], m.created, m.recovery)
            for m in state.by_seq.values()
        },
        "peers": await store.peers(),
        "next_seq": state.next_seq,
        "events": list(state.event_log),
        "event_marks": state.event_marks(),
    }


async def fill(store, count: int, to: str = "beta") -> None:
    for i in range(count):
        await store.add(new_message("alpha", to, START + i, id=f"{to}{i}",
                                    body={"text": MARKER}), RULES)


@pytest_twisted.ensureDeferred
async def test_torn_last_line_is_skipped_and_the_log_stays_usable(tmp_path):
    store = open_jsonl(tmp_path)
    await fill(store, 3)
    await store.close()
    path = tmp_path / "messages.jsonl"
    data = path.read_bytes()
    # a crash in the middle of the last write (the last message's snapshot; its event
    # record came after it)
    last = data.rindex(b'{"seq"')
    path.write_bytes(data[: last + 25])

    with capturedLogs() as events:
        store = open_jsonl(tmp_path)
    try:
        assert sorted(store.records.by_id) == ["beta0", "beta1"]
        torn = data[:last].count(b"\n") + 1
        skipped = [e for e in events if e.get("line") == torn]
        assert len(skipped) == 1 and MARKER not in repr(events)
        await fill(store, 1, to="gamma")
    finally:
        await store.close()
    store = open_jsonl(tmp_path)
    try:
        assert sorted(store.records.by_id) == ["beta0", "beta1", "gamma0"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_corrupt_lines_are_skipped_counted_and_logged_by_number(tmp_path):
    good = [
        {"seq": 1, "message": {"id": "a", "from": "alpha", "to": "beta", "ts":
                               "2024-04-05T19:14:38.000Z", "body": {"text": MARKER}}},
        {"seq": 2, "message": {"id": "b", "from": "alpha", "to": "beta", "ts":
                               "2024-04-05T19:14:39.000Z"}},
    ]
    bad = [
        '{"seq": 3, "message": {"id": "c", "text": "' + MARKER + '"',  # not JSON
        json.dumps({"seq": 4, "message": {"id": "d", "from": "alpha"}}),  # no "to"
        json.dumps({"op": "state", "id": "a", "status": "bogus", "attempts": 0}),
        json.dumps([1, 2]),
        "\xff\xfe garbage " + MARKER,
    ]
    text = "\n".join([json.dumps(good[0]), *bad, json.dumps(good[1])]) + "\n"
    (tmp_path / "messages.jsonl").write_text(text, encoding="utf-8", errors="surrogateescape")
    with capturedLogs() as events:
        loaded = backend.read_log(str(tmp_path / "messages.jsonl"), START)
    assert [m.id for m in loaded.messages] == ["a", "b"]
    assert loaded.skipped == 5 and loaded.records == 2
    assert sorted(e["line"] for e in events if "line" in e) == [2, 3, 4, 5, 6]
    assert MARKER not in repr(events)


@pytest_twisted.ensureDeferred
async def test_reads_the_reference_brokers_file(tmp_path):
    def env(i, **extra):
        e = {"id": f"r{i}", "from": "alpha", "to": "beta", "ts": "2024-04-05T19:14:38.000Z",
             "type": "message", "body": {"n": i}, "replyTo": None, "ack": i == 1}
        e.update(extra)
        return e

    records = [
        {"seq": 1, "message": env(1)},
        {"seq": 2, "message": env(2)},
        {"seq": 3, "message": env(3, kind="request", rootId="r3", status="leased",
                                 attempts=2, leaseUntil=int(START * 1000) + 9000,
                                 leaseId="L3")},
        # the reference rewrites its file: a later snapshot of an id replaces the earlier
        {"seq": 2, "message": env(2, status="done")},
    ]
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    store = open_jsonl(tmp_path)
    try:
        r1, r2, r3 = (store.records.by_id[f"r{i}"] for i in (1, 2, 3))
        assert (r1.status, r1.attempts, r1.kind, r1.ack, r1.lease_until) == (
            QUEUED, 0, "message", True, None)
        assert r1.created == 1712344478.0
        assert r2.status == DONE
        assert (r3.status, r3.attempts, r3.lease_id, r3.root_id) == (LEASED, 2, "L3", "r3")
        assert store.records.next_seq == 4
        result = await ack(store, "r3", "beta", "L3", "completed", None, START, RULES)
        assert result["status"] == DONE
        (m,) = await store.pull("beta", 5, LEASE, START, RULES)
        assert m.id == "r1"
    finally:
        await store.close()


async def churn(store, rounds: int) -> None:
    """Messages that come and go: many records, few live messages."""
    for r in range(rounds):
        await store.register("delta", START + r)
        await store.add(new_message("alpha", "delta", START, id=f"c{r}", body={"text": MARKER}),
                        RULES)
        (m,) = await store.pull("delta", 1, LEASE, START, RULES)
        outcome = "completed" if r % 3 else "retry"
        await ack(store, m.id, "delta", m.lease_id, outcome, None, START,
                  make_rules(max_attempts=0))


@pytest_twisted.ensureDeferred
async def test_compaction_keeps_everything(tmp_path):
    store = open_jsonl(tmp_path)
    try:
        await store.register("gamma", START)
        await fill(store, 5)
        # removes beta0 (created START)
        assert await store.sweep_expired(START + 1, START + 1, RULES) == 1
        await store.pull("beta", 2, LEASE, START, RULES)
        await store.sweep_leases(START + LEASE, RULES)  # beta1, beta2 get recovery marks
        leased = await store.pull("beta", 1, LEASE * 100, START + LEASE, RULES)  # beta1 again
        await churn(store, 50)
        before = await snapshot(store)
        assert len(lines(tmp_path)) > 150

        await store.compact()
        assert store.compactions == 1
        live = len(before["messages"]) + len(before["peers"]) + len(before["events"])
        assert len(lines(tmp_path)) == live + 2  # + the next-seq and event-marks records
        assert not os.path.exists(tmp_path / "messages.jsonl.compact")
        assert await snapshot(store) == before
        await store.add(new_message("alpha", "beta", START, id="after"), RULES)
    finally:
        await store.close()
    store = open_jsonl(tmp_path)
    try:
        after = await snapshot(store)
        assert after["messages"].pop("after")[0] == before["next_seq"]
        after["next_seq"] -= 1
        assert after.pop("events")[:-1] == before.pop("events")  # + the event of "after"
        assert after.pop("event_marks")[1] == before.pop("event_marks")[1] + 1
        assert after == before
        assert "beta0" not in store.records.by_id
        assert store.records.by_id["beta2"].recovery is True
        result = await ack(store, leased[0].id, "beta", leased[0].lease_id, "completed", None,
                           START + LEASE, RULES)
        assert result["status"] == DONE
        assert store.records.by_id["c0"].status == FAILED
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_writes_during_compaction_reach_the_new_file(tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "COMPACT_CHUNK", 7)
    store = open_jsonl(tmp_path)
    try:
        await fill(store, 60)
        await churn(store, 20)
        done = store.compact()
        compaction = store.compaction
        # requests keep coming while the chunks are written, one per reactor turn
        await store.sweep_expired(START + 2, START + 2, RULES)
        i = 0
        while not done.called:
            await store.add(new_message("alpha", "gamma", START, id=f"during{i}"), RULES)
            for m in await store.pull("beta", 1, LEASE, START, RULES):
                await ack(store, m.id, "beta", m.lease_id, "completed", None, START, RULES)
            i += 1
        await done
        assert i >= 3 and compaction.tail_records >= i, "the writes overlapped the compaction"
        before = await snapshot(store)
    finally:
        await store.close()
    store = open_jsonl(tmp_path)
    try:
        assert await snapshot(store) == before
        assert store.records.by_id[f"during{i - 1}"].status == QUEUED
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_crash_during_compaction_loses_nothing(tmp_path):
    store = open_jsonl(tmp_path)
    await fill(store, 30)
    await churn(store, 10)
    compaction = store._start_compaction()
    compaction.call.cancel()
    compaction.step()  # part of the new file is written, then the process dies
    compaction.file.flush()
    await store.add(new_message("alpha", "beta", START, id="late"), RULES)
    before = await snapshot(store)
    assert os.path.exists(tmp_path / "messages.jsonl.compact")

    reopened = open_jsonl(tmp_path)  # the crashed process's files are simply abandoned
    try:
        assert await snapshot(reopened) == before
        assert not os.path.exists(tmp_path / "messages.jsonl.compact")
    finally:
        await reopened.close()
        compaction.file.close()
        store.file.close()


@pytest_twisted.ensureDeferred
async def test_no_rewrite_per_operation(tmp_path):
    store = open_jsonl(tmp_path)
    try:
        inode = os.stat(tmp_path / "messages.jsonl").st_ino
        size = 0
        for r in range(40):
            await churn_one(store, r)
            now_size = os.stat(tmp_path / "messages.jsonl").st_size
            assert now_size > size, "every operation appends"
            size = now_size
        assert os.stat(tmp_path / "messages.jsonl").st_ino == inode
        assert store.compactions == 0, "below compact_min_records nothing is rewritten"

        store.compact_min_records = 100
        for r in range(40, 640):
            await churn_one(store, r)
            if r % 10 == 0:  # events past retention leave, as messages do
                await store.trim_events(START + 1)
        await drain(store)
        # compaction is amortised: at most one per compact_min_records appended records
        assert 1 <= store.compactions <= (600 * 4) // 100
        assert len(lines(tmp_path)) == store.log_records <= 2 * store.records.live_records() + 3
    finally:
        await store.close()


async def churn_one(store, r: int) -> None:
    await store.add(new_message("alpha", "beta", START, id=f"n{r}"), RULES)
    (m,) = await store.pull("beta", 1, LEASE, START, RULES)
    await ack(store, m.id, "beta", m.lease_id, "completed", None, START, RULES)


async def drain(store) -> None:
    if store.compaction is not None:
        await store.compact()


@pytest_twisted.ensureDeferred
async def test_one_fsync_per_turn_under_sync_full(tmp_path, monkeypatch):
    store = open_jsonl(tmp_path, sync="full")
    synced: List[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    try:
        ds = [store.add(new_message("alpha", "beta", START, id=f"f{i}"), RULES) for i in range(25)]
        assert not any(d.called for d in ds)
        for d in ds:
            assert await d is True
        assert synced == [store.file.fileno()]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_sync_normal_writes_before_the_result_without_fsync(tmp_path, monkeypatch):
    store = open_jsonl(tmp_path)
    synced: List[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    try:
        d = store.add(new_message("alpha", "beta", START, id="w"), RULES)
        assert len(lines(tmp_path)) == 0
        await d
        assert len(lines(tmp_path)) == 2 and synced == []  # the message and its event
    finally:
        await store.close()


def test_group_commit_failure_fails_the_held_results_and_retries():
    clock = Clock()
    attempts: List[int] = []

    def commit():
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError(28, "No space left on device")

    commits = GroupCommit(clock, commit, "test")

    def write(n):
        commits.touch()
        return n

    ds = [commits.run(write, n) for n in range(3)]
    assert not any(d.called for d in ds)
    clock.advance(0)
    for d in ds:
        assert d.result.check(OSError)
        d.addErrback(lambda f: None)
    later = commits.run(lambda: "read")
    assert not later.called, "nothing is revealed until the retried commit succeeds"
    clock.advance(1)
    assert later.result == "read" and len(attempts) == 2
    assert commits.run(lambda: 5).result == 5, "reads on a committed state answer at once"


def test_a_failing_commit_is_the_stores_health_until_one_succeeds():
    """What GET /healthz of the ops listener reports (503 while commits fail)."""
    clock = Clock()
    attempts = []
    timings = []

    def commit():
        attempts.append(clock.seconds())
        clock.advance(0.25)  # the commit takes a quarter of a second
        if len(attempts) == 1:
            raise OSError(28, "No space left on device")

    commits = GroupCommit(clock, commit, "test")
    commits.observers.append(timings.append)
    assert commits.failure is None
    commits.touch()
    d = commits.run(lambda: None)
    clock.advance(0)
    d.addErrback(lambda f: None)
    assert commits.failure == "commits are failing: OSError: [Errno 28] No space left on device"
    clock.advance(1)
    assert commits.failure is None and timings == [0.25, 0.25]


@pytest_twisted.ensureDeferred
async def test_commits_are_timed(tmp_path):
    store = open_jsonl(tmp_path)
    timings = []
    store.observe_commits(timings.append)
    await store.add(new_message("alpha", "beta", START), RULES)
    await store.close()
    assert len(timings) >= 1


class FullDisk:
    """The log's file on a disk that fills up: the first write stores ``room`` bytes,
    every later one fails with ENOSPC (a full disk) until ``freed``."""

    def __init__(self, real, room: int) -> None:
        self.real = real
        self.room = room
        self.full = True

    def write(self, data) -> int:
        if not self.full:
            return self.real.write(data)
        if self.room:
            written = self.real.write(bytes(data[: self.room]))
            self.room = 0
            return written
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


async def refused(d) -> Exception:
    try:
        await d
    except OSError as e:
        return e
    raise AssertionError("the write was expected to fail")


@pytest_twisted.ensureDeferred
async def test_a_failed_write_leaves_exactly_what_was_acknowledged(tmp_path):
    store = open_jsonl(tmp_path)
    try:
        await fill(store, 3)
        await store.register("beta", START)
        acknowledged = (tmp_path / "messages.jsonl").read_bytes()
        disk = store.file = FullDisk(store.file, room=30)  # a torn line, then nothing
        refusals = [await refused(store.add(new_message("alpha", "beta", START, id=f"lost{i}",
                                                        body={"text": MARKER}), RULES))
                    for i in range(3)]
        refusals.append(await refused(store.pull("beta", 1, LEASE, START, RULES)))
        assert all(e.errno == errno.ENOSPC for e in refusals)
        assert (tmp_path / "messages.jsonl").read_bytes() == acknowledged, (
            "no refused record, no torn line")
        assert sorted(store.records.by_id) == ["beta0", "beta1", "beta2"]
        (found,) = [m for m in store.records.by_id.values() if m.id == "beta0"]
        assert found.status == QUEUED, "the refused pull left nothing behind in memory"
        disk.full = False
        # A refused send sent again is new, not a duplicate of something never stored.
        assert await store.add(new_message("alpha", "beta", START, id="lost0"), RULES) is True
        assert [m.id for m in await store.pull("beta", 1, LEASE, START, RULES)] == ["beta0"]
    finally:
        await store.close()
    store = open_jsonl(tmp_path)
    try:
        assert sorted(store.records.by_id) == ["beta0", "beta1", "beta2", "lost0"]
        assert store.records.by_id["beta0"].status == LEASED
        assert all(json.loads(line) for line in lines(tmp_path))
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_torn_last_line_is_cut_off_at_start(tmp_path):
    store = open_jsonl(tmp_path)
    await fill(store, 2)
    await store.close()
    path = tmp_path / "messages.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"seq":3,"message":{"id":"torn"')
    store = open_jsonl(tmp_path)
    try:
        assert path.read_bytes() == whole
        await fill(store, 1, to="gamma")
    finally:
        await store.close()
    assert all(json.loads(line) for line in lines(tmp_path))


@pytest_twisted.ensureDeferred
async def test_a_log_of_an_earlier_broker_loads_without_completion_times(tmp_path):
    """Snapshots and state records as a broker before completion times wrote them: no
    ``completedAt``, state records without ``expiresAtTime``. A message keeps the
    TTL of its snapshot, and has no completion time until it completes."""
    envelope = {"id": "old", "from": "alpha", "to": "beta", "ts": "2024-04-05T19:14:38.000Z",
                "type": "message", "body": {"text": "x"}, "replyTo": None, "ack": False,
                "kind": "request", "rootId": None, "parentId": None, "status": "queued",
                "attempts": 0, "leaseUntil": None, "leaseId": None, "created": START,
                "expiresAtTime": START + 600}
    state = {"op": "state", "id": "old", "status": "done", "attempts": 0, "leaseUntil": None,
             "leaseId": None, "error": None, "recovery": False, "deliveries": 1,
             "notBeforeTime": None, "deadReason": None}
    queued = dict(envelope, id="waiting")
    (tmp_path / "messages.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"seq": 1, "message": envelope}, state, {"seq": 2, "message": queued})) + "\n")
    store = open_jsonl(tmp_path)
    try:
        old = await store.find("old", START)
        assert (old.status, old.completed_at, old.expires_at) == (DONE, None, START + 600)
        (m,) = await store.pull("beta", 1, LEASE, START, RULES)
        await ack(store, "waiting", "beta", m.lease_id, "completed", None, START + 2, RULES)
    finally:
        await store.close()
    states = [r for r in map(json.loads, lines(tmp_path)) if r.get("op") == "state"]
    assert states[-1]["completedAt"] == START + 2
    store = open_jsonl(tmp_path)
    try:
        assert (await store.find("waiting", START + 3)).completed_at == START + 2
    finally:
        await store.close()
