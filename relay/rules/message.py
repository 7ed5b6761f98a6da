"""The record of one stored message (:class:`Message`): its envelope, its body and the
broker's bookkeeping, with the wire forms it is shown in.

Its fields are declared once (:attr:`Message.FIELDS`, :attr:`Message.STATE_FIELDS`);
what goes through every one of them (a copy, the delivery state) is compiled from
that list once, at import, into a plain function (as :mod:`dataclasses` does), so it
costs what the same function written out by hand would.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from relay.wire.protocol import DONE, LEASED, QUEUED, ROLE_PREFIX, compact_json, iso_timestamp

_UNDECODED = object()  # Message._body before its stored JSON text is read
_new_message = object.__new__


def compiled(name: str, parameters: str, lines: Sequence[str],
             namespace: Mapping[str, Any]) -> Callable[..., Any]:
    """The function ``name(parameters)`` whose body is ``lines``, with the globals
    ``namespace``: for code derived from a declared list of fields (never from input)."""
    scope = dict(namespace)
    body = "".join(f"    {line}\n" for line in lines)
    exec(f"def {name}({parameters}):\n{body}", scope)
    return scope[name]


def _text(value: Optional[str]) -> str:
    return "null" if value is None else encode_basestring(value)


def _number(value: Optional[int]) -> str:
    return "null" if value is None else str(value)


def now_ms(now: float) -> int:
    """Epoch milliseconds, the unit of ``leaseUntil``."""
    return int(now * 1000)


class Message:
    """One stored message: the §2/§5.1 envelope plus the broker's bookkeeping.

    ``not_before`` (epoch seconds) is when a delayed or retried-after message
    becomes deliverable; ``delay_until`` and ``expires_at`` are the sender's
    ``delaySeconds`` and ``ttlSeconds`` as times, fixed at send. ``v2`` is None
    for a message sent on the seed wire, else the compact JSON text of what a
    v2/v3 sender set that the seed envelope has no field for
    (:func:`relay.wire.v2.views.v2_meta`): its execution mode, session reference
    and shared-write grant (WIRE-V2 §3). ``completed_at`` (epoch seconds) is when
    it last became done or failed (None before, and for one that expired), shown
    on the v2 wire as the reference shows it.
    """

    # Every field of a message but its body, in the order of __init__'s assignments:
    # what a copy copies. STATE_FIELDS are those a transition changes (state()).
    FIELDS = ("seq", "id", "sender", "to", "created", "ts", "type", "reply_to", "ack", "kind",
              "root_id", "parent_id", "status", "attempts", "lease_until", "lease_id", "error",
              "recovery", "deliveries", "not_before", "dead_reason", "delay_until",
              "expires_at", "via", "sent_id", "v2", "priority", "holder", "completed_at")
    STATE_FIELDS = ("status", "attempts", "lease_until", "lease_id", "error", "recovery",
                    "deliveries", "not_before", "dead_reason", "holder", "completed_at",
                    "expires_at")
    # The body is held as its decoded object (_body) or its JSON text (_body_json),
    # with its size once known (_bytes).
    __slots__ = FIELDS + ("_body", "_body_json", "_bytes")

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
        deliveries: int = 0,
        not_before: Optional[float] = None,
        dead_reason: Optional[str] = None,
        delay_until: Optional[float] = None,
        expires_at: Optional[float] = None,
        via: Optional[str] = None,
        sent_id: Optional[str] = None,
        v2: Optional[str] = None,
        priority: int = 0,
        holder: Optional[str] = None,
        completed_at: Optional[float] = None,
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
        self.deliveries = deliveries
        self.not_before = not_before
        self.dead_reason = dead_reason
        self.delay_until = delay_until
        self.expires_at = expires_at
        # REACH §13: a copy of a group send has the group's address (``group:NAME``)
        # and the id its sender sent under.
        self.via = via
        self.sent_id = sent_id
        self.v2 = v2
        # REACH §14: 0..9, fixed at send; a pull leases higher first.
        self.priority = priority
        # REACH §13: the member that leased a role message last (None otherwise).
        self.holder = holder
        self.completed_at = completed_at
        self._bytes: Optional[int] = None

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
        self._bytes = None

    def body_bytes(self) -> int:
        """The size of the body's JSON text in UTF-8 bytes."""
        if self._bytes is None or self._body_json is None:
            self._bytes = len(self.body_json().encode("utf-8"))
        return self._bytes

    def stored_bytes(self) -> int:
        """What the message counts toward its recipient's inbox quota: the UTF-8 bytes
        of its body's JSON text and of every string of its envelope the sender chose
        (``id``, ``from``, ``to``, ``replyTo``, ``rootId``, ``parentId``)."""
        size = self.body_bytes()
        for text in (self.id, self.sender, self.to, self.reply_to, self.root_id,
                     self.parent_id):
            if text is not None:
                size += len(text) if text.isascii() else len(text.encode("utf-8"))
        return size

    def body_json(self) -> str:
        """The body as compact JSON text (UTF-8 characters kept, not escaped)."""
        if self._body_json is None:
            return compact_json(self._body)
        return self._body_json

    def copy(self) -> Message:
        """An independent copy: changing it (its body included) changes nothing here."""
        return _copy(self)

    @classmethod
    def from_envelope(cls, envelope: Dict[str, Any], created: float,
                      ttl_seconds: Optional[int] = None, delay_seconds: int = 0,
                      priority: int = 0) -> Message:
        """A new queued message from a :func:`relay.wire.protocol.normalize_envelope` result.

        ``ts`` is the broker's: the time the message is stored (spec §2). A delayed
        message carries the recovery mark from the start, so a v1.0 poller whose
        cursor passes it while it waits still gets it once when it is due (§7).
        """
        delayed = created + delay_seconds if delay_seconds else None
        return cls(
            id=envelope["id"],
            sender=envelope["from"],
            to=envelope["to"],
            created=created,
            type=envelope["type"],
            # Kept as the compact text of the validated body from here on: nothing
            # decodes a stored body again to send it.
            body_json=compact_json(envelope["body"]),
            reply_to=envelope["replyTo"],
            ack=envelope["ack"],
            kind=envelope["kind"],
            root_id=envelope["rootId"],
            parent_id=envelope["parentId"],
            not_before=delayed,
            delay_until=delayed,
            recovery=delayed is not None,
            expires_at=created + ttl_seconds if ttl_seconds else None,
            priority=priority,
        )

    @property
    def for_role(self) -> bool:
        """Whether this message waits in a role's queue (``to: "role:NAME"``)."""
        return self.to.startswith(ROLE_PREFIX)

    def lessee(self) -> str:
        """Who may hold this message's lease: its recipient, or for a role message
        the member that leased it last."""
        if self.to.startswith(ROLE_PREFIX):
            return self.holder or ""
        return self.to

    def envelope(self, viewer: Optional[str] = None, now: Optional[float] = None
                 ) -> Dict[str, Any]:
        """The wire form (spec §2 + §5.1) as ``viewer`` sees it at ``now``.

        ``leaseId`` is shown only to the recipient, only while the message is
        leased; ``expiresAt`` only for a message sent with ``ttlSeconds``;
        ``notBefore`` only for one sent with ``delaySeconds``, until it is due;
        ``via`` only for a copy of a group send.
        ``priority`` only above 0.
        """
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
        if viewer is not None and viewer == self.lessee() and self.status == LEASED:
            out["leaseId"] = self.lease_id
        if self.via is not None:
            out["via"] = self.via
        if self.expires_at is not None:
            out["expiresAt"] = iso_timestamp(self.expires_at)
        if self._delayed(now):
            out["notBefore"] = iso_timestamp(self.delay_until)
        if self.priority:
            out["priority"] = self.priority
        return out

    def envelope_json(self, viewer: Optional[str] = None, now: Optional[float] = None) -> str:
        """:meth:`envelope` as JSON text, with the stored body text spliced in undecoded."""
        parts = [
            '{"id":', encode_basestring(self.id),
            ',"from":', encode_basestring(self.sender),
            ',"to":', encode_basestring(self.to),
            ',"ts":', encode_basestring(self.ts),
            ',"type":', encode_basestring(self.type),
            ',"body":', self.body_json(),
            ',"replyTo":', _text(self.reply_to),
            ',"ack":', "true" if self.ack else "false",
            ',"kind":', encode_basestring(self.kind),
            ',"rootId":', _text(self.root_id),
            ',"parentId":', _text(self.parent_id),
            ',"status":', encode_basestring(self.status),
            ',"attempts":', str(self.attempts),
            ',"leaseUntil":', _number(self.lease_until),
        ]
        if viewer is not None and viewer == self.lessee() and self.status == LEASED:
            parts += ',"leaseId":', _text(self.lease_id)
        if self.via is not None:
            parts += ',"via":', encode_basestring(self.via)
        if self.expires_at is not None:
            parts += ',"expiresAt":', encode_basestring(iso_timestamp(self.expires_at))
        if self._delayed(now):
            parts += ',"notBefore":', encode_basestring(iso_timestamp(self.delay_until))
        if self.priority:
            parts += ',"priority":', str(self.priority)
        parts.append("}")
        return "".join(parts)

    def _delayed(self, now: Optional[float]) -> bool:
        """Whether the sender's delay still holds this message back at ``now`` (any
        delay, for ``now`` None): until it runs out, or a cancel or requeue ends it."""
        if self.delay_until is None:
            return False
        return now is None or (self.not_before is not None and now < self.delay_until)

    def size(self) -> int:
        """About how many bytes this message takes in a response (its body dominates)."""
        return len(self.body_json()) + 400

    def status_entry(self, now: float) -> Dict[str, Any]:
        """The ``/v1/status`` entry of this message at ``now``; ``error``, ``notBefore``
        (while delayed) and ``expiresAt`` only when set (epoch milliseconds); for a
        role message ``leasedBy`` while leased and ``completedBy`` once done (REACH
        §13)."""
        entry = {
            "id": self.id,
            "status": self.status,
            "attempts": self.attempts,
            "ts": self.ts,
            "from": self.sender,
            "to": self.to,
            "kind": self.kind,
            "deliveries": self.deliveries,
        }
        if self.error is not None:
            entry["error"] = self.error
        if self.not_before is not None and now < self.not_before:
            entry["notBefore"] = now_ms(self.not_before)
        if self.expires_at is not None:
            entry["expiresAt"] = now_ms(self.expires_at)
        if self.holder is not None:
            if self.status == LEASED:
                entry["leasedBy"] = self.holder
            elif self.status == DONE:
                entry["completedBy"] = self.holder
        return entry

    def state(self) -> Tuple[Any, ...]:
        """The mutable delivery fields (:attr:`STATE_FIELDS`), compared to tell whether a
        transition changed any (``expires_at`` last: only a requeue of a message past
        its TTL changes it)."""
        return _state(self)

    def set_state(self, state: Tuple[Any, ...]) -> None:
        """Take the delivery fields of another copy's :meth:`state`."""
        _set_state(self, state)

    def __repr__(self) -> str:  # ids and state only: never the body
        return f"<Message seq={self.seq} id={self.id!r} {self.status} attempts={self.attempts}>"


# The body travels as its JSON text, which no one can change in place.
_copy = compiled(
    "copy", "self",
    ["other = _new_message(Message)"]
    + [f"other.{name} = self.{name}" for name in Message.FIELDS]
    + ["other._body = _UNDECODED", "other._body_json = self.body_json()",
       "other._bytes = self._bytes", "return other"],
    {"Message": Message, "_new_message": _new_message, "_UNDECODED": _UNDECODED})
_state = compiled(
    "state", "self",
    [f"return ({', '.join(f'self.{name}' for name in Message.STATE_FIELDS)},)"], {})
_set_state = compiled(
    "set_state", "self, state",
    [f"({', '.join(f'self.{name}' for name in Message.STATE_FIELDS)},) = state"], {})



def _in_place(name: str, function: Callable[..., Any]) -> None:
    """Put ``function`` in the place of the method ``name`` of Message, with its
    docstring and hints: a call then costs no frame beyond the compiled one."""
    declared = getattr(Message, name)
    function.__doc__ = declared.__doc__
    function.__annotations__ = declared.__annotations__
    function.__qualname__ = declared.__qualname__
    function.__module__ = declared.__module__
    setattr(Message, name, function)


_in_place("copy", _copy)
_in_place("state", _state)
_in_place("set_state", _set_state)

__all__ = ["Message", "now_ms", "compiled"]
