"""The delivery state machine of spec §5.1, shared by every backend.

    queued -(pull)-> leased -(ack completed)-> done
                       |--(ack retry)-> queued (attempts+1; > maxAttempts -> failed)
                       '--(lease expiry)-> queued (and marked for v1.0 recovery)

Pure: functions take ``now`` and mutate one :class:`Message`; stores persist
what changed.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from relay import errors
from relay.protocol import DONE, FAILED, LEASED, QUEUED, iso_timestamp

_UNDECODED = object()  # Message._body before its stored JSON text is read


class Message:
    """One stored message: the §2/§5.1 envelope plus the broker's bookkeeping."""

    __slots__ = (
        "seq",
        "id",
        "sender",
        "to",
        "ts",
        "type",
        "_body",
        "_body_json",
        "reply_to",
        "ack",
        "kind",
        "root_id",
        "parent_id",
        "status",
        "attempts",
        "lease_until",
        "lease_id",
        "error",
        "created",
        "recovery",
    )

    def __init__(
        self,
        id: str,
        sender: str,
        to: str,
        created: float,
        type: str = "message",
        body: Optional[Dict[str, Any]] = None,
        reply_to: Optional[str] = None,
        ack: bool = False,
        kind: str = "message",
        root_id: Optional[str] = None,
        parent_id: Optional[str] = None,
        ts: Optional[str] = None,
        seq: int = 0,
        status: str = QUEUED,
        attempts: int = 0,
        lease_until: Optional[int] = None,
        lease_id: Optional[str] = None,
        error: Optional[str] = None,
        recovery: bool = False,
        body_json: Optional[str] = None,
    ) -> None:
        self.seq = seq
        self.id = id
        self.sender = sender
        self.to = to
        self.created = created
        self.ts = ts if ts is not None else iso_timestamp(created)
        self.type = type
        # A stored body may arrive as JSON text (``body_json``); it is decoded only
        # when read, so settling an ack never parses the body.
        if body_json is not None:
            self._body: Any = _UNDECODED
        else:
            self._body = {} if body is None else body
        self._body_json = body_json
        self.reply_to = reply_to
        self.ack = ack
        self.kind = kind
        self.root_id = root_id
        self.parent_id = parent_id
        self.status = status
        self.attempts = attempts
        self.lease_until = lease_until
        self.lease_id = lease_id
        self.error = error
        self.recovery = recovery

    @property
    def body(self) -> Any:
        """The message body (spec §2), decoded from its stored JSON on first use."""
        if self._body is _UNDECODED:
            self._body = json.loads(self._body_json)
            self._body_json = None  # the decoded object is the truth from now on
        return self._body

    @body.setter
    def body(self, value: Any) -> None:
        self._body = value
        self._body_json = None

    def body_json(self) -> str:
        """The body as compact JSON text."""
        if self._body_json is None:
            return json.dumps(self._body, separators=(",", ":"))
        return self._body_json

    @classmethod
    def from_envelope(cls, envelope: Dict[str, Any], created: float) -> Message:
        """A new queued message from a :func:`relay.protocol.normalize_envelope` result."""
        return cls(
            id=envelope["id"],
            sender=envelope["from"],
            to=envelope["to"],
            created=created,
            ts=envelope.get("ts"),
            type=envelope["type"],
            body=envelope["body"],
            reply_to=envelope["replyTo"],
            ack=envelope["ack"],
            kind=envelope["kind"],
            root_id=envelope["rootId"],
            parent_id=envelope["parentId"],
        )

    def envelope(self, with_lease: bool = False) -> Dict[str, Any]:
        """The wire form (spec §2 + §5.1); ``leaseId`` only for the puller."""
        out = {
            "id": self.id,
            "from": self.sender,
            "to": self.to,
            "ts": self.ts,
            "type": self.type,
            "body": self.body,
            "replyTo": self.reply_to,
            "ack": self.ack,
            "kind": self.kind,
            "rootId": self.root_id,
            "parentId": self.parent_id,
            "status": self.status,
            "attempts": self.attempts,
            "leaseUntil": self.lease_until,
        }
        if with_lease:
            out["leaseId"] = self.lease_id
        if self.error is not None:
            out["error"] = self.error
        return out

    def status_entry(self) -> Dict[str, Any]:
        """The ``/v1/status`` entry of this message."""
        return {
            "id": self.id,
            "status": self.status,
            "attempts": self.attempts,
            "ts": self.ts,
            "from": self.sender,
            "to": self.to,
            "kind": self.kind,
        }

    def state(self) -> Dict[str, Any]:
        """The mutable delivery fields, for stores that persist changes."""
        return {
            "status": self.status,
            "attempts": self.attempts,
            "leaseUntil": self.lease_until,
            "leaseId": self.lease_id,
            "error": self.error,
            "recovery": self.recovery,
        }

    def __repr__(self) -> str:  # ids and state only: never the body
        return f"<Message seq={self.seq} id={self.id!r} {self.status} attempts={self.attempts}>"


def not_found_status(message_id: str) -> Dict[str, Any]:
    """The ``/v1/status`` entry of an unknown (or not visible) id."""
    return {"id": message_id, "status": "not_found", "attempts": 0}


def new_lease_id() -> str:
    """A fresh opaque lease id."""
    return os.urandom(16).hex()


def now_ms(now: float) -> int:
    """Epoch milliseconds, the unit of ``leaseUntil``."""
    return int(now * 1000)


def lease_expired(message: Message, now: float) -> bool:
    """True when ``message`` is leased and its lease deadline has passed."""
    return (
        message.status == LEASED
        and message.lease_until is not None
        and message.lease_until <= now_ms(now)
    )


def lease(message: Message, lease_seconds: float, now: float) -> None:
    """queued -> leased under a fresh lease id."""
    message.status = LEASED
    message.lease_id = new_lease_id()
    message.lease_until = now_ms(now) + int(lease_seconds * 1000)
    message.recovery = False


def expire_lease(message: Message) -> None:
    """leased -> queued after the deadline; the old lease id is dead.

    The message is marked for the v1.0 recovery delivery (spec §5.1).
    """
    message.status = QUEUED
    message.lease_id = None
    message.lease_until = None
    message.recovery = True


def settle(
    message: Message,
    agent: str,
    lease_id: str,
    outcome: str,
    error: Optional[str],
    now: float,
    max_attempts: int,
) -> Dict[str, Any]:
    """Apply a ``/v1/ack``; returns ``{ok, status, attempts}`` or raises RelayError.

    A lease past its deadline is released first (and the ack refused with
    ``not_leased``), so the outcome never depends on when the sweep last ran.
    Callers persist ``message`` whenever its state changed, also on error.
    """
    if message.to != agent:
        raise errors.forbidden("only the recipient may acknowledge this message")
    if lease_expired(message, now):
        expire_lease(message)
    if message.status != LEASED:
        raise errors.not_leased()
    if message.lease_id != lease_id:
        raise errors.lease_mismatch()
    message.lease_id = None
    message.lease_until = None
    message.error = error
    if outcome == "completed":
        message.status = DONE
    else:
        message.attempts += 1
        message.status = FAILED if message.attempts > max_attempts else QUEUED
    return {"ok": True, "status": message.status, "attempts": message.attempts}

