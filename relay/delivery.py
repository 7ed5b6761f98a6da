"""The delivery rules of spec §5.1, written once for every backend.

    queued -(pull)-> leased -(ack completed)-> done
                       |--(ack retry)-> queued (attempts+1; > maxAttempts -> failed)
                       '--(lease expiry)-> queued (and marked for v1.0 recovery)

Pure: no reactor, no I/O. A *transition* is a function ``(message, now) -> result``
that changes one :class:`Message` (a private copy the store hands it) or raises
:class:`relay.errors.RelayError`; stores persist whatever it changed, also when it
raises (a lease found past its deadline is released, then the ack refused). A new
delivery outcome is one transition here, not a new method in every backend.

What a change means for waiting requests is decided here too (:func:`wakes`), so
every store reports the same :class:`Changes`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from relay import errors
from relay.protocol import DONE, FAILED, LEASED, QUEUED, iso_timestamp

_UNDECODED = object()  # Message._body before its stored JSON text is read
_new_message = object.__new__


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

    def copy(self) -> Message:
        """An independent copy: changing it (its body included) changes nothing here."""
        other = _new_message(Message)
        other.seq = self.seq
        other.id = self.id
        other.sender = self.sender
        other.to = self.to
        other.created = self.created
        other.ts = self.ts
        other.type = self.type
        # The body travels as its JSON text, which no one can change in place.
        other._body = _UNDECODED
        other._body_json = self.body_json()
        other.reply_to = self.reply_to
        other.ack = self.ack
        other.kind = self.kind
        other.root_id = self.root_id
        other.parent_id = self.parent_id
        other.status = self.status
        other.attempts = self.attempts
        other.lease_until = self.lease_until
        other.lease_id = self.lease_id
        other.error = self.error
        other.recovery = self.recovery
        return other

    @classmethod
    def from_envelope(cls, envelope: Dict[str, Any], created: float) -> Message:
        """A new queued message from a :func:`relay.protocol.normalize_envelope` result.

        ``ts`` is the broker's: the time the message is stored (spec §2).
        """
        return cls(
            id=envelope["id"],
            sender=envelope["from"],
            to=envelope["to"],
            created=created,
            type=envelope["type"],
            body=envelope["body"],
            reply_to=envelope["replyTo"],
            ack=envelope["ack"],
            kind=envelope["kind"],
            root_id=envelope["rootId"],
            parent_id=envelope["parentId"],
        )

    def envelope(self, viewer: Optional[str] = None) -> Dict[str, Any]:
        """The wire form (spec §2 + §5.1) as ``viewer`` sees it.

        ``leaseId`` is shown only to the recipient, only while the message is leased.
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
        if viewer is not None and viewer == self.to and self.status == LEASED:
            out["leaseId"] = self.lease_id
        return out

    def status_entry(self) -> Dict[str, Any]:
        """The ``/v1/status`` entry of this message; ``error`` only when there is one."""
        entry = {
            "id": self.id,
            "status": self.status,
            "attempts": self.attempts,
            "ts": self.ts,
            "from": self.sender,
            "to": self.to,
            "kind": self.kind,
        }
        if self.error is not None:
            entry["error"] = self.error
        return entry

    def state(self) -> Tuple[Any, ...]:
        """The mutable delivery fields, compared to tell whether a transition changed any."""
        return (
            self.status,
            self.attempts,
            self.lease_until,
            self.lease_id,
            self.error,
            self.recovery,
        )

    def __repr__(self) -> str:  # ids and state only: never the body
        return f"<Message seq={self.seq} id={self.id!r} {self.status} attempts={self.attempts}>"


Transition = Callable[[Message, float], Any]


@dataclass(frozen=True)
class Rules:
    """The delivery policy the transitions apply (broker config, read by the broker)."""

    max_attempts: int = 3


class Changes:
    """What a committed change means for waiting requests.

    ``ready`` holds the agents that may have newly deliverable messages; ``due``
    the ``(when, agent)`` pairs at which something of ``agent``'s may become
    deliverable (a lease deadline). Stores report these after their commit; the
    broker wakes waiters from them and from nothing else. ``lapsed`` counts the
    leases the change released because their deadline passed (for the metrics).
    """

    __slots__ = ("ready", "due", "lapsed")

    def __init__(self) -> None:
        self.ready: Set[str] = set()
        self.due: Set[Tuple[float, str]] = set()
        self.lapsed = 0

    def __bool__(self) -> bool:
        return bool(self.ready or self.due or self.lapsed)

    def update(self, other: Changes) -> None:
        self.ready |= other.ready
        self.due |= other.due
        self.lapsed += other.lapsed

    def __repr__(self) -> str:
        return f"<Changes ready={sorted(self.ready)} due={sorted(self.due)}>"


def wakes(changes: Changes, before: Optional[Tuple[Any, ...]], after: Message) -> None:
    """Note in ``changes`` what ``after`` means for its recipient's waiters.

    ``before`` is the message's :meth:`Message.state` before the change, None for
    a new message.
    """
    was = before[0] if before is not None else None
    if after.status == QUEUED and was != QUEUED:
        changes.ready.add(after.to)
    elif after.status == LEASED and (was != LEASED or before[2] != after.lease_until):
        changes.due.add((after.lease_until / 1000.0, after.to))


def not_found_status(message_id: str) -> Dict[str, Any]:
    """The ``/v1/status`` entry of an unknown (or not visible) id."""
    return {"id": message_id, "status": "not_found", "attempts": 0}


def new_lease_id() -> str:
    """A fresh opaque lease id."""
    return os.urandom(16).hex()


def now_ms(now: float) -> int:
    """Epoch milliseconds, the unit of ``leaseUntil``."""
    return int(now * 1000)


def lease_lapsed(message: Message, now: float) -> bool:
    """True when ``message`` is leased and its lease deadline has passed."""
    return (
        message.status == LEASED
        and message.lease_until is not None
        and message.lease_until <= now_ms(now)
    )


# -- transitions -------------------------------------------------------------------


def lease(message: Message, lease_seconds: float, now: float) -> None:
    """queued -> leased under a fresh lease id."""
    message.status = LEASED
    message.lease_id = new_lease_id()
    message.lease_until = now_ms(now) + int(lease_seconds * 1000)
    message.recovery = False


def lapse(message: Message, now: float, rules: Rules) -> None:
    """leased -> queued once the deadline has passed; the old lease id is dead.

    The message is marked for the v1.0 recovery delivery (spec §5.1).
    """
    message.status = QUEUED
    message.lease_id = None
    message.lease_until = None
    message.recovery = True


def catch_up(message: Message, now: float, rules: Rules) -> None:
    """Apply what time alone has done to ``message`` (a lapsed lease)."""
    if lease_lapsed(message, now):
        lapse(message, now, rules)


def check_lease(message: Message, agent: str, lease_id: str, now: float, rules: Rules) -> None:
    """The lease guard of every lease outcome, in the order of the spec: 403 when
    ``agent`` is not the recipient, 409 ``not_leased`` (a lapsed lease included),
    409 ``lease_mismatch``. (404 is the store's: the id is unknown.)"""
    if message.to != agent:
        raise errors.forbidden("only the recipient may acknowledge this message")
    catch_up(message, now, rules)
    if message.status != LEASED:
        raise errors.not_leased()
    if message.lease_id != lease_id:
        raise errors.lease_mismatch()


def _end_lease(message: Message) -> None:
    message.lease_id = None
    message.lease_until = None


def ack(agent: str, lease_id: str, outcome: str, error: Optional[str],
        rules: Rules) -> Transition:
    """The ``/v1/ack`` transition: ``completed`` -> done, ``retry`` -> queued
    (attempts + 1; past ``max_attempts`` -> failed). Results ``{ok, status, attempts}``."""

    def transition(message: Message, now: float) -> Dict[str, Any]:
        check_lease(message, agent, lease_id, now, rules)
        _end_lease(message)
        message.error = error
        if outcome == "completed":
            message.status = DONE
        else:
            message.attempts += 1
            message.status = FAILED if message.attempts > rules.max_attempts else QUEUED
        return {"ok": True, "status": message.status, "attempts": message.attempts}

    return transition


# -- the v1.0 poll -------------------------------------------------------------------


def poll_page(
    recovered: Iterable[Message],
    fresh: Iterable[Message],
    limit: int,
    since_id: Optional[str],
) -> Tuple[List[Message], Optional[str], List[Message]]:
    """One v1.0 poll page: ``(messages, cursor, unmarked)``.

    ``recovered`` are the recipient's queued messages at or before the cursor that
    carry the recovery mark, ``fresh`` its queued messages after the cursor, both
    in sequence order. Recovery deliveries come first, each once (``unmarked`` are
    the messages whose mark this page clears); the cursor is the last fresh
    message returned and never moves backwards (spec §5.1).
    """
    out = list(recovered)[:limit]
    page_fresh = list(fresh)[: limit - len(out)]
    out.extend(page_fresh)
    unmarked = [m for m in out if m.recovery]
    for message in unmarked:
        message.recovery = False
    cursor = page_fresh[-1].id if page_fresh else (since_id or None)
    return out, cursor, unmarked
