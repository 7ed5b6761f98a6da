"""A stateful property test of the §5.1 state machine against a small model.

Random sequences of send, pull, ack (completed/retry, with live and dead lease
ids), clock advances and sweeps run against the memory store; after every
step the store must agree with the model: no message leased to two holders,
a dead lease id never acks, terminal states never change, attempts never
decrease, nothing lost or duplicated.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from relay.delivery import Rules
from relay.errors import RelayError
from relay.protocol import DONE, FAILED, LEASED, QUEUED
from relay.store.memory import MemoryStore
from relay.testing import START, ack, new_message

RULES = Rules(max_attempts=2)
MAX_ATTEMPTS = RULES.max_attempts


def result_of(d):
    """The result of an already-fired Deferred (memory stores fire at once)."""
    box = []
    d.addBoth(box.append)
    assert box, "memory store Deferreds fire synchronously"
    value = box[0]
    if hasattr(value, "raiseException"):
        value.raiseException()
    return value


class DeliveryMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.store = MemoryStore()
        self.now = START
        self.model = {}  # id -> dict(status, attempts, lease_id, until)
        self.order = []
        self.lease_ids = []
        self.terminal = {}

    def expire(self):
        for m in self.model.values():
            if m["status"] == LEASED and m["until"] <= int(self.now * 1000):
                m.update(status=QUEUED, lease_id=None, until=None)

    @rule(count=st.integers(1, 3))
    def send(self, count):
        for _ in range(count):
            message = new_message("alpha", "beta", self.now)
            assert result_of(self.store.add(message)) is True
            self.model[message.id] = {"status": QUEUED, "attempts": 0, "lease_id": None,
                                      "until": None}
            self.order.append(message.id)

    @rule()
    def resend_duplicate(self):
        if self.order:
            again = new_message("alpha", "beta", self.now, id=self.order[0])
            assert result_of(self.store.add(again)) is False

    @rule(limit=st.integers(1, 4), lease=st.sampled_from([5, 30]))
    def pull(self, limit, lease):
        self.expire()
        expected = [i for i in self.order if self.model[i]["status"] == QUEUED][:limit]
        got = result_of(self.store.pull("beta", limit, lease, self.now, RULES))
        assert [m.id for m in got] == expected
        for m in got:
            assert m.lease_id not in self.lease_ids, "lease ids are fresh"
            self.lease_ids.append(m.lease_id)
            self.model[m.id].update(status=LEASED, lease_id=m.lease_id, until=m.lease_until)

    @rule(data=st.data(), outcome=st.sampled_from(["completed", "retry"]))
    def ack(self, data, outcome):
        if not self.order or not self.lease_ids:
            return
        message_id = data.draw(st.sampled_from(self.order))
        lease_id = data.draw(st.sampled_from(self.lease_ids))
        self.expire()
        m = self.model[message_id]
        try:
            result = result_of(ack(self.store, message_id, "beta", lease_id, outcome, None,
                                   self.now, RULES))
        except RelayError as e:
            if m["status"] != LEASED:
                assert e.code == "not_leased"
            else:
                assert e.code == "lease_mismatch" and m["lease_id"] != lease_id
            return
        assert m["status"] == LEASED and m["lease_id"] == lease_id, "only the live lease acks"
        if outcome == "completed":
            m.update(status=DONE)
        else:
            m["attempts"] += 1
            m.update(status=FAILED if m["attempts"] > MAX_ATTEMPTS else QUEUED)
        m.update(lease_id=None, until=None)
        assert result == {"ok": True, "status": m["status"], "attempts": m["attempts"]}

    @rule(seconds=st.sampled_from([1, 4, 10, 31]))
    def advance(self, seconds):
        self.now += seconds

    @rule()
    def sweep(self):
        result_of(self.store.sweep_leases(self.now, RULES))
        self.expire()

    @rule()
    def poll(self):
        self.expire()
        messages, _ = result_of(self.store.poll("beta", None, 200, self.now, RULES))
        assert [m.id for m in messages] == [
            i for i in self.order if self.model[i]["status"] == QUEUED
        ]

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "model"):
            return
        statuses = result_of(self.store.status(self.order, "alpha", self.now, RULES))
        assert len(statuses) == len(self.order)
        leased_by = {}
        deadline = int(self.now * 1000)

        def effective(status, until):
            # Both sides release an expired lease lazily: compare what a pull would see.
            return QUEUED if status == LEASED and until <= deadline else status

        for entry in statuses:
            m = self.model[entry["id"]]
            stored = self.store.records.by_id[entry["id"]]
            assert effective(stored.status, stored.lease_until) == effective(m["status"],
                                                                            m["until"])
            assert entry["attempts"] == m["attempts"]
            if entry["id"] in self.terminal:
                assert entry["status"] == self.terminal[entry["id"]], "terminal never changes"
            if entry["status"] in (DONE, FAILED):
                self.terminal[entry["id"]] = entry["status"]
            if effective(stored.status, stored.lease_until) == LEASED:
                assert stored.lease_id == m["lease_id"]
                assert stored.lease_id not in leased_by.values(), "one holder per lease"
                leased_by[entry["id"]] = stored.lease_id
        assert len(self.store.records.by_id) == len(self.order), "nothing lost or duplicated"


DeliveryMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
TestDelivery = DeliveryMachine.TestCase
