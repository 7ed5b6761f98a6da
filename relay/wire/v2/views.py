"""How one stored message looks on the v2/v3 wire, and how a v2/v3 send is stored
(WIRE-V2 §3): the pure mapping between the reference's snake_case envelope and the
seed-wire message both wires share.

Pure: no reactor, no I/O; times are epoch seconds handed in.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Dict, Optional, Tuple

from relay.wire.protocol import DONE, EXPIRED, FAILED, LEASED, QUEUED
from relay.wire.v2.canonical import canonical_text

# A relay.rules.delivery.Message; not imported, since relay.rules.delivery imports this module.
Message = Any

PROTOCOL_VERSION = 3
MAX_BODY_CHARS = 48000
MAX_SESSION_REF_CHARS = 300
MAX_TOPIC_CHARS = 200
MAX_IDEMPOTENCY_KEY_CHARS = 120
MAX_ERROR_CHARS = 300
EXECUTION_MODES = ("read", "continue", "write")
TTL_MIN_SECONDS = 60
TTL_MAX_SECONDS = 3600
DEFAULT_TTL_SECONDS = 3600
NOTICE_TTL_SECONDS = 3600
NOTICE_PREVIEW_CHARS = 400
# The seed-wire body keys a v2 message is stored with; a seed-wire body of only
# the first three is shown to v2 clients as its text.
TEXT, CONTEXT, TOPIC, MODE, SESSION_REF = ("text", "context", "topic", "executionMode",
                                           "sessionRef")
_PLAIN_KEYS = frozenset((TEXT, CONTEXT, TOPIC))
_V2_KEYS = _PLAIN_KEYS | {MODE, SESSION_REF}
# The stored statuses as v2 names them.
_STATUS = {QUEUED: "queued", LEASED: "leased", DONE: "completed", FAILED: "failed",
           EXPIRED: "expired"}
STATUSES = tuple(_STATUS.values())


def canonical_json(value: Any) -> str:
    """PROTOCOL-V2 §4's canonical text: sorted keys, no spaces, non-ASCII kept."""
    return canonical_text(value)


def message_id_for(origin: str, idempotency_key: str) -> str:
    """The id of ``origin``'s message sent with ``idempotency_key``: 32 hex characters
    derived from the pair, so a repeated send finds the first one on any broker of a
    shared store and after restarts."""
    digest = hashlib.sha256(f"relay-v2\n{origin}\n{idempotency_key}".encode())
    return digest.hexdigest()[:32]


@functools.lru_cache(maxsize=1024)
def v2_meta(mode: str, session_ref: str, allow_shared_write: bool) -> str:
    """The text kept in :attr:`relay.rules.delivery.Message.v2` for a v2/v3 message (an agent
    sends under few references: the texts are kept)."""
    meta: Dict[str, Any] = {"mode": mode, "ref": session_ref}
    if allow_shared_write:
        meta["shared"] = True
    return canonical_json(meta)


def read_meta(message: Message) -> Tuple[str, str, bool]:
    """``(execution_mode, session_ref, allow_shared_write)`` of a stored message; a
    seed-wire message reads ``("read", "", False)``."""
    if message.v2 is None:
        return "read", "", False
    return _read_meta(message.v2)


@functools.lru_cache(maxsize=1024)
def _read_meta(text: str) -> Tuple[str, str, bool]:
    meta = json.loads(text)
    return meta.get("mode", "read"), meta.get("ref", ""), bool(meta.get("shared"))


def stored_body(text: str, context: str, topic: str, mode: str, session_ref: str
                ) -> Dict[str, Any]:
    """The seed-wire body of a v2 message: its text, with ``context``, ``topic``,
    ``executionMode`` and ``sessionRef`` when set."""
    body: Dict[str, Any] = {TEXT: text}
    if context:
        body[CONTEXT] = context
    if topic:
        body[TOPIC] = topic
    body[MODE] = mode
    if session_ref:
        body[SESSION_REF] = session_ref
    return body


def shown_body(message: Message) -> Tuple[str, str, str]:
    """``(body, context, topic)`` of a stored message on the v2 wire: a body of only
    ``text`` (a string), ``context`` and ``topic`` (and, for a v2 message, its mode
    and reference) is that text; any other is its canonical JSON."""
    body = message.body
    keys = _V2_KEYS if message.v2 is not None else _PLAIN_KEYS
    text = body.get(TEXT) if isinstance(body, dict) else None
    if isinstance(text, str) and keys.issuperset(body):
        context, topic = body.get(CONTEXT), body.get(TOPIC)
        return (text, context if isinstance(context, str) else "",
                topic if isinstance(topic, str) else "")
    return canonical_json(body), "", ""


def topic_of(message: Message) -> str:
    """The v2 ``topic`` of a stored message ("" when none)."""
    return shown_body(message)[2]


def kind_of(message: Message) -> str:
    """The v2 ``kind``: a seed-wire ``message`` is a ``request``."""
    return "reply" if message.kind == "reply" else "request"


def status_of(message: Message, now: float) -> str:
    """The v2 status of a stored message at ``now``: ``expired`` once its TTL ran out
    while it was queued or leased (kept so by the sweep, or about to be)."""
    status = message.status
    if status in (QUEUED, LEASED) and message.expires_at is not None \
            and message.expires_at <= now:
        return "expired"
    return _STATUS.get(status, status)


def stored_status(status: str) -> Optional[str]:
    """The stored status every message of the v2 status ``status`` has (None: no one
    status; ``expired`` is also a queued or leased message past its TTL)."""
    if status == "expired":
        return None
    for stored, name in _STATUS.items():
        if name == status:
            return stored
    return None


def visible(message: Message, now: float) -> bool:
    """Whether a v2 read shows the stored ``message`` at ``now``: a message past its TTL
    only when it is kept (a v2/v3 message, :func:`relay.rules.delivery.outlives_ttl`); a
    seed-wire one is gone on both wires."""
    return message.v2 is not None or message.expires_at is None or message.expires_at > now


def expires_at(message: Message, default_ttl: float) -> float:
    """When the message expires (epoch seconds): its own TTL, else the broker's."""
    if message.expires_at is not None:
        return message.expires_at
    return message.created + default_ttl


def public_view(message: Message, viewer: str, default_ttl: float) -> Dict[str, Any]:
    """The v2 envelope of a stored message (PROTOCOL-V2 §2), with ``lease_token`` and
    ``lease_until`` (epoch seconds) for its recipient while it is leased."""
    body, context, topic = shown_body(message)
    mode, session_ref, shared = read_meta(message)
    out: Dict[str, Any] = {
        "message_id": message.id,
        "root_id": message.root_id or message.id,
        "parent_id": message.parent_id or message.reply_to,
        "origin": message.sender,
        "target": message.to,
        "kind": kind_of(message),
        "body": body,
        "session_ref": session_ref,
        "created_at": message.created,
        "expires_at": expires_at(message, default_ttl),
        "execution_mode": mode,
    }
    if context:
        out["context"] = context
    if topic:
        out["topic"] = topic
    if viewer == message.lessee() and message.status == LEASED and message.lease_id is not None:
        out["lease_token"] = message.lease_id
        out["lease_until"] = message.lease_until / 1000.0
    if shared:
        out["allow_shared_write"] = True
    return out


def summary(message: Message, default_ttl: float, now: float) -> Dict[str, Any]:
    """The bodiless entry of ``/v1/status`` and ``/v1/recent`` at ``now``;
    ``completed_at`` (epoch seconds) is when it last became done or failed."""
    return {
        "message_id": message.id,
        "origin": message.sender,
        "target": message.to,
        "kind": kind_of(message),
        "status": status_of(message, now),
        "attempts": message.deliveries,
        "last_error": (message.error or "")[:MAX_ERROR_CHARS],
        "created_at": message.created,
        "expires_at": expires_at(message, default_ttl),
        "completed_at": message.completed_at,
        "topic": topic_of(message),
    }


def not_found(message_id: str) -> Dict[str, Any]:
    """The ``/v1/status`` entry of an id the caller may not see or that is unknown."""
    return {"message_id": message_id, "status": "not_found", "attempts": 0}


def undelivered_text(request: Message, max_attempts: int, expired: bool) -> str:
    """The text of the notice a v2 sender gets when its request was never processed
    (PROTOCOL-V2 §5.2, in English). It quotes the start of the sender's own text."""
    reason = ("the message expired in the queue; the peer never processed it" if expired
              else (request.error or "unknown")[:MAX_ERROR_CHARS])
    text = shown_body(request)[0]
    preview = text[:NOTICE_PREVIEW_CHARS]
    limit = f"/{max_attempts}" if max_attempts else ""
    return (f"[Relay] Your relay message was not delivered:\n"
            f"target agent: {request.to}\n"
            f"attempts: {request.deliveries}{limit}\n"
            f"reason: {reason}\n\n"
            f"original message (first {len(preview)} characters):\n{preview}")
