"""Roles (REACH §13) on the ops listener: each role's queue depth and its leases by
member in the dashboard's overview and in /metrics."""

from __future__ import annotations

import pytest_twisted

from tests.ops.test_listener import Ops, families, value

TEAM = {"alpha": {}, "dan": {}, "erin": {}}
ROLES = {"triage": {"members": ["dan", "erin"], "selfJoin": True},
         "audit": {"members": ["erin"]}}


async def busy_roles() -> Ops:
    ops = Ops(agents=TEAM, roles=ROLES)
    c = ops.client
    for n in range(4):
        assert (await c.post("alpha", "/messages", {"to": "role:triage", "id": f"t{n}"}))[0] == 201
    assert (await c.post("dan", "/v1/pull", {"limit": 2}))[0] == 200
    assert (await c.post("erin", "/v1/pull", {"limit": 1, "role": "triage"}))[0] == 200
    return ops


@pytest_twisted.ensureDeferred
async def test_the_overview_lists_each_role_with_its_queue_and_leases_by_member():
    ops = await busy_roles()
    code, overview, _ = await ops.get("/api/overview")
    assert code == 200
    assert overview["roles"] == [
        {"name": "audit", "members": ["erin"], "selfJoin": False, "queued": 0, "leased": 0,
         "delayed": 0, "failed": 0, "leasesBy": {}},
        {"name": "triage", "members": ["dan", "erin"], "selfJoin": True, "queued": 1,
         "leased": 3, "delayed": 0, "failed": 0, "leasesBy": {"dan": 2, "erin": 1}},
    ]
    # the role's queue is a row of its own among the queues
    (row,) = [a for a in overview["agents"] if a["agent"] == "role:triage"]
    assert (row["queued"], row["leased"]) == (1, 3)


@pytest_twisted.ensureDeferred
async def test_metrics_count_role_queues_and_leases_by_member():
    ops = await busy_roles()
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_queue_messages"], agent="role:triage", state="queued") == 1
    assert value(f["relay_role_leases"], role="triage", member="dan") == 2
    assert value(f["relay_role_leases"], role="triage", member="erin") == 1


@pytest_twisted.ensureDeferred
async def test_the_dashboard_has_a_roles_table():
    ops = Ops()
    page = (await ops.get("/"))[1]
    assert b'id="roles"' in page
    code, overview, _ = await ops.get("/api/overview")
    assert overview["roles"] == []
