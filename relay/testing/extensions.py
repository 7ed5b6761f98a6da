""":class:`ExtensionContract`: the delivery extensions v1.2 (EXTENSIONS.md) as
every storage backend must apply them."""

from __future__ import annotations

import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing.contract import RULES, Contract, Recorder, ack, refusal, settle
from relay.testing.harness import START, make_rules
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED, iso_timestamp


class ExtensionContract(Contract):
    """The delivery extensions v1.2 (EXTENSIONS.md) as every IMessageStore must apply
    them; needs a ``store`` fixture. Each test names the section it covers."""

    async def leased(self, store, now=START, lease=None, **fields) -> Message:
        await self.send(store, now=now, **fields)
        (m,) = await store.pull("beta", 1, lease or self.LEASE, now, RULES)
        return m

    async def notice_of(self, store, request_id: str, now=START):
        return await store.find(delivery.notice_id(request_id), now)

    # -- §1 renew ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_renew_moves_the_deadline_and_keeps_the_lease(self, store):
        m = await self.leased(store, id="r")
        result = await settle(store, "r", delivery.renew("beta", m.lease_id, 600), START + 50)
        deadline = int((START + 50) * 1000) + 600_000
        assert result == {"ok": True, "leaseId": m.lease_id, "leaseUntil": deadline}
        found = await store.find("r", START)
        assert (found.lease_id, found.lease_until, found.attempts, found.deliveries) == (
            m.lease_id, deadline, 0, 1), "a renewal is not a delivery"
        assert await store.sweep_leases(START + self.LEASE, RULES) == 0
        shorter = await settle(store, "r", delivery.renew("beta", m.lease_id, 1), START + 60)
        assert shorter["leaseUntil"] == int((START + 61) * 1000), "a renewal may shorten"

    @pytest_twisted.ensureDeferred
    async def test_renew_guards_in_order(self, store):
        m = await self.leased(store, id="r")
        e = await refusal(settle(store, "nope", delivery.renew("beta", "x", 5), START))
        assert e.code == "no_such_message"
        e = await refusal(settle(store, "r", delivery.renew("gamma", m.lease_id, 5), START))
        assert (e.status, e.code) == (403, "forbidden")
        e = await refusal(settle(store, "r", delivery.renew("beta", "other", 5), START))
        assert (e.status, e.code) == (409, "lease_mismatch")
        e = await refusal(settle(store, "r", delivery.renew("beta", m.lease_id, 5),
                                START + self.LEASE))
        assert e.code == "not_leased", "a passed deadline is not renewed, swept or not"
        assert (await store.find("r", START)).status == QUEUED

    # -- §2 outcomes ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_release_requeues_without_penalty(self, store):
        m = await self.leased(store, id="rel")
        result = await ack(store, "rel", "beta", m.lease_id, "release", None, START)
        assert result == {"ok": True, "status": QUEUED, "attempts": 0}
        (again,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert (again.id, again.attempts, again.deliveries) == ("rel", 0, 2)

    @pytest_twisted.ensureDeferred
    async def test_retry_after_holds_the_message_back(self, store):
        heard = Recorder()
        store.subscribe(heard)
        for outcome in ("retry", "release"):
            m = await self.leased(store, id=outcome)
            heard.take()
            transition = delivery.ack("beta", m.lease_id, outcome, "later", RULES, 30)
            await settle(store, outcome, transition, START)
            assert heard.take() == (set(), {(START + 30, "beta")})
            assert await store.pull("beta", 1, self.LEASE, START + 29, RULES) == []
            assert (await store.poll("beta", None, 50, START + 29, RULES))[0] == []
            (entry,) = await store.status([outcome], "alpha", START + 29, RULES)
            assert entry["notBefore"] == int((START + 30) * 1000) and entry["status"] == QUEUED
            (again,) = await store.pull("beta", 1, self.LEASE, START + 30, RULES)
            assert again.id == outcome
            (entry,) = await store.status([outcome], "alpha", START + 30, RULES)
            assert "notBefore" not in entry

    @pytest_twisted.ensureDeferred
    async def test_reject_fails_at_once_and_notifies_the_requester(self, store):
        m = await self.leased(store, id="poison", kind="request", rootId="conv")
        result = await ack(store, "poison", "beta", m.lease_id, "reject", None, START)
        assert result == {"ok": True, "status": FAILED, "attempts": 0}
        found = await store.find("poison", START)
        assert (found.status, found.error, found.dead_reason) == (FAILED, "rejected", "rejected")
        notice = await self.notice_of(store, "poison")
        assert notice.envelope() == {
            "id": delivery.notice_id("poison"), "from": "beta", "to": "alpha", "ts": notice.ts,
            "type": "message", "ack": False, "kind": "reply", "rootId": "conv",
            "parentId": "poison", "replyTo": "poison", "status": QUEUED, "attempts": 0,
            "leaseUntil": None,
            "body": {"relayNotice": {"event": "failed", "messageId": "poison", "attempts": 0,
                                     "deliveries": 1, "error": "rejected"}}}

    @pytest_twisted.ensureDeferred
    async def test_plain_messages_and_cancelled_requests_get_no_notice(self, store):
        m = await self.leased(store, id="plain")
        await ack(store, "plain", "beta", m.lease_id, "reject", "no", START)
        assert await self.notice_of(store, "plain") is None
        await self.send(store, id="req", kind="request")
        await settle(store, "req", delivery.cancel("alpha", None), START)
        assert await self.notice_of(store, "req") is None
        quiet = make_rules(max_attempts=3, notify_failures=False)
        m = await self.leased(store, id="quiet", kind="request")
        await ack(store, "quiet", "beta", m.lease_id, "reject", None, START, quiet)
        assert await self.notice_of(store, "quiet") is None

    @pytest_twisted.ensureDeferred
    async def test_retry_past_max_attempts_notifies_with_the_acks_error(self, store):
        rules = make_rules(max_attempts=0)
        m = await self.leased(store, id="q", kind="request")
        result = await ack(store, "q", "beta", m.lease_id, "retry", "tool crashed", START, rules)
        assert result == {"ok": True, "status": FAILED, "attempts": 1}
        found = await store.find("q", START)
        assert (found.error, found.dead_reason) == ("tool crashed", "attempts")
        body = (await self.notice_of(store, "q")).body["relayNotice"]
        assert body == {"event": "failed", "messageId": "q", "attempts": 1, "deliveries": 1,
                        "error": "tool crashed"}

    # -- §3 deliveries and dead letters --------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_max_deliveries_fails_a_message_whose_leases_keep_lapsing(self, store):
        rules = make_rules(max_attempts=3, max_deliveries=2)
        await self.send(store, id="crash", kind="request")
        now = START
        for _ in range(2):
            (m,) = await store.pull("beta", 1, self.LEASE, now, rules)
            now += self.LEASE
        # the second lease lapsed: failed as of its deadline, before any sweep
        assert await store.pull("beta", 1, self.LEASE, now, rules) == []
        found = await store.find("crash", now)
        assert (found.status, found.deliveries, found.dead_reason, found.error) == (
            FAILED, 2, "deliveries", "delivered 2 times without completion")
        notice = await self.notice_of(store, "crash", now)
        assert notice.body["relayNotice"]["error"] == "delivered 2 times without completion"

    @pytest_twisted.ensureDeferred
    async def test_an_exhausted_lapse_is_failed_by_an_ack_too(self, store):
        rules = make_rules(max_attempts=3, max_deliveries=1)
        m = await self.leased(store, id="x", kind="request")
        e = await refusal(ack(store, "x", "beta", m.lease_id, "completed", None,
                             START + self.LEASE, rules))
        assert e.code == "not_leased"
        assert (await store.find("x", START)).status == FAILED
        assert await self.notice_of(store, "x") is not None
        for outcome in ("release", "retry"):
            m = await self.leased(store, id=outcome)
            await ack(store, outcome, "beta", m.lease_id, outcome, None, START, rules)
            found = await store.find(outcome, START)
            assert (found.status, found.error) == (FAILED,
                                                   "delivered 1 times without completion")

    @pytest_twisted.ensureDeferred
    async def test_requeue_resets_a_dead_letter(self, store):
        m = await self.leased(store, id="d")
        await ack(store, "d", "beta", m.lease_id, "reject", "bad", START)
        e = await refusal(settle(store, "d", delivery.requeue("gamma"), START))
        assert (e.status, e.code) == (403, "forbidden")
        for agent in ("beta", "alpha", None):
            result = await settle(store, "d", delivery.requeue(agent), START)
            assert result == {"ok": True, "status": QUEUED, "attempts": 0}
            found = await store.find("d", START)
            assert (found.status, found.attempts, found.deliveries, found.error,
                    found.not_before, found.dead_reason) == (QUEUED, 0, 0, None, None, None)
            e = await refusal(settle(store, "d", delivery.requeue(agent), START))
            assert (e.status, e.code) == (409, "wrong_state")
            m = await store.pull("beta", 1, self.LEASE, START, RULES)
            await ack(store, "d", "beta", m[0].lease_id, "reject", "bad", START)

    @pytest_twisted.ensureDeferred
    async def test_cancel_withdraws_and_kills_the_lease(self, store):
        m = await self.leased(store, id="c", kind="request")
        e = await refusal(settle(store, "c", delivery.cancel("beta", None), START))
        assert (e.status, e.code) == (403, "forbidden")
        result = await settle(store, "c", delivery.cancel("alpha", None), START)
        assert result == {"ok": True, "status": FAILED, "attempts": 0}
        found = await store.find("c", START)
        assert (found.error, found.dead_reason) == ("cancelled by sender", "cancelled")
        e = await refusal(ack(store, "c", "beta", m.lease_id, "completed", None, START))
        assert e.code == "not_leased"
        e = await refusal(settle(store, "c", delivery.cancel("alpha", "again"), START))
        assert e.code == "wrong_state"
        e = await refusal(settle(store, "c", delivery.requeue("beta"), START))
        assert e.code == "forbidden", "only the sender requeues a cancelled message"
        await settle(store, "c", delivery.requeue("alpha"), START)
        await self.send(store, id="q2")
        await settle(store, "q2", delivery.cancel("alpha", "changed my mind"), START)
        assert (await store.find("q2", START)).error == "changed my mind"

    # -- §4 notices are stored once -------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_one_notice_per_request(self, store):
        heard = Recorder()
        store.subscribe(heard)
        m = await self.leased(store, id="once", kind="request")
        heard.take()
        await ack(store, "once", "beta", m.lease_id, "reject", None, START)
        assert heard.take()[0] == {"alpha"}, "the notice wakes its recipient"
        await settle(store, "once", delivery.requeue("alpha"), START)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, "once", "beta", m.lease_id, "reject", "again", START)
        notices = await store.query("alpha", 50, {"kind": "reply"}, START, RULES)
        assert [n.id for n in notices] == [delivery.notice_id("once")]
        assert notices[0].body["relayNotice"]["error"] == "rejected", "the first one stays"

    # -- §5 conversations ----------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_pull_by_parent_leases_only_the_answers(self, store):
        await self.send(store, sender="beta", to="alpha", id="other")
        await self.send(store, sender="beta", to="alpha", id="a1", kind="reply", parentId="q")
        await self.send(store, sender="beta", to="alpha", id="a2", replyTo="q")
        await self.send(store, sender="beta", to="gamma", id="elsewhere", parentId="q")
        leased = await store.pull("alpha", 10, self.LEASE, START, RULES, "q")
        assert [m.id for m in leased] == ["a1", "a2"]
        assert await store.pull("alpha", 10, self.LEASE, START, RULES, "q") == []
        assert [m.id for m in await store.pull("alpha", 10, self.LEASE, START, RULES)] == [
            "other"]

    @pytest_twisted.ensureDeferred
    async def test_thread(self, store):
        await self.send(store, id="root", kind="request")
        await self.send(store, sender="beta", to="alpha", id="ans", rootId="root",
                        parentId="root", kind="reply")
        await self.send(store, sender="gamma", to="delta", id="foreign", rootId="root")
        await self.send(store, id="next", rootId="root", kind="request")
        await self.send(store, id="unrelated")

        async def page(agent, root="root", since=None, limit=50):
            messages, cursor = await store.thread(agent, root, since, limit, START, RULES)
            return [m.id for m in messages], cursor

        assert await page("alpha") == (["root", "ans", "next"], "next")
        assert await page("beta", limit=2) == (["root", "ans"], "ans")
        assert await page("beta", since="ans") == (["next"], "next")
        assert await page("beta", since="next") == ([], "next")
        assert await page("beta", since="unknown") == (["root", "ans", "next"], "next")
        assert await page("delta") == (["foreign"], "foreign")
        assert await page("beta", root="nothing") == ([], None)
        assert await page("beta", root="nothing", since="ans") == ([], None)

    @pytest_twisted.ensureDeferred
    async def test_query_boxes_and_conversation_filters(self, store):
        await self.send(store, id="q1", kind="request")
        await self.send(store, sender="beta", to="alpha", id="r1", kind="reply", parentId="q1",
                        rootId="q1")
        await self.send(store, sender="beta", to="alpha", id="r2", replyTo="q1")
        await self.send(store, sender="gamma", to="alpha", id="g1", rootId="q1")

        async def ids(agent, **filters):
            return [m.id for m in await store.query(agent, 50, filters, START, RULES)]

        assert await ids("beta") == ["q1"]
        assert await ids("beta", box="inbox") == ["q1"]
        assert await ids("beta", box="sent") == ["r2", "r1"]
        assert await ids("beta", box="all") == ["r2", "r1", "q1"]
        assert await ids("beta", box="sent", to="alpha", kind="reply") == ["r1"]
        assert await ids("beta", box="sent", **{"from": "alpha"}) == []
        assert await ids("alpha", rootId="q1") == ["g1", "r1"]
        assert await ids("alpha", box="all", rootId="q1") == ["g1", "r1", "q1"]
        assert await ids("alpha", parentId="q1") == ["r2", "r1"]
        assert await ids("alpha", parentId="q1", status=QUEUED, box="all") == ["r2", "r1"]

    # -- §6 reply in the ack ---------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_reply_in_the_ack_is_stored_with_the_completion(self, store):
        heard = Recorder()
        store.subscribe(heard)
        m = await self.leased(store, id="ask", kind="request", rootId="conv")
        heard.take()
        reply = {"id": "ans", "body": {"text": "42"}, "kind": "reply", "ack": True}
        transition = delivery.ack("beta", m.lease_id, "completed", None, RULES, reply=reply)
        result = await settle(store, "ask", transition, START + 1)
        assert result == {"ok": True, "status": DONE, "attempts": 0, "replyId": "ans",
                          "duplicate": False}
        answer = await store.find("ans", START)
        assert (answer.sender, answer.to, answer.parent_id, answer.reply_to, answer.root_id,
                answer.kind, answer.ack, answer.body) == ("beta", "alpha", "ask", "ask", "conv",
                                                          "reply", True, {"text": "42"})
        assert heard.take() == ({"alpha"}, set())

    @pytest_twisted.ensureDeferred
    async def test_a_reply_id_in_use_changes_nothing(self, store):
        await self.send(store, sender="gamma", to="delta", id="taken")
        m = await self.leased(store, id="ask")
        reply = {"id": "taken", "body": {}, "kind": "reply", "ack": False}
        transition = delivery.ack("beta", m.lease_id, "completed", None, RULES, reply=reply)
        e = await refusal(settle(store, "ask", transition, START))
        assert (e.status, e.code) == (409, "id_conflict")
        found = await store.find("ask", START)
        assert (found.status, found.lease_id) == (LEASED, m.lease_id), "the lease is intact"
        assert (await store.find("taken", START)).sender == "gamma"

    @pytest_twisted.ensureDeferred
    async def test_an_ack_with_a_reply_retried_is_a_duplicate_of_one_settle(self, store):
        m = await self.leased(store, id="ask", kind="request")
        reply = {"id": "ans", "body": {}, "kind": "reply", "ack": False}
        transition = delivery.ack("beta", m.lease_id, "completed", None, RULES, reply=reply)
        assert (await settle(store, "ask", transition, START))["duplicate"] is False
        again = await settle(store, "ask", transition, START + 1)
        assert again == {"ok": True, "status": DONE, "attempts": 0, "replyId": "ans",
                         "duplicate": True}
        other = delivery.ack("gamma", "whatever", "completed", None, RULES, reply=reply)
        e = await refusal(settle(store, "ask", other, START + 1))
        assert (e.status, e.code) == (403, "forbidden"), "another sender's retry is no duplicate"
        answers = await store.query("alpha", 10, {"parentId": "ask"}, START + 1, RULES)
        assert [a.id for a in answers] == ["ans"], "stored once"

    @pytest_twisted.ensureDeferred
    async def test_a_transition_with_a_stored_message_sees_it_in_its_settle(self, store):
        await self.send(store, id="m")
        await self.send(store, id="near", sender="gamma", to="delta")
        await self.send(store, id="brief", ttl_seconds=5)
        seen = []

        def decide(message, other, now):
            seen.append((message.id, None if other is None else (other.id, other.sender)))
            message.error = "looked"
            return delivery.Outcome("decided")

        for other_id in ("near", "absent", "brief"):
            result = await settle(store, "m", delivery.WithStored(other_id, decide), START + 10)
            assert result == "decided"
        assert seen == [("m", ("near", "gamma")), ("m", None), ("m", None)], \
            "an expired message is not seen"
        assert (await store.find("m", START + 10)).error == "looked"

    @pytest_twisted.ensureDeferred
    async def test_a_receipt_is_one_settle_storing_an_ack_back_to_the_sender(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="m1")
        heard.take()
        receipt_id = await settle(store, "m1", delivery.receipt("beta", b'{"status": "ok"}'),
                                  START + 1)
        receipt = await store.find(receipt_id, START + 1)
        assert (receipt.type, receipt.sender, receipt.to, receipt.reply_to, receipt.body) == (
            "ack", "beta", "alpha", "m1", {"status": "ok"})
        assert (await store.find("m1", START + 1)).status == QUEUED
        assert heard.take() == ({"alpha"}, set())
        e = await refusal(settle(store, "m1", delivery.receipt("alpha", b"{}"), START + 1))
        assert (e.status, e.code) == (403, "forbidden")

    # -- §7 TTL and delay ------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_a_delayed_message_waits_and_is_visible_with_not_before(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="later", delay_seconds=60)
        assert heard.take() == (set(), {(START + 60, "beta")})
        await self.send(store, id="now")
        leased = await store.pull("beta", 10, self.LEASE * 10, START, RULES)
        assert [m.id for m in leased] == ["now"]
        view = (await store.recent("beta", 2, START, RULES))[1]
        assert view.id == "later" and view.status == QUEUED
        assert view.envelope("beta", START)["notBefore"] == iso_timestamp(START + 60)
        assert "notBefore" not in view.envelope("beta", START + 60)
        (entry,) = await store.status(["later"], "alpha", START, RULES)
        assert entry["notBefore"] == int((START + 60) * 1000)
        (m,) = await store.pull("beta", 10, self.LEASE, START + 60, RULES)
        assert m.id == "later"

    @pytest_twisted.ensureDeferred
    async def test_a_v10_cursor_that_passed_a_delayed_message_gets_it_once(self, store):
        await self.send(store, id="later", delay_seconds=60)
        await self.send(store, id="after")
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["after"] and cursor == "after"
        assert (await store.poll("beta", cursor, 50, START + 59, RULES))[0] == []
        messages, cursor2 = await store.poll("beta", cursor, 50, START + 60, RULES)
        assert [m.id for m in messages] == ["later"] and cursor2 == "after"
        assert (await store.poll("beta", cursor, 50, START + 61, RULES))[0] == []
        await self.send(store, id="late2", delay_seconds=10)
        messages, _ = await store.poll("beta", cursor, 50, START + 100, RULES)
        assert [m.id for m in messages] == ["late2"], "a fresh due message: once, no repeat"
        assert (await store.poll("beta", "late2", 50, START + 101, RULES))[0] == []

    @pytest_twisted.ensureDeferred
    async def test_a_message_past_its_ttl_is_gone(self, store):
        m = await self.leased(store, id="held", ttl_seconds=10)
        await self.send(store, id="brief", ttl_seconds=10, kind="request")
        later = START + 10
        assert await store.pull("beta", 10, self.LEASE, later, RULES) == []
        assert await store.find("brief", later) is None
        assert (await store.status(["brief"], "alpha", later, RULES))[0]["status"] == "not_found"
        assert await store.recent("beta", 50, later, RULES) == []
        e = await refusal(ack(store, "held", "beta", m.lease_id, "completed", None, later))
        assert e.code == "no_such_message", "a lease on an expired message dies"
        assert await store.sweep_expired(START - 1, later, RULES) == 2
        notice = await self.notice_of(store, "brief", later)
        assert notice.body["relayNotice"] == {"event": "expired", "messageId": "brief",
                                              "attempts": 0, "deliveries": 0,
                                              "error": "expired unprocessed"}
        assert await store.sweep_expired(START - 1, later, RULES) == 0
        (entry,) = await store.status([delivery.notice_id("brief")], "alpha", later, RULES)
        assert entry["status"] == QUEUED and "expiresAt" not in entry

    @pytest_twisted.ensureDeferred
    async def test_ttl_fields_in_views(self, store):
        sent = await self.send(store, id="t", ttl_seconds=3600)
        found = await store.find("t", START)
        assert found.envelope()["expiresAt"] == iso_timestamp(START + 3600)
        assert found.envelope()["ts"] == sent.ts
        (entry,) = await store.status(["t"], "beta", START, RULES)
        assert entry["expiresAt"] == int((START + 3600) * 1000)

    @pytest_twisted.ensureDeferred
    async def test_an_expired_request_removed_by_age_is_notified_once(self, store):
        await self.send(store, id="old", kind="request", now=START)
        await self.send(store, id="done", kind="request", now=START)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, m.id, "beta", m.lease_id, "completed", None, START)
        assert await store.sweep_expired(START + 1, START + 1, RULES) == 2
        remaining = await store.query("alpha", 50, {}, START + 1, RULES)
        assert [n.id for n in remaining] == [delivery.notice_id("done")] or [
            n.id for n in remaining] == [delivery.notice_id("old")]
        (notice,) = remaining
        assert notice.body["relayNotice"]["event"] == "expired"

    # -- §8 cards ---------------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_cards_are_kept_replaced_and_removed(self, store):
        card = {"description": "answers ünicode questions", "skills": ["search", "sql"]}
        await store.register("beta", START, card)
        await store.register("alpha", START)
        await store.register("beta", START + 5)
        assert await store.peers() == [("alpha", int(START), None),
                                       ("beta", int(START) + 5, card)]
        (_, (_, _, returned)) = await store.peers()
        returned["skills"].append("forged")
        assert (await store.peers())[1][2] == card
        await store.register("beta", START + 6, {})
        assert (await store.peers())[1][2] == {}
        await store.register("beta", START + 7, None)
        assert (await store.peers())[1] == ("beta", int(START) + 7, None)
