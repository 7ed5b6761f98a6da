"""A stateful property test of the delivery state machine against a small model.

Random sequences of send (some delayed), pull, every ack outcome (with live and
dead lease ids, with and without retry-after), renew, requeue, cancel, clock
advances, sweeps and polls run against the memory store; after every step the
store must agree with the model: no message leased to two holders, a dead lease
id never acts, nothing is delivered before it is due, attempts and deliveries
follow the rules, failed messages are revived only by requeue, nothing is
lost or duplicated, and the inbox quota counters match a recount.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from relay.rules import delivery
from relay.store.memory import MemoryStore
from relay.testing import START, make_rules, new_message
from relay.wire.errors import RelayError
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED

RULES = make_rules(max_attempts=2, max_deliveries=2)


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
        # id -> status, attempts, deliveries, lease_id, until (ms), not_before
        self.model = {}
        self.order = []
        self.lease_ids = []

    # -- the model's own rules ------------------------------------------------------

    def ms(self):
        return int(self.now * 1000)

    def fail(self, m):
        m.update(status=FAILED, lease_id=None, until=None, not_before=None)

    def end_lease(self, m, retry_after=None):
        if m["deliveries"] >= RULES.max_deliveries:
            self.fail(m)
        else:
            m.update(status=QUEUED, lease_id=None, until=None,
                     not_before=self.now + retry_after if retry_after else None)

    def catch_up(self, m):
        if m["status"] == LEASED and m["until"] <= self.ms():
            self.end_lease(m)

    def catch_up_all(self):
        for m in self.model.values():
            self.catch_up(m)

    def deliverable(self):
        return [i for i in self.order if self.model[i]["status"] == QUEUED
                and (self.model[i]["not_before"] is None
                     or self.model[i]["not_before"] <= self.now)]

    def target(self, data):
        """A message and a lease id: mostly a held lease, sometimes any id ever seen."""
        held = [(i, m["lease_id"]) for i, m in self.model.items() if m["status"] == LEASED]
        if held and data.draw(st.integers(0, 3)):
            return data.draw(st.sampled_from(held))
        return data.draw(st.sampled_from(self.order)), data.draw(st.sampled_from(self.lease_ids))

    def settle(self, message_id, transition):
        """Settle through the store; the model has already caught up."""
        return result_of(self.store.settle(message_id, transition, self.now, RULES))

    # -- rules ------------------------------------------------------------------------

    @rule(count=st.integers(1, 3), delay=st.sampled_from([0, 0, 5]))
    def send(self, count, delay):
        for _ in range(count):
            message = new_message("alpha", "beta", self.now, delay_seconds=delay)
            assert result_of(self.store.add(message, RULES)) is True
            self.model[message.id] = {"status": QUEUED, "attempts": 0, "deliveries": 0,
                                      "lease_id": None, "until": None,
                                      "not_before": self.now + delay if delay else None}
            self.order.append(message.id)

    @rule()
    def resend_duplicate(self):
        if self.order:
            again = new_message("alpha", "beta", self.now, id=self.order[0])
            assert result_of(self.store.add(again, RULES)) is False

    @rule(limit=st.integers(1, 4), lease=st.sampled_from([5, 30]))
    def pull(self, limit, lease):
        self.catch_up_all()
        expected = self.deliverable()[:limit]
        got = result_of(self.store.pull("beta", limit, lease, self.now, RULES))
        assert [m.id for m in got] == expected
        for m in got:
            assert m.lease_id not in self.lease_ids, "lease ids are fresh"
            self.lease_ids.append(m.lease_id)
            model = self.model[m.id]
            model.update(status=LEASED, lease_id=m.lease_id, until=m.lease_until,
                         not_before=None, deliveries=model["deliveries"] + 1)
            assert m.deliveries == model["deliveries"]

    @rule(data=st.data(), outcome=st.sampled_from(["completed", "retry", "release", "reject"]),
          retry_after=st.sampled_from([None, 3]))
    def ack(self, data, outcome, retry_after):
        if not self.order or not self.lease_ids:
            return
        message_id, lease_id = self.target(data)
        if outcome not in ("retry", "release"):
            retry_after = None
        m = self.model[message_id]
        self.catch_up(m)
        transition = delivery.ack("beta", lease_id, outcome, None, RULES, retry_after)
        try:
            result = self.settle(message_id, transition)
        except RelayError as e:
            if m["status"] != LEASED:
                assert e.code == "not_leased"
            else:
                assert e.code == "lease_mismatch" and m["lease_id"] != lease_id
            return
        assert m["status"] == LEASED and m["lease_id"] == lease_id, "only the live lease acts"
        if outcome == "completed":
            m.update(status=DONE, lease_id=None, until=None)
        elif outcome == "reject":
            self.fail(m)
        elif outcome == "retry":
            m["attempts"] += 1
            if m["attempts"] > RULES.max_attempts:
                self.fail(m)
            else:
                self.end_lease(m, retry_after)
        else:
            self.end_lease(m, retry_after)
        assert result == {"ok": True, "status": m["status"], "attempts": m["attempts"]}

    @rule(data=st.data(), seconds=st.sampled_from([1, 10, 60]))
    def renew(self, data, seconds):
        if not self.order or not self.lease_ids:
            return
        message_id, lease_id = self.target(data)
        m = self.model[message_id]
        self.catch_up(m)
        try:
            result = self.settle(message_id, delivery.renew("beta", lease_id, seconds))
        except RelayError as e:
            assert e.code == ("not_leased" if m["status"] != LEASED else "lease_mismatch")
            return
        assert m["lease_id"] == lease_id
        m["until"] = self.ms() + seconds * 1000
        assert result["leaseUntil"] == m["until"]

    @rule(data=st.data(), agent=st.sampled_from(["alpha", "beta", "gamma"]))
    def requeue(self, data, agent):
        if not self.order:
            return
        message_id = data.draw(st.sampled_from(self.order))
        m = self.model[message_id]
        self.catch_up(m)
        allowed = agent == "alpha" or (agent == "beta" and not m.get("cancelled"))
        expected = None if not allowed else (None if m["status"] == FAILED else "wrong_state")
        if not allowed:
            expected = "forbidden"
        try:
            self.settle(message_id, delivery.requeue(agent))
        except RelayError as e:
            assert e.code == expected
            return
        assert expected is None
        m.update(status=QUEUED, attempts=0, deliveries=0, not_before=None, cancelled=False)

    @rule(data=st.data())
    def cancel(self, data):
        if not self.order:
            return
        message_id = data.draw(st.sampled_from(self.order))
        m = self.model[message_id]
        self.catch_up(m)
        try:
            self.settle(message_id, delivery.cancel("alpha", None))
        except RelayError as e:
            assert e.code == "wrong_state" and m["status"] in (DONE, FAILED)
            return
        assert m["status"] in (QUEUED, LEASED)
        self.fail(m)
        m["cancelled"] = True

    @rule(seconds=st.sampled_from([1, 4, 10, 31]))
    def advance(self, seconds):
        self.now += seconds

    @rule()
    def sweep(self):
        result_of(self.store.sweep_leases(self.now, RULES))
        self.catch_up_all()

    @rule()
    def poll(self):
        self.catch_up_all()
        messages, _ = result_of(self.store.poll("beta", None, 200, self.now, RULES))
        assert [m.id for m in messages] == self.deliverable()

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "model"):
            return
        self.catch_up_all()
        statuses = result_of(self.store.status(self.order, "alpha", self.now, RULES))
        assert len(statuses) == len(self.order)
        holders = set()
        for entry in statuses:
            m = self.model[entry["id"]]
            assert (entry["status"], entry["attempts"], entry["deliveries"]) == (
                m["status"], m["attempts"], m["deliveries"]), (entry, m)
            stored = self.store.records.by_id[entry["id"]]
            if stored.status == LEASED:
                assert stored.lease_id == m["lease_id"]
                assert stored.lease_id not in holders, "one holder per lease"
                holders.add(stored.lease_id)
        notices = {m.id for m in self.store.records.by_id.values() if m.sender == "beta"}
        assert len(self.store.records.by_id) == len(self.order) + len(notices), (
            "nothing lost or duplicated")
        for agent in ("alpha", "beta"):
            pending = [m for m in self.store.records.by_id.values()
                       if m.to == agent and m.status in delivery.PENDING]
            assert self.store.records.usage(agent) == (
                len(pending), sum(m.stored_bytes() for m in pending)), "quota counters"
        assert self.store.records.usage("beta")[0] == sum(
            1 for m in self.model.values() if m["status"] in delivery.PENDING)


DeliveryMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                             deadline=None)
TestDelivery = DeliveryMachine.TestCase
