"""The ``relay`` commands in process against the in-memory broker with a Clock: ``send``
with ``--id``, ``--ttl`` and ``--delay``, the lease commands, ``ask``, cards, the signed
nonce and a v1.1 broker told apart, groups, roles and priorities (REACH §13, §14), and
asking a person (§15)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, List

import pytest

from relay.cli.commands.messages import SEND_ID_NAMESPACE, message_id_for
from relay.wire.protocol import notice_id
from tests.support.cli import Terminal
from tests.support.client import result_of
from tests.support.teams import REVIEWERS, TRIAGE_ROLES, TRIAGE_TEAM

HOSTILE = "bad\x1b]0;owned\x07\u202eevil"


@pytest.fixture
def term(tmp_path: Path) -> Terminal:
    terminal = Terminal(tmp_path)
    for agent in ("alpha", "beta"):
        assert terminal(agent, "register").status == 0
    return terminal


def job(term: Terminal, *extra: str) -> str:
    return term("alpha", "send", "beta", "job", "--json", *extra).json()["id"]


def lease(term: Terminal) -> str:
    return term("beta", "pull", "--limit", "1", "--json").json()["messages"][0]["leaseId"]


# -- send --id, --ttl, --delay -------------------------------------------------------------


def test_send_id_is_an_idempotency_key_scoped_to_the_sender(term: Terminal) -> None:
    assert message_id_for("alpha", "nightly-42") == str(
        uuid.uuid5(SEND_ID_NAMESPACE, "alpha\nnightly-42"))
    first = term("alpha", "send", "beta", "report", "--id", "nightly-42", "--json").json()
    again = term("alpha", "send", "beta", "report", "--id", "nightly-42", "--json").json()
    assert first["id"] == again["id"] == message_id_for("alpha", "nightly-42")
    assert (first["duplicate"], again["duplicate"]) == (False, True)
    other = term("beta", "send", "alpha", "report", "--id", "nightly-42", "--json").json()
    assert other["id"] != first["id"] and other["duplicate"] is False
    readable = term("alpha", "send", "beta", "report", "--id", "nightly-42")
    assert readable.out == f"sent {first['id']} to beta (already accepted earlier)\n"


def test_send_with_ttl_and_delay_and_status_shows_them(term: Terminal) -> None:
    sent = job(term, "--ttl", "3600", "--delay", "120")
    (body,) = [b for b in term.http.bodies("/messages") if b["id"] == sent]
    assert (body["ttlSeconds"], body["delaySeconds"]) == (3600, 120)
    head, row = term("alpha", "status", sent).out.splitlines()
    assert head.split() == ["ID", "STATUS", "ATTEMPTS", "DELIVERIES", "FROM", "TO", "KIND",
                            "SENT", "DUE", "EXPIRES"]
    assert row.split()[1:] == ["queued", "0", "0", "alpha", "beta", "message", "just", "now",
                               "in", "2", "min", "in", "1", "h"]
    recent = term("beta", "recent").out
    assert "due in 2 min | expires in 1 h" in recent


# -- the lease commands -------------------------------------------------------------------------


def test_renew_release_reject_dead_requeue(term: Terminal) -> None:
    sent = job(term, "--kind", "request")
    lease_id = lease(term)
    renewed = term("beta", "renew", sent, lease_id, "--lease", "900")
    assert renewed.out == f"{sent}: leased until in 15 min\n"
    released = term("beta", "release", sent, lease_id, "--after", "30")
    assert released.out == f"{sent}: queued (attempts 0)\n"
    assert term.http.bodies("/v1/ack")[-1]["retryAfterSeconds"] == 30
    term.settle(30)
    lease_id = lease(term)
    rejected = term("beta", "reject", sent, lease_id, "--reason", HOSTILE)
    assert rejected.out == f"{sent}: failed (attempts 0)\n"
    for agent, box in (("beta", "received"), ("alpha", "sent")):
        dead = term(agent, "dead")
        head, row, hint = dead.out.splitlines()
        assert head.split() == ["ID", "BOX", "PEER", "KIND", "SENT", "ATTEMPTS", "DELIVERIES",
                                "ERROR"]
        assert row.split()[:9] == [sent, box, "alpha" if agent == "beta" else "beta",
                                   "request", "30", "s", "ago", "0", "2"]
        assert "bad\\x1b]0;owned\\x07\\u202eevil" in row and "\x1b" not in dead.out
        assert hint == "(`relay requeue ID` puts a message back in the queue)"
    assert term("alpha", "dead", "--json").json()["messages"][0]["error"] == HOSTILE
    assert term("beta", "requeue", sent).out == f"{sent}: queued\n"
    assert term("beta", "dead").out == "no dead letters\n"


def test_ack_retry_after(term: Terminal) -> None:
    sent = job(term)
    done = term("beta", "ack", sent, lease(term), "retry", "--error", "busy", "--after", "60")
    assert done.out == f"{sent}: queued (attempts 1)\n"
    assert term.http.bodies("/v1/ack")[-1] == {
        "messageId": sent, "leaseId": term.http.bodies("/v1/ack")[-1]["leaseId"],
        "outcome": "retry", "error": "busy", "retryAfterSeconds": 60}


def test_cancel(term: Terminal) -> None:
    sent = job(term)
    assert term("alpha", "cancel", sent, "--reason", "superseded").out == (
        f"{sent}: failed (cancelled)\n")
    refused = term("beta", "cancel", sent)
    assert refused.status == 1 and refused.err.startswith("error: forbidden: ")


def test_pull_by_parent_thread_and_query_filters(term: Terminal) -> None:
    root = job(term, "--kind", "request")
    term("beta", "send", "alpha", "unrelated")
    term("beta", "send", "alpha", "answer", "--kind", "reply", "--reply-to", root,
         "--root-id", root)
    answers = term("alpha", "pull", "--parent", root, "--json").json()["messages"]
    assert [m["body"] for m in answers] == [{"text": "answer"}]
    thread = term("alpha", "thread", root)
    blocks = thread.out.split("\n\n")
    assert [b.splitlines()[-1].strip() for b in blocks] == ["job", "answer"]
    assert "unrelated" not in thread.out
    paged = term("alpha", "thread", root, "--limit", "1")
    assert paged.out.endswith(f"(more with --since {root})\n")
    sent = term("alpha", "query", "--box", "sent", "--root", root, "--json").json()
    assert [m["id"] for m in sent["messages"]] == [root]
    replies = term("alpha", "query", "--box", "all", "--parent", root, "--json").json()
    assert [m["body"] for m in replies["messages"]] == [{"text": "answer"}]


# -- ask ------------------------------------------------------------------------------------------


def answer_next(term: Terminal, **reply: Any) -> str:
    worker = term.client("beta")
    (message,) = term.run(worker.pull(limit=1))["messages"]
    if "reject" in reply:
        term.run(worker.reject(message["id"], message["leaseId"], reply["reject"]))
    else:
        term.run(worker.complete(message["id"], message["leaseId"], reply={"body": reply}))
    term.settle()
    return message["id"]


def test_ask_prints_the_answer(term: Terminal) -> None:
    d = term.begin("alpha", "ask", "beta", "2 + 2?")
    request = answer_next(term, text="4\nfour")
    done = result_of(d)
    assert (done.status, done.out, done.err) == (0, "4\nfour\n", "")
    d = term.begin("alpha", "ask", "beta", "--json-body", '{"op": "sum"}', "--json")
    answer_next(term, total=4, note=HOSTILE)
    done = result_of(d)
    assert done.json()["body"] == {"total": 4, "note": HOSTILE}
    d = term.begin("alpha", "ask", "beta", "again")
    answer_next(term, note=HOSTILE)
    assert "\x1b" not in result_of(d).out
    (body,) = [b for b in term.http.bodies("/messages") if b["id"] == request]
    assert (body["kind"], body["body"]) == ("request", {"text": "2 + 2?"})


def test_ask_exits_1_when_the_request_fails(term: Terminal) -> None:
    d = term.begin("alpha", "ask", "beta", "bad")
    request = answer_next(term, reject="cannot parse")
    done = result_of(d)
    assert (done.status, done.out) == (1, "")
    assert done.err == f"error: request_failed: request {request} to beta failed: cannot parse\n"


def test_ask_exits_1_when_no_answer_comes_in_time(term: Terminal) -> None:
    d = term.begin("alpha", "ask", "beta", "anyone?", "--timeout", "5", "--json")
    term.settle(5)
    done = result_of(d)
    request = term.http.bodies("/messages")[-1]["id"]
    assert done.status == 1
    assert done.err == (
        f"error: request_timeout: no answer from beta to request {request} within 5 s\n")
    assert done.json() == {"error": {"status": 0, "code": "request_timeout", "message": (
        f"no answer from beta to request {request} within 5 s")}}


# -- cards -----------------------------------------------------------------------------------


def test_register_with_a_card_and_peers_shows_it(term: Terminal) -> None:
    done = term("beta", "register", "--description", f"reviews\ndiffs {HOSTILE}",
                "--skill", "review", "--skill", "python")
    assert done.out == "registered beta with its card\n"
    head, alpha, beta = term("alpha", "peers").out.splitlines()
    assert head.split() == ["AGENT", "ONLINE", "LAST", "SEEN", "SKILLS", "DESCRIPTION"]
    assert alpha.split() == ["alpha", "yes", "just", "now"]
    assert beta.split()[:6] == ["beta", "yes", "just", "now", "review,", "python"]
    assert "reviews diffs bad\\x1b]0;owned\\x07\\u202eevil" in beta
    assert term("beta", "register").out == "registered beta\n"
    peers = term("alpha", "peers", "--json").json()["peers"]
    assert peers[1]["card"]["skills"] == ["review", "python"]
    assert term("beta", "register", "--remove-card").out == "registered beta (card removed)\n"
    assert "card" not in term("alpha", "peers", "--json").json()["peers"][1]
    assert term("alpha", "peers").out.splitlines()[0].split() == ["AGENT", "ONLINE", "LAST",
                                                                  "SEEN"]
    mixed = term("beta", "register", "--remove-card", "--skill", "x")
    assert mixed.status == 2 and "--remove-card takes no --description or --skill" in mixed.err


# -- the nonce, and a v1.1 broker ---------------------------------------------------------------


def test_every_command_sends_a_fresh_nonce_when_advertised(term: Terminal) -> None:
    job(term)
    signed = [headers for _, path, headers, _ in term.http.requests if path != "/"]
    nonces = [headers["X-Relay-Nonce"][0] for headers in signed]
    assert len(nonces) == len(set(nonces)) == len(signed)


@pytest.fixture
def v11(tmp_path: Path) -> Terminal:
    terminal = Terminal(tmp_path, v11=True)
    for agent in ("alpha", "beta"):
        assert terminal(agent, "register").status == 0
    return terminal


@pytest.mark.parametrize("argv, capability", [
    (["renew", "m", "l"], "leaseRenew"),
    (["release", "m", "l"], 'the "release" outcome'),
    (["reject", "m", "l"], 'the "reject" outcome'),
    (["ack", "m", "l", "retry", "--after", "5"], "retryAfter"),
    (["requeue", "m"], "deadLetters"),
    (["cancel", "m"], "deadLetters"),
    (["thread", "m"], "threads"),
    (["pull", "--parent", "m"], "pullFilter"),
    (["query", "--box", "all"], "threads"),
    (["send", "beta", "x", "--ttl", "5"], "messageTtl"),
    (["send", "beta", "x", "--delay", "5"], "delayedDelivery"),
    (["register", "--skill", "x"], "peerCards"),
])
def test_a_v11_broker_is_told_apart(v11: Terminal, argv: List[str], capability: str) -> None:
    done = v11("alpha", *argv)
    assert done.status == 1
    assert done.err.startswith(f"error: unsupported: the broker lacks {capability}"), done.err
    assert not any("X-Relay-Nonce" in headers for _, _, headers, _ in v11.http.requests)


def test_dead_on_a_v11_broker_lists_the_inbox_only(v11: Terminal) -> None:
    done = v11("beta", "dead")
    assert done.status == 0 and done.out == "no dead letters\n"
    assert done.err == "warning: the broker lacks threads (query by box): received messages only\n"
    assert v11.http.bodies("/v1/messages/query")[-1] == {"status": "failed"}


def test_a_failure_notice_reads_as_one() -> None:
    from relay.cli.output import message_block, watch_line

    notice = {"id": notice_id("q1"), "from": "beta", "to": "alpha", "kind": "reply",
              "type": "message", "parentId": "q1", "replyTo": "q1",
              "body": {"relayNotice": {"event": "failed", "messageId": "q1", "attempts": 0,
                                       "deliveries": 1, "error": "cannot parse"}}}
    text = "[notice] request q1 failed: cannot parse (attempts 0, deliveries 1)"
    assert message_block(notice, 0)[-1] == "  " + text
    assert watch_line(notice, 0).endswith(f"[{notice_id('q1')}]: {text}")
    # The same body from an agent, under an id of its own, is that agent's words.
    forged = dict(notice, id="f", **{"from": "mallory"})
    assert "[notice]" not in "\n".join(message_block(forged, 0))
    assert watch_line(forged, 0).startswith("mallory (reply) [f]: ")
    assert "[notice]" not in watch_line(forged, 0)


@pytest.fixture
def triage_term(tmp_path: Path) -> Terminal:
    terminal = Terminal(tmp_path, agents=TRIAGE_TEAM, roles=TRIAGE_ROLES)
    for agent in TRIAGE_TEAM:
        assert terminal(agent, "register").status == 0
    return terminal


# -- groups (REACH §13) --------------------------------------------------------------------


def test_relay_send_to_a_group_prints_the_copies(tmp_path: Path) -> None:
    term = Terminal(tmp_path, **REVIEWERS)
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


def test_relay_peers_lists_the_groups_and_roles(tmp_path: Path) -> None:
    term = Terminal(tmp_path, roles={"triage": {"members": ["bob"]}}, **REVIEWERS)
    term("alice", "register")
    lines = term("alice", "peers").out.splitlines()
    assert [line.split() for line in lines[-5:]] == [
        ["GROUP", "MEMBERS"], ["group:reviewers", "alice,", "bob,", "carol"], [],
        ["ROLE", "MEMBERS"], ["role:triage", "bob"]]
    answer = term("alice", "peers", "--json").json()
    assert answer["groups"] == [{"name": "reviewers", "members": ["alice", "bob", "carol"]}]


# -- roles and priority (REACH §13, §14) ---------------------------------------------------


def test_relay_send_priority_and_to_a_role_and_pull_by_role(triage_term: Terminal) -> None:
    triage_term("alpha", "send", "dan", "later", "--id", "k1")
    sent = triage_term("alpha", "send", "dan", "now", "--priority", "7", "--json").json()
    work = triage_term("alpha", "send", "role:triage", "triage this", "--json").json()
    assert [b.get("priority") for b in triage_term.http.bodies("/messages")] == [None, 7, None]
    readable = triage_term("alpha", "send", "role:triage", "more", "--priority", "2")
    assert readable.status == 0 and readable.out.endswith(" to role:triage\n")
    more = triage_term.http.bodies("/messages")[-1]["id"]
    pulled = triage_term("dan", "pull", "--role", "triage", "--json").json()["messages"]
    assert [m["id"] for m in pulled] == [more, work["id"]]
    assert triage_term.http.bodies("/v1/pull")[-1]["role"] == "triage"
    rest = triage_term("dan", "pull", "--json").json()["messages"]
    assert rest[0]["id"] == sent["id"]


def test_relay_send_refuses_a_priority_outside_0_to_9(triage_term: Terminal) -> None:
    for bad in ("10", "-1", "high", "1.5"):
        done = triage_term("alpha", "send", "dan", "x", "--priority", bad)
        assert done.status == 2 and "--priority" in done.err and "0 to 9" in done.err
    assert triage_term.http.bodies("/messages") == []


# -- asking a person (REACH §15) ------------------------------------------------------------


def test_ask_a_question_with_options_prints_the_persons_answer(term: Terminal) -> None:
    d = term.begin("alpha", "ask", "beta", "Ship 2.1 today?", "--option", "ship it",
                   "--option", "wait a day", "--wait", "30")
    request = answer_next(term, answer="wait a day")
    done = result_of(d)
    assert (done.status, done.out, done.err) == (0, "wait a day\n", "")
    (body,) = [b for b in term.http.bodies("/messages") if b["id"] == request]
    assert (body["kind"], body["body"]) == (
        "request", {"question": "Ship 2.1 today?", "options": ["ship it", "wait a day"]})

    d = term.begin("alpha", "ask", "beta", "--question", "Which branch?")
    request = answer_next(term, answer=f"release/2.1 {HOSTILE}")
    done = result_of(d)
    assert done.status == 0 and "\x1b" not in done.out and done.out.startswith("release/2.1 ")
    (body,) = [b for b in term.http.bodies("/messages") if b["id"] == request]
    assert body["body"] == {"question": "Which branch?"}

    d = term.begin("alpha", "ask", "beta", "Drop it?", "--option", "yes")
    request = answer_next(term, reject="not my call")
    done = result_of(d)
    assert done.status == 1 and done.err.endswith("failed: not my call\n")


@pytest.mark.parametrize("argv, says", [
    (["--option", "a"] * 11, "give 1 to 10 options, not 11"),
    (["--option", "a", "--option", "a"], "the options must differ"),
    (["--option", ""], "every option must be a non-empty string"),
    (["--question", "--json-body"], "--json-body does not go with --question"),
])
def test_ask_refuses_options_the_page_cannot_show(term: Terminal, argv: List[str],
                                                   says: str) -> None:
    done = term("alpha", "ask", "beta", "q?", *argv)
    assert done.status == 2 and says in done.err
    assert term.http.bodies("/messages") == []
