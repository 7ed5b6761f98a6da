"""The v1.0 HTTP API, section by section of the spec (§1, §2, §4, §6).

Every request runs in memory through the broker's own request class; time is
a ``task.Clock``.
"""

from __future__ import annotations

import json
import re

import pytest
import pytest_twisted

from relay import __version__
from relay.testing import START
from relay.wire.protocol import MAX_BODY_BYTES
from tests.support.api import Broker, assert_error, assert_json_headers

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\Z")


async def two_agents(**broker) -> Broker:
    b = Broker(**broker)
    await b.register("alpha", "beta")
    return b


# -- §4 GET / ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_root_needs_no_auth_and_reports_the_protocol():
    b = Broker()
    reply = await b.get(None, "/")
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json["protocol"] == "1.0"
    assert reply.json["broker"] == "dsh-agent-relay"
    assert reply.json["version"] == __version__
    assert reply.json["storage"] == "memory"
    caps = reply.json["capabilities"]
    for name in ("leaseDelivery", "requestReply", "filteredQuery"):
        assert caps[name] is True


@pytest_twisted.ensureDeferred
async def test_root_ignores_auth_headers_even_when_wrong():
    b = Broker()
    reply = await b.get("alpha", "/", secret="wrong")
    assert reply.code == 200 and reply.json["protocol"] == "1.0"


# -- §4 POST /register, GET /peers -------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_register_returns_agent_and_seconds():
    b = Broker()
    reply = await b.post("alpha", "/register", {"agent": "alpha"})
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json == {"ok": True, "agent": "alpha", "ts": int(b.clock.seconds())}


@pytest_twisted.ensureDeferred
async def test_register_without_body():
    b = Broker()
    reply = await b.post("alpha", "/register")
    assert reply.code == 200 and reply.json["agent"] == "alpha"


@pytest_twisted.ensureDeferred
async def test_register_body_agent_must_match_header():
    b = Broker()
    assert_error(await b.post("alpha", "/register", {"agent": "beta"}), 400, "bad_request")
    assert (await b.store.peers()) == []


@pytest_twisted.ensureDeferred
async def test_register_body_must_be_an_object():
    b = Broker()
    assert_error(await b.post("alpha", "/register", ["alpha"]), 400, "bad_request")
    assert_error(await b.post("alpha", "/register", raw=b"{nope"), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_peers_sorted_with_ttl_90_seconds():
    b = Broker()
    await b.register("gamma")
    b.clock.advance(10)
    await b.register("alpha")
    start = int(b.clock.seconds())
    reply = await b.get("alpha", "/peers")
    assert reply.code == 200
    assert_json_headers(reply)
    assert reply.json == {
        "peers": [
            {"agent": "alpha", "online": True, "lastSeen": start},
            {"agent": "gamma", "online": True, "lastSeen": start - 10},
        ]
    }
    b.clock.advance(79.5)
    online = {p["agent"]: p["online"] for p in (await b.get("alpha", "/peers")).json["peers"]}
    assert online == {"alpha": True, "gamma": True}
    b.clock.advance(0.5)  # gamma: now - lastSeen == 90, not < 90
    online = {p["agent"]: p["online"] for p in (await b.get("alpha", "/peers")).json["peers"]}
    assert online == {"alpha": True, "gamma": False}


@pytest_twisted.ensureDeferred
async def test_heartbeat_refreshes_last_seen():
    b = Broker()
    await b.register("alpha")
    b.clock.advance(200)
    await b.register("alpha")
    (peer,) = (await b.get("alpha", "/peers")).json["peers"]
    assert peer == {"agent": "alpha", "online": True, "lastSeen": int(b.clock.seconds())}


# -- §2 / §4 POST /messages ---------------------------------------------------------


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


# -- §1 request bodies: invalid JSON, UTF-8, size --------------------------------


@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"to": "beta",}', b"\xff\xfe{}",
                                 b'{"to": "beta", "body": {"t": "\xc3"}}',
                                 b'{"to": "beta", "body": {"t": "\\ud800"}}',
                                 b'{"to": "beta", "body": {"x": NaN}}',
                                 b'{"to": "beta", "body": {"x": -Infinity}}',
                                 b'{"to": "beta", "body": {"x": 1e400}}',
                                 b'{"to": "beta", "body": {"x": 1' + b"0" * 5000 + b'}}'])
@pytest_twisted.ensureDeferred
async def test_invalid_json_or_utf8_is_400(raw):
    b = await two_agents()
    assert_error(await b.post("alpha", "/messages", raw=raw), 400, "bad_request")
    assert (await b.poll("beta"))[0] == []


@pytest.mark.parametrize("number", [b"1e400", b"-1E+999", b"1" + b"0" * 400 + b".5"])
@pytest_twisted.ensureDeferred
async def test_a_number_beyond_a_double_is_named_as_such(number):
    """Valid JSON, but stored it would be served back as Infinity: refused, and the
    message says why rather than calling the body invalid JSON."""
    b = await two_agents()
    reply = await b.post("alpha", "/messages", raw=b'{"to": "beta", "body": {"x": %s}}' % number)
    assert_error(reply, 400, "bad_request")
    assert "too large for a double" in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_every_stored_body_is_served_back_as_strict_json():
    b = await two_agents()
    raw = b'{"to": "beta", "body": {"big": 1e308, "neg": -0.0, "int": 123456789012345678901}}'
    assert (await b.post("alpha", "/messages", raw=raw)).code == 201
    reply = await b.get("beta", "/messages")
    json.loads(reply.raw, parse_constant=lambda name: pytest.fail(f"non-JSON {name}"))


def _sized_envelope(size: int) -> bytes:
    head = b'{"to":"beta","body":{"pad":"'
    tail = b'"}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@pytest_twisted.ensureDeferred
async def test_body_of_exactly_1_mib_is_accepted():
    b = await two_agents()
    raw = _sized_envelope(MAX_BODY_BYTES)
    assert len(raw) == MAX_BODY_BYTES
    assert (await b.post("alpha", "/messages", raw=raw)).code == 201


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest_twisted.ensureDeferred
async def test_body_over_1_mib_is_400(chunked):
    b = await two_agents()
    raw = _sized_envelope(MAX_BODY_BYTES + 1)
    reply = await b.post("alpha", "/messages", raw=raw, chunked=chunked)
    assert_error(reply, 400, "bad_request")
    assert (await b.poll("beta"))[0] == []


@pytest_twisted.ensureDeferred
async def test_chunked_upload_in_many_pieces_over_the_limit_is_400():
    b = await two_agents()
    piece = b"x" * 65536
    chunks = [b'{"to":"beta","body":{"pad":"'] + [piece] * 17 + [b'"}}']
    headers = b.signed_headers("alpha", "POST", "/messages", b"".join(chunks))
    reply = await b.send("POST", "/messages", headers=headers, chunked=True, chunks=chunks)
    assert_error(reply, 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_chunked_upload_under_the_limit_is_accepted():
    b = await two_agents()
    chunks = [b'{"to":"beta",', b'"body":{"t":"hi"}}']
    headers = b.signed_headers("alpha", "POST", "/messages", b"".join(chunks))
    reply = await b.send("POST", "/messages", headers=headers, chunked=True, chunks=chunks)
    assert reply.code == 201


@pytest_twisted.ensureDeferred
async def test_oversized_body_is_400_even_unsigned_and_on_root():
    b = Broker()
    raw = b"x" * (MAX_BODY_BYTES + 1)
    assert_error(await b.post(None, "/register", raw=raw), 400, "bad_request")
    assert_error(await b.send("GET", "/", raw), 400, "bad_request")


# -- §4 GET /messages: cursor and limit ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_poll_cursor_semantics():
    b = await two_agents()
    await b.register("gamma")
    ids = [await b.message("alpha", "beta", id=f"m{i}") for i in range(5)]
    await b.message("alpha", "gamma", id="other")
    messages, cursor = await b.poll("beta", "?limit=2")
    assert [m["id"] for m in messages] == ids[:2] and cursor == ids[1]
    messages, cursor = await b.poll("beta", f"?since={cursor}")
    assert [m["id"] for m in messages] == ids[2:] and cursor == ids[4]
    messages, cursor = await b.poll("beta", f"?since={cursor}&limit=50")
    assert messages == [] and cursor == ids[4], "an empty poll keeps the cursor"
    messages, _ = await b.poll("beta", "?since=unknown-id")
    assert [m["id"] for m in messages] == ids, "an unknown cursor returns everything"
    messages, _ = await b.poll("beta", "?since=other")
    assert [m["id"] for m in messages] == [], "ordering is global: other agents' ids count"


@pytest_twisted.ensureDeferred
async def test_poll_with_empty_since_as_the_reference_client_sends_it():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.message("alpha", "beta", id="b")
    reply = await b.get("beta", "/messages?since=&limit=50")
    assert reply.code == 200
    assert_json_headers(reply)
    assert [m["id"] for m in reply.json["messages"]] == ["a", "b"]
    assert reply.json["cursor"] == "b"


@pytest_twisted.ensureDeferred
async def test_poll_with_nothing_returns_a_null_cursor():
    b = await two_agents()
    reply = await b.get("beta", "/messages?since=&limit=50")
    assert reply.json == {"messages": [], "cursor": None}
    reply = await b.get("beta", "/messages")
    assert reply.json == {"messages": [], "cursor": None}


@pytest_twisted.ensureDeferred
async def test_poll_returns_only_my_messages():
    b = await two_agents()
    await b.message("alpha", "beta", id="to-beta")
    await b.message("beta", "alpha", id="to-alpha")
    assert [m["id"] for m in (await b.poll("beta"))[0]] == ["to-beta"]
    assert [m["id"] for m in (await b.poll("alpha"))[0]] == ["to-alpha"]


@pytest_twisted.ensureDeferred
async def test_poll_cursor_with_percent_encoded_id():
    b = await two_agents()
    await b.message("alpha", "beta", id="a b&c")
    await b.message("alpha", "beta", id="next")
    messages, cursor = await b.poll("beta", "?since=a%20b%26c&limit=50")
    assert [m["id"] for m in messages] == ["next"] and cursor == "next"


@pytest.mark.parametrize(
    ("limit", "expected"),
    [("1", 1), ("0", 1), ("-5", 1), ("2.9", 2), ("199", 199), ("200", 200), ("201", 200),
     ("100000", 200), ("abc", 50), ("", 50), ("NaN", 50), ("Infinity", 50), (None, 50)],
)
@pytest_twisted.ensureDeferred
async def test_poll_limit_is_clamped(limit, expected):
    b = await two_agents()
    for i in range(205):
        await b.message("alpha", "beta", id=f"m{i:03d}")
    query = "" if limit is None else f"?limit={limit}"
    messages, cursor = await b.poll("beta", query)
    assert len(messages) == expected
    assert cursor == f"m{expected - 1:03d}"


# -- §4 POST /messages/<id>/ack (v1.0 receipts) -------------------------------------------


@pytest_twisted.ensureDeferred
async def test_receipt_stores_an_ack_envelope_for_the_sender():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1", ack=True)
    reply = await b.post("beta", "/messages/m1/ack", {"status": "ok"})
    assert reply.code == 201
    assert_json_headers(reply)
    assert reply.json["accepted"] is True
    (receipt,), _ = await b.poll("alpha")
    assert receipt["id"] == reply.json["id"]
    assert receipt["type"] == "ack" and receipt["replyTo"] == "m1"
    assert receipt["from"] == "beta" and receipt["to"] == "alpha"
    assert receipt["body"] == {"status": "ok"}


@pytest_twisted.ensureDeferred
async def test_receipt_with_error_status():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    reply = await b.post("beta", "/messages/m1/ack", {"status": "error", "error": "boom"})
    assert reply.code == 201
    (receipt,), _ = await b.poll("alpha")
    assert receipt["body"] == {"status": "error", "error": "boom"}


@pytest_twisted.ensureDeferred
async def test_receipt_with_empty_body_defaults_to_ok():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    assert (await b.post("beta", "/messages/m1/ack")).code == 201
    (receipt,), _ = await b.poll("alpha")
    assert receipt["body"] == {"status": "ok"}


@pytest_twisted.ensureDeferred
async def test_receipt_for_unknown_id_is_404():
    b = await two_agents()
    assert_error(await b.post("beta", "/messages/nope/ack", {"status": "ok"}),
                 404, "no_such_message")


@pytest_twisted.ensureDeferred
async def test_receipt_only_from_the_recipient():
    b = await two_agents()
    await b.register("gamma")
    await b.message("alpha", "beta", id="m1")
    assert_error(await b.post("gamma", "/messages/m1/ack", {}), 403, "forbidden")
    assert_error(await b.post("alpha", "/messages/m1/ack", {}), 403, "forbidden")
    assert (await b.poll("alpha"))[0] == []


@pytest.mark.parametrize("body", [{"status": "maybe"}, {"status": "error", "error": 5}, [],
                                  "ok"])
@pytest_twisted.ensureDeferred
async def test_receipt_rejects_malformed_bodies(body):
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    assert_error(await b.post("beta", "/messages/m1/ack", body), 400, "bad_request")
    assert (await b.poll("alpha"))[0] == []


@pytest_twisted.ensureDeferred
async def test_receipt_for_odd_ids():
    b = await two_agents()
    await b.message("alpha", "beta", id="with space")
    await b.message("alpha", "beta", id="a/b")
    assert (await b.post("beta", "/messages/with%20space/ack", {})).code == 201
    assert (await b.post("beta", "/messages/a/b/ack", {})).code == 201
    receipts, _ = await b.poll("alpha")
    assert sorted(r["replyTo"] for r in receipts) == ["a/b", "with space"]


@pytest_twisted.ensureDeferred
async def test_receipt_for_expired_message_is_404():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    b.clock.advance(8 * 86400)
    await b.broker.sweep_expired()
    assert_error(await b.post("beta", "/messages/m1/ack", {}), 404, "no_such_message")


# -- §3 / §6 authentication at the HTTP level ---------------------------------------------


@pytest.mark.parametrize(("method", "path"), [("POST", "/register"), ("GET", "/peers"),
                                              ("POST", "/messages"), ("GET", "/messages"),
                                              ("POST", "/messages/x/ack"), ("POST", "/v1/pull"),
                                              ("POST", "/v1/ack"), ("POST", "/v1/status"),
                                              ("POST", "/v1/recent"),
                                              ("POST", "/v1/messages/query")])
@pytest_twisted.ensureDeferred
async def test_every_endpoint_but_root_needs_auth(method, path):
    b = await two_agents()
    assert_error(await b.send(method, path, b"{}"), 401, "unauthenticated")
    assert_error(await b.request("alpha", method, path, {}, secret="wrong"),
                 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_signature_covers_the_query_string():
    b = await two_agents()
    headers = b.signed_headers("beta", "GET", "/messages?limit=1", b"")
    assert_error(await b.send("GET", "/messages?limit=2", headers=headers),
                 401, "unauthenticated")
    assert (await b.send("GET", "/messages?limit=1", headers=headers)).code == 200


@pytest_twisted.ensureDeferred
async def test_signature_covers_the_body():
    b = await two_agents()
    headers = b.signed_headers("alpha", "POST", "/messages", b'{"to":"beta"}')
    assert_error(await b.send("POST", "/messages", b'{"to": "beta"}', headers),
                 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_skew_at_http_level():
    b = await two_agents()
    now = int(b.clock.seconds())
    assert (await b.get("alpha", "/peers", timestamp=now - 300)).code == 200
    assert (await b.get("alpha", "/peers", timestamp=now + 300)).code == 200
    assert_error(await b.get("alpha", "/peers", timestamp=now - 301), 401, "unauthenticated")
    assert_error(await b.get("alpha", "/peers", timestamp=now + 301), 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_lockout_at_http_level():
    b = await two_agents()
    for _ in range(5):
        assert_error(await b.get("alpha", "/peers", secret="wrong"), 401, "unauthenticated")
    assert_error(await b.get("alpha", "/peers"), 403, "locked")
    assert (await b.get("beta", "/peers")).code == 200, "only the failing agent is locked"
    b.clock.advance(300)
    assert (await b.get("alpha", "/peers")).code == 200


@pytest_twisted.ensureDeferred
async def test_rate_limit_at_http_level():
    b = Broker(rateLimitLoopback=3)
    for _ in range(2):
        assert (await b.post("alpha", "/register", {})).code == 200
    assert_error(await b.get("beta", "/peers", secret="wrong"), 401, "unauthenticated")
    assert_error(await b.post("alpha", "/register", {}), 429, "rate_limited")
    assert_error(await b.get("beta", "/nope"), 429, "rate_limited")
    assert_error(await b.get(None, "/"), 429, "rate_limited")
    b.clock.advance(120)
    assert (await b.post("alpha", "/register", {})).code == 200


@pytest_twisted.ensureDeferred
async def test_requests_refused_for_size_and_get_root_count_toward_the_limit():
    b = Broker(rateLimitLoopback=3)
    too_big = b"x" * (MAX_BODY_BYTES + 1)
    assert_error(await b.post("alpha", "/messages", raw=too_big), 400, "bad_request")
    assert (await b.get(None, "/")).code == 200
    assert_error(await b.post(None, "/messages", raw=too_big), 400, "bad_request")
    assert_error(await b.get(None, "/"), 429, "rate_limited")


@pytest_twisted.ensureDeferred
async def test_per_agent_secrets_and_unknown_agent():
    b = Broker(agents={"alpha": {"secret": "a-secret-0123456789"},
                       "beta": {"secret": "b-secret-0123456789"}})
    b.secrets.update(alpha="a-secret-0123456789", beta="b-secret-0123456789")
    await b.register("alpha", "beta")
    assert_error(await b.post("alpha", "/register", {}, secret="b-secret-0123456789"),
                 401, "unauthenticated")
    assert_error(await b.post("gamma", "/register", {}), 401, "unknown_agent")


# -- §6 unknown routes and wrong methods ---------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nope"), ("POST", "/nope"), ("GET", "/v1/nope"), ("DELETE", "/messages"),
     ("PUT", "/register"), ("GET", "/register"), ("POST", "/peers"), ("GET", "/v1/pull"),
     ("GET", "/messages/m1/ack"), ("POST", "/"), ("DELETE", "/"), ("GET", "/messages/"),
     ("POST", "/messages/m1"), ("PATCH", "/v1/ack"), ("GET", "/v1/status"),
     ("GET", "/%2F"), ("POST", "/v1/%70ull"), ("POST", "/%72egister"), ("GET", "//peers"),
     ("POST", "//messages"), ("POST", "//v1/pull"), ("POST", "//messages/m1/ack"),
     ("GET", "//"), ("POST", "/messages/m1%2Fack"), ("POST", "/messages/m1%2fack"),
     ("POST", "/messages%2Fm1/ack"), ("POST", "/messages/m1/%61ck"),
     ("POST", "/messages/m1/ack%2F")],
)
@pytest_twisted.ensureDeferred
async def test_unknown_route_or_wrong_method_is_404_not_found(method, path):
    b = await two_agents()
    raw = b"" if method in ("GET", "DELETE") else b"{}"
    reply = await b.request("alpha", method, path, raw=raw)
    assert_error(reply, 404, "not_found")
    assert method in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_a_receipt_path_that_matches_only_once_decoded_stores_nothing():
    b = await two_agents()
    await b.message("alpha", "beta", id="m1")
    assert_error(await b.post("beta", "/messages/m1%2Fack", {}), 404, "not_found")
    assert (await b.poll("alpha"))[0] == [], "no receipt was stored"


@pytest_twisted.ensureDeferred
async def test_an_escaped_id_in_the_receipt_path_is_the_decoded_id():
    b = await two_agents()
    await b.message("alpha", "beta", id="sl/ash ü")
    reply = await b.post("beta", "/messages/sl%2Fash%20%C3%BC/ack", {})
    assert reply.code == 201, reply
    (receipt,), _ = await b.poll("alpha")
    assert receipt["replyTo"] == "sl/ash ü"


@pytest_twisted.ensureDeferred
async def test_an_encoded_root_needs_authentication():
    b = Broker()
    assert_error(await b.send("GET", "/%2F"), 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_head_on_root_is_not_an_error():
    b = Broker()
    reply = await b.send("HEAD", "/")
    assert reply.code == 200


@pytest_twisted.ensureDeferred
async def test_head_on_a_signed_get_route_is_no_route():
    """A HEAD would run the poll and drop its page: no route, and the once-delivery
    of an expired lease (spec §5.1) is still there for the GET."""
    b = Broker()
    await b.register("alpha", "beta")
    sent = await b.message("alpha", "beta")
    _, cursor = await b.poll("beta")
    await b.pull("beta", leaseSeconds=1)
    b.advance(2)
    for path in (f"/messages?since={cursor}", "/peers"):
        reply = await b.request("beta", "HEAD", path)
        assert reply.code == 404 and not reply.raw, (path, reply)
    messages, _ = await b.poll("beta", f"?since={cursor}")
    assert [m["id"] for m in messages] == [sent]


# -- the API under a plain twisted.web Site (relay.testing's StubTreq client) ---------


@pytest_twisted.ensureDeferred
async def test_api_works_under_a_plain_site_body_limit_included():
    from relay.testing import make_api

    _, client, _ = make_api()
    for agent in ("alpha", "beta"):
        assert (await client.post(agent, "/register", {}))[0] == 200
    code, body, _ = await client.post("alpha", "/messages", {"to": "beta", "body": {"n": 1}})
    assert code == 201 and body["duplicate"] is False
    code, body, _ = await client.get("beta", "/messages?since=&limit=50")
    assert code == 200 and [m["body"] for m in body["messages"]] == [{"n": 1}]
    code, body, _ = await client.post("alpha", "/messages",
                                      raw=_sized_envelope(MAX_BODY_BYTES + 1))
    assert (code, body["error"]["code"]) == (400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_a_receipt_is_one_store_operation():
    from tests.api.test_ack import logged_store

    b = Broker(store=logged_store())
    await b.register("alpha", "beta")
    await b.message("alpha", "beta", id="m1")
    del b.store.operations[:]
    reply = await b.post("beta", "/messages/m1/ack", {"status": "ok"})
    assert reply.code == 201
    assert b.store.operations == ["settle"]
    del b.store.operations[:]
    assert_error(await b.post("alpha", "/messages/m1/ack", {"status": "ok"}), 403, "forbidden")
    assert_error(await b.post("beta", "/messages/m1/ack", {"status": "maybe"}), 400,
                 "bad_request")
    assert_error(await b.post("beta", "/messages/none/ack", {}), 404, "no_such_message")
    assert b.store.operations == ["settle"] * 3
