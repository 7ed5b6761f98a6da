"""The queue indexes of the memory store (and so of jsonl, which keeps the same records):
:class:`relay.store.memory.SortedKeys` keeps a sorted list's order whatever its chunks,
and pulls keep REACH §14's order (higher priority first, then by sequence, across an
agent's inbox and its roles) over queues long enough to span many chunks."""

from __future__ import annotations

import random
from bisect import bisect_left, insort

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.store import memory
from relay.store.memory import MemoryStore, SortedKeys
from relay.testing import START, TEAM_RULES, ack, new_message
from relay.wire.protocol import QUEUED

OPERATIONS = st.lists(st.tuples(st.sampled_from(["add", "add", "discard", "after"]),
                                st.integers(0, 100)), max_size=400)


def result_of(d):
    """The result of an already-fired Deferred (memory stores fire at once)."""
    box = []
    d.addBoth(box.append)
    value = box[0]
    if hasattr(value, "raiseException"):
        value.raiseException()
    return value


def check_sorted_keys(operations):
    """Apply ``operations`` to a SortedKeys of small chunks and to a sorted list;
    they agree after each."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "CHUNK_KEYS", 8)  # many chunks, cut and joined often
        keys, model = SortedKeys(), []
        for operation, key in operations:
            if operation == "add":
                keys.add(key)
                insort(model, key)
            elif operation == "discard":
                i = bisect_left(model, key)
                present = i < len(model) and model[i] == key
                assert keys.discard(key) is present
                if present:
                    del model[i]
            else:
                assert list(keys.after(key)) == [k for k in model if k > key]
                assert (key in keys) is (key in model)
            assert list(keys) == model and len(keys) == len(model)
            assert bool(keys) is bool(model)
            if model:
                assert keys.first() == model[0]
            assert all(0 < len(chunk) <= 8 for chunk in keys.chunks)
            assert keys.lasts == [chunk[-1] for chunk in keys.chunks]


@given(OPERATIONS)
def test_sorted_keys_keep_the_order_of_a_sorted_list(operations):
    check_sorted_keys(operations)


@pytest.mark.parametrize("seed", range(4))
def test_sorted_keys_grow_and_shrink_like_a_queue(seed):
    # a queue's life: mostly the newest added, taken from anywhere, some put back
    rnd = random.Random(seed)
    newest, operations = 0, []
    for _ in range(3000):
        roll = rnd.random()
        if roll < 0.45:
            newest += 1
            operations.append(("add", newest if rnd.random() < 0.8 else rnd.randint(0, newest)))
        elif roll < 0.9:
            operations.append(("discard", rnd.randint(0, newest)))
        else:
            operations.append(("after", rnd.randint(0, newest)))
    check_sorted_keys(operations)


@pytest.mark.parametrize("seed", range(3))
def test_pulls_keep_priority_then_sequence_across_many_chunks(seed, monkeypatch):
    monkeypatch.setattr(memory, "CHUNK_KEYS", 8)
    rnd = random.Random(seed)
    store = MemoryStore()
    queued = {}  # id -> (-priority, seq): erin's inbox and the roles she holds
    for n in range(400):
        to = rnd.choice(["erin", "role:triage", "role:audit", "dan"])
        message = new_message("alpha", to, START, id=f"m{n}")
        message.priority = rnd.choice([0, 0, 0, 1, 5, 9])
        assert result_of(store.add(message, TEAM_RULES)) is True
        if to != "dan":
            queued[message.id] = (-message.priority, n)
    while queued:
        limit = rnd.randint(1, 7)
        pulled = result_of(store.pull("erin", limit, 60, START, TEAM_RULES))
        assert [m.id for m in pulled] == sorted(queued, key=queued.get)[:limit]
        for message in pulled:
            # most are done; some go back to the queue and keep their place
            outcome = "release" if rnd.random() < 0.2 else "completed"
            result_of(ack(store, message.id, "erin", message.lease_id, outcome, None, START,
                          TEAM_RULES))
            if result_of(store.find(message.id, START)).status != QUEUED:
                del queued[message.id]
    (dan,) = [d for d in result_of(store.queue_depths(START)) if d.agent == "dan"]
    assert dan.queued == len([m for m in store.records.by_seq.values() if m.to == "dan"])
