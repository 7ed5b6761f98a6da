"""Groups (REACH §13) from the client side: ``RelayClient.send`` to ``group:NAME``,
``relay send group:NAME`` and ``relay status`` of the sent id, in process against the
in-memory broker with a Clock."""

from __future__ import annotations

from pathlib import Path

from relay.wire.errors import RelayError
from tests.cli.test_commands import Terminal
from tests.support.client import Net, failure_of

TEAM = {"agents": {"alice": {}, "bob": {}, "carol": {}},
        "groups": {"reviewers": {"members": ["alice", "bob", "carol"]}}}


def test_send_to_a_group_returns_the_copies_and_status_lists_them() -> None:
    net = Net(**TEAM)
    alice, bob = net.client("alice"), net.client("bob")
    sent = net.run(alice.send("group:reviewers", {"text": "please review"}, message_id="g1"))
    assert sent["id"] == "g1" and sent["duplicate"] is False
    assert [c["to"] for c in sent["copies"]] == ["bob", "carol"]
    again = net.run(alice.send("group:reviewers", {"text": "please review"}, message_id="g1"))
    assert again == dict(sent, duplicate=True)
    (leased,) = net.run(bob.pull())["messages"]
    assert (leased["id"], leased["via"]) == (sent["copies"][0]["id"], "group:reviewers")
    (entry,) = net.run(alice.status(["g1"]))["messages"]
    assert entry == {"id": "g1", "via": "group:reviewers", "copies": [
        dict(sent["copies"][0], status="leased"), dict(sent["copies"][1], status="queued")]}


def test_an_unknown_group_is_a_relay_error() -> None:
    net = Net(**TEAM)
    error = failure_of(net.start(net.client("alice").send("group:nobody", {})))
    assert (error.status, error.code) == (404, "no_such_agent")


def test_a_broker_without_groups_is_told_before_anything_is_sent() -> None:
    net = Net(v11=True, **TEAM)
    error = failure_of(net.start(net.client("alice").send("group:reviewers", {})))
    assert isinstance(error, RelayError) and "groups" in str(error)
    assert ("POST", "/messages") not in net.http.paths()


def test_relay_send_to_a_group_prints_the_copies(tmp_path: Path) -> None:
    term = Terminal(tmp_path, **TEAM)
    done = term("alice", "send", "group:reviewers", "look at PR 7", "--id", "pr7")
    assert done.status == 0, done.err
    lines = done.out.splitlines()
    assert lines[0].startswith("sent ") and lines[0].endswith("to group:reviewers: 2 copies")
    assert lines[1].split() == ["TO", "COPY", "ID"]
    assert [line.split()[0] for line in lines[2:]] == ["bob", "carol"]
    as_json = term("alice", "send", "group:reviewers", "look at PR 7", "--id", "pr7",
                   "--json").json()
    assert as_json["duplicate"] is True
    assert [line.split()[1] for line in lines[2:]] == [c["id"] for c in as_json["copies"]]
    again = term("alice", "send", "group:reviewers", "look at PR 7", "--id", "pr7")
    assert "2 copies (already accepted earlier)" in again.out
    status = term("alice", "status", as_json["id"])
    rows = status.out.splitlines()
    assert "GROUP SEND" in rows[0]
    assert {row.split()[0] for row in rows[1:]} == {c["id"] for c in as_json["copies"]}
    assert all(f"{as_json['id']} (group:reviewers)" in row for row in rows[1:])


def test_a_request_to_a_group_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    net = Net(**TEAM)
    error = failure_of(net.start(net.client("alice").request("group:reviewers", {}, 5)))
    assert error.code == "bad_request" and "per copy" in str(error)
    assert ("POST", "/messages") not in net.http.paths()
    term = Terminal(tmp_path, **TEAM)
    asked = term("alice", "ask", "group:reviewers", "anyone?", "--timeout", "5")
    assert asked.status == 1 and "per copy" in asked.err


def test_relay_peers_lists_the_groups_and_roles(tmp_path: Path) -> None:
    term = Terminal(tmp_path, roles={"triage": {"members": ["bob"]}}, **TEAM)
    term("alice", "register")
    lines = term("alice", "peers").out.splitlines()
    assert [line.split() for line in lines[-5:]] == [
        ["GROUP", "MEMBERS"], ["group:reviewers", "alice,", "bob,", "carol"], [],
        ["ROLE", "MEMBERS"], ["role:triage", "bob"]]
    answer = term("alice", "peers", "--json").json()
    assert answer["groups"] == [{"name": "reviewers", "members": ["alice", "bob", "carol"]}]
