"""Roles (REACH §13) and priorities (§14) through ``RelayClient`` and the ``relay``
command, in process against the in-memory broker with a Clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.wire.errors import RelayError
from tests.cli.test_commands import Terminal
from tests.support.client import Net

TEAM = {"alpha": {}, "dan": {}, "erin": {}}
ROLES = {"triage": {"members": ["dan", "erin"]}}


@pytest.fixture
def net() -> Net:
    return Net(agents=TEAM, roles=ROLES)


def test_the_client_sends_with_a_priority_and_to_a_role(net: Net) -> None:
    alpha, dan = net.client("alpha"), net.client("dan")
    net.run(dan.register())
    net.run(alpha.send("dan", {"n": 1}, message_id="plain"))
    net.run(alpha.send("dan", {"n": 2}, message_id="urgent", priority=7))
    net.run(alpha.send("role:triage", {"n": 3}, message_id="work", priority=3))
    sent = [b for b in net.http.bodies("/messages")]
    assert [b.get("priority") for b in sent] == [None, 7, 3]
    pulled = net.run(dan.pull(limit=10))["messages"]
    assert [m["id"] for m in pulled] == ["urgent", "work", "plain"]
    assert pulled[1]["to"] == "role:triage"
    done = net.run(dan.complete("work", pulled[1]["leaseId"], reply={"body": {"ok": 1},
                                                                     "priority": 5}))
    assert done["status"] == "done"
    (entry,) = net.run(alpha.status(["work"]))["messages"]
    assert entry["completedBy"] == "dan"


def test_the_client_pulls_from_one_role(net: Net) -> None:
    alpha, erin = net.client("alpha"), net.client("erin")
    net.run(erin.register())
    net.run(alpha.send("erin", {}, message_id="own"))
    net.run(alpha.send("role:triage", {}, message_id="work"))
    assert [m["id"] for m in net.run(erin.pull(role="triage"))["messages"]] == ["work"]
    assert net.http.bodies("/v1/pull")[-1]["role"] == "triage"
    with pytest.raises(RelayError) as e:
        net.run(erin.pull(role="nobody"))
    assert e.value.code == "no_such_agent"


def test_the_client_checks_a_priority_before_sending(net: Net) -> None:
    alpha = net.client("alpha")
    for bad in (10, -1, True, 1.5):
        with pytest.raises(ValueError):
            alpha.send("dan", {}, priority=bad)


def test_a_v11_broker_is_not_asked_for_priorities_or_roles() -> None:
    net = Net(v11=True)
    alpha = net.client("alpha")
    for call in (lambda: alpha.send("beta", {}, priority=4),
                 lambda: alpha.send("role:triage", {}),
                 lambda: alpha.pull(role="triage")):
        with pytest.raises(RelayError) as e:
            net.run(call())
        assert e.value.code == "unsupported"
    assert net.http.bodies("/messages") == [] and net.http.bodies("/v1/pull") == []


# -- the relay command ----------------------------------------------------------------


@pytest.fixture
def term(tmp_path: Path) -> Terminal:
    terminal = Terminal(tmp_path, agents=TEAM, roles=ROLES)
    for agent in TEAM:
        assert terminal(agent, "register").status == 0
    return terminal


def test_relay_send_priority_and_to_a_role_and_pull_by_role(term: Terminal) -> None:
    term("alpha", "send", "dan", "later", "--id", "k1")
    sent = term("alpha", "send", "dan", "now", "--priority", "7", "--json").json()
    work = term("alpha", "send", "role:triage", "triage this", "--json").json()
    assert [b.get("priority") for b in term.http.bodies("/messages")] == [None, 7, None]
    readable = term("alpha", "send", "role:triage", "more", "--priority", "2")
    assert readable.status == 0 and readable.out.endswith(" to role:triage\n")
    more = term.http.bodies("/messages")[-1]["id"]
    pulled = term("dan", "pull", "--role", "triage", "--json").json()["messages"]
    assert [m["id"] for m in pulled] == [more, work["id"]]
    assert term.http.bodies("/v1/pull")[-1]["role"] == "triage"
    rest = term("dan", "pull", "--json").json()["messages"]
    assert rest[0]["id"] == sent["id"]


def test_relay_send_refuses_a_priority_outside_0_to_9(term: Terminal) -> None:
    for bad in ("10", "-1", "high", "1.5"):
        done = term("alpha", "send", "dan", "x", "--priority", bad)
        assert done.status == 2 and "--priority" in done.err and "0 to 9" in done.err
    assert term.http.bodies("/messages") == []
