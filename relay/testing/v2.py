""":class:`Wire2Contract`: the second wire's messages (WIRE-V2) in the one store of
every backend."""

from __future__ import annotations

import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing.contract import RULES, Contract, ack, refusal
from relay.testing.harness import START
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
