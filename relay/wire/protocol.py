"""Wire-protocol constants and request validation (spec §2, §4, §5.1).

Pure: no reactor, no I/O. Everything here takes plain values and either returns
normalised data or raises :class:`relay.wire.errors.RelayError`.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import json
import re
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from relay.wire.errors import bad_request

PROTOCOL_VERSION = "1.0"
BROKER_NAME = "dsh-agent-relay"

MAX_BODY_BYTES = 1024 * 1024
HEARTBEAT_TTL_SECONDS = 90
# REACH §15: where the main listener serves the human inbox page
INBOX_PATH = "/inbox/"
MAX_CLOCK_SKEW_SECONDS = 300
DEFAULT_LIMIT = 50
MAX_LIMIT = 200
MAX_STATUS_IDS = 200
MAX_LEASE_SECONDS = 86400
MAX_WAIT_SECONDS = 20
MAX_JSON_DEPTH = 100
# The most JSON values (objects, arrays, strings, numbers, literals) one request body
# may hold: parsing is bounded work, whatever the body's shape.
MAX_JSON_VALUES = 100_000

MESSAGE_TYPES = ("message", "ack")
MESSAGE_KINDS = ("message", "request", "reply")
STATUSES = ("queued", "leased", "done", "failed")
OUTCOMES = ("completed", "retry", "release", "reject")
BOXES = ("inbox", "sent", "all")

# v1.2 limits (EXTENSIONS.md)
MAX_RETRY_AFTER_SECONDS = 43200
MAX_DELAY_SECONDS = 86400
MAX_REASON_CHARS = 1000
MAX_CARD_DESCRIPTION_CHARS = 2000
MAX_CARD_SKILL_CHARS = 100
MAX_CARD_SKILLS = 50
MAX_CARD_ROLES = 64
# REACH §14: a message's priority is an integer 0..MAX_PRIORITY (0 when absent).
MAX_PRIORITY = 9
ROLE_PREFIX = "role:"
# Every id and reference field (``id``, ``replyTo``, ``rootId``, ``parentId``,
# ``messageId``, ``leaseId``, ``since``, filters): at most this many characters.
MAX_ID_CHARS = 256
# Failure notice ids (EXTENSIONS.md §4) are derived from the request id in a space
# of their own: no client may send an id that begins with this prefix, so no one
# can take a notice's id before the broker stores the notice.
NOTICE_ID_PREFIX = "relay-notice-"
NOTICE_NAMESPACE = uuid.UUID("6f1c9d52-2b0e-5b4e-9a3c-5d0c6a7e1f42")
# GET /peers (additive paging): ``limit`` is clamped to 1..1000, and an answer stops
# once its entries hold about this many bytes (as every listing does), with ``next``.
MAX_PEERS_LIMIT = 1000
PEERS_BUDGET_BYTES = 4 * 1024 * 1024
# Fields the broker sets on an atomic reply; a client may not.
BROKER_SET_REPLY_FIELDS = ("to", "from", "parentId", "replyTo", "rootId")

REQUEST_KIND = "request"

QUEUED = "queued"
LEASED = "leased"
DONE = "done"
FAILED = "failed"
# A message of the v2/v3 wire kept after its TTL ran out while queued or leased (the
# reference's ``expired``, WIRE-V2 §3). Never a seed-wire status: every seed-wire
# view leaves a message past its TTL out, so no seed-wire client ever sees it.
EXPIRED = "expired"
STORED_STATUSES = STATUSES + (EXPIRED,)

AGENT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
# REACH §13: the address of a group (``group:NAME``) beside agent names.
GROUP_PREFIX = "group:"

_MISSING = object()


def notice_id(request_id: str) -> str:
    """The id of the failure notice of ``request_id``: the same on every broker, and
    in the reserved space no client may send an id in."""
    return NOTICE_ID_PREFIX + str(uuid.uuid5(NOTICE_NAMESPACE, request_id))


def check_id(value: str, field: str) -> str:
    """``value``, an id or reference field, when it has at most 256 characters; else 400."""
    if len(value) > MAX_ID_CHARS:
        raise bad_request(f"{field} must be at most {MAX_ID_CHARS} characters")
    return value


def loggable(text: str) -> str:
    """``text`` (an id a client chose) for a log line: at most ``MAX_ID_CHARS``
    characters, and escaped as Python writes a string (``\\n``, ``\\x00``) when
    it holds a control or other unprintable character, so that it can neither forge
    a line nor flood the log."""
    if len(text) > MAX_ID_CHARS:
        text = text[:MAX_ID_CHARS] + "..."
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def optional_query_id(value: Optional[str], field: str) -> Optional[str]:
    """An id of the query string (``since``): None when absent or empty, else
    :func:`check_id`."""
    return check_id(value, field) if value else None


def check_new_id(value: str, field: str) -> str:
    """``value``, the id of a new message, when :func:`check_id` takes it and it is
    not in the failure notices' reserved space; else 400."""
    check_id(value, field)
    if value.startswith(NOTICE_ID_PREFIX):
        raise bad_request(f"{field} must not begin with {NOTICE_ID_PREFIX!r}: such ids "
                          "are reserved for the broker's failure notices")
    return value


def _chosen_or_new_id(value: Any, absent: Any, field: str) -> str:
    """The id a sender chose for a new message (:func:`check_new_id`), or a new UUID
    when ``value`` is ``absent``; 400 for anything but a non-empty string."""
    if value is absent:
        return str(uuid.uuid4())
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field} must be a non-empty string")
    return check_new_id(value, field)


def is_valid_agent_name(name: str) -> bool:
    """True when ``name`` is a legal agent name (``[A-Za-z0-9_.-]{1,64}``)."""
    return bool(AGENT_NAME.match(name))


# The throwaway agents of `relay selfcheck`: selfcheck-<8 hex digits>-a and -b.
# The protocol cannot remove an agent; the relay's own views leave these out.
SELFCHECK_AGENT = re.compile(r"selfcheck-[0-9a-f]{8}-[ab]\Z")


def is_selfcheck_agent(name: str) -> bool:
    """Whether ``name`` is one of the throwaway agents of a ``relay selfcheck`` run."""
    return SELFCHECK_AGENT.match(name) is not None


@functools.lru_cache(maxsize=4096)
def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1`` and IPv4-mapped loopback addresses
    (a zone id such as ``%lo`` is ignored): the hosts spec §3 calls loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if address.is_loopback:
        return True
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped is not None and mapped.is_loopback


@functools.lru_cache(maxsize=4096)
def address_group(host: str) -> str:
    """The key a client address is counted under (rate limits, connection caps): the
    address itself, an IPv4-mapped address as its IPv4 address, and any other IPv6
    address as its /64 (one host usually holds a whole /64)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.version == 6:
        mapped = address.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        if not address.is_loopback:
            return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


_second_prefix: Tuple[int, str] = (-1, "")


def iso_seconds(text: str) -> Optional[float]:
    """Epoch seconds of an ISO-8601 timestamp (``Z`` or an offset; UTC without
    either), or None when ``text`` is not one."""
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def iso_timestamp(seconds: float) -> str:
    """An ISO-8601 UTC timestamp with milliseconds, as JavaScript's ``toISOString``."""
    global _second_prefix
    whole, micros = divmod(round(seconds * 1_000_000), 1_000_000)
    fraction = micros // 1000
    cached, prefix = _second_prefix
    if cached != whole:
        dt = datetime.datetime.fromtimestamp(whole, tz=datetime.timezone.utc)
        prefix = dt.strftime("%Y-%m-%dT%H:%M:%S.")
        _second_prefix = (whole, prefix)
    return f"{prefix}{fraction:03d}Z"


class _NotJSON(ValueError):
    """A constant JSON does not have (``NaN``, ``Infinity``)."""


def _reject_constant(name: str) -> Any:
    raise _NotJSON(name)


class _TooLarge(ValueError):
    """A number JSON allows that overflows a double (``1e400``)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _TooLarge()
    return value


def _double_int(text: str) -> int:
    """An integer literal that a double holds (``10**400`` is Infinity to JavaScript,
    and ``float()`` of it raises); else :class:`_TooLarge`."""
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise _TooLarge() from None
    return value


def _shape(value: Any, raw: bytes) -> Optional[str]:
    """Why ``value`` is too big in shape — nested deeper than ``MAX_JSON_DEPTH`` or
    holding more than ``MAX_JSON_VALUES`` values — else None.

    Iterative, and skipped when ``raw`` holds too few brackets and commas to reach
    either bound (each value but the first follows a comma or an opening bracket).
    """
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= MAX_JSON_DEPTH and brackets + raw.count(b",") < MAX_JSON_VALUES:
        return None
    count = 1
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels"
        children = item.values() if isinstance(item, dict) else item
        count += len(children)
        if count > MAX_JSON_VALUES:
            return f"made of more than {MAX_JSON_VALUES} JSON values"
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return None


def _compact_encoder() -> Callable[[Any], str]:
    """``JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode``, with the C
    encoder made once instead of per call where the runtime has one."""
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    chunks = make(None, encoder.default, json.encoder.encode_basestring, None,
                  encoder.key_separator, encoder.item_separator, False, False, True)

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    return encode


compact_json = _compact_encoder()


# A \u escape of a UTF-16 surrogate: alone it decodes to text UTF-8 cannot carry.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# One shared decoder: json.loads with options builds a new one per call.
_STRICT_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
# 309 digits in a row: where an integer may pass a double's range (about 1.8e308).
_LONG_DIGITS = re.compile(rb"[0-9]{309}")
# Checks each integer too (a Python call per integer): only for bodies that have one.
_INT_CHECKING_DECODER = json.JSONDecoder(parse_constant=_reject_constant,
                                         parse_float=_finite_float, parse_int=_double_int)


def parse_json_body(raw: bytes, *, empty_ok: bool = True) -> Any:
    """Decode a request body as strict JSON; an empty body is ``{}`` when ``empty_ok``.

    ``NaN``, ``Infinity``, numbers that overflow a double and lone surrogate
    escapes are refused: stored, they would be served back as text no JSON
    parser (or no UTF-8 encoder) accepts. So is a body of more than
    ``MAX_JSON_VALUES`` values (parsing one costs work in proportion), and
    nesting deeper than ``MAX_JSON_DEPTH``: near the interpreter's recursion
    limit a body can parse yet fail to encode when served, and block its
    recipient's queue with 503s.
    """
    if not raw.strip():
        if empty_ok:
            return {}
        raise bad_request("request body is required")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    decoder = _INT_CHECKING_DECODER if _LONG_DIGITS.search(raw) else _STRICT_DECODER
    try:
        value = decoder.decode(text)
    except _TooLarge:
        raise bad_request("request body holds a number too large for a double "
                          "(beyond about 1.8e308)") from None
    except (ValueError, RecursionError):
        raise bad_request("request body is not valid JSON") from None
    if isinstance(value, (dict, list)):
        problem = _shape(value, raw)
        if problem is not None:
            raise bad_request(f"request body is {problem}")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("request body holds an invalid unicode escape") from None
    return value


def parse_json_object(raw: bytes) -> Dict[str, Any]:
    """A request body that must be a JSON object (``{}`` when empty)."""
    value = parse_json_body(raw)
    if not isinstance(value, dict):
        raise bad_request("body must be a JSON object")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_integral(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integral JSON number, else None."""
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def clamp_limit(value: Any, default: int = DEFAULT_LIMIT) -> int:
    """A ``limit`` clamped to 1..200; a missing or non-numeric value gives the default.

    Numbers are floored like the reference broker does; strings holding numbers
    are accepted because v1.0 passes ``limit`` in the query string.
    """
    if value is None or isinstance(value, bool):
        return default
    if isinstance(value, int):
        return max(1, min(MAX_LIMIT, value))
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return default
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        return default
    if number != number or number in (float("inf"), float("-inf")):
        return default
    return max(1, min(MAX_LIMIT, int(number // 1)))


def parse_lease_seconds(body: Dict[str, Any]) -> Optional[int]:
    """``leaseSeconds`` from a pull body: an integer 1..86400, None when absent, else 400."""
    value = body.get("leaseSeconds")
    if value is None:
        return None
    seconds = _as_integral(value)
    if seconds is None or not 1 <= seconds <= MAX_LEASE_SECONDS:
        raise bad_request(f"leaseSeconds must be an integer from 1 to {MAX_LEASE_SECONDS}")
    return seconds


def parse_wait_seconds(value: Any, name: str) -> int:
    """The ``wait`` of ``GET /messages``: an integer 0..20 written in decimal digits.
    (The body field ``waitSeconds`` is a JSON integer: :func:`strict_int`.)"""
    if value is None:
        return 0
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,3}", value):
        value = int(value)
    seconds = _as_integral(value)
    if seconds is None or not 0 <= seconds <= MAX_WAIT_SECONDS:
        raise bad_request(f"{name} must be an integer from 0 to {MAX_WAIT_SECONDS}")
    return seconds


def check_body_agent(body: Dict[str, Any], agent: str) -> None:
    """A body ``agent`` field, when present, must name the authenticated agent."""
    if "agent" in body and body["agent"] != agent:
        raise bad_request("body.agent must match X-Relay-Agent header")


def _optional_string(body: Dict[str, Any], field: str) -> Optional[str]:
    value = body.get(field)
    if value is None:
        return value
    if isinstance(value, str):
        return check_id(value, field)
    raise bad_request(f"{field} must be a string or null")


def normalize_envelope(body: Any, agent: str) -> Dict[str, Any]:
    """Validate a sent envelope (full or shorthand) and fill the §2 defaults.

    Returns the client-controlled fields of the stored envelope: ``id``,
    ``from``, ``to``, ``type``, ``body``, ``replyTo``, ``ack``, ``kind``,
    ``rootId`` and ``parentId`` (spec §2: ``from`` and ``id`` are assigned if
    absent). A ``null`` ``from``, ``body`` or ``ack`` counts as absent. ``ts`` is
    always the broker's, the time the message is stored, as the reference broker
    sets it; the broker-managed fields (``status``, ``attempts``, ``leaseUntil``,
    ``leaseId``) are ignored when sent too.
    """
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    msg_id = _chosen_or_new_id(body.get("id", _MISSING), _MISSING, "id")
    sender = body.get("from")
    if sender is not None and sender != agent:
        raise bad_request("envelope.from must match X-Relay-Agent header")
    to = body.get("to")
    if not isinstance(to, str) or not to:
        raise bad_request("to is required")
    check_id(to, "to")
    if to == agent:
        raise bad_request("cannot send a message to yourself")
    msg_type = body.get("type", "message")
    if msg_type not in MESSAGE_TYPES:
        raise bad_request('type must be "message" or "ack"')
    payload = body.get("body")
    if payload is None:
        payload = {}
    elif not isinstance(payload, dict):
        raise bad_request("body must be an object")
    ack = body.get("ack")
    if ack is None:
        ack = False
    elif not isinstance(ack, bool):
        raise bad_request("ack must be a boolean")
    kind = body.get("kind")
    if kind is None:
        kind = "message"
    elif kind not in MESSAGE_KINDS:
        raise bad_request('kind must be "message", "request" or "reply"')
    return {
        "id": msg_id,
        "from": agent,
        "to": to,
        "type": msg_type,
        "body": payload,
        "replyTo": _optional_string(body, "replyTo"),
        "ack": ack,
        "kind": kind,
        "rootId": _optional_string(body, "rootId"),
        "parentId": _optional_string(body, "parentId"),
    }


def ack_receipt(target: Dict[str, Any], agent: str, body: Any) -> Dict[str, Any]:
    """The ``type: "ack"`` envelope a v1.0 receipt stores back to the sender."""
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    status = body.get("status", "ok")
    if status not in ("ok", "error"):
        raise bad_request('status must be "ok" or "error"')
    payload: Dict[str, Any] = {"status": status}
    if status == "error":
        error = body.get("error", "unknown")
        if not isinstance(error, str):
            raise bad_request("error must be a string")
        payload["error"] = error
    return {
        "id": str(uuid.uuid4()),
        "from": agent,
        "to": target["from"],
        "type": "ack",
        "body": payload,
        "replyTo": target["id"],
        "ack": False,
        "kind": "message",
        "rootId": None,
        "parentId": None,
    }


def strict_int(body: Dict[str, Any], field: str, lo: int, hi: int,
               name: Optional[str] = None) -> Optional[int]:
    """An optional v1.2 integer field: a JSON integer ``lo..hi`` (not a float such as
    ``30.0`` or ``3e1``, a string or a boolean); None when absent or null; else 400
    naming it ``name`` (``field`` by default)."""
    value = body.get(field)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise bad_request(f"{name or field} must be an integer from {lo} to {hi}")
    return value


def required_id(body: Dict[str, Any], field: str) -> str:
    """A required non-empty string field (``messageId``, ``leaseId``, ``rootId``)."""
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field} is required (a non-empty string)")
    return check_id(value, field)


def optional_id(body: Dict[str, Any], field: str) -> Optional[str]:
    """An optional non-empty string field; None when absent or null."""
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field} must be a non-empty string")
    return check_id(value, field)


def parse_reply(value: Any) -> Dict[str, Any]:
    """The ``reply`` of an atomic ``completed`` ack (v1.2 §6): ``{id, body, kind, ack}``
    with defaults; unknown keys are ignored, the broker-set ones are 400."""
    if not isinstance(value, dict):
        raise bad_request("reply must be an object")
    for field in BROKER_SET_REPLY_FIELDS:
        if field in value:
            raise bad_request(f"reply.{field} is set by the broker")
    reply_id = _chosen_or_new_id(value.get("id"), None, "reply.id")
    body = value.get("body")
    if body is None:
        body = {}
    elif not isinstance(body, dict):
        raise bad_request("reply.body must be an object")
    kind = value.get("kind")
    if kind is None:
        kind = "reply"
    elif kind not in ("reply", "message"):
        raise bad_request('reply.kind must be "reply" or "message"')
    ack = value.get("ack")
    if ack is None:
        ack = False
    elif not isinstance(ack, bool):
        raise bad_request("reply.ack must be a boolean")
    reply = {"id": reply_id, "body": body, "kind": kind, "ack": ack}
    priority = parse_priority(value, "reply.priority")
    if priority:
        reply["priority"] = priority  # REACH §14: only when set
    return reply


class AckRequest:
    """A validated ``/v1/ack`` body (v1.1 plus the v1.2 outcomes, retry-after and reply)."""

    __slots__ = ("message_id", "lease_id", "outcome", "error", "retry_after", "reply")

    def __init__(self, message_id: str, lease_id: str, outcome: str, error: Optional[str],
                 retry_after: Optional[int] = None,
                 reply: Optional[Dict[str, Any]] = None) -> None:
        self.message_id = message_id
        self.lease_id = lease_id
        self.outcome = outcome
        self.error = error
        self.retry_after = retry_after
        self.reply = reply


def parse_ack(body: Dict[str, Any]) -> AckRequest:
    """A ``/v1/ack`` body, or 400."""
    message_id = required_id(body, "messageId")
    lease_id = required_id(body, "leaseId")
    outcome = body.get("outcome")
    if outcome not in OUTCOMES:
        raise bad_request('outcome must be "completed", "retry", "release" or "reject"')
    error = body.get("error")
    if error is not None and (not isinstance(error, str) or len(error) > MAX_REASON_CHARS):
        raise bad_request(f"error must be a string of at most {MAX_REASON_CHARS} characters")
    retry_after = strict_int(body, "retryAfterSeconds", 0, MAX_RETRY_AFTER_SECONDS)
    if retry_after is not None and outcome not in ("retry", "release"):
        raise bad_request("retryAfterSeconds goes only with retry or release")
    reply = body.get("reply")
    if reply is not None:
        if outcome != "completed":
            raise bad_request("reply goes only with completed")
        reply = parse_reply(reply)
    return AckRequest(message_id, lease_id, outcome, error, retry_after, reply)


def parse_renew(body: Dict[str, Any]) -> Tuple[str, str, Optional[int]]:
    """``(messageId, leaseId, leaseSeconds or None)`` of a ``/v1/lease/renew`` body."""
    message_id = required_id(body, "messageId")
    lease_id = required_id(body, "leaseId")
    return message_id, lease_id, strict_int(body, "leaseSeconds", 1, MAX_LEASE_SECONDS)


def parse_reason(body: Dict[str, Any]) -> Optional[str]:
    """The optional ``reason`` of ``/v1/cancel``: a string of at most 1000 characters."""
    reason = body.get("reason")
    if reason is None:
        return None
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise bad_request(f"reason must be a string of at most {MAX_REASON_CHARS} characters")
    return reason


def parse_send_options(body: Dict[str, Any]) -> Tuple[Optional[int], int]:
    """``(ttlSeconds or None, delaySeconds)`` of a sent envelope (v1.2 §7). The TTL's
    upper bound is the broker's (``capabilities.messageTtl.maxSeconds``)."""
    ttl = body.get("ttlSeconds")
    if ttl is not None and (not _is_int(ttl) or ttl < 1):
        raise bad_request("ttlSeconds must be an integer of at least 1")
    delay = strict_int(body, "delaySeconds", 0, MAX_DELAY_SECONDS)
    return ttl, delay or 0


def parse_priority(body: Dict[str, Any], field: str = "priority") -> int:
    """The ``priority`` of a sent envelope or of a reply (REACH §14): a JSON integer
    0..9, 0 when absent or null; else 400."""
    return strict_int(body, "priority", 0, MAX_PRIORITY, field) or 0


def parse_role(body: Dict[str, Any]) -> Optional[str]:
    """The ``role`` of a pull (REACH §13): a role name, None when absent or null."""
    value = body.get("role")
    if value is None:
        return None
    if not isinstance(value, str) or not AGENT_NAME.match(value):
        raise bad_request("role must be a role name ([A-Za-z0-9_.-]{1,64})")
    return value


KEEP_CARD = object()  # a register without ``card`` keeps the stored one


def parse_card(body: Dict[str, Any]) -> Any:
    """The ``card`` of ``/register`` (v1.2 §8): :data:`KEEP_CARD` when absent, None to
    remove it (``card: null``), else the validated card."""
    if "card" not in body:
        return KEEP_CARD
    card = body["card"]
    if card is None:
        return None
    if not isinstance(card, dict):
        raise bad_request("card must be an object or null")
    for key in card:
        if key not in ("description", "skills", "roles"):
            raise bad_request(f"card.{key} is not a card field (description, skills, roles)")
    out: Dict[str, Any] = {}
    description = card.get("description")
    if description is not None:
        if not isinstance(description, str) or len(description) > MAX_CARD_DESCRIPTION_CHARS:
            raise bad_request(f"card.description must be a string of at most "
                              f"{MAX_CARD_DESCRIPTION_CHARS} characters")
        out["description"] = description
    skills = card.get("skills")
    if skills is not None:
        if (not isinstance(skills, list) or len(skills) > MAX_CARD_SKILLS
                or not all(isinstance(s, str) and len(s) <= MAX_CARD_SKILL_CHARS
                           for s in skills)):
            raise bad_request(f"card.skills must be a list of at most {MAX_CARD_SKILLS} "
                              f"strings of at most {MAX_CARD_SKILL_CHARS} characters")
        out["skills"] = list(skills)
    roles = card.get("roles")
    if roles is not None:
        if (not isinstance(roles, list) or len(roles) > MAX_CARD_ROLES
                or not all(isinstance(r, str) and AGENT_NAME.match(r) for r in roles)):
            raise bad_request(f"card.roles must be a list of at most {MAX_CARD_ROLES} role "
                              "names ([A-Za-z0-9_.-]{1,64})")
        out["roles"] = sorted(set(roles))
    return out


def parse_peers_query(after: Optional[str], limit: Optional[str],
                      cards: Optional[str]) -> Tuple[Optional[str], Optional[int], bool]:
    """``(after, limit, cards)`` of ``GET /peers``'s additive query parameters: the
    agent name to list after (a page's ``next``), the most entries (clamped to
    1..1000 like the seed's ``limit``; None: as many as the byte budget holds) and
    whether cards are wanted (``true``, the default, or ``false``); else 400."""
    if after is not None:
        check_id(after, "after")
    count = None
    if limit is not None:
        try:
            number = float(limit.strip())
        except ValueError:
            number = float("nan")
        if number == number and abs(number) != float("inf"):  # else: no count limit
            count = max(1, min(MAX_PEERS_LIMIT, int(number // 1)))
    if cards is None or cards in ("true", "1"):
        wanted = True
    elif cards in ("false", "0"):
        wanted = False
    else:
        raise bad_request('cards must be "true" or "false"')
    return after or None, count, wanted


def peers_page(entries: List[Dict[str, Any]], after: Optional[str], limit: Optional[int],
               budget: Optional[int] = None) -> Dict[str, Any]:
    """The ``GET /peers`` answer of ``entries`` (sorted by name): those after
    ``after``, at most ``limit``, stopping once they hold about ``budget`` bytes
    (:data:`PEERS_BUDGET_BYTES` by default; never empty when one is left), and
    ``next`` (the last name listed) when more follow. Without more to list, the
    seed's shape exactly: ``{"peers": [...]}``."""
    budget = PEERS_BUDGET_BYTES if budget is None else budget
    page: List[Dict[str, Any]] = []
    size = 0
    remaining = [e for e in entries if after is None or e["agent"] > after]
    for entry in remaining:
        size += _peer_size(entry)
        if page and (size > budget or (limit is not None and len(page) >= limit)):
            break
        page.append(entry)
    document: Dict[str, Any] = {"peers": page}
    if len(page) < len(remaining):
        document["next"] = page[-1]["agent"]
    return document


def team_listing(teams: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The ``/peers`` ``groups`` or ``roles`` list (REACH §13) of configured teams
    (each with ``members``): ``[{"name", "members"}, ...]`` sorted by name."""
    return [{"name": name, "members": list(teams[name].members)} for name in sorted(teams)]


def _peer_size(entry: Dict[str, Any]) -> int:
    """About how many bytes a ``/peers`` entry takes in the answer."""
    card = entry.get("card")
    return len(entry["agent"]) + 64 + (len(compact_json(card)) if card is not None else 0)


def parse_status_ids(body: Dict[str, Any]) -> List[str]:
    """The ids of a ``/v1/status`` body: an array is required; the first 200 are used."""
    ids = body.get("messageIds")
    if not isinstance(ids, list):
        raise bad_request("messageIds array is required")
    out = []
    for value in ids[:MAX_STATUS_IDS]:
        if isinstance(value, str):
            out.append(check_id(value, "messageIds"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(json.dumps(value))
        else:
            raise bad_request("messageIds must hold strings")
    return out


def parse_query_filters(body: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """The filters of a query body: ``kind``, ``status``, ``from``, ``to``, and the v1.2
    ``box`` (``inbox``, the default, ``sent`` or ``all``), ``rootId``, ``parentId``."""
    filters: Dict[str, Optional[str]] = {}
    for field in ("kind", "status", "from", "to", "rootId", "parentId"):
        value = body.get(field)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{field} must be a string")
        filters[field] = check_id(value, field) if value else None
    box = body.get("box")
    if box is None:
        box = "inbox"
    elif box not in BOXES:
        raise bad_request('box must be "inbox", "sent" or "all"')
    filters["box"] = box
    return filters
