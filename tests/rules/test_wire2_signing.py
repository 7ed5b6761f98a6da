"""The v2/v3 wire's canonical JSON and signatures (relay.wire.v2): the reference's golden
vectors, sign and verify agreeing, and every refusal of a keyring check."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pytest

from relay.wire.v2.canonical import canonical_body, canonical_text
from relay.wire.v2.signing import (
    MAX_CLOCK_SKEW_SECONDS,
    Refusal,
    SignedHeaders,
    SigningKey,
    check_request,
    read_agent,
    sign,
    signed_headers,
    speaks_v2,
    string_to_sign,
    verify,
)

GOLDEN = json.loads((Path(__file__).parent / "vectors" / "wire2_golden.json").read_text("utf-8"))
V2 = {vector["name"]: vector for vector in GOLDEN["v2"]}
AGENT, SECRET = GOLDEN["agent"], GOLDEN["secret"]
METHOD, PATH, TS = GOLDEN["method"], GOLDEN["path"], GOLDEN["timestamp"]
NOW = 1_755_250_000
OLD, NEW = "o" * 32, "n" * 32


# -- golden vectors --------------------------------------------------------------------


@pytest.mark.parametrize("vector", GOLDEN["v2"], ids=lambda v: v["name"])
def test_the_canonical_body_is_the_golden_bytes(vector):
    assert canonical_body(vector["payload"]).hex() == vector["body_hex"]


@pytest.mark.parametrize("vector", GOLDEN["v2"], ids=lambda v: v["name"])
def test_v2_signatures_are_the_golden_ones(vector):
    body = bytes.fromhex(vector["body_hex"])
    assert sign(SECRET, AGENT, METHOD, PATH, TS, body) == vector["signature"]
    assert verify(SECRET, AGENT, METHOD, PATH, TS, body, vector["signature"])


@pytest.mark.parametrize("vector", GOLDEN["v3"], ids=lambda v: v["name"])
def test_v3_signatures_are_the_golden_ones(vector):
    body = canonical_body(V2[vector["payload_of"]]["payload"])
    signature = sign(SECRET, AGENT, METHOD, PATH, TS, body, vector["key_id"])
    assert signature == vector["signature"]
    assert verify(SECRET, AGENT, METHOD, PATH, TS, body, signature, vector["key_id"])
    assert not verify(SECRET, AGENT, METHOD, PATH, TS, body, signature), "v3 is not v2"


def test_the_five_vectors_are_all_there():
    assert len(GOLDEN["v2"]) + len(GOLDEN["v3"]) == 5


def test_the_string_to_sign_is_the_documented_one():
    body = b'{"a":1}'
    digest = hashlib.sha256(body).hexdigest()
    assert string_to_sign("dsh", 7, "post", "/v1/pull?x=1", body) == (
        f"dsh\n7\nPOST\n/v1/pull?x=1\n{digest}".encode())
    assert string_to_sign("dsh", b"7", b"POST", b"/v1/pull", body, "k1") == (
        f"dsh\nk1\n7\nPOST\n/v1/pull\n{digest}".encode())
    expected = hmac.new(b"k", f"dsh\n7\nPOST\n/v1/pull?x=1\n{digest}".encode(),
                        hashlib.sha256).hexdigest()
    assert sign("k", "dsh", "POST", "/v1/pull?x=1", 7, body) == expected


def test_a_method_without_a_body_signs_the_empty_body():
    empty = hashlib.sha256(b"").hexdigest().encode()
    assert string_to_sign("a", 1, "GET", "/healthz", b"{}").endswith(empty)
    assert string_to_sign("a", 1, "DELETE", "/x", b"{}").endswith(empty)
    assert not string_to_sign("a", 1, "PUT", "/x", b"{}").endswith(empty)


# -- canonical JSON --------------------------------------------------------------------


def test_canonical_json_sorts_every_level_and_keeps_non_ascii_raw():
    assert canonical_text({"b": [{"z": 1, "a": 2.0}], "a": "é\n\u0001\"\\"}) == (
        '{"a":"é\\n\\u0001\\"\\\\","b":[{"a":2.0,"z":1}]}')
    assert canonical_body({"x": "€"}) == '{"x":"€"}'.encode()


@pytest.mark.parametrize("payload", [{"x": float("nan")}, {"x": float("inf")}, {"x": "\ud800"}])
def test_what_has_no_canonical_form_is_a_value_error(payload):
    with pytest.raises(ValueError):
        canonical_body(payload)


# -- client headers ----------------------------------------------------------------------


def test_signed_headers_are_v2_without_a_key_id_and_v3_with_one():
    body = canonical_body(V2["request_ascii"]["payload"])
    v2 = signed_headers(SECRET, "Test-Agent ", METHOD, PATH, body, timestamp=int(TS))
    assert v2 == {"X-Agent-Relay-Agent": AGENT, "X-Agent-Relay-Timestamp": TS,
                  "X-Agent-Relay-Signature": V2["request_ascii"]["signature"]}
    v3 = signed_headers(SECRET, AGENT, METHOD, PATH, body, timestamp=int(TS), key_id="legacy")
    assert v3["X-Agent-Relay-Key-Id"] == "legacy"
    assert v3["X-Agent-Relay-Signature"] == GOLDEN["v3"][0]["signature"]


def test_a_request_speaks_v2_when_it_carries_the_agent_header_even_empty():
    assert speaks_v2(b"dsh") and speaks_v2(b"")
    assert not speaks_v2(None)


# -- the keyring check ---------------------------------------------------------------------


def request(secret=SECRET, agent=AGENT, key_id=None, timestamp=NOW, body=b'{"limit":1}',
            path="/v1/pull", **overrides) -> SignedHeaders:
    headers = signed_headers(secret, agent, "POST", path, body, timestamp=timestamp,
                             key_id=key_id)
    raw = {name.lower().encode(): value.encode() for name, value in headers.items()}
    raw.update({name.encode(): value for name, value in overrides.items()})
    return SignedHeaders.read(raw.get)


def check(headers, ring, now=NOW, body=b'{"limit":1}', path=b"/v1/pull"):
    return check_request(ring, read_agent(headers), headers, b"POST", path, body, now)


def refusal(headers, ring, **kw) -> Refusal:
    with pytest.raises(Refusal) as caught:
        check(headers, ring, **kw)
    return caught.value


RING = {"legacy": SigningKey((OLD,), NOW + 100), "k2": SigningKey((NEW,))}


def test_v2_verifies_with_any_live_key_and_says_which():
    assert check(request(OLD), RING) == (AGENT, "legacy", "v2", NOW)
    assert check(request(NEW), RING) == (AGENT, "k2", "v2", NOW)


def test_v3_verifies_with_the_key_it_names_only():
    assert check(request(NEW, key_id="k2"), RING) == (AGENT, "k2", "v3", NOW)
    wrong = refusal(request(OLD, key_id="k2"), RING)
    assert (wrong.error.status, wrong.error.code, wrong.counts) == (401, "unauthenticated", True)


def test_the_legacy_key_may_hold_several_secrets():
    ring = {"legacy": SigningKey((NEW, OLD))}
    assert check(request(OLD, key_id="legacy"), ring).key_id == "legacy"
    assert check(request(NEW), ring).key_id == "legacy"


def test_an_unknown_key_id_is_401_unknown_key_and_counts_not():
    refused = refusal(request(NEW, key_id="k9"), RING)
    assert (refused.error.status, refused.error.code) == (401, "unknown_key")
    assert (refused.reason, refused.counts) == ("unknown_key", False)


def test_a_key_past_not_after_is_refused_on_v3_and_v2_after_that_second():
    at_limit = NOW + 100
    assert check(request(OLD, key_id="legacy", timestamp=at_limit), RING, now=at_limit)
    later = NOW + 101
    v3 = refusal(request(OLD, key_id="legacy", timestamp=later), RING, now=later)
    assert (v3.error.code, v3.error.message, v3.reason) == (
        "unknown_key", "expired relay key", "expired_key")
    v2 = refusal(request(OLD, timestamp=later), RING, now=later)
    assert (v2.error.status, v2.error.code, v2.counts) == (401, "unknown_key", False)
    assert check(request(NEW, timestamp=later), RING, now=later).key_id == "k2"


def test_a_ring_whose_every_key_expired_refuses_v2_as_unknown_key():
    ring = {"legacy": SigningKey((OLD,), NOW - 1)}
    refused = refusal(request("x" * 32), ring)
    assert (refused.error.code, refused.counts) == ("unknown_key", False)


@pytest.mark.parametrize("offset, ok", [(300, True), (-300, True), (301, False), (-301, False)])
def test_the_skew_window_is_300_seconds_either_way(offset, ok):
    headers = request(NEW, timestamp=NOW + offset)
    if ok:
        assert check(headers, RING).timestamp == NOW + offset
    else:
        refused = refusal(headers, RING)
        assert (refused.error.code, refused.error.message, refused.reason, refused.counts) == (
            "unauthenticated", "timestamp skew", "clock_skew", True)
    assert MAX_CLOCK_SKEW_SECONDS == 300


@pytest.mark.parametrize("stamp", [b"soon", b"1e9", b"0x10", b"12 34", b"1" * 16])
def test_a_timestamp_that_is_not_a_number_is_401(stamp):
    refused = refusal(request(NEW, **{"x-agent-relay-timestamp": stamp}), RING)
    assert (refused.error.code, refused.reason, refused.counts) == (
        "unauthenticated", "bad_timestamp", True)


def test_a_fractional_timestamp_is_a_number_as_the_reference_reads_it():
    body = b'{"limit":1}'
    stamp = f"{NOW}.5"
    headers = SignedHeaders(AGENT.encode(), None, stamp.encode(),
                            sign(NEW, AGENT, "POST", "/v1/pull", stamp, body).encode())
    assert check(headers, RING).timestamp == NOW


@pytest.mark.parametrize("tamper", ["body", "path", "agent", "secret", "signature"])
def test_any_change_is_a_bad_signature(tamper):
    body, path, secret = b'{"limit":1}', b"/v1/pull", NEW
    headers = request(secret)
    if tamper == "body":
        body = b'{"limit":2}'
    elif tamper == "path":
        path = b"/v1/pull?limit=2"
    elif tamper == "agent":
        headers = headers._replace(agent=b"other")
        ring = {"legacy": SigningKey((NEW,))}
        refused = refusal(headers, ring, body=body, path=path)
        assert refused.reason == "bad_signature"
        return
    elif tamper == "secret":
        headers = request("z" * 32)
    else:
        headers = headers._replace(signature=b"0" * 64)
    refused = refusal(headers, RING, body=body, path=path)
    assert (refused.error.status, refused.error.code, refused.error.message) == (
        401, "unauthenticated", "invalid signature")
    assert (refused.reason, refused.counts) == ("bad_signature", True)


def test_an_upper_case_hex_signature_verifies():
    headers = request(NEW)
    assert check(headers._replace(signature=headers.signature.upper()), RING)


@pytest.mark.parametrize("missing", ["agent", "timestamp", "signature"])
@pytest.mark.parametrize("value", [None, b""])
def test_a_missing_or_empty_header_is_401_missing_headers(missing, value):
    headers = request(NEW)._replace(**{missing: value})
    with pytest.raises(Refusal) as caught:
        read_agent(headers)
    assert (caught.value.error.status, caught.value.error.code) == (401, "unauthenticated")
    assert caught.value.error.message == "missing authentication headers"
    assert (caught.value.reason, caught.value.counts) == ("missing_headers", False)


@pytest.mark.parametrize("name", [b"a b", b"x" * 65, b"\xc3\xa9", b"a/b"])
def test_a_bad_agent_name_is_401(name):
    with pytest.raises(Refusal) as caught:
        read_agent(request(NEW)._replace(agent=name))
    assert (caught.value.error.code, caught.value.reason) == ("unauthenticated", "bad_agent_name")


def test_the_agent_is_read_trimmed_in_lower_case_and_signed_so():
    headers = request(NEW)._replace(agent=b" Test-Agent ")
    assert read_agent(headers) == AGENT
    assert check(headers, RING).agent == AGENT


@pytest.mark.parametrize("value, scheme", [(None, "v2"), (b"", "v2"), (b"  ", "v2"),
                                           (b" k2 ", "v3")])
def test_an_empty_key_id_header_means_v2_as_the_reference_reads_it(value, scheme):
    headers = request(NEW)._replace(key_id=value)
    assert headers.scheme == scheme
    if scheme == "v2":
        assert check(headers, RING).scheme == "v2"
