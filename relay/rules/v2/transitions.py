"""The v2/v3 wire's delivery transitions (PROTOCOL-V2 §5, §7 as the reference at
6d17ff4 applies them), over the same stored messages as :mod:`relay.rules.delivery`.

Pure: no reactor, no I/O. Each is a :data:`relay.rules.delivery.Transition` a store
applies with :meth:`relay.store.interface.IMessageStore.settle`, after
:func:`relay.rules.delivery.catch_up` released a lapsed lease.
"""

from __future__ import annotations

from typing import Optional

from relay.rules import delivery
from relay.rules.delivery import Kept, Message, Outcome, Rules, Transition
from relay.wire import errors
from relay.wire.protocol import DONE, LEASED, QUEUED
from relay.wire.v2 import views

OUTCOMES = ("completed", "retry")


def lease_mismatch() -> errors.RelayError:
    """409 ``lease_mismatch``: the token names no active lease of the caller."""
    return errors.RelayError(409, "lease_mismatch", "lease is no longer active")


def ack(agent: str, lease_token: str, outcome: str, error: Optional[str],
        rules: Rules) -> Transition:
    """``POST /v1/ack``: only the recipient, or the member holding a role message's
    lease (403); with ``lease_token``, only for that active lease (409
    ``lease_mismatch``); without one, only while the message is leased (400, WIRE-V2
    §2). ``completed`` finishes it; ``retry`` queues it again, or fails it with the
    sender's notice once it was pulled ``maxAttempts`` times (the reference's rule,
    one retry sooner than the seed wire's) or past the broker's other limits."""

    def transition(message: Message, now: float) -> Outcome:
        if message.lessee() != agent:
            raise errors.forbidden("message is not assigned to this agent")
        if lease_token:
            if message.status != LEASED or message.lease_id != lease_token:
                raise lease_mismatch()
        elif message.status != LEASED:
            raise errors.bad_request("message is not currently leased")
        if outcome not in OUTCOMES:
            raise errors.bad_request("invalid acknowledgement outcome")
        if outcome == "retry" and message.deliveries >= rules.max_attempts:
            # The seed rule fails a retry past max_attempts retries: counted so, this
            # retry is past them.
            message.attempts = max(message.attempts, rules.max_attempts)
        done = delivery.ack(agent, message.lease_id, outcome, error, rules)(message, now)
        return Outcome({"ok": True}, done.notices)

    return transition


def renew(agent: str, lease_token: str, lease_seconds: float) -> Transition:
    """``POST /v1/lease/renew``: the active lease of that token, held by the caller,
    ends ``lease_seconds`` from now; any other case is 409 ``lease_mismatch``."""

    def transition(message: Message, now: float) -> Outcome:
        if (message.lessee() != agent or message.status != LEASED
                or message.lease_id != lease_token):
            raise lease_mismatch()
        message.lease_until = delivery.now_ms(now) + int(lease_seconds * 1000)
        return Outcome({"ok": True, "lease_until": message.lease_until / 1000.0})

    return transition


def requeue(agent: str, admin: bool = False) -> Kept:
    """``POST /v1/admin/requeue``: the recipient of an unfinished request puts it back
    in its queue (leased, failed or expired -> queued, its attempts reset); 404 in
    any other state. An ``admin`` (``security.admin_agents``) may requeue any message,
    a completed one too. A message past its TTL lives its TTL again from now
    (:func:`relay.rules.delivery.revive`), so that it is delivered: the reference's keeps
    its deadline and expires again at once."""
    states = ("leased", "failed", "expired", "completed") if admin else (
        "leased", "failed", "expired")

    def transition(message: Message, now: float) -> Outcome:
        if not admin and (message.lessee() != agent or views.kind_of(message) != "request"
                          or message.status == DONE):
            raise errors.forbidden("only the receiving agent may requeue an unfinished request")
        if views.status_of(message, now) not in states:
            raise errors.no_such_message("message is not in a requeue-able state")
        message.status = QUEUED
        message.lease_id = message.lease_until = None
        message.attempts = message.deliveries = 0
        message.not_before = message.dead_reason = None
        message.error = message.error or "requeued by operator"
        delivery.revive(message, now)
        return Outcome({"ok": True, "message_id": message.id})

    return Kept(transition)


def cancel(agent: str, admin: bool = False) -> Kept:
    """``POST /v1/admin/cancel``: the sender of a request marks it ``completed`` so it
    is never delivered (a held lease dies); 404 once it is completed. An ``admin``
    may cancel any message. An expired one too, as the reference does."""

    def transition(message: Message, now: float) -> Outcome:
        if not admin and (message.sender != agent or views.kind_of(message) != "request"):
            raise errors.forbidden("only the requesting agent may cancel its request")
        if message.status == DONE:
            raise errors.no_such_message("message is not in a cancellable state")
        message.status = DONE
        message.completed_at = now
        message.lease_id = message.lease_until = None
        message.not_before = message.dead_reason = None
        message.recovery = False
        message.error = message.error or "cancelled by operator"
        return Outcome({"ok": True, "message_id": message.id})

    return Kept(transition)
