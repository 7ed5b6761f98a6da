"""The signing functions of :mod:`relay.wire.signing`, tested directly against an
independent HMAC of the signing strings of seed §3 and EXTENSIONS.md §9.

(The broker's side, the Authenticator, is tested in test_auth.py.)
"""

from __future__ import annotations

import hashlib
import hmac

import pytest

from relay.wire.signing import (
    AGENT_HEADER,
    NONCE,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    auth_headers,
    new_nonce,
    sign,
    signed_bytes,
    signing_string,
    verify,
)

SECRET = "s3cret"
BODY = b'{"to":"beta","body":{"text":"hi"}}'
TS = 1712345678


def hmac_hex(secret: str, data: bytes) -> str:
    return hmac.new(secret.encode(), data, hashlib.sha256).hexdigest()


@pytest.mark.parametrize(("args", "expected"), [
    (("POST", "/messages", TS, BODY), b"POST\n/messages\n1712345678\n" + BODY),
    (("post", "/messages", TS, BODY), b"POST\n/messages\n1712345678\n" + BODY),
    ((b"GET", b"/messages?since=a&limit=5", b"1712345678", b""),
     b"GET\n/messages?since=a&limit=5\n1712345678\n"),
    (("POST", "/m", 1712345678.9, "é✓"), "POST\n/m\n1712345678\né✓".encode()),
    (("POST", "/m", TS, b"", "alpha", "n" * 16), b"POST\n/m\n1712345678\n\nalpha\n" + b"n" * 16),
    (("POST", "/m", TS, b"x", None, "n" * 16), b"POST\n/m\n1712345678\nx\n\n" + b"n" * 16),
    (("POST", "/m", TS, b"x", "alpha", None), b"POST\n/m\n1712345678\nx"),
])
def test_the_signing_string(args, expected):
    assert signing_string(*args) == expected


def test_signed_bytes_is_the_signing_string_of_received_bytes():
    assert signed_bytes(b"post", b"/p?q", b"1", b"{}") == b"POST\n/p?q\n1\n{}"
    assert signed_bytes(b"POST", b"/p", b"1", b"{}", b"a", b"n") == b"POST\n/p\n1\n{}\na\nn"


def test_the_signature_is_the_lowercase_hex_hmac_sha256():
    expected = hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + BODY)
    assert sign(SECRET, "POST", "/messages", TS, BODY) == expected
    assert sign(SECRET.encode(), "POST", "/messages", TS, BODY.decode()) == expected
    assert sign(SECRET, "GET", "/peers", TS) == hmac_hex(SECRET, b"GET\n/peers\n1712345678\n")


@pytest.mark.parametrize("transform", [str, str.upper, lambda s: f"  {s}\n"])
def test_verify_takes_the_signature_in_any_case_and_surrounding_space(transform):
    signature = sign(SECRET, "POST", "/messages", TS, BODY)
    assert verify(SECRET, "POST", "/messages", TS, BODY, transform(signature)) is True


@pytest.mark.parametrize("signature", ["", "0" * 64, "zz", "é" * 64,
                                       hmac_hex("other", b"POST\n/messages\n1712345678\n")])
def test_verify_refuses_any_other_signature_without_raising(signature):
    assert verify(SECRET, "POST", "/messages", TS, BODY, signature) is False


@pytest.mark.parametrize("change", [{"method": "PUT"}, {"path": "/messages?x"},
                                    {"timestamp": TS + 1}, {"raw_body": BODY + b" "},
                                    {"secret": "s3cret2"}])
def test_verify_refuses_a_signature_of_another_request(change):
    signature = sign(SECRET, "POST", "/messages", TS, BODY)
    request = {"secret": SECRET, "method": "POST", "path": "/messages", "timestamp": TS,
               "raw_body": BODY, **change}
    assert verify(signature=signature, **request) is False


def test_auth_headers_without_and_with_a_nonce():
    assert auth_headers(SECRET, "alpha", "POST", "/messages", TS, BODY) == {
        AGENT_HEADER: "alpha", TIMESTAMP_HEADER: "1712345678",
        SIGNATURE_HEADER: hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + BODY)}
    nonce = "abcdefghijklmnop"
    assert auth_headers(SECRET, "alpha", "POST", "/messages", TS, BODY, nonce) == {
        AGENT_HEADER: "alpha", TIMESTAMP_HEADER: "1712345678", NONCE_HEADER: nonce,
        SIGNATURE_HEADER: hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + BODY +
                                   b"\nalpha\n" + nonce.encode())}


def test_new_nonces_are_well_formed_and_fresh():
    nonces = {new_nonce() for _ in range(1000)}
    assert len(nonces) == 1000
    assert all(NONCE.match(n) and len(n) == 32 for n in nonces)


@pytest.mark.parametrize(("nonce", "ok"), [("a" * 16, True), ("a" * 64, True), ("a" * 15, False),
                                           ("a" * 65, False), ("A-z_0" * 4, True),
                                           ("a" * 16 + "=", False), ("a" * 16 + "\n", False),
                                           ("é" * 16, False)])
def test_the_nonce_header_pattern_of_section_9(nonce, ok):
    assert bool(NONCE.match(nonce)) is ok
