"""``relay mcp`` tools with roles (REACH §13) and priorities (§14), against the
in-memory broker with a Clock: ``relay_send`` to a role and with a priority,
``relay_inbox`` by role, and a request a role's member answers."""

from __future__ import annotations

from tests.mcp.test_tools import call, refused, session
from tests.support.client import Net, result_of

TEAM = {"alice": {}, "dan": {}, "erin": {}}
ROLES = {"triage": {"members": ["dan", "erin"]}}


def team() -> Net:
    return Net(agents=TEAM, roles=ROLES)


def test_relay_send_to_a_role_with_a_priority_and_the_inbox_shows_both() -> None:
    net = team()
    alice, _ = session(net, "alice")
    dan, _ = session(net, "dan")
    call(net, alice, "relay_send", to="dan", text="whenever")
    sent = call(net, alice, "relay_send", to="role:triage", text="now", priority=8)
    assert sent["sent"] and sent["to"] == "role:triage"
    assert net.http.bodies("/messages")[-1]["priority"] == 8
    first, second = call(net, dan, "relay_inbox", wait_seconds=0)["messages"]
    assert (first["id"], first["role"], first["priority"]) == (sent["id"], "triage", 8)
    assert "role" not in second and "priority" not in second
    assert refused(net, alice, "relay_send", to="dan", text="x", priority=10).code == \
        "bad_arguments"


def test_relay_inbox_narrowed_to_a_role() -> None:
    net = team()
    alice, _ = session(net, "alice")
    erin, _ = session(net, "erin")
    call(net, alice, "relay_send", to="erin", text="own")
    work = call(net, alice, "relay_send", to="role:triage", text="work")
    (taken,) = call(net, erin, "relay_inbox", wait_seconds=0, role="triage")["messages"]
    assert taken["id"] == work["id"]
    assert net.http.bodies("/v1/pull")[-1]["role"] == "triage"
    assert refused(net, erin, "relay_inbox", wait_seconds=0, role="nobody").code == \
        "no_such_agent"


def test_a_request_to_a_role_is_answered_by_the_member_that_took_it() -> None:
    net = team()
    alice, _ = session(net, "alice")
    dan, _ = session(net, "dan")
    erin, _ = session(net, "erin")
    late = call(net, alice, "relay_request", to="role:triage", text="triage?",
                wait_seconds=0)
    request_id = late["request_id"]
    (question,) = call(net, erin, "relay_inbox", wait_seconds=0)["messages"]
    assert call(net, dan, "relay_inbox", wait_seconds=0)["messages"] == []
    # dan did not take it: a reply of his naming the request is not its answer
    net.run(net.client("dan").send("alice", {"text": "forged"}, kind="reply",
                                   parent_id=request_id, reply_to=request_id))
    waited = call(net, alice, "relay_wait_reply", request_id=request_id, wait_seconds=0)
    assert waited["answered"] is False
    replied = call(net, erin, "relay_reply", message_id=question["id"], text="p1")
    assert replied["replied"] and replied["to"] == "alice"
    d = alice.call("relay_wait_reply", {"request_id": request_id, "wait_seconds": 10})
    for _ in range(5):
        net.settle(1)
    waited = result_of(d)
    assert waited["answered"] is True
    assert waited["untrusted"] == {"from": "erin", "body": {"text": "p1"}}
