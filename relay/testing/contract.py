"""What every contract suite shares: the rules its stores apply, a subscriber that
records the change reports, and the base class of the suites."""

from __future__ import annotations

from typing import List, Optional, Tuple

from relay.rules import delivery
from relay.rules.delivery import Changes, Message, Rules
from relay.testing.harness import START, make_rules, new_message
from relay.wire import errors

RULES = make_rules(max_attempts=3)


async def refusal(d) -> errors.RelayError:
    """The RelayError the Deferred ``d`` fails with (an AssertionError when it fires)."""
    try:
        await d
    except errors.RelayError as e:
        return e
    raise AssertionError("expected a RelayError")


def ack(store, message_id: str, agent: str, lease_id: str, outcome: str,
        error: Optional[str], now: float, rules: Rules = RULES):
    """Settle a lease through the store with :func:`relay.rules.delivery.ack`."""
    return store.settle(message_id, delivery.ack(agent, lease_id, outcome, error, rules), now,
                        rules)


class Recorder:
    """A store subscriber that keeps every :class:`relay.rules.delivery.Changes` it hears."""

    def __init__(self) -> None:
        self.heard: List[Changes] = []
        self.lapsed = 0

    def __call__(self, changes: Changes) -> None:
        self.heard.append(changes)
        self.lapsed += changes.lapsed

    def take(self) -> Tuple[set, set]:
        """``(ready agents, due pairs)`` heard since the last take (lease deadlines
        held included)."""
        ready, due = set(), set()
        for changes in self.heard:
            ready |= changes.ready
            due |= changes.due
            due.update(changes.held)
        self.heard = []
        return ready, due


class Contract:
    """The base of the contract suites: the lease they ask for, and how a message is sent."""

    LEASE = 60

    async def send(self, store, sender="alpha", to="beta", now=START, **fields) -> Message:
        message = new_message(sender, to, now, **fields)
        assert await store.add(message, RULES) is True
        return message


def settle(store, message_id: str, transition, now: float, rules: Rules = RULES):
    return store.settle(message_id, transition, now, rules)
