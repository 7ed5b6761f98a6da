"""The two signature schemes of the v2/v3 wire (PROTOCOL-V2 §3, §3.1), signing and
verifying, as pure functions.

The one definition the broker verifies with and every v2/v3 client of the relay
signs with. A request carries ``X-Agent-Relay-Agent`` (the agent, lower case),
``X-Agent-Relay-Timestamp`` (epoch seconds) and ``X-Agent-Relay-Signature`` (hex
HMAC-SHA256). The string signed is, joined by ``\\n``::

    v2: agent, timestamp, METHOD, path, sha256hex(body)
    v3: agent, key id, timestamp, METHOD, path, sha256hex(body)

v3 is v2 with ``X-Agent-Relay-Key-Id``: the key id names the key of the agent's
keyring that signed. ``path`` is the request target as sent (path and query);
``body`` the raw bytes of a POST, PUT or PATCH, and empty for any other method
(the reference broker reads no body of those, so its clients sign none).

:func:`check_request` verifies a request against an agent's keyring (WIRE-V2 §4):
a v3 request with the key it names, which must exist and not be past its
``notAfter`` (else ``401 unknown_key``); a v2 request with any key of the ring
that is not past its ``notAfter``. The broker adds the rails around it (failure
lockout, rate limit): :meth:`relay.rules.auth.Authenticator.verify_v2`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple, Union

from relay.wire import errors

__all__ = [
    "AGENT_HEADER", "KEY_ID_HEADER", "TIMESTAMP_HEADER", "SIGNATURE_HEADER", "KEY_ID",
    "LEGACY_KEY_ID", "MAX_CLOCK_SKEW_SECONDS", "PROTOCOL_VERSION", "SIGNATURE_SCHEMES",
    "Keyring", "Refusal", "SignedHeaders", "SigningKey", "Verified", "check_request",
    "parse_timestamp", "read_agent", "sign", "signed_headers", "speaks_v2", "string_to_sign",
    "verify",
]

AGENT_HEADER = "X-Agent-Relay-Agent"
KEY_ID_HEADER = "X-Agent-Relay-Key-Id"
TIMESTAMP_HEADER = "X-Agent-Relay-Timestamp"
SIGNATURE_HEADER = "X-Agent-Relay-Signature"

# What GET /healthz reports: the wire's version, and the schemes a broker accepts.
PROTOCOL_VERSION = 3
SIGNATURE_SCHEMES = ("v2", "v3")
MAX_CLOCK_SKEW_SECONDS = 300
# The key every agent has: its ``secret`` (or the shared secret, without per-agent ones).
LEGACY_KEY_ID = "legacy"
# A key id, as the reference's config accepts it.
KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
# The methods whose body is signed; any other signs the empty body.
BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
# An agent name as the broker accepts it (relay.wire.protocol.AGENT_NAME), read in lower case.
_AGENT = re.compile(r"[a-z0-9_.-]{1,64}\Z")
# Epoch seconds: an integer, or a decimal fraction (the reference reads it as a number).
_TIMESTAMP = re.compile(rb"[-+]?[0-9]{1,15}(?:\.[0-9]{1,9})?\Z")

BytesOrText = Union[bytes, str]


def _as_bytes(value: BytesOrText) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else value


def string_to_sign(agent: BytesOrText, timestamp: Union[int, BytesOrText],
                   method: BytesOrText, path: BytesOrText, body: bytes = b"",
                   key_id: Optional[BytesOrText] = None) -> bytes:
    """The exact bytes that are MACed for one request: the v3 string with a non-empty
    ``key_id``, else the v2 one. ``timestamp`` is epoch seconds as an int, or the
    header's value as sent; ``body`` is the raw request body (ignored unless
    ``method`` is POST, PUT or PATCH)."""
    stamp = str(timestamp).encode("ascii") if isinstance(timestamp, int) else _as_bytes(timestamp)
    verb = _as_bytes(method).upper()
    digest = hashlib.sha256(body if verb in BODY_METHODS else b"").hexdigest().encode("ascii")
    if key_id:
        parts: Tuple[bytes, ...] = (_as_bytes(agent), _as_bytes(key_id), stamp, verb,
                                    _as_bytes(path), digest)
    else:
        parts = (_as_bytes(agent), stamp, verb, _as_bytes(path), digest)
    return b"\n".join(parts)


def sign(secret: BytesOrText, agent: BytesOrText, method: BytesOrText, path: BytesOrText,
         timestamp: Union[int, BytesOrText], body: bytes = b"",
         key_id: Optional[BytesOrText] = None) -> str:
    """The lowercase hex HMAC-SHA256 signature of one request (v3 with ``key_id``)."""
    return hmac.new(_as_bytes(secret), string_to_sign(agent, timestamp, method, path, body,
                                                      key_id), hashlib.sha256).hexdigest()


def verify(secret: BytesOrText, agent: BytesOrText, method: BytesOrText, path: BytesOrText,
           timestamp: Union[int, BytesOrText], body: bytes, signature: BytesOrText,
           key_id: Optional[BytesOrText] = None) -> bool:
    """True when ``signature`` is the request's signature with ``secret`` (compared in
    constant time, hex in either letter case). Checks nothing else: not the clock,
    not the key's validity (:func:`check_request` does)."""
    expected = sign(secret, agent, method, path, timestamp, body, key_id).encode("ascii")
    return hmac.compare_digest(expected, _as_bytes(signature).lower())


def signed_headers(secret: str, agent: str, method: str, path: str, body: bytes = b"", *,
                   timestamp: int, key_id: Optional[str] = None) -> Dict[str, str]:
    """The headers that sign one request of ``agent``: v3 with ``key_id`` (the id of the
    key ``secret`` is), else v2. ``path`` is the request target as sent (with its query);
    ``timestamp`` the client's clock in epoch seconds. The agent name is sent and
    signed in lower case, as the broker reads it."""
    name = agent.strip().lower()
    headers = {
        AGENT_HEADER: name,
        TIMESTAMP_HEADER: str(int(timestamp)),
        SIGNATURE_HEADER: sign(secret, name, method, path, int(timestamp), body, key_id),
    }
    if key_id:
        headers[KEY_ID_HEADER] = key_id
    return headers


class SigningKey(NamedTuple):
    """One key of an agent's keyring: the secrets that verify under its id (the
    ``legacy`` key holds every secret of the agent's ``secret``, several while one is
    rotated; a key of ``keys`` has one), and the epoch second after which it is refused
    (None: never)."""

    secrets: Tuple[str, ...]
    not_after: Optional[float] = None

    def live(self, now: float) -> bool:
        """True until ``not_after`` has passed (a key is still good at that second)."""
        return self.not_after is None or now <= self.not_after


Keyring = Mapping[str, SigningKey]


class SignedHeaders(NamedTuple):
    """The four authentication headers of a v2/v3 request as received (None: absent)."""

    agent: Optional[bytes]
    key_id: Optional[bytes]
    timestamp: Optional[bytes]
    signature: Optional[bytes]

    @classmethod
    def read(cls, header: Callable[[bytes], Optional[bytes]]) -> SignedHeaders:
        """The headers, from ``header(lower-case name)`` (the first value, stripped)."""
        return cls(header(b"x-agent-relay-agent"), header(b"x-agent-relay-key-id"),
                   header(b"x-agent-relay-timestamp"), header(b"x-agent-relay-signature"))

    @property
    def key(self) -> str:
        """The key id the request names: empty for a v2 request (no header, or an
        empty one, as the reference reads it)."""
        if not self.key_id:
            return ""
        try:
            return self.key_id.decode("ascii").strip()
        except UnicodeDecodeError:
            return "\ufffd"  # names no key (KEY_ID is ASCII), and still asks for v3

    @property
    def scheme(self) -> str:
        """``v3`` when the request names a key id, else ``v2``."""
        return "v3" if self.key else "v2"


def speaks_v2(agent_header: Optional[bytes]) -> bool:
    """True for a request of the v2/v3 wire: one carrying ``X-Agent-Relay-Agent``, even
    empty (WIRE-V2 §1); every other request speaks the seed's wire."""
    return agent_header is not None


class Refusal(Exception):
    """Why a v2/v3 request is refused: the RelayError to answer, the ``reason`` of
    ``relay_auth_failures_total`` (:data:`relay.rules.auth.FAILURE_REASONS`), and whether it
    counts toward the failure lockout (a wrong timestamp or signature does; a missing
    header, an unknown agent or key, or a key past ``notAfter`` does not)."""

    def __init__(self, reason: str, error: errors.RelayError, counts: bool = False) -> None:
        super().__init__(str(error))
        self.reason = reason
        self.error = error
        self.counts = counts


class Verified(NamedTuple):
    """A v2/v3 request whose signature verified: the agent, the id of the key that
    verified it, the scheme (``v2``/``v3``) and the timestamp (whole seconds)."""

    agent: str
    key_id: str
    scheme: str
    timestamp: int


def read_agent(headers: SignedHeaders) -> str:
    """The agent a v2/v3 request names (trimmed, in lower case, as the reference reads
    it). Refusal ``401 unauthenticated`` when a header is missing or empty, or the name
    is not an agent name."""
    if not headers.agent or not headers.timestamp or not headers.signature:
        raise Refusal("missing_headers", errors.unauthenticated("missing authentication headers"))
    try:
        agent = headers.agent.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        agent = ""
    if not _AGENT.match(agent):
        raise Refusal("bad_agent_name", errors.unauthenticated("invalid agent name"))
    return agent


def parse_timestamp(value: bytes) -> Optional[float]:
    """The epoch seconds of ``X-Agent-Relay-Timestamp``, or None when it is not a number."""
    value = value.strip()
    return float(value) if _TIMESTAMP.match(value) else None


def check_request(ring: Keyring, agent: str, headers: SignedHeaders, method: bytes,
                  path: bytes, body: bytes, now: float) -> Verified:
    """Verify a request of ``agent`` (:func:`read_agent`) against its keyring ``ring`` at
    the time ``now``. Raises :class:`Refusal`:

    - ``401 unknown_key``: a v3 request naming a key the ring lacks or one past its
      ``notAfter``; a v2 request when every key is past its ``notAfter``, or whose
      signature only a key past it verifies;
    - ``401 unauthenticated``: a timestamp that is not a number or more than
      :data:`MAX_CLOCK_SKEW_SECONDS` from ``now``, or a signature no key verifies
      (these two count toward the lockout).
    """
    key_id = headers.key
    if key_id:
        key = ring.get(key_id)
        if key is None:
            raise Refusal("unknown_key", errors.unknown_key("unknown relay key id"))
        if not key.live(now):
            raise Refusal("expired_key", errors.unknown_key("expired relay key"))
        candidates: Tuple[Tuple[str, SigningKey], ...] = ((key_id, key),)
    else:
        candidates = tuple((kid, key) for kid, key in ring.items() if key.live(now))
        if not candidates:
            raise Refusal("expired_key", errors.unknown_key(
                "every key of this agent is past its notAfter"))
    assert headers.timestamp is not None and headers.signature is not None
    stamp = headers.timestamp.strip()
    timestamp = parse_timestamp(stamp)
    if timestamp is None:
        raise Refusal("bad_timestamp", errors.unauthenticated("invalid timestamp"), counts=True)
    if abs(int(now) - timestamp) > MAX_CLOCK_SKEW_SECONDS:
        raise Refusal("clock_skew", errors.unauthenticated("timestamp skew"), counts=True)
    signed = string_to_sign(agent, stamp, method, path, body, key_id or None)
    signature = headers.signature.strip().lower()
    for kid, key in candidates:
        if _matches(key, signed, signature):
            return Verified(agent, kid, "v3" if key_id else "v2", int(timestamp))
    if not key_id and any(_matches(key, signed, signature)
                          for key in ring.values() if not key.live(now)):
        raise Refusal("expired_key", errors.unknown_key("expired relay key"))
    raise Refusal("bad_signature", errors.unauthenticated("invalid signature"), counts=True)


def _matches(key: SigningKey, signed: bytes, signature: bytes) -> bool:
    for secret in key.secrets:
        mac = _keyed(secret).copy()
        mac.update(signed)
        if hmac.compare_digest(mac.hexdigest().encode("ascii"), signature):
            return True
    return False


@functools.lru_cache(maxsize=1024)
def _keyed(secret: str) -> Any:
    """An HMAC-SHA256 of ``secret`` that has hashed nothing yet: a copy of it signs
    without deriving the key's pads again (the seed wire keeps its keys so too)."""
    return hmac.new(secret.encode("utf-8"), digestmod=hashlib.sha256)
