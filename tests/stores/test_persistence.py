"""Restart tests for the persistent backends: close, reopen on the same directory, compare."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import pytest_twisted

from relay.rules import delivery
from relay.store.jsonl import snapshot_record
from relay.testing import RULES, START, ack, make_rules, new_message
from relay.wire.errors import RelayError
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED
from tests.conftest import open_backend

LEASE = 60


@pytest.fixture(params=("sqlite", "jsonl"))
def persistent(request) -> str:
    return request.param


async def everything(store, agents=("alpha", "beta", "gamma")) -> Dict[str, Any]:
    """Every stored message (all fields, lease ids included) and the peers."""
    messages = {}
    for agent in agents:
        for m in await store.query(agent, 200, {"box": "all"}, START, RULES):
            messages[m.id] = (m.seq, snapshot_record(m)["message"], m.created, m.recovery)
    return {"messages": messages, "peers": await store.peers()}


async def populate(store) -> Dict[str, str]:
    """A store with every kind of state; returns the lease ids still live."""
    await store.register("beta", START)
    await store.register("alpha", START + 1)
    await store.register("gamma", START + 2)
    for i in range(8):
        m = new_message("alpha", "beta", START + i, id=f"m{i}", body={"n": i, "text": "hé"},
                        kind="request" if i % 2 else "message", rootId=f"r{i}")
        assert await store.add(m, RULES) is True
    assert await store.add(new_message("beta", "alpha", START, id="back", kind="reply",
                                       parentId="m1"), RULES) is True
    for i in range(2):
        assert await store.add(new_message("alpha", "gamma", START, id=f"g{i}"), RULES) is True
    # m0 done; m1 retried (queued, attempts 1); m2 failed (attempts 1 > maxAttempts 0)
    leased = {m.id: m.lease_id for m in await store.pull("beta", 3, LEASE, START, RULES)}
    assert sorted(leased) == ["m0", "m1", "m2"]
    await ack(store, "m0", "beta", leased["m0"], "completed", None, START, RULES)
    await ack(store, "m1", "beta", leased["m1"], "retry", "busy", START, RULES)
    await ack(store, "m2", "beta", leased["m2"], "retry", "e2", START, make_rules(max_attempts=0))
    # a v1.0 cursor past every queued message; then m1 leased and expired -> recovery mark
    _, cursor = await store.poll("beta", None, 50, START, RULES)
    assert [m.id for m in await store.pull("beta", 1, LEASE, START, RULES)] == ["m1"]
    assert await store.sweep_leases(START + LEASE + 1, RULES) == 1
    assert (await store.find("m1", START)).recovery is True
    # live leases, valid for long after the restart
    leased = await store.pull("gamma", 2, LEASE * 10, START + LEASE, RULES)
    live = {m.id: m.lease_id for m in leased}
    return {"cursor": cursor, **live}


@pytest_twisted.ensureDeferred
async def test_restart_keeps_everything(persistent, tmp_path):
    store = open_backend(persistent, tmp_path)
    await populate(store)
    before = await everything(store)
    await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        after = await everything(store)
        assert after == before
        statuses = {k: v[1]["status"] for k, v in after["messages"].items()}
        assert statuses["m0"] == DONE and statuses["m2"] == FAILED
        assert statuses["m1"] == QUEUED and after["messages"]["m1"][1]["attempts"] == 1
        assert after["messages"]["m1"][3] is True, "the recovery mark survives"
        assert after["messages"]["m2"][1]["error"] == "e2"
        assert {k for k, s in statuses.items() if s == LEASED} == {"g0", "g1"}
        assert after["messages"]["g0"][1]["leaseId"]
    finally:
        await store.close()


async def recounted(store) -> Dict[str, Any]:
    """Each agent's pending messages and their stored bytes, counted from the messages."""
    usage = {}
    for agent in ("alpha", "beta", "gamma"):
        pending = [m for m in await store.query(agent, 200, {}, START, RULES)
                   if m.status in delivery.PENDING]
        usage[agent] = (len(pending), sum(m.stored_bytes() for m in pending))
    return usage


@pytest_twisted.ensureDeferred
async def test_restart_keeps_the_quota_counters(persistent, tmp_path):
    store = open_backend(persistent, tmp_path)
    await populate(store)
    expected = await recounted(store)
    assert expected["beta"][0] == 6 and expected["gamma"][0] == 2
    await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        assert {a: store.records.usage(a) for a in expected} == expected
        full = make_rules(inbox_max_messages=expected["beta"][0])
        with pytest.raises(RelayError) as refused:
            await store.add(new_message("alpha", "beta", START, id="over"), full)
        assert refused.value.code == "inbox_full"
        assert await store.sweep_expired(START + 3, START + 3, RULES) > 0
        assert {a: store.records.usage(a) for a in expected} == await recounted(store)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_restart_keeps_leases_dedup_recovery_and_order(persistent, tmp_path):
    store = open_backend(persistent, tmp_path)
    state = await populate(store)
    await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        now = START + LEASE + 3
        # dedup survives
        assert await store.add(new_message("alpha", "beta", now, id="m0"), RULES) is False
        # a live lease survives with its id and deadline
        result = await ack(store, "g0", "gamma", state["g0"], "completed", None, now, RULES)
        assert result["status"] == DONE
        # the recovery delivery happens once, after the restart
        messages, _ = await store.poll("beta", state["cursor"], 50, now, RULES)
        assert [m.id for m in messages] == ["m1"]
        messages, _ = await store.poll("beta", state["cursor"], 50, now, RULES)
        assert messages == []
        # order continues: a new message sorts after every old one
        fresh = new_message("alpha", "beta", now, id="new")
        assert await store.add(fresh, RULES) is True
        seqs = [m.seq for m in await store.recent("beta", 200, START, RULES)]
        assert seqs == sorted(seqs, reverse=True) and seqs[0] == fresh.seq
        assert await store.is_registered("gamma") is True
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_seq_never_goes_back_after_expiry(persistent, tmp_path):
    store = open_backend(persistent, tmp_path)
    for i in range(3):
        await store.add(new_message("alpha", "beta", START, id=f"old{i}"), RULES)
    last = (await store.find("old2", START)).seq
    assert await store.sweep_expired(START + 1, START + 1, RULES) == 3
    await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        assert await store.find("old0", START) is None
        m = new_message("alpha", "beta", START + 2, id="young")
        await store.add(m, RULES)
        assert m.seq > last
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_state_changed_after_restart_survives_another(persistent, tmp_path):
    store = open_backend(persistent, tmp_path)
    await store.add(new_message("alpha", "beta", START, id="a"), RULES)
    await store.close()
    for step in range(3):
        store = open_backend(persistent, tmp_path)
        (m,) = await store.pull("beta", 1, LEASE, START + step * LEASE * 2, RULES)
        await ack(store, "a", "beta", m.lease_id, "retry", f"e{step}", START,
                  make_rules(max_attempts=5))
        await store.close()
    store = open_backend(persistent, tmp_path)
    try:
        found = await store.find("a", START)
        assert (found.status, found.attempts, found.error) == (QUEUED, 3, "e2")
    finally:
        await store.close()


async def populate_v12(store) -> Dict[str, Any]:
    """Every kind of v1.2 state: deliveries, a renewed lease, retry-after, a delay, a TTL,
    dead letters with their reasons, a failure notice, an atomic reply, cards."""
    await store.register("beta", START, {"description": "worker", "skills": ["a", "b"]})
    await store.register("alpha", START)
    for i in range(6):
        assert await store.add(new_message("alpha", "beta", START, id=f"x{i}",
                                           kind="request"), RULES) is True
    assert await store.add(new_message("alpha", "beta", START, id="delayed",
                                       delay_seconds=3600), RULES) is True
    assert await store.add(new_message("alpha", "beta", START, id="brief",
                                       ttl_seconds=7200), RULES) is True
    leased = {m.id: m for m in await store.pull("beta", 6, LEASE, START, RULES)}
    renewed = await store.settle("x0", delivery.renew("beta", leased["x0"].lease_id, 86400),
                                 START, RULES)
    await ack(store, "x1", "beta", leased["x1"].lease_id, "reject", "poison", START, RULES)
    await store.settle("x2", delivery.ack("beta", leased["x2"].lease_id, "retry", "later",
                                          RULES, 600), START, RULES)
    await store.settle("x3", delivery.cancel("alpha", "not needed"), START, RULES)
    reply = {"id": "answer", "body": {"text": "ok"}, "kind": "reply", "ack": False}
    await store.settle("x4", delivery.ack("beta", leased["x4"].lease_id, "completed", None,
                                          RULES, reply=reply), START, RULES)
    return {"x0": (leased["x0"].lease_id, renewed["leaseUntil"])}


@pytest_twisted.ensureDeferred
async def test_restart_keeps_every_v12_field(persistent, tmp_path):
    store = open_backend(persistent, tmp_path)
    state = await populate_v12(store)
    before = await everything(store)
    statuses_before = await store.status(list(before["messages"]), "alpha", START, RULES)
    await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        after = await everything(store)
        assert after == before
        assert await store.status(list(before["messages"]), "alpha", START,
                                  RULES) == statuses_before
        assert after["peers"][1] == ("beta", int(START),
                                     {"description": "worker", "skills": ["a", "b"]})
        x = {k: v[1] for k, v in after["messages"].items()}
        assert (x["x0"]["leaseId"], x["x0"]["leaseUntil"]) == state["x0"], "renewed deadline"
        assert (x["x1"]["status"], x["x1"]["deadReason"]) == (FAILED, "rejected")
        assert (x["x2"]["status"], x["x2"]["notBeforeTime"]) == (QUEUED, START + 600)
        assert (x["x3"]["deadReason"], x["x3"]["error"]) == ("cancelled", "not needed")
        assert x["x4"]["status"] == DONE and x["answer"]["parentId"] == "x4"
        assert x["delayed"]["delayUntilTime"] == START + 3600
        assert x["brief"]["expiresAtTime"] == START + 7200
        assert all(x[f"x{i}"]["deliveries"] == 1 for i in range(5))
        assert delivery.notice_id("x1") in x, "the notice was stored with the failure"
        # and they still act: the renewed lease acks, the delay holds, the notice is once
        assert (await ack(store, "x0", "beta", state["x0"][0], "completed", None,
                          START + 3000, RULES))["status"] == DONE
        assert [m.id for m in await store.pull("beta", 10, LEASE, START + 3000, RULES)] == [
            "x2", "x5", "brief"]
        await store.settle("x1", delivery.requeue("alpha"), START, RULES)
        (m,) = await store.pull("beta", 1, LEASE, START + 3000, RULES)
        await ack(store, "x1", "beta", m.lease_id, "reject", None, START + 3000, RULES)
        notices = await store.query("alpha", 50, {"kind": "reply", "from": "beta"},
                                    START + 3000, RULES)
        assert [n.id for n in notices].count(delivery.notice_id("x1")) == 1
    finally:
        await store.close()


async def every_event(store, agents=("alpha", "beta", "gamma")) -> Dict[str, Any]:
    out = {}
    for agent in agents:
        page = await store.events(agent, 0, 1000)
        out[agent] = (page.reset, list(page.events))
    return out


@pytest_twisted.ensureDeferred
async def test_restart_keeps_the_events_their_order_and_the_retention_floor(persistent,
                                                                           tmp_path):
    store = open_backend(persistent, tmp_path)
    await populate(store)
    before = await every_event(store)
    assert before["beta"][1] and before["alpha"][1]
    last = max(e.id for _, events in before.values() for e in events)
    await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        assert await every_event(store) == before
        await store.put_webhook("beta", '{"acked":2,"url":"http://127.0.0.1:1/"}')
        await store.add(new_message("alpha", "beta", START + 50, id="after"), RULES)
        (newest,) = (await store.events("beta", last, 10)).events
        assert newest.id > last, "event ids never go back"
        trimmed = await store.trim_events(START + 40)
        assert trimmed > 0
    finally:
        await store.close()

    store = open_backend(persistent, tmp_path)
    try:
        page = await store.events("beta", 0, 10)
        assert page.reset is not None, "the retention floor survives a restart"
        assert await store.webhook_states() == {
            "beta": '{"acked":2,"url":"http://127.0.0.1:1/"}'}
        assert [e.id for e in (await store.events("beta", newest.id - 1, 10)).events] == [
            newest.id]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_delay_that_ended_while_down_is_released_once_after_restarts(persistent,
                                                                          tmp_path):
    store = open_backend(persistent, tmp_path)
    await store.add(new_message("alpha", "beta", START, delay_seconds=30, id="held"), RULES)
    await store.close()
    store = open_backend(persistent, tmp_path)
    try:
        assert (await store.events("beta", 0, 10)).events == []
        assert await store.release_due(START + 31) == 1
        (event,) = (await store.events("beta", 0, 10)).events
        assert event.type == "message" and "held" in event.data
    finally:
        await store.close()
    store = open_backend(persistent, tmp_path)
    try:
        assert await store.release_due(START + 32) == 0
        assert len((await store.events("beta", 0, 10)).events) == 1
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_what_retention_kept_to_resume_an_agent_survives_restarts(persistent,
                                                                       tmp_path):
    store = open_backend(persistent, tmp_path)
    await store.add(new_message("alpha", "beta", START, id="b1"), RULES)
    (b1,) = (await store.events("beta", 0, 10)).events
    for i in range(3):
        await store.add(new_message("alpha", "gamma", START + 1, id=f"g{i}"), RULES)
    assert await store.trim_events(START + 40) == 4
    await store.close()
    for _ in range(2):  # a restart, then (jsonl) one after a compaction
        store = open_backend(persistent, tmp_path)
        try:
            page = await store.events("beta", b1.id, 10)
            assert page.reset is None, "beta lost nothing after b1"
            assert (await store.events("beta", b1.id - 1, 10)).reset is not None
            if persistent == "jsonl":
                await store.compact()
        finally:
            await store.close()


@pytest_twisted.ensureDeferred
async def test_restart_keeps_completion_times_and_the_expired_v2_messages(persistent,
                                                                           tmp_path):
    from relay.rules.v2 import transitions
    from relay.wire.protocol import EXPIRED
    from relay.wire.v2 import views

    def v2_message(message_id: str) -> delivery.Message:
        return delivery.Message(id=message_id, sender="alpha", to="beta", created=START,
                                body_json='{"executionMode":"read","text":"x"}',
                                kind="request", expires_at=START + 60,
                                v2=views.v2_meta("read", "", False))

    later = START + 61
    store = open_backend(persistent, tmp_path)
    for message_id in ("v2-done", "v2-expired", "v2-revived"):
        assert await store.add(v2_message(message_id), RULES) is True
    assert await store.add(new_message("alpha", "beta", START, id="seed-failed"), RULES)
    leased = {m.id: m for m in await store.pull("beta", 4, LEASE, START, RULES)}
    await ack(store, "v2-done", "beta", leased["v2-done"].lease_id, "completed", None,
              START + 1.25, RULES)
    for message_id in ("v2-expired", "v2-revived"):
        await ack(store, message_id, "beta", leased[message_id].lease_id, "release", None,
                  START + 2, RULES)
    await ack(store, "seed-failed", "beta", leased["seed-failed"].lease_id, "reject", None,
              START + 3, RULES)
    assert await store.sweep_expired(START - 1, later, RULES) == 2
    await store.settle("v2-revived", transitions.requeue("beta"), later, RULES)
    before = {m: await store.find(m, later, True) for m in
              ("v2-done", "v2-expired", "v2-revived", "seed-failed")}
    await store.close()

    for _ in range(2):  # and after a change made after the first restart
        store = open_backend(persistent, tmp_path)
        try:
            after = {m: await store.find(m, later, True) for m in before}
            for message_id, message in before.items():
                kept = after[message_id]
                assert (kept.status, kept.completed_at, kept.expires_at, kept.seq) == (
                    message.status, message.completed_at, message.expires_at,
                    message.seq), message_id
            assert after["v2-done"].completed_at == START + 1.25
            assert after["seed-failed"].completed_at == START + 3
            assert (after["v2-expired"].status, after["v2-expired"].completed_at) == (
                EXPIRED, None)
            assert after["v2-revived"].expires_at == later + 60
            assert await store.sweep_expired(START - 1, later, RULES) == 0
            if before["v2-revived"].status == QUEUED:
                (m,) = await store.pull("beta", 1, LEASE, later, RULES)
                await store.settle(m.id, transitions.ack("beta", m.lease_id, "completed",
                                                         None, RULES), later + 1, RULES)
                before["v2-revived"] = await store.find("v2-revived", later + 1)
                assert before["v2-revived"].completed_at == later + 1
        finally:
            await store.close()
