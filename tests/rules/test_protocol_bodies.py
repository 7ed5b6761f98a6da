"""Request bodies of :mod:`relay.wire.protocol`, tested directly: strict JSON, the sent
envelope (seed §2, §5.1) and the v1.0 ack receipt (seed §4).

The seed fixes the envelope's fields, types and defaults and answers every malformed
body with ``400 bad_request``; the reference broker (whose ``JSON.parse`` keeps the
last of duplicate keys and refuses ``NaN``) settles what the seed leaves open.
"""

from __future__ import annotations

import json
import uuid

import pytest

from relay.wire.protocol import (
    MAX_ID_CHARS,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    ack_receipt,
    check_body_agent,
    compact_json,
    normalize_envelope,
    parse_json_body,
    parse_json_object,
)
from tests.support.protocol import CONTENT, refusal

# -- strict JSON ----------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "value"), [
    (b"{}", {}),
    (b'{"a":1}', {"a": 1}),
    (b" \r\n\t{\"a\": [1, 2.5, -3e2, true, false, null]} \n", {"a": [1, 2.5, -300.0, True,
                                                                        False, None]}),
    (b"[]", []),
    (b"5", 5),
    (b'"text"', "text"),
    (b"null", None),
    ('{"t":"h\u00e9llo \u2713 \U0001F600"}'.encode(), {"t": "héllo ✓ 😀"}),
    (b'{"t":"\\u00e9\\ud83d\\ude00"}', {"t": "é😀"}),  # a surrogate pair is one character
    (b'{"n":1.7976931348623157e308}', {"n": 1.7976931348623157e308}),
    (b'{"n":-1.7976931348623157e308}', {"n": -1.7976931348623157e308}),
    (b'{"n":1e-400}', {"n": 0.0}),  # underflows to zero: still a number every parser reads
])
def test_json_bodies_decode(raw, value):
    assert parse_json_body(raw) == value


def test_duplicate_keys_keep_the_last_value_as_json_parse_does():
    assert parse_json_body(b'{"to":"a","to":"b"}') == {"to": "b"}


@pytest.mark.parametrize("raw", [b"", b" ", b"\r\n\t "])
def test_an_empty_body_is_an_empty_object_unless_one_is_required(raw):
    assert parse_json_body(raw) == {}
    assert parse_json_object(raw) == {}
    error = refusal(lambda r: parse_json_body(r, empty_ok=False), raw, field="request body")
    assert error.message == "request body is required"


@pytest.mark.parametrize("raw", [
    b"{", b"}", b"{'a':1}", b'{"a":1,}', b"[1,]", b'{"a"}', b"nul", b"True", b"{} {}",
    b'{"a":1} x', b"\xef\xbb\xbf{}", b"01", b"+1", b".5", b"1.", b"0x10", b'"\t"',
    b"NaN", b"-NaN", b"Infinity", b"-Infinity", b'{"n":NaN}', b'{"n":[Infinity]}',
    b'{"n":-Infinity}', b'{"n":"' + CONTENT.encode() + b'",}',
    b"1" * 5000,  # more digits than an integer may have
])
def test_text_that_is_not_strict_json_is_refused(raw):
    error = refusal(parse_json_body, raw, field="request body")
    assert error.message == "request body is not valid JSON"


@pytest.mark.parametrize("raw", [b"\xff", b'{"t":"\xc3"}', b'{"t":"\xed\xa0\x80"}',
                                 b'{"t":"' + CONTENT.encode() + b'\xfe"}'])
def test_a_body_that_is_not_utf8_is_refused(raw):
    error = refusal(parse_json_body, raw, field="request body")
    assert error.message == "request body is not valid UTF-8"


@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"1.5e309", b"9" * 400 + b".0"])
def test_a_number_beyond_a_double_is_refused(number):
    error = refusal(parse_json_body, b'{"n":' + number + b"}", field="request body")
    assert "too large for a double" in error.message


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\uDFFF", b"\\ud83d", b"\\ude00\\ud83d",
                                    b"\\ud83dx"])
def test_a_lone_surrogate_escape_is_refused(escape):
    error = refusal(parse_json_body, b'{"t":"' + escape + b'"}', field="request body")
    assert error.message == "request body holds an invalid unicode escape"
    refusal(parse_json_body, b'{"' + escape + b'":1}', field="request body")


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


@pytest.mark.parametrize("make", [lambda d: nested(d),
                                  lambda d: b'{"a":' * (d - 1) + b"{}" + b"}" * (d - 1)])
def test_nesting_up_to_100_levels_is_taken_and_101_refused(make):
    assert parse_json_body(make(MAX_JSON_DEPTH)) is not None
    error = refusal(parse_json_body, make(MAX_JSON_DEPTH + 1), field="request body")
    assert error.message == "request body is nested deeper than 100 levels"


def test_nesting_far_beyond_the_recursion_limit_is_a_400_not_a_crash():
    refusal(parse_json_body, nested(100_000), field="request body")
    refusal(parse_json_object, b'{"a":' + nested(50_000) + b"}", field="request body")


def test_a_body_of_100000_values_is_taken_and_one_more_refused():
    # The array itself is one value: MAX_JSON_VALUES - 1 elements fill the bound.
    fits = b"[" + b",".join([b"0"] * (MAX_JSON_VALUES - 1)) + b"]"
    assert len(parse_json_body(fits)) == MAX_JSON_VALUES - 1
    over = b"[" + b",".join([b"0"] * MAX_JSON_VALUES) + b"]"
    error = refusal(parse_json_body, over, field="request body")
    assert error.message == "request body is made of more than 100000 JSON values"


def test_values_are_counted_in_objects_and_nested_arrays_too():
    half = MAX_JSON_VALUES // 2
    raw = json.dumps({"a": list(range(half)), "b": {str(i): i for i in range(half)}}).encode()
    refusal(parse_json_body, raw, field="request body")


@pytest.mark.parametrize("raw", [b"[]", b"[1]", b"5", b'"x"', b"null", b"true", b"1.5"])
def test_a_body_that_must_be_an_object_refuses_every_other_json_value(raw):
    error = refusal(parse_json_object, raw, field="body")
    assert error.message == "body must be a JSON object"


def test_compact_json_is_what_the_wire_sends():
    value = {"a": [1, 2.5, None, True], "t": "é✓😀\n\"", "e": {}}
    text = compact_json(value)
    assert text == '{"a":[1,2.5,null,true],"t":"é✓😀\\n\\"","e":{}}'
    assert json.loads(text) == value
    assert compact_json("x") == '"x"'


# -- the sent envelope ----------------------------------------------------------------------

AGENT = "alpha"


def envelope(**fields):
    return normalize_envelope({"to": "beta", **fields}, AGENT)


def test_the_shorthand_gets_every_default_of_seed_section_2():
    stored = normalize_envelope({"to": "beta"}, AGENT)
    assert set(stored) == {"id", "from", "to", "type", "body", "replyTo", "ack", "kind",
                           "rootId", "parentId"}
    assert str(uuid.UUID(stored["id"])) == stored["id"]
    assert {k: v for k, v in stored.items() if k != "id"} == {
        "from": "alpha", "to": "beta", "type": "message", "body": {}, "replyTo": None,
        "ack": False, "kind": "message", "rootId": None, "parentId": None}
    assert normalize_envelope({"to": "beta"}, AGENT)["id"] != stored["id"]


def test_a_full_envelope_is_kept_field_by_field():
    sent = {"id": "m-1", "from": "alpha", "to": "beta", "type": "ack", "body": {"x": [1]},
            "replyTo": "m-0", "ack": True, "kind": "reply", "rootId": "r", "parentId": "m-0"}
    assert normalize_envelope(dict(sent), AGENT) == sent


def test_broker_managed_and_unknown_fields_are_ignored():
    stored = envelope(ts="2001-01-01T00:00:00.000Z", status="done", attempts=9,
                      leaseUntil=1, leaseId="l", extra={"x": 1})
    assert set(stored) == {"id", "from", "to", "type", "body", "replyTo", "ack", "kind",
                           "rootId", "parentId"}


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("from", None, "alpha"), ("body", None, {}), ("ack", None, False), ("kind", None, "message"),
    ("replyTo", None, None), ("rootId", None, None), ("parentId", None, None),
    ("ack", False, False), ("ack", True, True), ("kind", "request", "request"),
    ("type", "message", "message"), ("body", {}, {}),
    ("id", "x" * MAX_ID_CHARS, "x" * MAX_ID_CHARS), ("id", "é✓", "é✓"),
    ("replyTo", "", ""), ("rootId", "r" * MAX_ID_CHARS, "r" * MAX_ID_CHARS),
])
def test_accepted_envelope_fields(field, value, expected):
    assert envelope(**{field: value})[field] == expected


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"id": None}, "id", "id must be a non-empty string"),  # the reference refuses null too
    ({"id": ""}, "id", "id must be a non-empty string"),
    ({"id": 5}, "id", "id must be a non-empty string"),
    ({"id": True}, "id", "id must be a non-empty string"),
    ({"id": [CONTENT]}, "id", "id must be a non-empty string"),
    ({"id": "x" * (MAX_ID_CHARS + 1)}, "id", "id must be at most 256 characters"),
    ({"id": "relay-notice-" + CONTENT}, "id", None),
    ({"from": "beta"}, "from", "envelope.from must match X-Relay-Agent header"),
    ({"from": CONTENT}, "from", "envelope.from must match X-Relay-Agent header"),
    ({"from": ""}, "from", "envelope.from must match X-Relay-Agent header"),
    ({"to": None}, "to", "to is required"),
    ({"to": ""}, "to", "to is required"),
    ({"to": 7}, "to", "to is required"),
    ({"to": ["beta"]}, "to", "to is required"),
    ({"to": "b" * (MAX_ID_CHARS + 1)}, "to", "to must be at most 256 characters"),
    ({"to": AGENT}, "yourself", "cannot send a message to yourself"),
    ({"type": None}, "type", 'type must be "message" or "ack"'),  # as the reference
    ({"type": "request"}, "type", 'type must be "message" or "ack"'),
    ({"type": "Message"}, "type", 'type must be "message" or "ack"'),
    ({"type": CONTENT}, "type", 'type must be "message" or "ack"'),
    ({"body": []}, "body", "body must be an object"),
    ({"body": CONTENT}, "body", "body must be an object"),
    ({"body": 0}, "body", "body must be an object"),
    ({"ack": "true"}, "ack", "ack must be a boolean"),
    ({"ack": 1}, "ack", "ack must be a boolean"),
    ({"ack": 0}, "ack", "ack must be a boolean"),
    ({"kind": "ack"}, "kind", 'kind must be "message", "request" or "reply"'),
    ({"kind": ""}, "kind", 'kind must be "message", "request" or "reply"'),
    ({"kind": CONTENT}, "kind", 'kind must be "message", "request" or "reply"'),
    ({"replyTo": 5}, "replyTo", "replyTo must be a string or null"),
    ({"rootId": {"id": CONTENT}}, "rootId", "rootId must be a string or null"),
    ({"parentId": False}, "parentId", "parentId must be a string or null"),
    ({"parentId": "p" * (MAX_ID_CHARS + 1)}, "parentId",
     "parentId must be at most 256 characters"),
])
def test_refused_envelopes(fields, field, message):
    body = {"to": "beta", **fields}
    error = refusal(normalize_envelope, body, AGENT, field=field)
    if message is not None:
        assert error.message == message


@pytest.mark.parametrize("body", [None, [], "x", 5, True])
def test_an_envelope_must_be_an_object(body):
    error = refusal(normalize_envelope, body, AGENT, field="body")
    assert error.message == "body must be a JSON object"


def test_a_client_id_is_kept_verbatim_for_idempotency():
    assert envelope(id=" A b ")["id"] == " A b "


# -- body.agent -----------------------------------------------------------------------------


@pytest.mark.parametrize("body", [{}, {"agent": "alpha"}, {"other": 1}])
def test_a_body_agent_absent_or_matching_is_taken(body):
    assert check_body_agent(body, "alpha") is None


@pytest.mark.parametrize("value", ["beta", "ALPHA", "", None, 5, [CONTENT]])
def test_a_body_agent_that_is_not_the_header_agent_is_refused(value):
    error = refusal(check_body_agent, {"agent": value}, "alpha", field="agent")
    assert error.message == "body.agent must match X-Relay-Agent header"


# -- the v1.0 ack receipt -------------------------------------------------------------------

TARGET = {"id": "m-1", "from": "beta"}


@pytest.mark.parametrize(("body", "payload"), [
    ({}, {"status": "ok"}),
    ({"status": "ok"}, {"status": "ok"}),
    ({"status": "ok", "error": "ignored"}, {"status": "ok"}),
    ({"status": "error"}, {"status": "error", "error": "unknown"}),
    ({"status": "error", "error": "disk on fire"}, {"status": "error", "error": "disk on fire"}),
    ({"status": "error", "error": ""}, {"status": "error", "error": ""}),
])
def test_a_receipt_goes_back_to_the_sender_as_an_ack_envelope(body, payload):
    receipt = ack_receipt(TARGET, "alpha", body)
    assert str(uuid.UUID(receipt["id"])) == receipt["id"]
    assert {k: v for k, v in receipt.items() if k != "id"} == {
        "from": "alpha", "to": "beta", "type": "ack", "body": payload, "replyTo": "m-1",
        "ack": False, "kind": "message", "rootId": None, "parentId": None}


@pytest.mark.parametrize(("body", "field", "message"), [
    ({"status": None}, "status", 'status must be "ok" or "error"'),
    ({"status": "OK"}, "status", 'status must be "ok" or "error"'),
    ({"status": CONTENT}, "status", 'status must be "ok" or "error"'),
    ({"status": True}, "status", 'status must be "ok" or "error"'),
    ({"status": "error", "error": 5}, "error", "error must be a string"),
    ({"status": "error", "error": None}, "error", "error must be a string"),
    ({"status": "error", "error": {"t": CONTENT}}, "error", "error must be a string"),
])
def test_refused_receipts(body, field, message):
    error = refusal(ack_receipt, TARGET, "alpha", body, field=field)
    assert error.message == message


@pytest.mark.parametrize("body", [None, [], "ok"])
def test_a_receipt_body_must_be_an_object(body):
    refusal(ack_receipt, TARGET, "alpha", body, field="body")
