"""The delivery rules of spec §5.1 and of the v1.2 extensions, written once for every
backend.

    queued -(pull)-> leased -(ack completed)-> done
      ^                |--(ack retry)-> queued (attempts+1; > maxAttempts -> failed)
      |                |--(ack release)-> queued
      |                |--(ack reject)-> failed
      |                |--(lease lapses)-> queued (and marked for v1.0 recovery)
      |                '--(cancel)-> failed
      '--(requeue)-- failed

A lease that ends without completion (lapse, retry, release) after
``maxDeliveries`` leases fails the message; a failed or expired ``request``
leaves one failure notice for its sender.

Pure: no reactor, no I/O. A *transition* is a function
``(message, now) -> Outcome`` that changes one :class:`Message` (a private copy
the store hands it), or raises :class:`relay.wire.errors.RelayError`. Before a
transition runs, the store applies what time alone has done (:func:`catch_up`:
a lapsed lease), and persists that even when the transition then raises. A new
delivery outcome is one transition here, not a new method in every backend.

The record itself, :class:`Message`, is :mod:`relay.rules.message`'s.

What a change means for waiting requests is decided here too (:func:`wakes`), so
every store reports the same :class:`Changes`.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from relay.rules.message import Message, now_ms
from relay.wire import errors
from relay.wire.protocol import (
    DONE,
    EXPIRED,
    FAILED,
    LEASED,
    QUEUED,
    ROLE_PREFIX,
    ack_receipt,
    compact_json,
    notice_id,
    parse_json_body,
)
from relay.wire.v2 import views

# Why a message failed (kept with it; the reason label of dead-letter metrics).
ATTEMPTS = "attempts"
DELIVERIES = "deliveries"
REJECTED = "rejected"
CANCELLED = "cancelled"
DEAD_REASONS = (ATTEMPTS, DELIVERIES, REJECTED, CANCELLED)

def is_role(address: str) -> bool:
    """Whether ``address`` names a role's queue (REACH §13: ``role:`` and the role's
    name; no agent name holds a colon)."""
    return address.startswith(ROLE_PREFIX)


def rank(message: Message) -> Tuple[int, int]:
    """The order a pull leases in (REACH §14): higher priority first, then by sequence."""
    return -message.priority, message.seq



Transition = Callable[[Message, float], "Outcome"]
RouteCheck = Callable[[str, str], None]


@dataclass(frozen=True)
class WithStored:
    """A transition that decides on a second stored message too: the store reads the
    message ``other_id`` (None when unknown or expired) in the same transaction as
    the message it settles, and applies ``decide(message, other, now)``."""

    other_id: str
    decide: Callable[[Message, Optional[Message], float], Outcome]


@dataclass(frozen=True)
class Kept:
    """A transition that applies also to a message of the v2/v3 wire past its TTL (kept
    until retention removes it: :func:`outlives_ttl`): the v2 wire's admin requeue and
    cancel. To any other transition such a message is unknown (404), as it is to every
    seed-wire request."""

    transition: Transition


@dataclass(frozen=True)
class Role:
    """A role of the config (REACH §13): its members by config, and whether agents may
    join it through their card (``selfJoin``)."""

    members: FrozenSet[str] = frozenset()
    self_join: bool = False


@dataclass(frozen=True)
class Rules:
    """The delivery policy the transitions apply: ``broker.*`` keys of the same names,
    read by the broker (their defaults are the config table's)."""

    max_attempts: int
    max_deliveries: int  # 0: no limit
    notify_failures: bool
    # The most messages (and body bytes) waiting for one recipient — queued or
    # leased — before a send to it is refused (429 inbox_full); 0: no limit.
    inbox_max_messages: int
    inbox_max_bytes: int
    # broker.notifyFailedToSender: notices to the senders of v2/v3 requests (WIRE-V2 §3)
    notify_v2: bool
    # REACH §13: the roles configured, by name (``roles:``).
    roles: Mapping[str, Role]


@dataclass(frozen=True)
class Outcome:
    """What a transition did: its result, the failure notices to store with it (a
    notice whose id exists already is not stored again), and a reply that must be
    new (an existing id fails the whole transition with ``IdConflict``)."""

    value: Any
    notices: Tuple[Message, ...] = ()
    reply: Optional[Message] = None


class IdConflict(errors.RelayError):
    """A message a transition would store has an id another message uses."""

    def __init__(self, message_id: str, field: str = "reply.id") -> None:
        super().__init__(409, "id_conflict", f"{field} is used by another message")
        self.message_id = message_id


class NewMessagesRefused(errors.RelayError):
    """A transition that would store a new message while the broker refuses them (its
    disk is nearly full): 503 ``busy`` with the broker's reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, "busy", reason)


class Changes:
    """What a committed change means for waiting requests.

    ``ready`` holds the agents that may have newly deliverable messages; ``due``
    the ``(when, agent)`` pairs at which something of ``agent``'s may become
    deliverable (a delay running out, or a deadline learnt from elsewhere).
    ``held`` has one ``(deadline, agent)`` pair per lease granted or renewed, and
    ``released`` one per lease that ended before its deadline or was renewed away
    from it: the broker wakes an agent's waiters at a lease deadline only while a
    lease still ends then. Stores report these after their commit; the broker wakes
    waiters from them and from nothing else.

    For the broker's counters, the same report tallies the change: ``stored``
    holds ``(sender, recipient)`` of every new message (sends, receipts, notices,
    replies), ``dead`` the reason of every message that became failed, and
    ``lapsed`` counts the leases released because their deadline passed.

    ``expiring`` holds the ``expiresAt`` times (epoch seconds) of new requests sent
    with a TTL (or revived with one: :func:`revive`): the broker sweeps then, so the
    sender's failure notice is stored when the request expires, not at the next
    periodic sweep.

    ``events`` holds the agents for which events were recorded (REACH §11): their
    open event streams and webhooks read them; ``hooks`` the agents whose webhook
    settings changed (§12).
    """

    __slots__ = ("ready", "due", "held", "released", "stored", "dead", "lapsed", "expiring",
                 "events", "hooks")

    def __init__(self) -> None:
        self.ready: Set[str] = set()
        self.due: Set[Tuple[float, str]] = set()
        self.held: List[Tuple[float, str]] = []
        self.released: List[Tuple[float, str]] = []
        self.stored: List[Tuple[str, str]] = []
        self.dead: List[str] = []
        self.lapsed = 0
        self.expiring: Set[float] = set()
        self.events: Set[str] = set()
        self.hooks: Set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.ready or self.due or self.held or self.released or self.stored
                    or self.dead or self.lapsed or self.expiring or self.events or self.hooks)

    def update(self, other: Changes) -> None:
        self.ready |= other.ready
        self.due |= other.due
        self.held += other.held
        self.released += other.released
        self.stored += other.stored
        self.dead += other.dead
        self.lapsed += other.lapsed
        self.expiring |= other.expiring
        self.events |= other.events
        self.hooks |= other.hooks

    def __repr__(self) -> str:
        return f"<Changes ready={sorted(self.ready)} due={sorted(self.due)}>"


def wakes(changes: Changes, before: Optional[Tuple[Any, ...]], after: Message) -> None:
    """Note in ``changes`` what ``after`` means for its recipient's waiters (and
    tally it for the counters).

    ``before`` is the message's :meth:`Message.state` before the change, None for
    a new message.
    """
    was = before[0] if before is not None else None
    if was == LEASED and before[2] is not None and (after.status != LEASED
                                                    or before[2] != after.lease_until):
        changes.released.append((before[2] / 1000.0, after.to))
    if before is None:
        changes.stored.append((after.sender, after.to))
        if after.expires_at is not None and after.kind == "request":
            changes.expiring.add(after.expires_at)
    elif after.status == FAILED and was != FAILED:
        changes.dead.append(after.dead_reason or ATTEMPTS)
    elif (before[11] != after.expires_at and after.expires_at is not None
          and after.kind == "request"):
        changes.expiring.add(after.expires_at)  # revived with a TTL of its own again
    if after.status == QUEUED:
        moved = was != QUEUED or before[7] != after.not_before
        if moved and after.not_before is not None:
            changes.due.add((after.not_before, after.to))
        elif was != QUEUED:
            changes.ready.add(after.to)
    elif after.status == LEASED and (was != LEASED or before[2] != after.lease_until):
        changes.held.append((after.lease_until / 1000.0, after.to))


PENDING = (QUEUED, LEASED)


def inbox_full(usage: Tuple[int, int], message: Message, rules: Rules) -> bool:
    """True when ``message`` would take its recipient's pending messages, counted in
    ``usage`` as ``(messages, stored bytes)``, past a limit of ``rules``."""
    count, size = usage
    return bool((rules.inbox_max_messages and count >= rules.inbox_max_messages)
                or (rules.inbox_max_bytes
                    and size + message.stored_bytes() > rules.inbox_max_bytes))


def not_found_status(message_id: str) -> Dict[str, Any]:
    """The ``/v1/status`` entry of an unknown (or not visible) id."""
    return {"id": message_id, "status": "not_found", "attempts": 0}


# REACH §13: the namespace of the ids of group copies (uuid5 of sender, sent id, member).
GROUP_COPY_NAMESPACE = uuid.UUID("5b0f3a4e-7d1c-4c8e-9a52-6d7e1f0c2b93")


def group_copy_id(sender: str, sent_id: str, member: str) -> str:
    """The id of ``member``'s copy of the group send ``sent_id`` by ``sender``: the same
    on every broker, so a repeated send finds the copies the first one stored."""
    return str(uuid.uuid5(GROUP_COPY_NAMESPACE, json.dumps([sender, sent_id, member])))


def group_copies(sent: Message, via: str, members: Iterable[str]) -> List[Message]:
    """The copies of the group send ``sent`` (a message built from the sent envelope)
    to ``via`` (``group:NAME``) for ``members`` other than the sender, in name order:
    each its own message to its member with ``via`` and ``sent_id``, in the thread of
    the sent ``rootId`` (the sent id when it starts one)."""
    copies = []
    for member in sorted(set(members) - {sent.sender}):
        copy = sent.copy()
        copy.id = group_copy_id(sent.sender, sent.id, member)
        copy.to = member
        copy.via = via
        copy.sent_id = sent.id
        copy.root_id = sent.root_id if sent.root_id is not None else sent.id
        copies.append(copy)
    return copies


def group_status(sent_id: str, copies: Sequence[Message]) -> Dict[str, Any]:
    """The ``/v1/status`` entry of a group send (REACH §13): its id, ``via`` and its
    copies (``to``, ``id``, ``status``) in recipient order."""
    return {"id": sent_id, "via": copies[0].via,
            "copies": [{"to": c.to, "id": c.id, "status": c.status}
                       for c in sorted(copies, key=lambda c: c.to)]}


def new_lease_id() -> str:
    """A fresh opaque lease id."""
    return os.urandom(16).hex()


def lease_lapsed(message: Message, now: float) -> bool:
    """True when ``message`` is leased and its lease deadline has passed."""
    return (
        message.status == LEASED
        and message.lease_until is not None
        and message.lease_until <= now_ms(now)
    )


def expired(message: Message, now: float) -> bool:
    """True when ``message`` was sent with a TTL that has run out: it is gone (to the
    seed wire; see :func:`outlives_ttl`)."""
    return message.expires_at is not None and message.expires_at <= now


def outlives_ttl(message: Message) -> bool:
    """Whether ``message`` is kept after its TTL ran out: a message of the v2/v3 wire is,
    until retention (``messageTtlDays``) removes it, as the reference keeps its
    terminal messages (WIRE-V2 §3); a seed-wire one is removed at its expiry
    (EXTENSIONS §7: gone, its id free again)."""
    return message.v2 is not None


def keep_expired(message: Message) -> None:
    """queued or leased -> expired: a message of the v2/v3 wire whose TTL ran out before
    it was processed (a held lease dies). A done or failed one stays as it is."""
    _end_lease(message)
    message.status = EXPIRED
    message.recovery = False
    message.not_before = None


def revive(message: Message, now: float) -> None:
    """A message put back in its queue after its TTL ran out lives its TTL again from
    ``now``, so that it may be delivered."""
    if message.expires_at is not None and message.expires_at <= now:
        message.expires_at = now + (message.expires_at - message.created)


def due(message: Message, now: float) -> bool:
    """True when no delay holds ``message`` back."""
    return message.not_before is None or message.not_before <= now


def deliverable(message: Message, now: float) -> bool:
    """True when ``message`` may be pulled or polled at ``now``."""
    return message.status == QUEUED and due(message, now) and not expired(message, now)


def failure_notice(request: Message, event: str, now: float, max_deliveries: int = 0,
                   max_attempts: int = 0) -> Message:
    """The notice of §4: from the request's recipient to its sender, a reply to it.

    A request sent on the v2/v3 wire gets the notice that wire knows instead: an
    ``undelivered`` reply in text, with the request's mode, reference and topic
    (WIRE-V2 §3; it quotes the lower of ``max_attempts`` and ``max_deliveries``)."""
    if request.v2 is not None:
        return _undelivered_v2(request, event, now, max_deliveries, max_attempts)
    body = {"relayNotice": {"event": event, "messageId": request.id,
                            "attempts": request.attempts, "deliveries": request.deliveries,
                            "error": request.error}}
    return Message(
        id=notice_id(request.id),
        sender=request.to,
        to=request.sender,
        created=now,
        body_json=compact_json(body),
        reply_to=request.id,
        kind="reply",
        root_id=request.root_id or request.id,
        parent_id=request.id,
    )


def _undelivered_v2(request: Message, event: str, now: float, max_deliveries: int,
                    max_attempts: int) -> Message:
    _, context, topic = views.shown_body(request)
    mode, session_ref, _ = views.read_meta(request)
    # The limit the reference quotes is its maxAttempts; here the pulls a message may
    # have are also bounded by maxDeliveries, so the lower of the two is quoted.
    limit = min(max_attempts, max_deliveries) if max_deliveries else max_attempts
    text = views.undelivered_text(request, limit, event == "expired")
    return Message(
        id=notice_id(request.id),
        sender=request.to,
        to=request.sender,
        created=now,
        body_json=compact_json(views.stored_body(text, "", topic, mode, session_ref)),
        kind="reply",
        root_id=request.root_id or request.id,
        parent_id=request.id,
        expires_at=now + views.NOTICE_TTL_SECONDS,
        v2=views.v2_meta(mode, session_ref, False),
    )


def _notices(message: Message, now: float, rules: Rules, event: str = "failed"
             ) -> Tuple[Message, ...]:
    notify = rules.notify_failures if message.v2 is None else rules.notify_v2
    if notify and message.kind == "request" and message.dead_reason != CANCELLED:
        return (failure_notice(message, event, now, rules.max_deliveries, rules.max_attempts),)
    return ()


# -- transitions -------------------------------------------------------------------


def lease(message: Message, lease_seconds: float, now: float,
          agent: Optional[str] = None) -> None:
    """queued -> leased under a fresh lease id; one more delivery. A role message
    remembers ``agent``, the member that leased it."""
    if message.to.startswith(ROLE_PREFIX):
        message.holder = agent
    message.status = LEASED
    message.lease_id = new_lease_id()
    message.lease_until = now_ms(now) + int(lease_seconds * 1000)
    message.recovery = False
    message.deliveries += 1
    message.not_before = None


def _end_lease(message: Message) -> None:
    message.lease_id = None
    message.lease_until = None


def _fail(message: Message, reason: str, error: Optional[str], now: float) -> None:
    _end_lease(message)
    message.status = FAILED
    message.completed_at = now
    message.dead_reason = reason
    message.error = error
    message.recovery = False
    message.not_before = None


def _exhausted(message: Message, rules: Rules) -> bool:
    return bool(rules.max_deliveries) and message.deliveries >= rules.max_deliveries


def _requeue_after_lease(message: Message, now: float, rules: Rules,
                         retry_after: Optional[int]) -> Tuple[Message, ...]:
    """A lease ended without completion: queued again, or failed when the message
    has been delivered ``maxDeliveries`` times."""
    if _exhausted(message, rules):
        _fail(message, DELIVERIES, f"delivered {message.deliveries} times without completion",
              now)
        return _notices(message, now, rules)
    _end_lease(message)
    message.status = QUEUED
    message.not_before = now + retry_after if retry_after else None
    return ()


def lapse(message: Message, now: float, rules: Rules) -> Tuple[Message, ...]:
    """leased -> queued once the deadline has passed; the old lease id is dead.

    The message is marked for the v1.0 recovery delivery (spec §5.1). An exhausted
    message fails instead, as of its deadline.
    """
    notices = _requeue_after_lease(message, now, rules, None)
    if message.status == QUEUED:
        message.recovery = True
    return notices


def catch_up(message: Message, now: float, rules: Rules) -> Tuple[Message, ...]:
    """Apply what time alone has done to ``message`` (a lapsed lease); returns the
    failure notices that brings."""
    if lease_lapsed(message, now):
        return lapse(message, now, rules)
    return ()


def check_lease(message: Message, agent: str, lease_id: str) -> None:
    """The lease guard of every lease outcome, in the order of the spec: 403 when
    ``agent`` is not the recipient (of a role message: the member holding its
    lease), 409 ``not_leased`` (a lapsed lease included, since :func:`catch_up` ran
    first), 409 ``lease_mismatch``. (404 is the store's:
    the id is unknown.)"""
    if message.lessee() != agent:
        if message.to.startswith(ROLE_PREFIX):
            raise errors.forbidden("only the member holding the lease may renew or "
                                   "acknowledge this message")
        raise errors.forbidden("only the recipient may acknowledge this message")
    if message.status != LEASED:
        raise errors.not_leased()
    if message.lease_id != lease_id:
        raise errors.lease_mismatch()


def reply_message(message: Message, agent: str, fields: Dict[str, Any], now: float) -> Message:
    """The reply of an atomic ``completed`` ack (§6): from the caller to the acked
    message's sender, answering it. ``fields`` are the validated ``reply``."""
    return Message(
        id=fields["id"],
        sender=agent,
        to=message.sender,
        created=now,
        body_json=compact_json(fields["body"]),
        reply_to=message.id,
        ack=fields["ack"],
        kind=fields["kind"],
        root_id=message.root_id or message.id,
        parent_id=message.id,
        priority=fields.get("priority", 0),
    )


def ack(agent: str, lease_id: str, outcome: str, error: Optional[str], rules: Rules,
        retry_after: Optional[int] = None, reply: Optional[Dict[str, Any]] = None,
        check_route: Optional[RouteCheck] = None, refuse_new: Optional[str] = None
        ) -> Union[Transition, WithStored]:
    """The ``/v1/ack`` transition (§5.1, v1.2 §2 and §6). Results
    ``{ok, status, attempts}``; with ``reply`` also ``replyId`` and ``duplicate``.

    ``completed`` -> done; ``retry`` -> queued (attempts + 1; past
    ``max_attempts`` -> failed); ``release`` -> queued; ``reject`` -> failed.
    ``retry_after`` holds a requeued message back that many seconds.
    ``check_route(sender, recipient)`` applies the routing ACL to the reply.

    With ``reply``, a :class:`WithStored` transition that sees the stored message
    of the reply's id: the same ack retried after its answer was lost is answered
    by :func:`repeated_reply` (``duplicate: true``) before anything else is
    checked; otherwise ``refuse_new`` (why new messages are refused now, None when
    they are not) is :class:`NewMessagesRefused`, and then the ack applies.
    """

    def transition(message: Message, now: float) -> Outcome:
        check_lease(message, agent, lease_id)
        notices: Tuple[Message, ...] = ()
        answer: Optional[Message] = None
        if outcome == "completed":
            if reply is not None:
                if check_route is not None:
                    check_route(agent, message.sender)
                answer = reply_message(message, agent, reply, now)
            _end_lease(message)
            message.status = DONE
            message.completed_at = now
            message.error = error
        elif outcome == "reject":
            _fail(message, REJECTED, error if error is not None else "rejected", now)
            notices = _notices(message, now, rules)
        elif outcome == "retry":
            message.attempts += 1
            message.error = error
            if message.attempts > rules.max_attempts:
                _fail(message, ATTEMPTS, error, now)
                notices = _notices(message, now, rules)
            else:
                notices = _requeue_after_lease(message, now, rules, retry_after)
        else:  # release
            message.error = error
            notices = _requeue_after_lease(message, now, rules, retry_after)
        value = {"ok": True, "status": message.status, "attempts": message.attempts}
        if answer is not None:
            value.update(replyId=answer.id, duplicate=False)
        return Outcome(value, notices, answer)

    if reply is None:
        return transition

    def decide(message: Message, stored: Optional[Message], now: float) -> Outcome:
        repeated = repeated_reply(message, stored, agent)
        if repeated is not None:
            return Outcome(repeated)
        if refuse_new is not None:
            raise NewMessagesRefused(refuse_new)
        return transition(message, now)

    return WithStored(reply["id"], decide)


def repeated_reply(message: Message, stored: Optional[Message], agent: str
                   ) -> Optional[Dict[str, Any]]:
    """The answer to an ack with a reply whose id is stored already, when that ack is
    the same one retried (its answer was lost): ``stored`` was sent by ``agent`` in
    answer to ``message``, and ``message`` is done. None when it is not."""
    if (stored is None or stored.sender != agent
            or message.id not in (stored.parent_id, stored.reply_to)
            or message.status != DONE):
        return None
    return {"ok": True, "status": message.status, "attempts": message.attempts,
            "replyId": stored.id, "duplicate": True}


def receipt(agent: str, raw_body: bytes, check_route: Optional[RouteCheck] = None,
            refuse_new: Optional[str] = None) -> Transition:
    """The v1.0 receipt ``POST /messages/<id>/ack`` (§4): a ``type: "ack"`` message from
    the recipient back to the sender, stored as the outcome's reply; the acked
    message does not change. Results the receipt's id.

    403 when ``agent`` is not the recipient; then the body (``raw_body``, read only
    now) is parsed (400), ``check_route`` applied to the receipt, and
    ``refuse_new`` (why new messages are refused now) is :class:`NewMessagesRefused`.
    """

    def transition(message: Message, now: float) -> Outcome:
        if message.to != agent:
            raise errors.forbidden("only the recipient may acknowledge this message")
        envelope = ack_receipt({"id": message.id, "from": message.sender}, agent,
                               parse_json_body(raw_body))
        if check_route is not None:
            check_route(agent, envelope["to"])
        if refuse_new is not None:
            raise NewMessagesRefused(refuse_new)
        return Outcome(envelope["id"], reply=Message.from_envelope(envelope, now))

    return transition


def renew(agent: str, lease_id: str, lease_seconds: float) -> Transition:
    """``/v1/lease/renew`` (§1): the deadline becomes now + ``lease_seconds``; the
    lease id, the attempts and the deliveries do not change."""

    def transition(message: Message, now: float) -> Outcome:
        check_lease(message, agent, lease_id)
        message.lease_until = now_ms(now) + int(lease_seconds * 1000)
        return Outcome({"ok": True, "leaseId": message.lease_id,
                        "leaseUntil": message.lease_until})

    return transition


def requeue(agent: Optional[str]) -> Transition:
    """``/v1/requeue`` (§3): failed -> queued with attempts and deliveries reset. The
    sender or the recipient may (only the sender for a cancelled message); ``agent``
    None is the operator (the ops dashboard)."""

    def transition(message: Message, now: float) -> Outcome:
        if agent is not None:
            if agent not in (message.sender, message.lessee()):
                raise errors.forbidden("only the sender or the recipient may requeue "
                                       "this message")
            if message.dead_reason == CANCELLED and agent != message.sender:
                raise errors.forbidden("its sender cancelled this message: only the "
                                       "sender may requeue it")
        if message.status != FAILED:
            raise errors.wrong_state(f"message is {message.status}, not failed")
        message.status = QUEUED
        message.attempts = 0
        message.deliveries = 0
        message.error = None
        message.not_before = None
        message.dead_reason = None
        revive(message, now)  # (the operator's requeue of a v2 message kept past its TTL)
        return Outcome({"ok": True, "status": QUEUED, "attempts": 0})

    return transition


def cancel(agent: Optional[str], reason: Optional[str]) -> Transition:
    """``/v1/cancel`` (§3): the sender withdraws a queued or leased message; it fails
    with ``reason`` and a held lease dies. No failure notice. ``agent`` None is the
    operator."""

    def transition(message: Message, now: float) -> Outcome:
        if agent is not None and agent != message.sender:
            raise errors.forbidden("only the sender may cancel this message")
        if message.status in (DONE, FAILED):
            raise errors.wrong_state(f"message is already {message.status}")
        _fail(message, CANCELLED, reason if reason is not None else "cancelled by sender", now)
        return Outcome({"ok": True, "status": FAILED, "attempts": message.attempts})

    return transition


def expiry_notices(messages: Iterable[Message], now: float, rules: Rules
                   ) -> Tuple[Message, ...]:
    """The notices of requests that expired unprocessed (queued or leased)."""
    out = []
    for message in messages:
        if message.status in (QUEUED, LEASED):
            expired_copy = message.copy()
            expired_copy.error = "expired unprocessed"
            out.extend(_notices(expired_copy, now, rules, event="expired"))
    return tuple(out)


# -- the v1.0 poll -------------------------------------------------------------------


def within_budget(messages: Iterable[Message], budget: int) -> List[Message]:
    """The first of ``messages`` whose sizes add up to at most ``budget`` bytes, and
    always the first one: a response is bounded in bytes, and never empty when
    there is something to say."""
    out: List[Message] = []
    total = 0
    for message in messages:
        total += message.size()
        if out and total > budget:
            break
        out.append(message)
    return out


def poll_page(
    recovered: Iterable[Message],
    fresh: Iterable[Message],
    limit: int,
    since_id: Optional[str],
    budget: int,
) -> Tuple[List[Message], Optional[str], List[Message]]:
    """One v1.0 poll page: ``(messages, cursor, unmarked)``.

    ``recovered`` are the recipient's deliverable messages at or before the
    cursor that carry the recovery mark (a lapsed lease, a delay run out),
    ``fresh`` its deliverable messages after the cursor, both in sequence order.
    Recovery deliveries come first, each once (``unmarked`` are the messages whose
    mark this page clears); the page stops at ``limit`` messages or at
    ``budget`` bytes (:func:`within_budget`); the cursor is the last fresh message
    returned and never moves backwards (spec §5.1, v1.2 §7).
    """
    recovered = list(recovered)[:limit]
    out = within_budget(recovered + list(fresh)[: limit - len(recovered)], budget)
    page_fresh = out[len(recovered):]
    unmarked = [m for m in out if m.recovery]
    for message in unmarked:
        message.recovery = False
    cursor = page_fresh[-1].id if page_fresh else (since_id or None)
    return out, cursor, unmarked
