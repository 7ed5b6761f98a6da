""":class:`TeamContract`: REACH §13 role queues and §14 priorities as every
storage backend keeps them."""

from __future__ import annotations

import json

import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing.contract import Contract, ack, refusal
from relay.testing.harness import START, make_rules, new_message
from relay.wire.protocol import DONE, LEASED

TEAM_RULES = make_rules(max_attempts=3, roles={
    "triage": delivery.Role(frozenset({"dan", "erin"}), self_join=True),
    "audit": delivery.Role(frozenset({"erin"}), self_join=False),
})


class TeamContract(Contract):
    """REACH §13 roles and §14 priorities as a store keeps them: a role's queue leased
    by competing members, each message once, only by its holder; pulls by priority,
    then in order; the v1.0 poll untouched."""

    async def send(self, store, sender="alpha", to="beta", now=START, **fields) -> Message:
        priority = fields.pop("priority", 0)
        message = new_message(sender, to, now, **fields)
        message.priority = priority
        assert await store.add(message, TEAM_RULES) is True
        return message

    def pull(self, store, agent: str, limit: int = 10, now: float = START, role=None):
        return store.pull(agent, limit, self.LEASE, now, TEAM_RULES, None, role)

    @pytest_twisted.ensureDeferred
    async def test_a_pull_leases_higher_priority_first_and_in_order_within_one(self, store):
        for message_id, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 9), ("e", 5)):
            await self.send(store, id=message_id, priority=priority)
        assert [m.id for m in await self.pull(store, "beta", 2)] == ["d", "b"]
        assert [m.id for m in await self.pull(store, "beta", 10)] == ["e", "a", "c"]

    @pytest_twisted.ensureDeferred
    async def test_equal_priorities_keep_the_order_of_sending(self, store):
        for n in range(6):
            await self.send(store, id=f"m{n}", priority=3)
        assert [m.id for m in await self.pull(store, "beta", 10)] == [
            f"m{n}" for n in range(6)]

    @pytest_twisted.ensureDeferred
    async def test_the_v10_poll_stays_in_sequence_order(self, store):
        for message_id, priority in (("a", 0), ("b", 7), ("c", 2)):
            await self.send(store, id=message_id, priority=priority)
        messages, _ = await store.poll("beta", None, 10, START, TEAM_RULES)
        assert [m.id for m in messages] == ["a", "b", "c"]

    @pytest_twisted.ensureDeferred
    async def test_a_priority_is_kept_and_shown_only_above_zero(self, store):
        await self.send(store, id="urgent", priority=7)
        await self.send(store, id="plain")
        urgent, plain = await store.find("urgent", START), await store.find("plain", START)
        assert urgent.priority == 7 and urgent.envelope()["priority"] == 7
        assert json.loads(urgent.envelope_json())["priority"] == 7
        assert "priority" not in plain.envelope() and plain.priority == 0

    @pytest_twisted.ensureDeferred
    async def test_a_released_message_keeps_its_place_by_priority(self, store):
        await self.send(store, id="low", priority=1)
        await self.send(store, id="high", priority=8)
        (first,) = await self.pull(store, "beta", 1)
        assert first.id == "high"
        await ack(store, "high", "beta", first.lease_id, "release", None, START, TEAM_RULES)
        assert [m.id for m in await self.pull(store, "beta", 10)] == ["high", "low"]

    @pytest_twisted.ensureDeferred
    async def test_a_delayed_urgent_message_waits_for_its_delay(self, store):
        await self.send(store, id="plain")
        delayed = new_message("alpha", "beta", START, delay_seconds=30, id="later")
        delayed.priority = 9
        assert await store.add(delayed, TEAM_RULES) is True
        assert [m.id for m in await self.pull(store, "beta", 10)] == ["plain"]
        await store.release_due(START + 30, TEAM_RULES)
        assert [m.id for m in await self.pull(store, "beta", 10, START + 30)] == ["later"]

    # -- roles ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_competing_members_lease_a_role_message_once(self, store):
        await self.send(store, to="role:triage", id="t1")
        await self.send(store, to="role:triage", id="t2")
        dan = await self.pull(store, "dan", 1)
        erin = await self.pull(store, "erin", 5)
        assert [m.id for m in dan] == ["t1"] and [m.id for m in erin] == ["t2"]
        assert await self.pull(store, "dan") == [] and await self.pull(store, "erin") == []
        assert dan[0].to == "role:triage" and dan[0].holder == "dan"

    @pytest_twisted.ensureDeferred
    async def test_only_the_holder_renews_or_acks_a_role_message(self, store):
        await self.send(store, to="role:triage", id="t", kind="request")
        (leased,) = await self.pull(store, "dan")
        for agent in ("erin", "alpha", "role:triage"):
            e = await refusal(ack(store, "t", agent, leased.lease_id, "completed", None,
                                 START, TEAM_RULES))
            assert (e.status, e.code) == (403, "forbidden")
            e = await refusal(store.settle("t", delivery.renew(agent, leased.lease_id, 60),
                                          START, TEAM_RULES))
            assert (e.status, e.code) == (403, "forbidden")
        (entry,) = await store.status(["t"], "alpha", START, TEAM_RULES)
        assert entry["status"] == LEASED and entry["leasedBy"] == "dan"
        assert "completedBy" not in entry
        reply = {"id": "answer", "body": {"ok": 1}, "kind": "reply", "ack": False,
                 "priority": 4}
        transition = delivery.ack("dan", leased.lease_id, "completed", None, TEAM_RULES,
                                  reply=reply)
        assert (await store.settle("t", transition, START, TEAM_RULES))["replyId"] == "answer"
        (entry,) = await store.status(["t"], "alpha", START, TEAM_RULES)
        assert entry["status"] == DONE and entry["completedBy"] == "dan"
        assert "leasedBy" not in entry
        answer = await store.find("answer", START)
        assert (answer.sender, answer.to, answer.priority) == ("dan", "alpha", 4)
        # the holder sees the status of what it worked on; another member does not
        (own,) = await store.status(["t"], "dan", START, TEAM_RULES)
        assert own["completedBy"] == "dan"
        (other,) = await store.status(["t"], "erin", START, TEAM_RULES)
        assert other["status"] == "not_found"

    @pytest_twisted.ensureDeferred
    async def test_a_lapsed_role_lease_goes_back_to_the_role_queue(self, store):
        await self.send(store, to="role:triage", id="t")
        (first,) = await self.pull(store, "dan")
        later = START + self.LEASE
        (again,) = await self.pull(store, "erin", now=later)
        assert again.id == "t" and again.holder == "erin" and again.deliveries == 2
        e = await refusal(ack(store, "t", "dan", first.lease_id, "completed", None, later,
                             TEAM_RULES))
        assert (e.status, e.code) == (403, "forbidden")
        await ack(store, "t", "erin", again.lease_id, "completed", None, later, TEAM_RULES)
        (entry,) = await store.status(["t"], "alpha", later, TEAM_RULES)
        assert entry["completedBy"] == "erin"

    @pytest_twisted.ensureDeferred
    async def test_a_pull_ranks_the_own_queue_and_the_roles_together(self, store):
        await self.send(store, to="erin", id="own-old")
        await self.send(store, to="role:audit", id="audit", priority=2)
        await self.send(store, to="role:triage", id="triage-old")
        await self.send(store, to="erin", id="own-urgent", priority=6)
        assert [m.id for m in await self.pull(store, "erin")] == [
            "own-urgent", "audit", "own-old", "triage-old"]

    @pytest_twisted.ensureDeferred
    async def test_a_pull_narrowed_to_a_role(self, store):
        await self.send(store, to="erin", id="own")
        await self.send(store, to="role:audit", id="audit")
        await self.send(store, to="role:triage", id="triage")
        assert [m.id for m in await self.pull(store, "erin", role="triage")] == ["triage"]
        e = await refusal(self.pull(store, "dan", role="audit"))
        assert (e.status, e.code) == (403, "forbidden")
        e = await refusal(self.pull(store, "dan", role="nobody"))
        assert (e.status, e.code) == (404, "no_such_agent")
        assert [m.id for m in await self.pull(store, "erin")] == ["own", "audit"]

    @pytest_twisted.ensureDeferred
    async def test_the_v10_poll_never_returns_a_role_message(self, store):
        await self.send(store, to="role:triage", id="t")
        for member in ("dan", "erin"):
            messages, _ = await store.poll(member, None, 10, START, TEAM_RULES)
            assert messages == []
        assert await store.recent("dan", 10, START, TEAM_RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_a_card_joins_an_open_role(self, store):
        await self.send(store, to="role:triage", id="t1")
        await store.register("zed", int(START), {"roles": ["triage"]})
        assert [m.id for m in await self.pull(store, "zed")] == ["t1"]
        # a card listing a closed role gives nothing of it (the broker refuses it first)
        await self.send(store, to="role:audit", id="a1")
        await store.register("yan", int(START), {"roles": ["audit"]})
        assert await self.pull(store, "yan") == []
        await store.register("zed", int(START), {"description": "left"})
        await self.send(store, to="role:triage", id="t2")
        assert await self.pull(store, "zed") == []

    @pytest_twisted.ensureDeferred
    async def test_every_member_is_told_of_a_role_message(self, store):
        await store.register("zed", int(START), {"roles": ["triage"]})
        await self.send(store, to="role:triage", id="t", priority=3)
        for member in ("dan", "erin", "zed"):
            page = await store.events(member, 0, 10)
            assert [(e.type, json.loads(e.data)) for e in page.events] == [
                ("message", {"id": "t", "from": "alpha", "to": "role:triage",
                             "kind": "message", "rootId": None, "parentId": None,
                             "priority": 3})]
        assert (await store.events("role:triage", 0, 10)).events == []
        (leased,) = await self.pull(store, "zed")
        page = await store.events("alpha", 0, 10)
        assert [e.type for e in page.events] == ["status"]
        assert json.loads(page.events[0].data)["status"] == LEASED

    @pytest_twisted.ensureDeferred
    async def test_a_role_queue_has_its_depth(self, store):
        await self.send(store, to="role:triage", id="t1")
        await self.send(store, to="role:triage", id="t2")
        await self.pull(store, "dan", 1)
        depths = {d.agent: d for d in await store.queue_depths(START)}
        assert (depths["role:triage"].queued, depths["role:triage"].leased) == (1, 1)
