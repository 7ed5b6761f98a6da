""":class:`EventContract`: the events of REACH §11 as every storage backend
records them."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import pytest_twisted

from relay.testing.contract import RULES, Contract, Recorder, ack
from relay.testing.harness import START
from relay.wire.protocol import FAILED, LEASED, QUEUED


class EventContract(Contract):
    """REACH §11 events as a store records them: with the change that causes them,
    in order per agent, resumable without loss or repeat, and trimmed by retention."""

    async def read(self, store, agent: str, after: Optional[int], limit: int = 100):
        return await store.events(agent, after, limit)

    async def events_of(self, store, agent: str, after: int = 0) -> List[Tuple[str, Dict]]:
        page = await self.read(store, agent, after)
        assert page.reset is None
        return [(e.type, json.loads(e.data)) for e in page.events]

    @pytest_twisted.ensureDeferred
    async def test_a_send_pull_and_ack_record_their_events(self, store):
        sent = await self.send(store, id="m1", kind="request", rootId="r", parentId="p",
                               body={"text": "never in an event"})
        assert await self.events_of(store, "beta") == [
            ("message", {"id": "m1", "from": "alpha", "to": "beta", "kind": "request",
                         "rootId": "r", "parentId": "p"})]
        (leased,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, sent.id, "beta", leased.lease_id, "reject", "bad input", START)
        seen = await self.events_of(store, "alpha")
        assert seen[:2] == [
            ("status", {"id": "m1", "to": "beta", "status": LEASED, "attempts": 0,
                        "deliveries": 1}),
            ("status", {"id": "m1", "to": "beta", "status": FAILED, "attempts": 0,
                        "deliveries": 1, "error": "bad input"}),
        ]
        # the failure notice to the sender is a message like any other
        assert seen[2][0] == "message" and seen[2][1]["parentId"] == "m1"
        everything = await self.read(store, "alpha", 0)
        assert "never in an event" not in repr(everything)
        assert await self.events_of(store, "beta") == [("message", {
            "id": "m1", "from": "alpha", "to": "beta", "kind": "request", "rootId": "r",
            "parentId": "p"})]

    @pytest_twisted.ensureDeferred
    async def test_a_lapsed_lease_is_a_new_message_event_and_a_status(self, store):
        await self.send(store, id="m1")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        await store.sweep_leases(START + self.LEASE + 1, RULES)
        kinds = [(t, d["id"], d.get("status")) for t, d in await self.events_of(store, "beta")]
        assert kinds == [("message", "m1", None), ("message", "m1", None)]
        statuses = [d["status"] for _, d in await self.events_of(store, "alpha")]
        assert statuses == [LEASED, QUEUED]

    @pytest_twisted.ensureDeferred
    async def test_resume_gives_exactly_the_events_after_the_id(self, store):
        for i in range(5):
            await self.send(store, id=f"m{i}")
        page = await self.read(store, "beta", 0)
        ids = [e.id for e in page.events]
        assert ids == sorted(ids) and len(set(ids)) == 5
        await self.send(store, to="gamma", id="other")
        for i in range(5, 8):
            await self.send(store, id=f"m{i}")
        resumed = await self.read(store, "beta", ids[2])
        assert [json.loads(e.data)["id"] for e in resumed.events] == [
            "m3", "m4", "m5", "m6", "m7"]
        assert resumed.last == resumed.events[-1].id
        small = await self.read(store, "beta", ids[2], limit=2)
        assert [json.loads(e.data)["id"] for e in small.events] == ["m3", "m4"]
        again = await self.read(store, "beta", small.last)
        assert [json.loads(e.data)["id"] for e in again.events] == ["m5", "m6", "m7"]
        assert (await self.read(store, "beta", again.last)).events == []

    @pytest_twisted.ensureDeferred
    async def test_no_position_starts_at_the_present(self, store):
        await self.send(store, id="m0")
        page = await self.read(store, "beta", None)
        assert page.events == [] and page.reset is None
        await self.send(store, id="m1")
        later = await self.read(store, "beta", page.last)
        assert [json.loads(e.data)["id"] for e in later.events] == ["m1"]

    @pytest_twisted.ensureDeferred
    async def test_an_unknown_or_trimmed_position_is_a_reset(self, store):
        await self.send(store, id="old", now=START)
        first = (await self.read(store, "beta", 0)).events[0].id
        await self.send(store, id="new", now=START + 100)
        unknown = await self.read(store, "beta", first + 1000)
        assert unknown.reset == "unknown event id" and unknown.events == []
        assert (await self.read(store, "beta", -1)).reset == "unknown event id"
        assert await store.trim_events(START + 50) == 1
        trimmed = await self.read(store, "beta", 0)
        assert trimmed.reset is not None and "eventRetentionSeconds" in trimmed.reset
        assert trimmed.last >= first + 1
        kept = await self.read(store, "beta", first)
        assert [json.loads(e.data)["id"] for e in kept.events] == ["new"]

    @pytest_twisted.ensureDeferred
    async def test_retention_resets_only_a_stream_that_lost_events_of_its_own(self, store):
        # beta's last event is old; other agents' events, older than retention,
        # raise the floor past it: beta lost nothing, and resumes.
        await self.send(store, id="b1", now=START)
        await self.send(store, id="b2", now=START)
        b1, b2 = [e.id for e in (await self.read(store, "beta", 0)).events]
        for i in range(3):
            await self.send(store, to="gamma", id=f"g{i}", now=START + 1)
        assert await store.trim_events(START + 50) == 5  # the floor is past b2 now
        await self.send(store, id="b3", now=START + 100)
        resumed = await self.read(store, "beta", b2)
        assert resumed.reset is None, "nothing of beta's was removed after b2"
        assert [json.loads(e.data)["id"] for e in resumed.events] == ["b3"]
        lost = await self.read(store, "beta", b1)
        assert lost.reset is not None and lost.events == [], "b2 was removed after b1"
        assert (await self.read(store, "gamma", 0)).reset is not None
        # later trims move each agent's newest removed event along
        await self.send(store, to="gamma", id="g3", now=START + 101)
        assert await store.trim_events(START + 200) == 2
        b3 = resumed.events[0].id
        again = await self.read(store, "beta", b3)
        assert again.reset is None and again.events == []
        assert (await self.read(store, "beta", b2)).reset is not None

    @pytest_twisted.ensureDeferred
    async def test_a_delay_records_its_message_event_when_it_ends(self, store):
        await self.send(store, id="later", now=START, delay_seconds=60)
        await self.send(store, id="now", now=START)
        assert [d["id"] for _, d in await self.events_of(store, "beta")] == ["now"]
        assert await store.release_due(START + 59) == 0
        assert await store.release_due(START + 60) == 1
        assert await store.release_due(START + 61) == 0, "released once"
        assert [d["id"] for _, d in await self.events_of(store, "beta")] == ["now", "later"]
        pulled = await store.pull("beta", 5, self.LEASE, START + 61, RULES)
        assert sorted(m.id for m in pulled) == ["later", "now"]

    @pytest_twisted.ensureDeferred
    async def test_webhook_states_are_kept_per_agent(self, store):
        assert await store.webhook_states() == {}
        await store.put_webhook("beta", '{"acked":3}')
        await store.put_webhook("gamma", '{"acked":1}')
        await store.put_webhook("beta", '{"acked":4}')
        assert await store.webhook_states() == {"beta": '{"acked":4}', "gamma": '{"acked":1}'}
        await store.put_webhook("gamma", None)
        await store.put_webhook("nobody", None)
        assert await store.webhook_states() == {"beta": '{"acked":4}'}

    @pytest_twisted.ensureDeferred
    async def test_a_webhook_merge_keeps_what_it_does_not_set(self, store):
        heard = Recorder()
        store.subscribe(heard)
        first = await store.merge_webhook("beta", {"url": "u1"}, {"acked": 7})
        assert json.loads(first) == {"url": "u1", "acked": 7}
        second = await store.merge_webhook("beta", {"acked": 9}, {"acked": 1}, False)
        assert json.loads(second) == {"url": "u1", "acked": 9}
        assert (await store.webhook_states())["beta"] == second
        hooks = set()
        for changes in heard.heard:
            hooks |= changes.hooks
        assert hooks == {"beta"}, "a progress write is not announced"

    @pytest_twisted.ensureDeferred
    async def test_one_broker_at_a_time_delivers_webhooks(self, store):
        from relay.store.interface import ISharedNonces

        assert await store.lead_webhooks("a", START, 15) is True
        if not ISharedNonces.providedBy(store):  # one broker writes this store
            assert await store.lead_webhooks("b", START + 5, 15) is True
            return
        assert await store.lead_webhooks("b", START + 5, 15) is False
        assert await store.lead_webhooks("a", START + 10, 15) is True
        assert await store.lead_webhooks("b", START + 24, 15) is False
        assert await store.lead_webhooks("b", START + 26, 15) is True, "a lapsed role moves"
        assert await store.lead_webhooks("b", START + 30, 0) is True  # handed over
        assert await store.lead_webhooks("a", START + 30.5, 15) is True
        assert "*" not in await store.webhook_states()

    @pytest_twisted.ensureDeferred
    async def test_changes_name_the_agents_with_new_events(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="m1")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        agents = set()
        for changes in heard.heard:
            agents |= changes.events
        assert agents == {"alpha", "beta"}
