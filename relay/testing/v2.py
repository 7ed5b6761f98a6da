""":class:`Wire2Contract`: the second wire's messages (WIRE-V2) in the one store of
every backend."""

from __future__ import annotations

import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing.contract import RULES, Contract, ack, refusal
from relay.testing.harness import START, new_message
from relay.wire.protocol import DONE, QUEUED


class Wire2Contract(Contract):
    """The v2/v3 wire's messages in the one store (WIRE-V2 §3) as every IMessageStore
    keeps them; needs a ``store`` fixture."""

    async def send_v2(self, store, message_id: str, sender="alpha", to="beta", now=START,
                      mode="continue", ref="sess-1", shared=True, kind="request"
                      ) -> Message:
        from relay.wire.v2 import views

        body = views.stored_body("hé ☃", "ctx", "topic-a", mode, ref)
        message = Message(id=message_id, sender=sender, to=to, created=now,
                          body_json=views.canonical_json(body), kind=kind, root_id="root-9",
                          expires_at=now + 600, v2=views.v2_meta(mode, ref, shared))
        assert await store.add(message, RULES) is True
        return message

    @pytest_twisted.ensureDeferred
    async def test_a_v2_message_keeps_its_wire_fields_through_its_life(self, store):
        from relay.wire.v2 import views

        await self.send_v2(store, "v2-1")
        await self.send(store, id="seed-1")
        found = await store.find("v2-1", START)
        assert views.read_meta(found) == ("continue", "sess-1", True)
        assert views.shown_body(found) == ("hé ☃", "ctx", "topic-a")
        assert (await store.find("seed-1", START)).v2 is None
        leased = await store.pull("beta", 5, self.LEASE, START, RULES)
        assert {m.id: m.v2 for m in leased} == {"v2-1": found.v2, "seed-1": None}
        await ack(store, "v2-1", "beta", leased[0].lease_id, "completed", None, START)
        (done,) = await store.query("alpha", 5, {"box": "sent", "rootId": "root-9"}, START,
                                    RULES)
        assert (done.status, done.v2, done.expires_at) == (DONE, found.v2, START + 600)

    @pytest_twisted.ensureDeferred
    async def test_a_v2_request_that_fails_leaves_a_v2_notice_in_text(self, store):
        from relay.rules.v2 import transitions
        from relay.wire.v2 import views

        await self.send_v2(store, "v2-req", mode="write", shared=True)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await store.settle("v2-req", delivery.ack("beta", m.lease_id, "reject", "no", RULES),
                           START + 1, RULES)
        notice = await store.find(delivery.notice_id("v2-req"), START + 1)
        assert (notice.sender, notice.to, notice.kind, notice.parent_id) == (
            "beta", "alpha", "reply", "v2-req")
        assert views.read_meta(notice) == ("write", "sess-1", False)
        text, _, topic = views.shown_body(notice)
        assert text.startswith("[Relay] Your relay message was not delivered")
        assert "reason: no" in text and "hé ☃" in text and topic == "topic-a"
        assert notice.expires_at == START + 1 + views.NOTICE_TTL_SECONDS
        # and the v2 transitions guard as the reference does
        error = await refusal(store.settle("v2-req", transitions.ack("alpha", "", "completed",
                                                                    None, RULES), START, RULES))
        assert (error.status, error.code) == (403, "forbidden")
        error = await refusal(store.settle("v2-req", transitions.ack("beta", "", "completed",
                                                                    None, RULES), START, RULES))
        assert (error.status, error.code) == (400, "bad_request")

    @pytest_twisted.ensureDeferred
    async def test_v2_acks_with_and_without_a_token(self, store):
        from relay.rules.v2 import transitions

        await self.send_v2(store, "a")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        error = await refusal(store.settle("a", transitions.ack("beta", "stale", "completed",
                                                               None, RULES), START, RULES))
        assert (error.status, error.code) == (409, "lease_mismatch")
        renewed = await store.settle("a", transitions.renew("beta", m.lease_id, 300),
                                     START + 10, RULES)
        assert renewed == {"ok": True, "lease_until": START + 310}
        assert await store.settle("a", transitions.ack("beta", m.lease_id, "retry", "later",
                                                       RULES), START + 11, RULES) == {"ok": True}
        (again,) = await store.pull("beta", 1, self.LEASE, START + 12, RULES)
        assert again.deliveries == 2 and again.error == "later"
        assert await store.settle("a", transitions.ack("beta", "", "completed", None, RULES),
                                  START + 13, RULES) == {"ok": True}
        error = await refusal(store.settle("a", transitions.renew("beta", again.lease_id, 60),
                                          START + 14, RULES))
        assert (error.status, error.code) == (409, "lease_mismatch")

    @pytest_twisted.ensureDeferred
    async def test_v2_requeue_and_cancel(self, store):
        from relay.rules.v2 import transitions

        await self.send_v2(store, "r")
        error = await refusal(store.settle("r", transitions.requeue("beta"), START, RULES))
        assert (error.status, error.code) == (404, "no_such_message")  # queued already
        await store.pull("beta", 1, self.LEASE, START, RULES)
        error = await refusal(store.settle("r", transitions.requeue("alpha"), START, RULES))
        assert (error.status, error.code) == (403, "forbidden")
        assert await store.settle("r", transitions.requeue("beta"), START, RULES) == {
            "ok": True, "message_id": "r"}
        found = await store.find("r", START)
        assert (found.status, found.deliveries, found.lease_id) == (QUEUED, 0, None)
        error = await refusal(store.settle("r", transitions.cancel("beta"), START, RULES))
        assert (error.status, error.code) == (403, "forbidden")
        assert await store.settle("r", transitions.cancel("alpha"), START, RULES) == {
            "ok": True, "message_id": "r"}
        assert (await store.find("r", START)).status == DONE
        assert await store.pull("beta", 1, self.LEASE, START, RULES) == []
        error = await refusal(store.settle("r", transitions.cancel("alpha"), START, RULES))
        assert (error.status, error.code) == (404, "no_such_message")

    # -- completion times and the messages kept past their TTL (WIRE-V2 §3) --------

    @pytest_twisted.ensureDeferred
    async def test_the_time_a_message_completes_or_fails_is_kept(self, store):
        from relay.rules.v2 import transitions

        await self.send_v2(store, "v2-done")
        await self.send(store, id="seed-failed", kind="request")
        await self.send(store, id="waiting")
        v2, seed = await store.pull("beta", 2, self.LEASE, START, RULES)
        await store.settle(v2.id, transitions.ack("beta", v2.lease_id, "completed", None,
                                                  RULES), START + 5.5, RULES)
        await ack(store, seed.id, "beta", seed.lease_id, "reject", "no", START + 7)
        assert (await store.find("v2-done", START + 8)).completed_at == START + 5.5
        assert (await store.find("seed-failed", START + 8)).completed_at == START + 7
        assert (await store.find("waiting", START + 8)).completed_at is None
        # a requeue keeps it, as the reference's does; a completion again moves it
        await store.settle("seed-failed", delivery.requeue("alpha"), START + 9, RULES)
        (again,) = await store.pull("beta", 1, self.LEASE, START + 9, RULES)
        assert again.completed_at == START + 7
        await ack(store, again.id, "beta", again.lease_id, "completed", None, START + 10)
        assert (await store.find("seed-failed", START + 10)).completed_at == START + 10

    @pytest_twisted.ensureDeferred
    async def test_a_v2_message_past_its_ttl_is_kept_as_expired(self, store):
        from relay.store.interface import QueueDepth
        from relay.wire.protocol import EXPIRED

        later = START + 601  # the v2 messages of send_v2 live 600 s
        await self.send_v2(store, "v2-queued")
        await self.send_v2(store, "v2-leased", to="gamma")
        await self.send_v2(store, "v2-done", to="delta")
        seed = new_message("alpha", "beta", START, ttl_seconds=600, id="seed", kind="request")
        assert await store.add(seed, RULES) is True
        (leased,) = await store.pull("gamma", 1, self.LEASE * 10, START, RULES)
        (done,) = await store.pull("delta", 1, self.LEASE, START, RULES)
        await ack(store, done.id, "delta", done.lease_id, "completed", None, START + 1)
        await store.register("gamma", START)
        assert await store.sweep_expired(START - 1, later, RULES) == 3  # the done one stays
        for message_id, status in (("v2-queued", EXPIRED), ("v2-leased", EXPIRED),
                                   ("v2-done", DONE)):
            assert await store.find(message_id, later) is None  # gone for the seed wire
            kept = await store.find(message_id, later, True)
            assert (kept.status, kept.expires_at) == (status, START + 600), message_id
        assert (await store.find("v2-leased", later, True)).lease_id is None
        assert await store.find("seed", later, True) is None  # a seed-wire one is removed
        assert await store.status(["v2-queued", "seed"], "alpha", later, RULES) == [
            {"id": "v2-queued", "status": "not_found", "attempts": 0},
            {"id": "seed", "status": "not_found", "attempts": 0}]
        assert await store.query("alpha", 10, {"box": "sent"}, later, RULES) == []
        assert await store.pull("beta", 5, self.LEASE, later, RULES) == []
        assert await store.queue_depths(later) == [
            QueueDepth("alpha", queued=3, oldest_queued=later)]  # the three notices
        notices = await store.pull("alpha", 5, self.LEASE, later, RULES)
        assert sorted(m.parent_id for m in notices) == ["seed", "v2-leased", "v2-queued"]
        error = await refusal(ack(store, "v2-queued", "beta", "x", "completed", None, later))
        assert error.code == "no_such_message"
        # kept, they are swept no more; an agent no message waits for is forgotten
        assert await store.sweep_expired(START - 1, later + 60, RULES) == 0
        assert await store.forget_peers(START + 1) == ["gamma"]
        # retention removes them with the rest (the expired ones were counted then)
        assert await store.sweep_expired(START + 1, later + 60, RULES) == 1
        for message_id in ("v2-queued", "v2-leased", "v2-done"):
            assert await store.find(message_id, later + 60, True) is None

    @pytest_twisted.ensureDeferred
    async def test_the_depths_of_named_agents_count_their_settled_messages(self, store):
        from relay.store.interface import QueueDepth

        later = START + 601
        await self.send_v2(store, "expires")
        await self.send(store, id="done", now=START + 1)
        await self.send(store, id="failed", now=START + 2)
        await self.send(store, id="waits", now=START + 3)
        await self.send(store, id="later", now=START + 4, delay_seconds=5000)
        leased = {m.id: m for m in await store.pull("beta", 3, self.LEASE, START, RULES)}
        await ack(store, "done", "beta", leased["done"].lease_id, "completed", None, START)
        await ack(store, "failed", "beta", leased["failed"].lease_id, "reject", None, START)
        await ack(store, "expires", "beta", leased["expires"].lease_id, "release", None, START)
        await store.sweep_expired(START - 1, later, RULES)
        unsettled = QueueDepth("beta", queued=1, failed=1, delayed=1, oldest_queued=START + 3)
        assert (await store.queue_depths(later))[-1] == unsettled
        assert await store.queue_depths(later, ["beta", "nobody"]) == [
            QueueDepth("beta", queued=1, failed=1, delayed=1, oldest_queued=START + 3, done=1,
                       expired=1),
            QueueDepth("nobody")]

    @pytest_twisted.ensureDeferred
    async def test_an_expired_v2_message_requeued_lives_its_ttl_again(self, store):
        from relay.rules.v2 import transitions
        from relay.wire.protocol import EXPIRED

        later = START + 601
        await self.send_v2(store, "late")
        await store.sweep_expired(START - 1, later, RULES)
        error = await refusal(store.settle("late", delivery.requeue("beta"), later, RULES))
        assert error.code == "no_such_message"  # the seed wire's requeue never sees it
        assert await store.settle("late", transitions.requeue("beta"), later, RULES) == {
            "ok": True, "message_id": "late"}
        revived = await store.find("late", later)
        assert (revived.status, revived.expires_at) == (QUEUED, later + 600)
        (m,) = await store.pull("beta", 1, self.LEASE, later, RULES)
        assert (m.id, m.deliveries) == ("late", 1)
        await store.sweep_expired(START - 1, later + 601, RULES)
        assert (await store.find("late", later + 601, True)).status == EXPIRED
        assert await store.settle("late", transitions.cancel("alpha"), later + 602,
                                  RULES) == {"ok": True, "message_id": "late"}
        cancelled = await store.find("late", later + 602, True)
        assert (cancelled.status, cancelled.completed_at) == (DONE, later + 602)

    @pytest_twisted.ensureDeferred
    async def test_a_listing_with_a_match_reads_on_until_it_has_enough(self, store):
        for n in range(3):
            await self.send(store, id=f"hit-{n}", now=START + n)
        for n in range(250):
            await self.send(store, id=f"miss-{n}", now=START + 10 + n)
        await self.send_v2(store, "v2-old", now=START - 1000)
        await store.sweep_expired(START - 2000, START + 300, RULES)

        def hit(message: Message) -> bool:
            return message.id.startswith(("hit-", "v2-"))

        found = await store.query("beta", 3, {"box": "all"}, START + 300, RULES,
                                  match=lambda message: message.id.startswith("hit-"))
        assert [m.id for m in found] == ["hit-2", "hit-1", "hit-0"]
        found = await store.query("beta", 10, {"box": "inbox"}, START + 300, RULES, match=hit)
        assert [m.id for m in found] == ["v2-old", "hit-2", "hit-1", "hit-0"]  # kept, matched
        found = await store.query("beta", 10, {"box": "inbox", "status": "expired"},
                                  START + 300, RULES, match=hit)
        assert [(m.id, m.status) for m in found] == [("v2-old", "expired")]
        assert [m.id for m in await store.query("beta", 10, {"box": "inbox"}, START + 300,
                                                RULES)][-1] == "miss-240"
