"""Groups (REACH §13) at the HTTP level, in memory: config, ``/peers``, fan-out.

Time is a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted

from tests.http_support import Broker

TEAM = {"alice": {}, "bob": {}, "carol": {}, "dan": {}, "erin": {}}


def team_broker(**broker) -> Broker:
    broker.setdefault("agents", TEAM)
    broker.setdefault("groups", {"reviewers": {"members": ["alice", "bob", "carol"]}})
    broker.setdefault("roles", {"triage": {"members": ["dan", "erin"], "selfJoin": True}})
    return Broker(**broker)


@pytest_twisted.ensureDeferred
async def test_peers_lists_groups_and_roles_beside_peers():
    b = team_broker(groups={"reviewers": {"members": ["carol", "alice"]},
                            "a-team": {"members": []}})
    await b.register("alice")
    answer = (await b.get("alice", "/peers")).json
    assert [p["agent"] for p in answer["peers"]] == ["alice"]
    assert answer["groups"] == [{"name": "a-team", "members": []},
                                {"name": "reviewers", "members": ["carol", "alice"]}]
    assert answer["roles"] == [{"name": "triage", "members": ["dan", "erin"]}]
    # paged answers carry them too
    paged = (await b.get("alice", "/peers?limit=1")).json
    assert paged["groups"] == answer["groups"]


@pytest_twisted.ensureDeferred
async def test_peers_without_groups_or_roles_keeps_the_v12_shape():
    b = Broker()
    await b.register("alice")
    assert set((await b.get("alice", "/peers")).json) == {"peers"}
