"""``POST /messages``: the envelope and its defaults (seed §2), ids and duplicates,
recipients and the routing ACL, the v1.1 fields (§5.1), TTL and delay (EXTENSIONS.md
§7), reserved notice ids (§4), inbox quotas, group sends (REACH §13), role targets and
priority (§13, §14); and ``POST /v1/messages`` of the v2/v3 wire (WIRE-V2).

In memory, time on a ``task.Clock``; group sends on every backend.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict

import pytest
import pytest_twisted

from relay.testing import START, make_api, make_config
from relay.wire.protocol import MAX_ID_CHARS, iso_timestamp, notice_id
from relay.wire.v2 import views
from tests.support.api import (
    Broker,
    assert_error,
    assert_json_headers,
    refused,
    registered,
    two_agents,
)
from tests.support.teams import (
    GROUP_TEAM,
    ROLE_TEAM,
    ROLES,
    TeamBroker,
    group_broker,
    group_send,
    on,
)
from tests.support.v2 import assert_v2_error, leased_request

V11_FIELDS = {"id", "from", "to", "ts", "type", "body", "replyTo", "ack", "kind", "rootId",
              "parentId", "status", "attempts", "leaseUntil"}


ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\Z")


# -- v1.0: the envelope (seed §2, §4) ------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_shorthand_envelope_gets_the_defaults():
    b = await two_agents()
    reply = await b.post("alpha", "/messages", {"to": "beta"})
    assert reply.code == 201
    assert_json_headers(reply)
    assert reply.json["accepted"] is True and reply.json["duplicate"] is False
    msg_id = reply.json["id"]
    assert isinstance(msg_id, str) and msg_id
    (message,), _ = await b.poll("beta")
    assert message["id"] == msg_id
    assert message["from"] == "alpha" and message["to"] == "beta"
    assert message["type"] == "message" and message["body"] == {}
    assert message["replyTo"] is None and message["ack"] is False
    assert message["kind"] == "message"
    assert message["rootId"] is None and message["parentId"] is None
    assert ISO.match(message["ts"])


@pytest_twisted.ensureDeferred
async def test_full_envelope_is_kept_verbatim():
    b = await two_agents()
    envelope = {
        "id": "client-chosen-1",
        "from": "alpha",
        "to": "beta",
        "type": "ack",
        "body": {"text": "hi", "nested": {"n": [1, 2.5, None, True]}, "u": "héllo ✓"},
        "replyTo": "earlier",
        "ack": True,
    }
    reply = await b.post("alpha", "/messages", envelope)
    assert reply.code == 201 and reply.json == {
        "accepted": True, "id": "client-chosen-1", "duplicate": False,
    }
    (message,), cursor = await b.poll("beta")
    assert cursor == "client-chosen-1"
    for field, value in envelope.items():
        assert message[field] == value, field


@pytest_twisted.ensureDeferred
async def test_ts_is_assigned_by_the_broker_when_absent():
    b = await two_agents()
    await b.message("alpha", "beta", id="absent")
    await b.message("alpha", "beta", id="null", ts=None)
    await b.message("alpha", "beta", id="empty", ts="")
    await b.message("alpha", "beta", id="number", ts=1712345678)
    await b.message("alpha", "beta", id="object", ts={"iso": "x"})
    messages, _ = await b.poll("beta")
    assert [m["ts"] for m in messages] == ["2024-04-05T19:34:38.000Z"] * 5  # START


@pytest_twisted.ensureDeferred
async def test_ts_is_always_the_brokers_store_time():
    """Spec §2: ``ts`` is the "broker-side timestamp when the message is stored"; the
    reference sets it to now whatever the client sent, so a sender cannot backdate."""
    b = await two_agents()
    b.clock.advance(0.25)
    for sent in ("1999-01-01T00:00:00.000Z", 12345, "", None):
        await b.message("alpha", "beta", ts=sent)
    messages, _ = await b.poll("beta")
    assert [m["ts"] for m in messages] == ["2024-04-05T19:34:38.250Z"] * 4


@pytest_twisted.ensureDeferred
async def test_null_from_body_and_ack_count_as_absent():
    b = await two_agents()
    reply = await b.post("alpha", "/messages",
                         {"id": "n1", "to": "beta", "from": None, "body": None, "ack": None})
    assert reply.code == 201, reply.json
    (message,), _ = await b.poll("beta")
    assert (message["from"], message["body"], message["ack"]) == ("alpha", {}, False)


@pytest_twisted.ensureDeferred
async def test_duplicate_id_is_201_then_200_and_not_stored_twice():
    b = await two_agents()
    first = await b.post("alpha", "/messages", {"id": "m-1", "to": "beta", "body": {"n": 1}})
    again = await b.post("alpha", "/messages", {"id": "m-1", "to": "beta", "body": {"n": 2}})
    assert first.code == 201 and first.json == {"accepted": True, "id": "m-1", "duplicate": False}
    assert again.code == 200 and again.json == {"accepted": True, "id": "m-1", "duplicate": True}
    assert_json_headers(again)
    messages, _ = await b.poll("beta")
    assert [(m["id"], m["body"]) for m in messages] == [("m-1", {"n": 1})]


@pytest_twisted.ensureDeferred
async def test_any_string_up_to_256_characters_is_an_id():
    b = await two_agents()
    for message_id in ("with space", "ünï", "x" * 256, "a/b?c"):  # at most 256 characters
        reply = await b.post("alpha", "/messages", {"id": message_id, "to": "beta"})
        assert reply.code == 201 and reply.json["id"] == message_id


@pytest.mark.parametrize(
    "envelope",
    [
        {"body": {}},  # to missing
        {"to": ""},
        {"to": 5},
        {"to": None},
        {"to": ["beta"]},
        {"to": "beta", "from": "gamma"},  # from mismatch
        {"to": "beta", "from": 7},
        {"to": "alpha"},  # self-send
        {"to": "beta", "type": "reply"},
        {"to": "beta", "type": None},
        {"to": "beta", "type": 1},
        {"to": "beta", "kind": "question"},
        {"to": "beta", "kind": 3},
        {"to": "beta", "body": "text"},
        {"to": "beta", "body": ["x"]},
        {"to": "beta", "body": 1},
        {"to": "beta", "replyTo": 5},
        {"to": "beta", "replyTo": {"id": "x"}},
        {"to": "beta", "ack": "true"},
        {"to": "beta", "ack": 1},
        {"to": "beta", "id": ""},
        {"to": "beta", "id": 5},
        {"to": "beta", "id": None},
        {"to": "beta", "rootId": 5},
        {"to": "beta", "parentId": ["p"]},
    ],
    ids=lambda e: json.dumps(e),
)
@pytest_twisted.ensureDeferred
async def test_send_rejects_malformed_envelopes(envelope):
    b = await two_agents()
    assert_error(await b.post("alpha", "/messages", envelope), 400, "bad_request")
    assert (await b.poll("beta"))[0] == []


@pytest.mark.parametrize("value", [[], "text", 5, None, True])
@pytest_twisted.ensureDeferred
async def test_send_body_must_be_an_object(value):
    b = await two_agents()
    assert_error(await b.post("alpha", "/messages", raw=json.dumps(value).encode()),
                 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_send_empty_body_is_400():
    b = await two_agents()
    assert_error(await b.post("alpha", "/messages", raw=b""), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_send_accepts_null_reply_to_and_explicit_defaults():
    b = await two_agents()
    reply = await b.post("alpha", "/messages", {
        "to": "beta", "replyTo": None, "type": "message", "ack": False, "from": "alpha",
        "kind": "message", "rootId": None, "parentId": None,
    })
    assert reply.code == 201


@pytest_twisted.ensureDeferred
async def test_send_to_unregistered_recipient_is_404():
    b = await two_agents()
    reply = await b.post("alpha", "/messages", {"to": "nobody", "id": "lost"})
    assert_error(reply, 404, "no_such_agent")
    assert (await b.store.find("lost", START)) is None


@pytest_twisted.ensureDeferred
async def test_a_store_answering_is_registered_with_a_deferred_is_honoured():
    """Store plugins written when every IMessageStore method returned a Deferred."""
    from twisted.internet.defer import succeed

    from relay.store.memory import MemoryStore

    class AskingStore(MemoryStore):
        def is_registered(self, agent):
            return succeed(super().is_registered(agent))

    b = Broker(store=AskingStore())
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/messages", {"to": "nobody", "id": "lost"}),
                 404, "no_such_agent")
    assert (await b.store.find("lost", START)) is None
    assert (await b.post("alpha", "/messages", {"to": "beta", "id": "kept"})).code == 201


@pytest_twisted.ensureDeferred
async def test_a_send_checks_its_recipient_in_the_stores_add_alone():
    """One store operation per send: the registered-recipient rule is decided by
    ``add`` itself, never by a separate ``is_registered`` question."""
    from relay.store.memory import MemoryStore

    class CountingStore(MemoryStore):
        calls: list = []

        def is_registered(self, agent):
            self.calls.append("is_registered")
            return super().is_registered(agent)

        def add(self, message, rules, registered_recipient=False):
            self.calls.append(("add", registered_recipient))
            return super().add(message, rules, registered_recipient)

    b = Broker(store=CountingStore())
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/messages", {"to": "nobody", "id": "lost"}),
                 404, "no_such_agent")
    assert (await b.post("alpha", "/messages", {"to": "beta", "id": "kept"})).code == 201
    assert b.store.calls == [("add", True), ("add", True)]


@pytest_twisted.ensureDeferred
async def test_registered_offline_recipient_still_receives():
    b = await two_agents()
    b.clock.advance(10_000)
    await b.register("alpha")
    assert (await b.post("alpha", "/messages", {"to": "beta"})).code == 201


@pytest_twisted.ensureDeferred
async def test_broker_managed_fields_are_ignored_on_send():
    b = await two_agents()
    await b.message("alpha", "beta", id="m", status="done", attempts=9, leaseUntil=1,
                    leaseId="forged")
    (message,), _ = await b.poll("beta")
    assert message["status"] == "queued" and message["attempts"] == 0
    assert message["leaseUntil"] is None and "leaseId" not in message


@pytest.mark.parametrize("field", ["id", "replyTo", "rootId", "parentId", "to"])
@pytest_twisted.ensureDeferred
async def test_an_id_or_reference_over_256_characters_is_400(field):
    _, client, _ = await registered("alpha", "beta")
    at_limit: Dict[str, Any] = {"to": "beta", field: "x" * MAX_ID_CHARS}
    if field == "to":
        at_limit["to"] = "beta"
    else:
        assert (await client.post("alpha", "/messages", at_limit))[0] == 201
    over = {"to": "beta", field: "y" * (MAX_ID_CHARS + 1)}
    message = refused(await client.post("alpha", "/messages", over))
    assert field in message and "256" in message


# -- v1.1: fields and the routing ACL (seed §5.1) ------------------------------------------


@pytest_twisted.ensureDeferred
async def test_v11_fields_are_stored_and_returned():
    b = await two_agents()
    await b.message("alpha", "beta", id="r", kind="reply", rootId="root", parentId="p")
    (m,) = await b.pull("beta")
    assert (m["kind"], m["rootId"], m["parentId"]) == ("reply", "root", "p")


@pytest_twisted.ensureDeferred
async def test_acl_on_send():
    b = Broker(agents={"alpha": {"allowed_targets": ["beta"]}, "gamma": {}})
    await b.register("alpha", "beta", "gamma")
    assert (await b.post("alpha", "/messages", {"to": "beta"})).code == 201
    assert_error(await b.post("alpha", "/messages", {"to": "gamma", "id": "x"}),
                 403, "forbidden")
    assert (await b.store.find("x", START)) is None
    assert (await b.post("beta", "/messages", {"to": "gamma"})).code == 201, "no entry"
    assert (await b.post("gamma", "/messages", {"to": "alpha"})).code == 201, "no list"


@pytest_twisted.ensureDeferred
async def test_acl_is_checked_before_the_recipient_lookup():
    b = Broker(agents={"alpha": {"allowed_targets": ["beta"]}})
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/messages", {"to": "nobody"}), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_acl_empty_list_forbids_everyone():
    b = Broker(agents={"alpha": {"allowed_targets": []}})
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/messages", {"to": "beta"}), 403, "forbidden")


# -- inbox quotas --------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_full_inbox_is_429_inbox_full_until_the_recipient_takes_some():
    _, client, _ = make_api(inboxMaxMessages=2)
    assert (await client.post("beta", "/register", {}))[0] == 200
    for i in range(2):
        assert (await client.post("alpha", "/messages", {"to": "beta", "id": f"f{i}"}))[0] == 201
    code, body, _ = await client.post("alpha", "/messages", {"to": "beta", "id": "f2"})
    assert code == 429 and body["error"]["code"] == "inbox_full"
    assert "'beta'" in body["error"]["message"]
    code, body, _ = await client.post("alpha", "/messages", {"to": "beta", "id": "f0"})
    assert (code, body["duplicate"]) == (200, True)
    _, pulled, _ = await client.post("beta", "/v1/pull", {"limit": 1})
    (m,) = pulled["messages"]
    assert (await client.post("beta", "/v1/ack", {"messageId": m["id"], "leaseId": m["leaseId"],
                                                  "outcome": "completed"}))[0] == 200
    assert (await client.post("alpha", "/messages", {"to": "beta", "id": "f2"}))[0] == 201


@pytest_twisted.ensureDeferred
async def test_the_inbox_byte_limit_counts_bodies():
    _, client, _ = make_api(inboxMaxBytes=1000)
    assert (await client.post("beta", "/register", {}))[0] == 200
    big = {"t": "é" * 450}  # 900 UTF-8 bytes of text
    assert (await client.post("alpha", "/messages", {"to": "beta", "body": big}))[0] == 201
    code, body, _ = await client.post("alpha", "/messages", {"to": "beta", "body": big})
    assert (code, body["error"]["code"]) == (429, "inbox_full")


@pytest_twisted.ensureDeferred
async def test_the_inbox_byte_quota_counts_ids_and_references():
    _, client, _ = await registered("alpha", "beta", inboxMaxBytes=2100)
    for i in range(2):
        envelope = {"to": "beta", "id": f"{i}" + "i" * 255, "rootId": "r" * 256,
                    "parentId": "p" * 256, "replyTo": "t" * 256}
        assert (await client.post("alpha", "/messages", envelope))[0] == 201
    envelope = {"to": "beta", "id": "2" + "i" * 255, "rootId": "r" * 256}
    message = refused(await client.post("alpha", "/messages", envelope), 429, "inbox_full")
    assert "beta" in message


# -- v1.2: TTL and delay (EXTENSIONS.md §7), the v1.1 shape kept (§10) ---------------------


@pytest_twisted.ensureDeferred
async def test_a_message_without_extension_fields_has_the_v11_fields_everywhere():
    b = await two_agents()
    await b.message("alpha", "beta", id="plain", kind="request")
    views = [(await b.poll("beta"))[0][0],
             (await b.post("beta", "/v1/recent", {})).json["messages"][0],
             (await b.post("beta", "/v1/messages/query", {})).json["messages"][0],
             (await b.post("alpha", "/v1/thread", {"rootId": "plain"})).json["messages"][0]]
    for view in views:
        assert set(view) == V11_FIELDS, view
    (leased,) = await b.pull("beta")
    assert set(leased) == V11_FIELDS | {"leaseId"}


@pytest_twisted.ensureDeferred
async def test_ttl():
    b = await two_agents(messageTtlDays=1)
    reply = await b.post("alpha", "/messages", {"to": "beta", "ttlSeconds": 30, "kind": "request"})
    assert reply.code == 201
    msg_id = reply.json["id"]
    (message,), _ = await b.poll("beta")
    assert message["expiresAt"] == iso_timestamp(START + 30)
    (entry,) = await b.status("alpha", msg_id)
    assert entry["expiresAt"] == int((START + 30) * 1000)
    b.clock.advance(30)
    assert await b.pull("beta") == []
    (entry,) = await b.status("alpha", msg_id)
    assert entry["status"] == "not_found"
    await b.broker.sweep_expired()
    (notice,) = await b.pull("alpha")
    assert notice["body"]["relayNotice"]["event"] == "expired"


@pytest.mark.parametrize(("ttl", "days"), [(0, 7), (-1, 7), (1.5, 7), (30.0, 7), ("30", 7),
                                           (86401, 1), (1, 0)])
@pytest_twisted.ensureDeferred
async def test_ttl_seconds_range(ttl, days):
    b = await two_agents(messageTtlDays=days)
    reply = await b.post("alpha", "/messages", {"to": "beta", "ttlSeconds": ttl})
    assert_error(reply, 400, "bad_request")
    assert "ttlSeconds" in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_delay():
    b = await two_agents()
    reply = await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": 120, "id": "d"})
    assert reply.code == 201
    assert await b.pull("beta") == []
    (view,) = (await b.post("beta", "/v1/recent", {})).json["messages"]
    assert view["notBefore"] == iso_timestamp(START + 120)
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(19)
    assert not waiting.called
    b.advance(1)
    assert (await waiting).json["messages"] == []
    b.clock.advance(99)  # START + 119
    pulls = []
    store_pull = b.store.pull
    b.store.pull = lambda *args: pulls.append(args) or store_pull(*args)
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    for _ in range(9):
        b.advance(0.1)
    assert not waiting.called and len(pulls) == 1, "no busy loop while the delay runs"
    b.advance(0.15)  # the delay runs out: the waiting pull wakes then, not at its deadline
    (leased,) = (await waiting).json["messages"]
    assert leased["id"] == "d" and "notBefore" not in leased


@pytest.mark.parametrize("delay", [-1, 86401, 1.5, "5", True])
@pytest_twisted.ensureDeferred
async def test_delay_seconds_range(delay):
    b = await two_agents()
    assert_error(await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": delay}),
                 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_a_zero_delay_and_null_fields_are_no_extension():
    b = await two_agents()
    await b.post("alpha", "/messages", {"to": "beta", "delaySeconds": 0, "ttlSeconds": None})
    (message,), _ = await b.poll("beta")
    assert set(message) == V11_FIELDS


# -- v1.2: the ids of failure notices are reserved (EXTENSIONS.md §4) ----------------------


@pytest_twisted.ensureDeferred
async def test_no_one_can_take_the_id_of_a_failure_notice_first():
    _, client, _ = await registered("alpha", "beta", "mallory")
    request = {"to": "beta", "id": "q1", "kind": "request"}
    assert (await client.post("alpha", "/messages", request))[0] == 201
    squat = {"to": "alpha", "id": notice_id("q1"), "kind": "reply", "parentId": "q1"}
    message = refused(await client.post("mallory", "/messages", squat))
    assert "reserved" in message
    _, pulled, _ = await client.post("beta", "/v1/pull", {"limit": 1})
    (leased,) = pulled["messages"]
    in_reply = {"messageId": leased["id"], "leaseId": leased["leaseId"],
                "outcome": "completed", "reply": {"id": notice_id("q9")}}
    assert "reserved" in refused(await client.post("beta", "/v1/ack", in_reply))
    reject = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": "reject"}
    assert (await client.post("beta", "/v1/ack", reject))[0] == 200
    _, answers, _ = await client.post("alpha", "/v1/pull", {"parentId": "q1"})
    (notice,) = answers["messages"]
    assert notice["id"] == notice_id("q1") and notice["from"] == "beta"
    assert notice["body"]["relayNotice"]["event"] == "failed"


# -- v1.3: group sends (REACH §13), on every backend ---------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_group_send_stores_one_copy_per_member_but_the_sender(store):
    b = await group_broker(store)
    reply = await group_send(b, id="g1", kind="request", body={"text": "review this"})
    assert reply.code == 201
    copies = reply.json["copies"]
    assert reply.json == {"accepted": True, "id": "g1", "duplicate": False,
                          "copies": copies}
    assert [c["to"] for c in copies] == ["bob", "carol"]
    assert len({c["id"] for c in copies} | {"g1"}) == 3
    for member, copy in (("bob", copies[0]), ("carol", copies[1])):
        (leased,) = (await on(b, b.post(member, "/v1/pull", {}))).json["messages"]
        assert leased["id"] == copy["id"]
        assert leased["to"] == member and leased["from"] == "alice"
        assert leased["via"] == "group:reviewers"
        assert leased["body"] == {"text": "review this"} and leased["kind"] == "request"
        assert leased["rootId"] == "g1"
    assert (await on(b, b.post("alice", "/v1/pull", {}))).json["messages"] == []
    # each copy is an ordinary message: its own lease and ack
    (bob_copy,) = (await on(b, b.post("bob", "/v1/status",
                                      {"messageIds": [copies[0]["id"]]}))).json["messages"]
    assert bob_copy["status"] == "leased"


@pytest_twisted.ensureDeferred
async def test_a_repeated_group_send_is_a_duplicate_with_the_same_copies(store):
    b = await group_broker(store)
    first = await group_send(b, id="g1")
    again = await group_send(b, id="g1", body={"n": 2})
    assert again.code == 200
    assert again.json == dict(first.json, duplicate=True)
    (pulled,) = (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"]
    assert pulled["body"] == {"n": 1}
    assert (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"] == []


@pytest_twisted.ensureDeferred
async def test_a_full_inbox_of_one_member_refuses_the_whole_send(store):
    b = await group_broker(store, inboxMaxMessages=1)
    assert (await on(b, b.post("dan", "/messages", {"to": "carol", "id": "fill"}))).code == 201
    refused = await group_send(b, id="g1")
    assert_error(refused, 429, "inbox_full")
    assert "'carol'" in refused.json["error"]["message"]
    assert (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"] == []
    (entry,) = (await on(b, b.post("alice", "/v1/status",
                                   {"messageIds": ["g1"]}))).json["messages"]
    assert entry["status"] == "not_found"
    assert b.broker.counters.refused == {"inbox_full": 1}
    # once carol took hers, the same send goes through whole
    (taken,) = (await on(b, b.post("carol", "/v1/pull", {}))).json["messages"]
    await on(b, b.post("carol", "/v1/ack", {"messageId": "fill", "leaseId": taken["leaseId"],
                                            "outcome": "completed"}))
    assert (await group_send(b, id="g1")).code == 201
    assert b.broker.counters.group_sends == {"reviewers": 1}


@pytest_twisted.ensureDeferred
async def test_an_unknown_group_is_no_such_agent(store):
    b = await group_broker(store)
    for to in ("group:nobody", "group:", "group:Reviewers"):
        assert_error(await group_send(b, to=to), 404, "no_such_agent")


@pytest_twisted.ensureDeferred
async def test_the_acl_names_the_group_as_a_target(store):
    agents = dict(GROUP_TEAM, alice={"allowed_targets": ["group:pair"]},
                  dan={"allowed_targets": ["bob", "carol"]})
    b = await group_broker(store, agents=agents)
    assert (await group_send(b, to="group:pair")).code == 201
    assert_error(await group_send(b, to="group:reviewers"), 403, "forbidden")
    # members themselves are no licence to reach their group
    assert_error(await group_send(b, sender="dan", to="group:pair"), 403, "forbidden")
    # as for an agent, the ACL answers first: an unknown group is no different
    assert_error(await group_send(b, sender="dan", to="group:nobody"), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_a_sent_id_that_names_a_message_is_an_id_conflict(store):
    b = await group_broker(store)
    assert (await on(b, b.post("alice", "/messages", {"to": "dan", "id": "taken"}))).code == 201
    assert_error(await group_send(b, id="taken"), 409, "id_conflict")
    assert (await on(b, b.post("bob", "/v1/pull", {}))).json["messages"] == []


@pytest_twisted.ensureDeferred
async def test_each_member_is_told_of_its_copy(store):
    b = await group_broker(store)
    copies = (await group_send(b, id="g1")).json["copies"]
    for copy in copies:
        page = await b.store.events(copy["to"], 0, 10)
        assert [(e.type, json.loads(e.data)["id"]) for e in page.events] == [
            ("message", copy["id"])]
        # REACH §11: a message event carries via when set
        assert json.loads(page.events[0].data)["via"] == "group:reviewers"
    assert (await b.store.events("alice", 0, 10)).events == []


@pytest_twisted.ensureDeferred
async def test_a_group_whose_only_member_is_the_sender_makes_no_copy(store):
    b = await group_broker(store, groups={"solo": {"members": ["alice"]}})
    reply = await group_send(b, to="group:solo", id="g1")
    assert reply.code == 201 and reply.json["copies"] == []


# -- v1.3: role targets and priority (REACH §13, §14) --------------------------------------


@pytest_twisted.ensureDeferred
async def test_priority_is_an_integer_from_0_to_9(role_broker):
    await role_broker.register("beta")
    for bad in (10, -1, 1.5, 3.0, "3", True, [1]):
        reply = await role_broker.post("alpha", "/messages", {"to": "beta", "priority": bad})
        assert_error(reply, 400, "bad_request")
        assert "priority" in reply.json["error"]["message"]
    for good in (0, 9, None):
        reply = await role_broker.post("alpha", "/messages", {"to": "beta", "priority": good})
        assert reply.code == 201


@pytest_twisted.ensureDeferred
async def test_an_unknown_role_is_no_such_agent_and_the_acl_names_role_targets(role_broker):
    assert_error(await role_broker.post("alpha", "/messages", {"to": "role:nope"}), 404,
                 "no_such_agent")
    await role_broker.register("beta")
    assert (await role_broker.post("narrow", "/messages", {"to": "role:triage"})).code == 201
    assert_error(await role_broker.post("narrow", "/messages", {"to": "role:audit"}), 403,
                 "forbidden")
    assert_error(await role_broker.post("narrow", "/messages", {"to": "beta"}), 403, "forbidden")


@pytest_twisted.ensureDeferred
async def test_group_copies_carry_the_sent_priority():
    b = TeamBroker(agents=ROLE_TEAM, roles=ROLES, groups={"pair": {"members": ["dan", "erin"]}})
    await b.register("dan")
    await b.message("alpha", "dan", id="plain")
    sent = await b.post("alpha", "/messages", {"to": "group:pair", "id": "g", "priority": 6})
    assert sent.code == 201 and len(sent.json["copies"]) == 2
    first, second = await b.pull("dan")
    assert (first["via"], first["priority"]) == ("group:pair", 6)
    assert second["id"] == "plain"
    assert_error(await b.post("alpha", "/messages", {"to": "group:pair", "priority": 10}),
                 400, "bad_request")


# -- the v2/v3 wire: POST /v1/messages (WIRE-V2) -------------------------------------------


@pytest_twisted.ensureDeferred
async def test_send_is_idempotent_per_sender_and_key(v2_broker):
    alpha = v2_broker.client("alpha")
    first = await alpha.send_request("beta", "hello", idempotency_key="k-1")
    assert first.code == 200
    assert first.json == {"message_id": views.message_id_for("alpha", "k-1"), "created": True,
                          "protocol_version": 3}
    again = await alpha.send_request("beta", "other text", idempotency_key="k-1")
    assert again.json == dict(first.json, created=False)
    other = await v2_broker.client("gamma").send_request("beta", "hello", idempotency_key="k-1")
    assert other.json["created"] is True and other.json["message_id"] != first.json[
        "message_id"]
    assert len(await v2_broker.client("beta").pull()) == 2


@pytest_twisted.ensureDeferred
async def test_send_refusals(v2_broker):
    alpha = v2_broker.client("alpha")
    base = alpha.request_payload("beta", "hello")
    cases = [
        (dict(base, origin="gamma"), 403, "forbidden"),
        (dict(base, kind="note"), 400, "bad_request"),
        (dict(base, body="   "), 400, "bad_request"),
        (dict(base, body="x" * 48001), 400, "bad_request"),
        (dict(base, idempotency_key=""), 400, "bad_request"),
        (dict(base, allow_shared_write="yes"), 400, "bad_request"),
        (dict(base, execution_mode="admin"), 400, "bad_request"),
        (dict(base, execution_mode="write"), 403, "forbidden"),
        (dict(base, kind="reply"), 400, "bad_request"),
        (dict(base, kind="reply", parent_id="nope"), 404, "no_such_message"),
        (dict(base, target="no such agent!"), 400, "bad_request"),
        (dict(base, target="名字"), 400, "bad_request"),
        (dict(base, target="a" * 65), 400, "bad_request"),
        (dict(base, target=None), 400, "bad_request"),
        ({k: v for k, v in base.items() if k != "target"}, 400, "bad_request"),
        (dict(base, body={"text": "an object"}), 400, "bad_request"),
    ]
    for payload, status, code in cases:
        assert_v2_error(await alpha.request("POST", "/v1/messages", payload), status, code)
    for raw in (b"", b"not json", b"[1]", b"{"):
        assert_v2_error(await alpha.request("POST", "/v1/messages", raw=raw), 400, "bad_request")
    assert await v2_broker.client("beta").pull() == []


@pytest_twisted.ensureDeferred
async def test_a_target_is_trimmed_and_lowercased_as_the_reference_reads_it(v2_broker):
    """The reference's clients lowercase the target themselves; a raw client need not."""
    alpha = v2_broker.client("alpha")
    for target in (" Beta ", "BETA"):
        assert (await alpha.send_request(target, f"to {target!r}")).code == 200
    pulled = await v2_broker.client("beta").pull()
    assert sorted(m["body"] for m in pulled) == ["to ' Beta '", "to 'BETA'"]
    assert {m["target"] for m in pulled} == {"beta"}


@pytest_twisted.ensureDeferred
async def test_send_limits_and_clamps(v2_broker):
    alpha = v2_broker.client("alpha")
    longest = "😀" * 48000  # code points, not UTF-16 units nor bytes
    assert (await alpha.send_request("beta", longest)).code == 200
    short = await alpha.send_request("beta", "ttl", ttl_seconds=5, topic="t" * 300,
                                     session_ref="s" * 400)
    long = await alpha.send_request("beta", "ttl", ttl_seconds=10**9)
    default = await alpha.send_request("beta", "ttl", ttl_seconds="soon")
    pulled = {m["message_id"]: m for m in await v2_broker.client("beta").pull()}
    assert pulled[short.json["message_id"]]["expires_at"] == START + 60
    assert len(pulled[short.json["message_id"]]["topic"]) == 200
    assert len(pulled[short.json["message_id"]]["session_ref"]) == 300
    assert pulled[long.json["message_id"]]["expires_at"] == START + 3600
    assert pulled[default.json["message_id"]]["expires_at"] == START + 3600
    (first,) = [m for m in pulled.values() if m["body"] == longest]
    assert first["execution_mode"] == "read"


@pytest_twisted.ensureDeferred
async def test_a_reply_inherits_from_its_request(v2_broker):
    alpha, beta, request_id, message = await leased_request(
        v2_broker, execution_mode="continue", session_ref="s-1", topic="plans", context="c",
        root_id="root-given")
    assert (message["root_id"], message["context"], message["topic"]) == (
        "root-given", "c", "plans")
    assert_v2_error(await v2_broker.client("gamma").send_reply(request_id, "alpha", "x"), 403,
                    "forbidden")
    assert_v2_error(await beta.send_reply(request_id, "gamma", "x"), 403, "forbidden")
    reply = await beta.send_reply(request_id, "alpha", "done", topic="ignored",
                                  execution_mode="write", allow_shared_write=True)
    assert reply.code == 200
    (answer,) = await alpha.pull()
    assert answer == {
        "message_id": reply.json["message_id"], "root_id": "root-given",
        "parent_id": request_id, "origin": "beta", "target": "alpha", "kind": "reply",
        "body": "done", "session_ref": "s-1", "created_at": START,
        "expires_at": START + 3600, "execution_mode": "continue", "topic": "plans",
        "lease_token": answer["lease_token"], "lease_until": START + 600}


@pytest_twisted.ensureDeferred
async def test_write_mode_is_closed_unless_granted(v2_brokers):
    broker = v2_brokers(config=make_config(agents={
        "alpha": {"allowed_targets": ["beta"], "allowed_write_targets": ["beta"]},
        "beta": {"allowed_targets": ["alpha"]}}))
    alpha, beta = broker.client("alpha"), broker.client("beta")
    assert (await alpha.send_request("beta", "w", execution_mode="write",
                                     allow_shared_write=True)).code == 200
    assert_v2_error(await alpha.send_request("gamma", "r"), 403, "forbidden")
    assert_v2_error(await beta.send_request("alpha", "w", execution_mode="write"), 403,
                    "forbidden")
    assert (await beta.send_request("alpha", "c", execution_mode="continue")).code == 200
    (message,) = await beta.pull()
    assert message["allow_shared_write"] is True and message["execution_mode"] == "write"
