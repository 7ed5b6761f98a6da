"""Commands on leases: ``pull``, ``ack`` (v1.1), ``renew``, ``release``, ``reject`` (v1.2)."""

from __future__ import annotations

import argparse
from typing import Any, Dict

from relay.cli.command import Context, non_negative_int, positive_int
from relay.cli.output import print_messages
from relay.wire.errors import RelayError

PULL_DESCRIPTION = """\
Lease queued messages: each is handed to this agent alone until the lease
ends, with a leaseId to acknowledge it by (`relay ack ID LEASE_ID completed`,
or `retry`; `relay release` and `relay reject` on a v1.2 broker). A lease
that runs out puts the message back in the queue; `relay renew` extends it.
--done completes each message once shown: the queue is read and emptied."""


def pull_arguments(parser: argparse.ArgumentParser) -> None:
    """The number of messages, the lease length and the parent and role filters."""
    parser.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        help="lease at most N messages (broker default 50)",
    )
    parser.add_argument(
        "--lease",
        type=positive_int,
        metavar="SECONDS",
        help="how long the lease lasts (default: the broker's leaseSeconds, 600)",
    )
    parser.add_argument(
        "--parent",
        metavar="ID",
        help="only the answers to message ID (its parentId or replyTo; v1.2)",
    )
    parser.add_argument(
        "--role",
        metavar="NAME",
        help="only the queue of role NAME, which this agent holds (v1.3; by default a "
        "pull takes from this agent's inbox and every role it holds)",
    )
    parser.add_argument(
        "--done",
        action="store_true",
        help="complete each message once shown: read the queue and empty it",
    )


async def pull(ctx: Context) -> int:
    """POST /v1/pull: lease queued messages; with ``--done`` complete each one too."""
    args, console = ctx.args, ctx.console
    answer = await ctx.client.pull(
        limit=args.limit, lease_seconds=args.lease, parent_id=args.parent, role=args.role
    )
    messages = answer.get("messages") or []
    console.emit(answer, lambda: print_messages(console, messages, "nothing to lease"))
    if not args.done:
        return 0
    failed = 0
    for message in messages:
        message_id = str(message.get("id"))
        try:
            await ctx.client.complete(message_id, str(message.get("leaseId") or ""))
        except RelayError as error:
            failed += 1
            console.warn(f"warning: {message_id} not completed: {error.code}: {error.message}")
    if messages and not console.as_json:
        console.warn(f"completed {len(messages) - failed} of {len(messages)}")
    return 1 if failed else 0


def _lease_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("message_id", metavar="ID", help="the leased message")
    parser.add_argument("lease_id", metavar="LEASE_ID", help="the leaseId that `pull` showed")


def _after_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--after",
        type=non_negative_int,
        metavar="SECONDS",
        help="not delivered again before SECONDS from now (v1.2 retry-after)",
    )


def ack_arguments(parser: argparse.ArgumentParser) -> None:
    """``ID LEASE_ID completed|retry``, the error text and the delay of a retry."""
    _lease_arguments(parser)
    parser.add_argument(
        "outcome",
        choices=["completed", "retry"],
        help="completed (done) or retry (queued again, one attempt more)",
    )
    parser.add_argument("--error", metavar="TEXT", help="why it is retried (shown by `status`)")
    _after_argument(parser)


def _print_settled(ctx: Context, message_id: str, answer: Dict[str, Any]) -> None:
    ctx.console.emit(
        answer,
        lambda: ctx.console.line(
            f"{message_id}: {answer.get('status')} (attempts {answer.get('attempts')})"
        ),
    )


async def ack(ctx: Context) -> int:
    """POST /v1/ack: finish (``completed``) or re-queue (``retry``) a leased message."""
    args = ctx.args
    answer = await ctx.client.ack_outcome(
        args.message_id, args.lease_id, args.outcome, args.error, retry_after=args.after
    )
    _print_settled(ctx, args.message_id, answer)
    return 0


def release_arguments(parser: argparse.ArgumentParser) -> None:
    """``ID LEASE_ID`` and a delay."""
    _lease_arguments(parser)
    _after_argument(parser)


async def release(ctx: Context) -> int:
    """POST /v1/ack ``release``: give a leased message back without using an attempt."""
    args = ctx.args
    answer = await ctx.client.release(args.message_id, args.lease_id, after=args.after)
    _print_settled(ctx, args.message_id, answer)
    return 0


def reject_arguments(parser: argparse.ArgumentParser) -> None:
    """``ID LEASE_ID`` and the reason."""
    _lease_arguments(parser)
    parser.add_argument(
        "--reason", metavar="TEXT", help='why it can never succeed (default "rejected")'
    )


async def reject(ctx: Context) -> int:
    """POST /v1/ack ``reject``: a leased message fails at once (a dead letter)."""
    args = ctx.args
    answer = await ctx.client.reject(args.message_id, args.lease_id, args.reason)
    _print_settled(ctx, args.message_id, answer)
    return 0


def renew_arguments(parser: argparse.ArgumentParser) -> None:
    """``ID LEASE_ID`` and the new lease length."""
    _lease_arguments(parser)
    parser.add_argument(
        "--lease",
        type=positive_int,
        metavar="SECONDS",
        help="the lease now ends SECONDS from now (default: the broker's leaseSeconds)",
    )


async def renew(ctx: Context) -> int:
    """POST /v1/lease/renew: extend (or shorten) a lease."""
    args = ctx.args
    answer = await ctx.client.renew(args.message_id, args.lease_id, args.lease)
    ctx.console.emit(
        answer,
        lambda: ctx.console.line(
            f"{args.message_id}: leased until {ctx.console.age(answer.get('leaseUntil'))}"
        ),
    )
    return 0
