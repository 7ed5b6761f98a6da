"""Events (REACH §11): what a change of a message means for the agents concerned,
how an event is written on the wire, and where a resumed stream starts.

Pure: no reactor, no I/O. The stores record the events :func:`derive` gives with
the change that causes them, in the same transaction (:mod:`relay.store.records`);
the event stream (:mod:`relay.broker.streams`) writes them as SSE records.

An event never carries a body, a card, a secret or a webhook URL: its data are
the ids, names, kind and delivery counts listed in REACH §11.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from relay.wire.protocol import QUEUED, compact_json

MESSAGE = "message"
STATUS = "status"
RESET = "reset"

# REACH §11: a comment line at least this often on every open stream.
KEEPALIVE_SECONDS = 15
KEEPALIVE = b": keepalive\n\n"

# The most events one read of a stream takes from the store.
READ_BATCH = 256

# In :attr:`relay.rules.delivery.Changes.events`: events of any agent may be new (a store
# shared by several brokers that may have missed notifications); no agent has this name.
ALL_AGENTS = "*"

# The longest ``since`` a client may send (an event id is a decimal number).
MAX_EVENT_ID_CHARS = 20


class Event(NamedTuple):
    """One recorded event of ``agent``'s stream: ``id`` increases in each agent's
    stream; ``data`` is the compact JSON text of the SSE ``data`` line; ``at`` is when
    it was recorded (epoch seconds), for retention."""

    id: int
    agent: str
    type: str
    data: str
    at: float


class EventPage(NamedTuple):
    """What a stream reads from the store: the events after its position, and, when
    the position asked for is not one the store can resume from, the reason of a
    ``reset`` (then ``events`` is empty). ``last`` is the position after this page
    (the id of the last event, or the present for a fresh or reset stream)."""

    events: List[Event]
    reset: Optional[str]
    last: int


def message_data(message: Any) -> Dict[str, Any]:
    """The ``data`` of a ``message`` event: the message's ids, names and kind, its
    priority when above 0, and the group it was sent to (``via``) for a group copy."""
    data = {"id": message.id, "from": message.sender, "to": message.to,
            "kind": message.kind, "rootId": message.root_id, "parentId": message.parent_id}
    if message.priority:
        data["priority"] = message.priority
    if message.via is not None:
        data["via"] = message.via
    return data


def status_data(message: Any) -> Dict[str, Any]:
    """The ``data`` of a ``status`` event: what ``/v1/status`` says of the message."""
    data = {"id": message.id, "to": message.to, "status": message.status,
            "attempts": message.attempts, "deliveries": message.deliveries}
    if message.error is not None:
        data["error"] = message.error
    return data


def derive(before: Optional[Tuple[Any, ...]], after: Any,
           now: float) -> List[Tuple[str, str, str]]:
    """The events a change of one message at ``now`` causes, as ``(agent, type, data
    JSON)``.

    ``before`` is the message's :meth:`relay.rules.delivery.Message.state` before the
    change (None for a new message). The recipient gets a ``message`` event when
    the message becomes deliverable: it enters the queue (stored, released,
    requeued, retried) due by ``now``, or a delay that held it back ends (the store
    then clears ``not_before``: :func:`relay.store.records.release_due`); the
    sender a ``status`` event whenever the status changes. The ``message`` event of
    a role message names the role's address: the store tells each member
    (:func:`relay.store.records.note`).
    """
    out: List[Tuple[str, str, str]] = []
    was = before[0] if before is not None else None
    due = after.not_before is None or after.not_before <= now
    if after.status == QUEUED and due and (was != QUEUED or before[7] != after.not_before):
        out.append((after.to, MESSAGE, compact_json(message_data(after))))
    if was is not None and was != after.status:
        out.append((after.sender, STATUS, compact_json(status_data(after))))
    return out


def parse_event_id(text: Optional[str]) -> Optional[int]:
    """The position a client resumes from (``since`` or ``Last-Event-ID``): an event
    id as a number, -1 for text that is no event id of this broker's (a ``reset``),
    None for no position (the stream starts at the present)."""
    if text is None:
        return None
    text = text.strip()
    if not text:
        return None
    if len(text) > MAX_EVENT_ID_CHARS or not text.isascii() or not text.isdigit():
        return -1
    return int(text)


def resume(position: Optional[int], floor: int, last: int) -> Optional[str]:
    """Why a stream asked to resume after ``position`` cannot (a ``reset``), or None.

    ``floor`` is the highest event id the store no longer keeps (retention), ``last``
    the highest it ever gave. A position above ``last`` or malformed is unknown; one
    below ``floor`` may have lost events to retention.
    """
    if position is None:
        return None
    if position < 0 or position > last:
        return "unknown event id"
    if position < floor:
        return "older than the events this broker keeps (broker.eventRetentionSeconds)"
    return None


def sse_record(event_id: int, event_type: str, data: str) -> bytes:
    """One SSE record: ``id``, ``event`` and one ``data`` line (compact JSON has no
    newline)."""
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event_id, event_type.encode("ascii"),
                                                   data.encode("utf-8"))


def reset_record(position: int, reason: str) -> bytes:
    """The SSE record of a ``reset``: its id is the present, where the stream goes on."""
    return sse_record(position, RESET, compact_json({"reason": reason}))


def webhook_body(event: Event) -> bytes:
    """The JSON body POSTed to a webhook for ``event`` (REACH §12)."""
    kind = compact_json(event.type)
    return f'{{"id":"{event.id}","event":{kind},"data":{event.data}}}'.encode()
