""":class:`GroupContract`: REACH §13 group sends as every storage backend stores
them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List

import pytest
import pytest_twisted

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing.contract import RULES, Contract
from relay.testing.harness import START, new_message
from relay.wire import errors
from relay.wire.protocol import LEASED, QUEUED


class GroupContract(Contract):
    """REACH §13 group sends as every IMessageStore must store them; needs a ``store``
    fixture: all copies or none, a repeat answered with the first copies, the status
    of the sent id, and the copies as ordinary messages in every view."""

    def copies(self, sent_id: str = "g1", members=("bob", "carol", "alice"),
               sender: str = "alice", now: float = START, **fields: Any) -> List[Message]:
        sent = new_message(sender, "group:team", now, id=sent_id, **fields)
        return delivery.group_copies(sent, "group:team", members)

    @pytest_twisted.ensureDeferred
    async def test_every_copy_is_stored_as_a_message_of_its_own(self, store):
        copies = self.copies(kind="request")
        assert [c.to for c in copies] == ["bob", "carol"], "the sender gets none"
        stored, answered = await store.add_group(copies, "alice", "g1", RULES)
        assert stored is True and [c.id for c in answered] == [c.id for c in copies]
        for copy in copies:
            (leased,) = await store.pull(copy.to, 10, self.LEASE, START, RULES)
            assert (leased.id, leased.via, leased.sent_id) == (copy.id, "group:team", "g1")
            assert (leased.root_id, leased.kind, leased.sender) == ("g1", "request", "alice")
        assert await store.find("g1", START) is None, "the sent id is not a message"

    @pytest_twisted.ensureDeferred
    async def test_a_repeat_answers_the_first_copies_whatever_the_members_now(self, store):
        first = self.copies()
        await store.add_group(first, "alice", "g1", RULES)
        stored, answered = await store.add_group(self.copies(members=("dan",)), "alice",
                                                 "g1", RULES)
        assert stored is False
        assert [(c.to, c.id) for c in answered] == [(c.to, c.id) for c in first]
        assert await store.pull("dan", 10, self.LEASE, START, RULES) == []
        # another sender's send under the same id is its own
        stored, other = await store.add_group(self.copies(sender="bob"), "bob", "g1", RULES)
        assert stored is True and {c.to for c in other} == {"alice", "carol"}

    @pytest_twisted.ensureDeferred
    async def test_one_full_inbox_refuses_every_copy(self, store):
        rules = replace(RULES, inbox_max_messages=1)
        await store.add(new_message("dan", "carol", START, id="fill"), rules)
        with pytest.raises(errors.RelayError) as info:
            await store.add_group(self.copies(), "alice", "g1", rules)
        assert (info.value.status, info.value.code) == (429, "inbox_full")
        assert await store.pull("bob", 10, self.LEASE, START, rules) == []
        (entry,) = await store.status(["g1"], "alice", START, rules)
        assert entry["status"] == "not_found"

    @pytest_twisted.ensureDeferred
    async def test_a_sent_id_or_copy_id_in_use_is_a_conflict_and_stores_nothing(self, store):
        await self.send(store, sender="alice", to="dan", id="taken")
        with pytest.raises(errors.RelayError) as info:
            await store.add_group(self.copies("taken"), "alice", "taken", RULES)
        assert info.value.code == "id_conflict"
        squatter = self.copies()[1]
        await self.send(store, sender="mallory", to="carol", id=squatter.id)
        with pytest.raises(errors.RelayError) as info:
            await store.add_group(self.copies(), "alice", "g1", RULES)
        assert info.value.code == "id_conflict"
        assert await store.pull("bob", 10, self.LEASE, START, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_the_status_of_the_sent_id_is_its_senders_only(self, store):
        copies = self.copies()
        await store.add_group(copies, "alice", "g1", RULES)
        (leased,) = await store.pull("bob", 1, self.LEASE, START, RULES)
        (entry,) = await store.status(["g1"], "alice", START, RULES)
        assert entry == {"id": "g1", "via": "group:team", "copies": [
            {"to": "bob", "id": copies[0].id, "status": LEASED},
            {"to": "carol", "id": copies[1].id, "status": QUEUED}]}
        for other in ("bob", "carol"):
            (hidden,) = await store.status(["g1"], other, START, RULES)
            assert hidden["status"] == "not_found"

    @pytest_twisted.ensureDeferred
    async def test_copies_are_in_the_sent_box_and_the_thread_and_expire(self, store):
        copies = self.copies(ttl_seconds=60)
        await store.add_group(copies, "alice", "g1", RULES)
        ids = [c.id for c in copies]
        sent = await store.query("alice", 10, {"box": "sent"}, START, RULES)
        assert sorted(m.id for m in sent) == sorted(ids)
        thread, _ = await store.thread("alice", "g1", None, 10, START, RULES)
        assert [m.id for m in thread] == ids
        await store.sweep_expired(START - 1, START + 61, RULES)
        (entry,) = await store.status(["g1"], "alice", START + 61, RULES)
        assert entry["status"] == "not_found"
