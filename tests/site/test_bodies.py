"""Request bodies: strict JSON in UTF-8, at most 1 MiB whether sent whole or chunked
(seed §1, §6). Bodies are kept as the compact JSON text that was validated, from the
request to the store to the response: never decoded to be sent, stored as UTF-8,
bounded in structure, and listed within a byte budget."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.rules.delivery import Message
from relay.store.records import RESPONSE_BUDGET_BYTES
from relay.testing import RULES, START, new_message
from relay.wire.protocol import MAX_BODY_BYTES, MAX_JSON_VALUES
from tests.conftest import open_backend
from tests.support.api import Broker, assert_error, sized_envelope, two_agents

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False,
                                                                      allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children,
                                                                        max_size=4),
    max_leaves=12,
)
maybe_text = st.none() | st.text(min_size=1)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.text(), json_values, max_size=5), message_id=st.text(min_size=1),
       reply_to=maybe_text, root_id=maybe_text, leased=st.booleans(),
       kind=st.sampled_from(["message", "request", "reply"]), ttl=st.none() | st.integers(1, 99),
       delay=st.integers(0, 99), viewer=st.sampled_from([None, "alpha", "beta"]),
       now=st.floats(0, 200))
def test_the_spliced_envelope_is_the_envelope(body, message_id, reply_to, root_id, leased,
                                              kind, ttl, delay, viewer, now):
    message = new_message("alpha", "beta", START, ttl_seconds=ttl, delay_seconds=delay,
                          id=message_id, body=body, replyTo=reply_to, rootId=root_id,
                          kind=kind)
    if leased:
        message.status, message.lease_id, message.lease_until = "leased", "L1", 1234
    stored = message.copy()  # as a store hands it out: the body as text
    text = stored.envelope_json(viewer, START + now)
    assert json.loads(text) == message.envelope(viewer, START + now)


def test_a_stored_body_is_never_decoded_to_be_sent():
    message = Message(id="m", sender="alpha", to="beta", created=START,
                      body_json='{"n": 1,  "kept": "as sent"}')
    text = message.envelope_json()
    assert '"body":{"n": 1,  "kept": "as sent"}' in text
    assert message._body_json is not None, "the body was not decoded"


@pytest_twisted.ensureDeferred
async def test_non_ascii_is_stored_and_served_as_utf8(tmp_path):
    b = Broker()
    await b.register("alpha", "beta")
    text = "☃ é 日本語 🦜" * 1000
    await b.message("alpha", "beta", body={"text": text})
    reply = await b.get("beta", "/messages")
    assert text.encode("utf-8") in reply.raw, "served as UTF-8, not \\u escapes"
    store = open_backend("sqlite", tmp_path)
    try:
        await store.add(new_message("alpha", "beta", START, id="u", body={"text": text}), RULES)
    finally:
        await store.close()
    db = sqlite3.connect(tmp_path / "relay.db")
    (stored,) = db.execute("SELECT body FROM messages WHERE id = 'u'").fetchone()
    db.close()
    assert stored == json.dumps({"text": text}, ensure_ascii=False, separators=(",", ":"))


def _stored_body_bytes(backend: str, data_dir) -> bytes:
    """The bytes the backend keeps for the body of message ``u``."""
    if backend == "jsonl":
        with open(os.path.join(data_dir, "messages.jsonl"), "rb") as f:
            return f.read()
    import psycopg

    from tests.conftest import postgres_dsn

    with psycopg.connect(postgres_dsn()) as conn:
        (body,) = conn.execute("SELECT body FROM relay_messages WHERE id = 'u'").fetchone()
    return body.encode("utf-8")


@pytest.mark.parametrize("backend", ["jsonl", "postgres"])
@pytest_twisted.ensureDeferred
async def test_non_ascii_is_stored_as_utf8_by_every_backend(backend, tmp_path):
    from tests.conftest import reset_postgres

    if backend == "postgres":
        reset_postgres()
    text = "☃ é 日本語 🦜" * 1000
    store = open_backend(backend, tmp_path)
    try:
        await store.add(new_message("alpha", "beta", START, id="u", body={"text": text}), RULES)
    finally:
        await store.close()
    stored = _stored_body_bytes(backend, tmp_path)
    assert text.encode("utf-8") in stored, "UTF-8, not \\u escapes"
    assert b"\\u" not in stored


@pytest.mark.parametrize("shape", ["empty objects", "numbers", "nested lists"])
@pytest_twisted.ensureDeferred
async def test_a_body_of_too_many_values_is_400(shape):
    b = Broker()
    await b.register("alpha", "beta")
    count = MAX_JSON_VALUES + 1
    value = {"empty objects": [{}] * count, "numbers": list(range(count)),
             "nested lists": [[1, [2]]] * (count // 3 + 1)}[shape]
    raw = json.dumps({"to": "beta", "body": {"v": value}}, separators=(",", ":")).encode()
    assert len(raw) < 1024 * 1024
    reply = await b.post("alpha", "/messages", raw=raw)
    assert_error(reply, 400, "bad_request")
    assert str(MAX_JSON_VALUES) in reply.json["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_a_body_just_within_the_bound_is_stored():
    b = Broker()
    await b.register("alpha", "beta")
    raw = json.dumps({"to": "beta", "body": {"v": list(range(MAX_JSON_VALUES - 10))}},
                     separators=(",", ":")).encode()
    assert (await b.post("alpha", "/messages", raw=raw)).code == 201


@pytest.mark.parametrize("backend", ["memory", "sqlite", "jsonl"])
@pytest_twisted.ensureDeferred
async def test_listings_stop_at_the_byte_budget_but_never_return_nothing(backend, tmp_path):
    store = open_backend(backend, tmp_path)
    try:
        big = "x" * (RESPONSE_BUDGET_BYTES // 3 - 1000)
        for i in range(5):
            await store.add(new_message("alpha", "beta", START, id=f"b{i}", body={"t": big}), RULES)
        recent = await store.recent("beta", 50, START, RULES)
        assert [m.id for m in recent] == ["b4", "b3", "b2"]
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["b0", "b1", "b2"] and cursor == "b2"
        leased = await store.pull("beta", 50, 60, START, RULES)
        assert [m.id for m in leased] == ["b0", "b1", "b2"]
        assert [m.id for m in await store.query("beta", 50, {"status": "queued"}, START,
                                                RULES)] == ["b4", "b3"]
        huge = "y" * (RESPONSE_BUDGET_BYTES + 10)
        await store.add(new_message("alpha", "gamma", START, id="huge", body={"t": huge}), RULES)
        assert [m.id for m in await store.recent("gamma", 50, START, RULES)] == ["huge"]
    finally:
        await store.close()
    if backend == "jsonl":
        size = os.path.getsize(tmp_path / "messages.jsonl")
        assert size < 3 * RESPONSE_BUDGET_BYTES, "each body written once"


@settings(max_examples=300, deadline=None)
@given(value=json_values | st.floats())
def test_answers_are_encoded_as_the_standard_encoder_would(value):
    """The encoder made once answers byte for byte as a compact json.JSONEncoder."""
    from relay.broker.api import encode_json

    reference = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode(value)
    assert encode_json(value) == reference.encode("utf-8")


# -- request bodies: JSON, UTF-8 and size (seed §1, §6) ------------------------------------


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


@pytest_twisted.ensureDeferred
async def test_body_of_exactly_1_mib_is_accepted():
    b = await two_agents()
    raw = sized_envelope(MAX_BODY_BYTES)
    assert len(raw) == MAX_BODY_BYTES
    assert (await b.post("alpha", "/messages", raw=raw)).code == 201


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest_twisted.ensureDeferred
async def test_body_over_1_mib_is_400(chunked):
    b = await two_agents()
    raw = sized_envelope(MAX_BODY_BYTES + 1)
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
