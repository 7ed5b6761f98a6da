""":class:`StoreContract`: the behaviour every storage backend must show (spec §4,
§5.1). A third-party backend proves itself by running it against its own store
fixture."""

from __future__ import annotations

from typing import List

import pytest_twisted
from twisted.internet.defer import Deferred

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing.contract import RULES, Contract, Recorder, ack, refusal
from relay.testing.harness import START, make_rules, new_message
from relay.wire import errors
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED


class StoreContract(Contract):
    """Behaviour tests for an IMessageStore; needs a ``store`` fixture.

    Every test drives time explicitly (``now``), never sleeps.
    """

    LEASE = 60

    async def send(self, store, sender="alpha", to="beta", now=START, **fields) -> Message:
        message = new_message(sender, to, now, **fields)
        assert await store.add(message, RULES) is True
        return message

    def test_provides_the_interface(self, store):
        from zope.interface.verify import verifyObject

        from relay.store.interface import IMessageStore

        assert verifyObject(IMessageStore, store)

    # -- add, dedup, find ------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_add_then_find(self, store):
        sent = await self.send(store, body={"text": "hi", "n": [1, 2]}, kind="request",
                               rootId="r1", replyTo="x")
        found = await store.find(sent.id, START)
        assert found.envelope() == {
            "id": sent.id, "from": "alpha", "to": "beta", "ts": sent.ts, "type": "message",
            "body": {"text": "hi", "n": [1, 2]}, "replyTo": "x", "ack": False,
            "kind": "request", "rootId": "r1", "parentId": None, "status": QUEUED,
            "attempts": 0, "leaseUntil": None,
        }
        assert await store.find("nope", START) is None

    @pytest_twisted.ensureDeferred
    async def test_duplicate_id_is_not_stored_twice(self, store):
        sent = await self.send(store, id="same")
        again = new_message("alpha", "beta", START + 1, id="same", body={"text": "other"})
        assert await store.add(again, RULES) is False
        assert (await store.find("same", START)).body == sent.body
        messages, _ = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["same"]

    @pytest_twisted.ensureDeferred
    async def test_any_string_is_an_id(self, store):
        for message_id in ("plain", "with space", "sl/ash", "ünï", "x" * 300):
            await self.send(store, id=message_id)
            assert (await store.find(message_id, START)).id == message_id

    @pytest_twisted.ensureDeferred
    async def test_returned_messages_are_copies(self, store):
        sent = await self.send(store, id="m", body={"text": "kept", "list": [1]})
        sent.status, sent.body["text"] = DONE, "changed after add"
        views = [await store.find("m", START), (await store.recent("beta", 1, START, RULES))[0],
                 (await store.query("beta", 1, {}, START, RULES))[0],
                 (await store.poll("beta", None, 1, START, RULES))[0][0]]
        for view in views:
            view.status, view.attempts, view.lease_id = DONE, 9, "forged"
            view.body["text"] = "changed"
            view.body["list"].append(2)
        (leased,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert leased.body == {"text": "kept", "list": [1]} and leased.attempts == 0
        leased.status, leased.lease_id = QUEUED, "forged"
        leased.body["text"] = "changed"
        found = await store.find("m", START)
        assert found.status == LEASED and found.lease_id not in (None, "forged")
        assert found.body == {"text": "kept", "list": [1]}
        assert await store.pull("beta", 1, self.LEASE, START, RULES) == []

    # -- v1.0 poll ---------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_poll_cursor(self, store):
        ids = [(await self.send(store, id=f"m{i}")).id for i in range(5)]
        await self.send(store, to="gamma", id="other")
        messages, cursor = await store.poll("beta", None, 2, START, RULES)
        assert [m.id for m in messages] == ids[:2] and cursor == ids[1]
        messages, cursor = await store.poll("beta", cursor, 50, START, RULES)
        assert [m.id for m in messages] == ids[2:] and cursor == ids[4]
        messages, cursor = await store.poll("beta", cursor, 50, START, RULES)
        assert messages == [] and cursor == ids[4]
        messages, cursor = await store.poll("beta", "unknown", 50, START, RULES)
        assert [m.id for m in messages] == ids
        messages, cursor = await store.poll("nobody", None, 50, START, RULES)
        assert messages == [] and cursor is None

    @pytest_twisted.ensureDeferred
    async def test_poll_returns_only_queued(self, store):
        a = await self.send(store, id="a")
        b = await self.send(store, id="b")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == [b.id] and cursor == b.id
        assert (await store.find(a.id, START)).status == LEASED

    @pytest_twisted.ensureDeferred
    async def test_recovery_delivery_after_lease_expiry(self, store):
        a = await self.send(store, id="a")
        b = await self.send(store, id="b")
        leased = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert [m.id for m in leased] == ["a"]
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["b"] and cursor == "b"
        assert await store.sweep_leases(START + self.LEASE + 1, RULES) == 1
        messages, cursor2 = await store.poll("beta", cursor, 50, START + self.LEASE + 1, RULES)
        assert [m.id for m in messages] == [a.id]
        assert cursor2 == b.id, "the cursor never moves backwards"
        messages, _ = await store.poll("beta", cursor2, 50, START + self.LEASE + 2, RULES)
        assert messages == [], "a recovery delivery happens once"

    @pytest_twisted.ensureDeferred
    async def test_recovery_without_sweep(self, store):
        await self.send(store, id="a")
        await self.send(store, id="b")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        _, cursor = await store.poll("beta", None, 50, START, RULES)
        messages, _ = await store.poll("beta", cursor, 50, START + self.LEASE + 1, RULES)
        assert [m.id for m in messages] == ["a"]

    @pytest_twisted.ensureDeferred
    async def test_recovery_deliveries_count_against_the_limit(self, store):
        for i in range(3):
            await self.send(store, id=f"r{i}")
        await self.send(store, id="after")
        await store.pull("beta", 3, self.LEASE, START, RULES)
        _, cursor = await store.poll("beta", None, 50, START, RULES)
        later = START + self.LEASE
        messages, cursor = await store.poll("beta", cursor, 2, later, RULES)
        assert [m.id for m in messages] == ["r0", "r1"] and cursor == "after"
        messages, cursor = await store.poll("beta", cursor, 2, later, RULES)
        assert [m.id for m in messages] == ["r2"] and cursor == "after"

    # -- pull and settle --------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_pull_leases_oldest_first(self, store):
        ids = [(await self.send(store, id=f"m{i}")).id for i in range(3)]
        await self.send(store, to="gamma")
        leased = await store.pull("beta", 2, self.LEASE, START, RULES)
        assert [m.id for m in leased] == ids[:2]
        for m in leased:
            assert m.status == LEASED and m.lease_id
            assert m.lease_until == int(START * 1000) + self.LEASE * 1000
            assert m.envelope("beta")["leaseId"] == m.lease_id
        assert leased[0].lease_id != leased[1].lease_id
        rest = await store.pull("beta", 10, self.LEASE, START, RULES)
        assert [m.id for m in rest] == ids[2:]
        assert await store.pull("beta", 10, self.LEASE, START, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_ack_completed(self, store):
        sent = await self.send(store)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        result = await ack(store, sent.id, "beta", m.lease_id, "completed", None, START)
        assert result == {"ok": True, "status": DONE, "attempts": 0}
        assert (await store.find(sent.id, START)).status == DONE
        assert await store.pull("beta", 10, self.LEASE, START + 10**6, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_retry_then_failed(self, store):
        sent = await self.send(store)
        for attempt in range(1, 5):
            (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
            result = await ack(store, sent.id, "beta", m.lease_id, "retry", f"e{attempt}", START)
            assert result["attempts"] == attempt
            assert result["status"] == (FAILED if attempt == 4 else QUEUED)
        found = await store.find(sent.id, START)
        assert found.status == FAILED and found.error == "e4" and found.attempts == 4
        assert await store.pull("beta", 1, self.LEASE, START, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_ack_errors(self, store):
        sent = await self.send(store)
        e = await refusal(ack(store, "nope", "beta", "l", "completed", None, START))
        assert (e.status, e.code) == (404, "no_such_message")
        e = await refusal(ack(store, sent.id, "beta", "l", "completed", None, START))
        assert (e.status, e.code) == (409, "not_leased")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        e = await refusal(ack(store, sent.id, "gamma", m.lease_id, "completed", None, START))
        assert (e.status, e.code) == (403, "forbidden")
        e = await refusal(ack(store, sent.id, "beta", "wrong", "completed", None, START))
        assert (e.status, e.code) == (409, "lease_mismatch")
        assert (await store.find(sent.id, START)).status == LEASED

    @pytest_twisted.ensureDeferred
    async def test_expired_lease_is_dead(self, store):
        sent = await self.send(store)
        (leased,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        old = leased.lease_id
        later = START + self.LEASE
        e = await refusal(ack(store, sent.id, "beta", old, "completed", None, later))
        assert e.code == "not_leased"
        found = await store.find(sent.id, START)
        assert found.status == QUEUED, "the refused ack persisted the lapsed lease"
        assert found.lease_id is None and found.lease_until is None
        (leased,) = await store.pull("beta", 1, self.LEASE, later, RULES)
        new = leased.lease_id
        assert new != old
        e = await refusal(ack(store, sent.id, "beta", old, "completed", None, later))
        assert e.code == "lease_mismatch"
        result = await ack(store, sent.id, "beta", new, "completed", None, later)
        assert result["status"] == DONE

    @pytest_twisted.ensureDeferred
    async def test_pull_releases_expired_leases_first(self, store):
        sent = await self.send(store)
        await store.pull("beta", 1, self.LEASE, START, RULES)
        assert await store.pull("beta", 1, self.LEASE, START + self.LEASE - 1, RULES) == []
        (again,) = await store.pull("beta", 1, self.LEASE, START + self.LEASE, RULES)
        assert again.id == sent.id and again.attempts == 0

    @pytest_twisted.ensureDeferred
    async def test_terminal_states_never_change(self, store):
        done = await self.send(store, id="done")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, done.id, "beta", m.lease_id, "completed", None, START)
        for outcome in ("completed", "retry"):
            e = await refusal(ack(store, done.id, "beta", m.lease_id, outcome, None, START))
            assert e.code == "not_leased"
        await store.sweep_leases(START + 10**6, RULES)
        assert (await store.find(done.id, START)).status == DONE
        messages, _ = await store.poll("beta", None, 50, START + 10**6, RULES)
        assert messages == []

    @pytest_twisted.ensureDeferred
    async def test_settle_applies_any_transition(self, store):
        sent = await self.send(store, id="t")

        def stamp(message, now):
            message.error = f"seen at {int(now)}"
            return delivery.Outcome({"id": message.id, "status": message.status})

        assert await store.settle("t", stamp, START + 1, RULES) == {"id": sent.id,
                                                                   "status": QUEUED}
        assert (await store.find("t", START)).error == f"seen at {int(START) + 1}"

        def refuse(message, now):
            message.error = "kept although the transition raised"
            raise errors.RelayError(409, "wrong_state", "refused")

        e = await refusal(store.settle("t", refuse, START, RULES))
        assert (e.status, e.code) == (409, "wrong_state")
        assert (await store.find("t", START)).error == "kept although the transition raised"
        e = await refusal(store.settle("unknown", stamp, START, RULES))
        assert e.code == "no_such_message"

    @pytest_twisted.ensureDeferred
    async def test_sweep_leases(self, store):
        await self.send(store, to="beta")
        await self.send(store, to="gamma")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        await store.pull("gamma", 1, self.LEASE * 2, START, RULES)
        assert await store.sweep_leases(START + self.LEASE - 1, RULES) == 0
        assert await store.sweep_leases(START + self.LEASE, RULES) == 1
        assert (await store.query("beta", 1, {}, START + self.LEASE, RULES))[0].status == QUEUED
        assert await store.sweep_leases(START + self.LEASE * 2, RULES) == 1
        assert await store.sweep_leases(START + self.LEASE * 3, RULES) == 0

    @pytest_twisted.ensureDeferred
    async def test_a_lease_whose_deadline_moved_lapses_at_the_new_deadline(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="moved")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        heard.take()

        def extend(message, now):
            message.lease_until += 100_000
            return delivery.Outcome(message.lease_until)

        new_deadline = await store.settle("moved", extend, START, RULES)
        assert heard.take() == (set(), {(new_deadline / 1000.0, "beta")})
        assert await store.sweep_leases(START + self.LEASE, RULES) == 0
        assert await store.pull("beta", 1, self.LEASE, START + self.LEASE, RULES) == []
        found = await store.find("moved", START)
        assert (found.status, found.lease_id) == (LEASED, m.lease_id)
        assert await store.sweep_leases(START + self.LEASE + 100, RULES) == 1
        assert (await store.find("moved", START)).status == QUEUED

    # -- what changes mean for waiters ------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_changes_are_reported_once_durable(self, store):
        heard = Recorder()
        store.subscribe(heard)
        sent = await self.send(store, id="w")
        assert heard.take() == ({"beta"}, set())
        assert await store.add(new_message("alpha", "beta", START, id="w"), RULES) is False
        assert heard.take() == (set(), set())
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert heard.take() == (set(), {(START + self.LEASE, "beta")})
        await ack(store, sent.id, "beta", m.lease_id, "retry", None, START)
        assert heard.take() == ({"beta"}, set())
        (m,) = await store.pull("beta", 1, self.LEASE, START + 1, RULES)
        heard.take()
        await ack(store, sent.id, "beta", m.lease_id, "completed", None, START + 1)
        assert heard.take() == (set(), set())
        await self.send(store, id="lapses", to="gamma")
        await store.pull("gamma", 1, self.LEASE, START, RULES)
        heard.take()
        assert await store.sweep_leases(START + self.LEASE, RULES) == 1
        assert heard.take() == ({"gamma"}, set())
        assert heard.lapsed == 1

    @pytest_twisted.ensureDeferred
    async def test_each_lease_is_reported_held_then_released(self, store):
        """One ``held`` pair per lease granted or renewed, one ``released`` pair per
        lease ended before its deadline or moved from it: the broker keeps a deadline
        wake-up only while some lease still ends then."""
        heard = Recorder()
        store.subscribe(heard)
        for i in range(3):
            await self.send(store, id=f"h{i}")
        heard.heard = []
        leased = await store.pull("beta", 3, self.LEASE, START, RULES)
        deadline = (START + self.LEASE, "beta")
        assert [p for c in heard.heard for p in c.held] == [deadline] * 3
        heard.heard = []
        await ack(store, leased[0].id, "beta", leased[0].lease_id, "completed", None, START)
        await ack(store, leased[1].id, "beta", leased[1].lease_id, "retry", None, START)

        def extend(message, now):
            message.lease_until += 100_000
            return delivery.Outcome(message.lease_until)

        moved = await store.settle(leased[2].id, extend, START, RULES)
        assert sorted(p for c in heard.heard for p in c.released) == [deadline] * 3
        assert [p for c in heard.heard for p in c.held] == [(moved / 1000.0, "beta")]

    @pytest_twisted.ensureDeferred
    async def test_reads_release_lapsed_leases_and_report_them(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="r")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        heard.take()
        later = START + self.LEASE
        (entry,) = await store.status(["r"], "alpha", later, RULES)
        assert entry["status"] == QUEUED
        assert heard.take() == ({"beta"}, set())
        assert heard.lapsed == 1

    # -- status, recent, query -----------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_status_visibility(self, store):
        sent = await self.send(store, kind="request")
        entries = await store.status([sent.id, "unknown"], "alpha", START, RULES)
        assert entries == [
            {"id": sent.id, "status": QUEUED, "attempts": 0, "ts": sent.ts, "from": "alpha",
             "to": "beta", "kind": "request", "deliveries": 0},
            {"id": "unknown", "status": "not_found", "attempts": 0},
        ]
        assert (await store.status([sent.id], "beta", START, RULES))[0]["status"] == QUEUED
        assert await store.status([sent.id], "gamma", START, RULES) == [
            {"id": sent.id, "status": "not_found", "attempts": 0}
        ]

    @pytest_twisted.ensureDeferred
    async def test_status_reports_the_last_error(self, store):
        sent = await self.send(store)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, sent.id, "beta", m.lease_id, "retry", "disk full", START)
        (entry,) = await store.status([sent.id], "alpha", START, RULES)
        assert entry["error"] == "disk full" and entry["attempts"] == 1
        assert "error" not in (await store.find(sent.id, START)).envelope("beta")

    @pytest_twisted.ensureDeferred
    async def test_recent_newest_first_any_status(self, store):
        ids = [(await self.send(store, id=f"m{i}")).id for i in range(4)]
        await self.send(store, sender="beta", to="alpha")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        recent = await store.recent("beta", 3, START, RULES)
        assert [m.id for m in recent] == ids[::-1][:3]
        assert [m.id for m in await store.recent("beta", 50, START, RULES)] == ids[::-1]
        assert (await store.recent("beta", 50, START, RULES))[-1].status == LEASED

    @pytest_twisted.ensureDeferred
    async def test_query_filters(self, store):
        req = await self.send(store, id="req", kind="request")
        await self.send(store, id="plain")
        await self.send(store, sender="beta", to="alpha", id="rep", kind="reply", parentId="req")
        await self.send(store, sender="gamma", to="delta", id="foreign")
        await store.pull("beta", 1, self.LEASE, START, RULES)

        async def ids(agent, limit=50, kind=None, status=None, sender=None, to=None):
            filters = {"kind": kind, "status": status, "from": sender, "to": to}
            return [m.id for m in await store.query(agent, limit, filters, START, RULES)]

        # The caller's inbox only, as the reference broker searches: beta's "rep" to
        # alpha is alpha's, not beta's.
        assert await ids("beta") == ["plain", "req"]
        assert await ids("beta", limit=1) == ["plain"]
        assert await ids("beta", kind="request") == [req.id]
        assert await ids("beta", status=LEASED) == ["req"]
        assert await ids("beta", status=QUEUED) == ["plain"]
        assert await ids("beta", sender="alpha") == ["plain", "req"]
        assert await ids("beta", to="beta") == ["plain", "req"]
        assert await ids("beta", to="alpha") == []
        assert await ids("beta", sender="gamma") == []
        assert await ids("alpha", kind="reply") == ["rep"]
        assert await ids("alpha", kind="request") == []
        assert await ids("delta", sender="gamma", to="delta") == ["foreign"]

    # -- peers ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_peers(self, store):
        assert await store.peers() == []
        asked = store.is_registered("beta")
        assert isinstance(asked, Deferred), "one shape: a Deferred, answered at once or not"
        assert await asked is False
        await store.register("beta", START)
        await store.register("alpha", START + 5)
        await store.register("beta", START + 10)
        assert await store.peers() == [("alpha", int(START) + 5, None),
                                       ("beta", int(START) + 10, None)]
        assert await store.is_registered("beta") is True

    @pytest_twisted.ensureDeferred
    async def test_add_to_an_unregistered_recipient_is_refused_when_asked(self, store):
        """The registered-recipient rule (spec §2) in the operation that adds: 404
        ``no_such_agent`` before the duplicate and inbox checks, nothing stored."""
        await store.register("alpha", START)
        refused = await refusal(store.add(new_message("alpha", "beta", START, id="early"),
                                         RULES, True))
        assert (refused.status, refused.code) == (404, "no_such_agent")
        assert await store.find("early", START) is None
        assert await store.add(new_message("beta", "alpha", START, id="back"), RULES,
                               True) is True
        await store.register("beta", START + 1)
        assert await store.add(new_message("alpha", "beta", START, id="early"), RULES,
                               True) is True
        assert await store.add(new_message("alpha", "nobody", START, id="any"), RULES) is True

    # -- message TTL ---------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_sweep_expired(self, store):
        old = await self.send(store, id="old", now=START)
        await store.pull("beta", 1, self.LEASE, START, RULES)
        await self.send(store, id="young", now=START + 100)
        assert await store.sweep_expired(START + 50, START + 50, RULES) == 1
        assert await store.find(old.id, START) is None
        e = await refusal(ack(store, old.id, "beta", "x", "completed", None, START + 60))
        assert e.code == "no_such_message"
        assert [m.id for m in await store.recent("beta", 50, START, RULES)] == ["young"]
        assert await store.sweep_expired(START + 50, START + 50, RULES) == 0
        assert await store.status(["old"], "alpha", START, RULES) == [
            {"id": "old", "status": "not_found", "attempts": 0}
        ]

    # -- what operators see --------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_queue_depths_count_by_state(self, store):
        from relay.store.interface import QueueDepth

        assert await store.queue_depths(START) == []
        for i in range(4):
            await self.send(store, id=f"b{i}", to="beta", now=START + i)
        await self.send(store, id="g0", to="gamma", now=START + 10)
        await self.send(store, id="d0", to="delta", now=START + 11)
        (first,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        (second,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, first.id, "beta", first.lease_id, "completed", None, START)
        await ack(store, second.id, "beta", second.lease_id, "retry", "x", START,
                  make_rules(max_attempts=0))
        (d,) = await store.pull("delta", 1, self.LEASE, START, RULES)
        await ack(store, d.id, "delta", d.lease_id, "completed", None, START)
        (g,) = await store.pull("gamma", 1, self.LEASE, START, RULES)
        assert await store.queue_depths(START) == [
            QueueDepth("beta", queued=2, failed=1, oldest_queued=START + 2),
            QueueDepth("gamma", leased=1),
        ]
        await store.sweep_leases(START + self.LEASE, RULES)
        assert (await store.queue_depths(START))[1] == QueueDepth("gamma", queued=1,
                                                                  oldest_queued=START + 10)
        await store.sweep_expired(START + 3, START, RULES)
        assert await store.queue_depths(START) == [
            QueueDepth("beta", queued=1, oldest_queued=START + 3),
            QueueDepth("gamma", queued=1, oldest_queued=START + 10),
        ]

    @pytest_twisted.ensureDeferred
    async def test_queue_depths_tell_delayed_messages_apart(self, store):
        from relay.store.interface import QueueDepth

        await self.send(store, id="later", to="beta", now=START, delay_seconds=100)
        await self.send(store, id="now", to="beta", now=START + 1)
        assert await store.queue_depths(START + 1) == [
            QueueDepth("beta", queued=1, delayed=1, oldest_queued=START + 1)]
        (m,) = await store.pull("beta", 5, self.LEASE, START + 1, RULES)
        assert await store.queue_depths(START + 1) == [
            QueueDepth("beta", leased=1, delayed=1)]
        await ack(store, m.id, "beta", m.lease_id, "completed", None, START + 1)
        assert await store.queue_depths(START + 100) == [
            QueueDepth("beta", queued=1, oldest_queued=START)]
        (m,) = await store.pull("beta", 5, self.LEASE, START + 100, RULES)
        await ack(store, m.id, "beta", m.lease_id, "reject", "poison", START + 100)
        assert await store.queue_depths(START + 100) == [QueueDepth("beta", failed=1)]

    @pytest_twisted.ensureDeferred
    async def test_health_and_commit_timings(self, store):
        timings: List[float] = []
        store.observe_commits(timings.append)
        assert await store.health() is None
        await self.send(store)
        assert await store.health() is None
        assert all(isinstance(t, float) and t >= 0 for t in timings)
