"""HMAC-SHA256 request signing of spec §3, as pure functions (stdlib only).

The one signing implementation of the relay: the broker verifies with it and
every client signs with it. The signing string is
``METHOD \\n PATH \\n TIMESTAMP \\n RAW_BODY`` where PATH is the pathname *with*
the query string exactly as sent and RAW_BODY the exact body bytes (empty when
there is no body).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Dict, Optional, Union

AGENT_HEADER = "X-Relay-Agent"
TIMESTAMP_HEADER = "X-Relay-Timestamp"
SIGNATURE_HEADER = "X-Relay-Signature"
NONCE_HEADER = "X-Relay-Nonce"
# EXTENSIONS.md §9: 16..64 characters of [A-Za-z0-9_-], fresh per request.
NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}\Z")

BytesOrText = Union[bytes, str]


def _as_bytes(value: BytesOrText) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else value


def signing_string(
    method: BytesOrText, path: BytesOrText, timestamp: Union[int, bytes], raw_body: BytesOrText,
    agent: Optional[BytesOrText] = None, nonce: Optional[BytesOrText] = None,
) -> bytes:
    """The exact bytes that are MACed for one request (spec §3); with a ``nonce``
    (EXTENSIONS.md §9) two more lines: the agent and the nonce.

    ``timestamp`` is the epoch seconds as an int, or the header's bytes as received.
    """
    stamp = timestamp if isinstance(timestamp, bytes) else str(int(timestamp)).encode("ascii")
    signer = nonce_bytes = None
    if nonce is not None:
        signer, nonce_bytes = _as_bytes(agent or b""), _as_bytes(nonce)
    return signed_bytes(_as_bytes(method), _as_bytes(path), stamp, _as_bytes(raw_body),
                        signer, nonce_bytes)


def signed_bytes(method: bytes, path: bytes, timestamp: bytes, raw_body: bytes,
                 agent: Optional[bytes] = None, nonce: Optional[bytes] = None) -> bytes:
    """:func:`signing_string` of values that are bytes already (a request's method,
    path, headers and body as the broker received them)."""
    if nonce is None:
        return b"\n".join((method.upper(), path, timestamp, raw_body))
    return b"\n".join((method.upper(), path, timestamp, raw_body, agent or b"", nonce))


def sign(
    secret: BytesOrText, method: str, path: str, timestamp: int, raw_body: BytesOrText = b"",
    agent: Optional[str] = None, nonce: Optional[str] = None,
) -> str:
    """The lowercase hex HMAC-SHA256 signature of one request."""
    return hmac.new(
        _as_bytes(secret), signing_string(method, path, timestamp, raw_body, agent, nonce),
        hashlib.sha256,
    ).hexdigest()


def new_nonce() -> str:
    """A fresh nonce for ``X-Relay-Nonce`` (32 URL-safe characters)."""
    return secrets.token_urlsafe(24)


def verify(
    secret: BytesOrText,
    method: str,
    path: str,
    timestamp: int,
    raw_body: BytesOrText,
    signature: str,
) -> bool:
    """Whether ``signature`` is the signature of this request (constant-time)."""
    expected = sign(secret, method, path, timestamp, raw_body)
    return hmac.compare_digest(expected.encode("ascii"), signature.strip().lower().encode("utf-8"))


def auth_headers(
    secret: BytesOrText,
    agent: str,
    method: str,
    path: str,
    timestamp: int,
    raw_body: BytesOrText,
    nonce: Optional[str] = None,
) -> Dict[str, str]:
    """The authentication headers of spec §3 for one request, with ``X-Relay-Nonce``
    (EXTENSIONS.md §9) when a ``nonce`` is given."""
    headers = {
        AGENT_HEADER: agent,
        TIMESTAMP_HEADER: str(int(timestamp)),
        SIGNATURE_HEADER: sign(secret, method, path, timestamp, raw_body, agent, nonce),
    }
    if nonce is not None:
        headers[NONCE_HEADER] = nonce
    return headers
