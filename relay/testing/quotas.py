""":class:`QuotaContract`: inbox quotas, the agent cap and forgetting agents, as
every storage backend must keep them."""

from __future__ import annotations

from typing import Any

import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import Rules
from relay.testing.contract import RULES, Contract, ack, refusal, settle
from relay.testing.harness import START, make_rules, new_message
from relay.wire import errors
from relay.wire.protocol import LEASED


class QuotaContract(Contract):
    """Inbox quotas, the agent cap and forgetting agents (``docs/SECURITY.md``) as
    every IMessageStore must apply them; needs a ``store`` fixture."""

    async def put(self, store, rules: Rules, **fields) -> Any:
        """``store.add`` of a message to beta under ``rules``: True, False or the error."""
        try:
            return await store.add(new_message("alpha", fields.pop("to", "beta"), START,
                                               **fields), rules)
        except errors.RelayError as e:
            return e

    @pytest_twisted.ensureDeferred
    async def test_a_full_inbox_refuses_new_messages_until_one_is_taken(self, store):
        rules = make_rules(inbox_max_messages=2)
        assert await self.put(store, rules, id="a") is True
        assert await self.put(store, rules, id="b") is True
        refused = await self.put(store, rules, id="c")
        assert (refused.status, refused.code) == (429, "inbox_full")
        assert "beta" in refused.message and "2 messages" in refused.message
        assert await self.put(store, rules, id="a") is False, "a duplicate stays a duplicate"
        assert await self.put(store, rules, id="c", to="gamma") is True, "per recipient"
        leased = await store.pull("beta", 2, self.LEASE, START, rules)
        assert (await self.put(store, rules, id="d")).code == "inbox_full", "leased counts"
        await ack(store, leased[0].id, "beta", leased[0].lease_id, "completed", None, START,
                  rules)
        assert await self.put(store, rules, id="d") is True
        assert (await store.find("d", START)).to == "beta"

    @pytest_twisted.ensureDeferred
    async def test_the_byte_limit_counts_utf8_bytes_of_the_body(self, store):
        one = new_message("alpha", "beta", START, id="x", body={"t": "\U0001F600" * 10})
        assert one.body_bytes() == len('{"t":""}') + 40, "UTF-8, not escapes"
        size = one.stored_bytes()
        assert size == one.body_bytes() + len("x" "alpha" "beta")
        rules = make_rules(inbox_max_bytes=2 * size)
        assert await self.put(store, rules, id="x", body=one.body) is True
        assert await self.put(store, rules, id="y", body=one.body) is True, "up to the limit"
        assert (await self.put(store, rules, id="z", body={})).code == "inbox_full"
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        await ack(store, m.id, "beta", m.lease_id, "reject", "no", START, rules)
        assert await self.put(store, rules, id="z", body=one.body) is True, "failed frees"

    @pytest_twisted.ensureDeferred
    async def test_the_byte_limit_counts_every_string_the_sender_chose(self, store):
        long = "\u00e9" * 200  # 400 UTF-8 bytes
        one = new_message("alpha", "beta", START, id="i" + long, body={},
                          replyTo="r" + long, rootId="o" + long, parentId="p" + long)
        assert one.stored_bytes() == len("{}") + 4 * 401 + len("alpha" "beta")
        rules = make_rules(inbox_max_bytes=2 * one.stored_bytes() - 1)
        assert await self.put(store, rules, id="i" + long, body={}, replyTo="r" + long,
                              rootId="o" + long, parentId="p" + long) is True
        refused = await self.put(store, rules, id="j" + long, body={}, replyTo="r" + long,
                                 rootId="o" + long, parentId="p" + long)
        assert (refused.status, refused.code) == (429, "inbox_full"), "ids count"
        assert await store.find("j" + long, START) is None
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        await ack(store, m.id, "beta", m.lease_id, "completed", None, START, rules)
        assert await self.put(store, rules, id="j" + long, body={}, replyTo="r" + long,
                              rootId="o" + long, parentId="p" + long) is True, "done frees"

    @pytest_twisted.ensureDeferred
    async def test_expiry_frees_the_inbox(self, store):
        rules = make_rules(inbox_max_messages=2)
        assert await self.put(store, rules, id="old") is True
        assert await store.add(new_message("alpha", "beta", START, id="brief",
                                           ttl_seconds=10), rules) is True
        assert (await self.put(store, rules, id="new")).code == "inbox_full"
        assert await store.sweep_expired(START - 1, START + 10, rules) == 1
        assert await self.put(store, rules, id="new") is True
        assert await store.sweep_expired(START + 1, START + 10, rules) == 2
        assert await self.put(store, rules, id="a") is True
        assert await self.put(store, rules, id="b") is True

    @pytest_twisted.ensureDeferred
    async def test_a_reply_into_a_full_inbox_is_refused_and_changes_nothing(self, store):
        rules = make_rules(inbox_max_messages=1)
        assert await self.put(store, rules, id="ask", kind="request") is True
        assert await store.add(new_message("gamma", "alpha", START, id="fill"), rules) is True
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        reply = {"id": "ans", "body": {}, "kind": "reply", "ack": False}
        transition = delivery.ack("beta", m.lease_id, "completed", None, rules, reply=reply)
        e = await refusal(store.settle("ask", transition, START, rules))
        assert (e.status, e.code) == (429, "inbox_full")
        found = await store.find("ask", START)
        assert (found.status, found.lease_id) == (LEASED, m.lease_id), "the lease is intact"
        assert await store.find("ans", START) is None

    @pytest_twisted.ensureDeferred
    async def test_failure_notices_are_stored_into_a_full_inbox(self, store):
        rules = make_rules(inbox_max_messages=1)
        assert await self.put(store, rules, id="ask", kind="request") is True
        assert await store.add(new_message("gamma", "alpha", START, id="fill"), rules) is True
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        await settle(store, "ask", delivery.ack("beta", m.lease_id, "reject", "no", rules),
                     START, rules)
        notice = await store.find(delivery.notice_id("ask"), START)
        assert notice is not None and notice.to == "alpha", "the requester still learns"

    @pytest_twisted.ensureDeferred
    async def test_the_agent_cap_refuses_only_new_agents(self, store):
        await store.register("alpha", START, max_agents=2)
        await store.register("beta", START, max_agents=2)
        e = await refusal(store.register("gamma", START, max_agents=2))
        assert (e.status, e.code) == (403, "forbidden") and "2 agents" in e.message
        await store.register("beta", START + 1, {"description": "x"}, max_agents=2)
        assert [name for name, _, _ in await store.peers()] == ["alpha", "beta"]
        await store.register("gamma", START, max_agents=0)  # 0: no limit

    @pytest_twisted.ensureDeferred
    async def test_forgetting_takes_only_long_offline_agents_with_no_messages(self, store):
        await store.register("idle", START, {"description": "gone"})
        await store.register("holder", START)
        await store.register("sender", START)
        await store.register("recent", START + 100)
        await self.send(store, sender="sender", to="holder", id="kept")
        (m,) = await store.pull("holder", 1, self.LEASE, START, RULES)
        await ack(store, m.id, "holder", m.lease_id, "completed", None, START)
        assert sorted(await store.forget_peers(START + 50)) == ["idle", "sender"]
        assert [name for name, _, _ in await store.peers()] == ["holder", "recent"]
        assert await store.is_registered("idle") is False
        assert await store.is_registered("holder") is True
        assert await store.forget_peers(START + 50) == []
        await store.register("idle", START + 60)
        assert [name for name, _, _ in await store.peers()] == ["holder", "idle", "recent"]
        assert await store.is_registered("idle") is True
        await store.sweep_expired(START + 1, START + 200, RULES)
        assert await store.forget_peers(START + 50) == ["holder"], "its messages are gone"

    def test_space_left_is_a_number_or_none(self, store):
        free = store.space_left()
        assert free is None or (isinstance(free, int) and free >= 0)
