"""Brokers with teams configured, in memory: groups (REACH §13), roles and priorities
(§13, §14) and people with an inbox (§15). Time is a ``task.Clock``, except where a
store that commits on the reactor answers (``on``, :class:`TeamBroker`)."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred

from relay.testing import make_config
from tests.support.api import Broker, answered

# -- groups ------------------------------------------------------------------------------

GROUP_TEAM = {"alice": {}, "bob": {}, "carol": {}, "dan": {}, "erin": {}}
GROUPS = {"reviewers": {"members": ["alice", "bob", "carol"]},
          "pair": {"members": ["alice", "bob"]}}


async def on(b: Broker, d):
    """The reply of ``d``, pumping the broker until a persistent store committed."""
    return await answered(b, d)


async def group_broker(store, **broker) -> Broker:
    broker.setdefault("agents", GROUP_TEAM)
    broker.setdefault("groups", GROUPS)
    b = Broker(store=store, config=make_config(**broker))
    for agent in ("alice", "bob", "carol", "dan"):
        assert (await on(b, b.post(agent, "/register", {}))).code == 200
    return b


async def group_send(b: Broker, sender: str = "alice", to: str = "group:reviewers",
                     **fields):
    return await on(b, b.post(sender, "/messages", dict({"to": to, "body": {"n": 1}},
                                                         **fields)))


# -- roles -------------------------------------------------------------------------------

ROLE_TEAM = {"alpha": {}, "beta": {}, "dan": {}, "erin": {}, "zed": {},
             "narrow": {"allowed_targets": ["role:triage"]}}
ROLES = {"triage": {"members": ["dan", "erin"], "selfJoin": True},
         "audit": {"members": ["erin"]}}


class TeamBroker(Broker):
    """A broker whose requests are answered once its store committed (the persistent
    stores commit on the reactor)."""

    def request(self, *args, **kwargs) -> Deferred:
        return ensureDeferred(answered(self, super().request(*args, **kwargs)))

    def start(self, agent: str, path: str, body) -> Deferred:
        """A request left running (a long poll)."""
        return super().request(agent, "POST", path, body)


async def ack_as(b: Broker, agent: str, message, outcome: str = "completed", **fields: Any):
    """``POST /v1/ack`` of ``message`` by ``agent`` (any lease id it holds)."""
    body = dict(fields, messageId=message["id"], leaseId=message.get("leaseId", "x"),
                outcome=outcome)
    return await b.post(agent, "/v1/ack", body)


# -- people ------------------------------------------------------------------------------

ALICE = "alice-secret-0123456789"
HUMAN = "human-secret-0123456789"


def human_broker() -> Broker:
    """alpha, an agent, and dana, a person, each with a secret of their own."""
    broker = Broker(config=make_config(agents={
        "alpha": {"secret": ALICE}, "dana": {"secret": HUMAN, "human": True}}))
    broker.secrets.update(alpha=ALICE, dana=HUMAN)
    return broker


# -- the client side's teams -------------------------------------------------------------

REVIEWERS = {"agents": {"alice": {}, "bob": {}, "carol": {}},
             "groups": {"reviewers": {"members": ["alice", "bob", "carol"]}}}
TRIAGE_TEAM = {"alpha": {}, "dan": {}, "erin": {}}
TRIAGE_ROLES = {"triage": {"members": ["dan", "erin"]}}
