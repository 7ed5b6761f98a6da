"""Commands on v1.1 leases: ``pull``, ``ack``."""

from __future__ import annotations

import argparse

from relay.cli.command import Context, positive_int
from relay.cli.output import print_messages

PULL_DESCRIPTION = """\
Lease queued messages: each is handed to this agent alone until the lease
ends, with a leaseId to acknowledge it by (`relay ack ID LEASE_ID completed`,
or `retry`). A lease that runs out puts the message back in the queue."""


def pull_arguments(parser: argparse.ArgumentParser) -> None:
    """The number of messages and the lease length."""
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


async def pull(ctx: Context) -> int:
    """POST /v1/pull: lease queued messages."""
    answer = await ctx.client.pull(limit=ctx.args.limit, lease_seconds=ctx.args.lease)
    messages = answer.get("messages") or []
    ctx.console.emit(answer, lambda: print_messages(ctx.console, messages, "nothing to lease"))
    return 0


def ack_arguments(parser: argparse.ArgumentParser) -> None:
    """``ID LEASE_ID completed|retry`` and the error text of a retry."""
    parser.add_argument("message_id", metavar="ID", help="the leased message")
    parser.add_argument("lease_id", metavar="LEASE_ID", help="the leaseId that `pull` showed")
    parser.add_argument(
        "outcome",
        choices=["completed", "retry"],
        help="completed (done) or retry (queued again, one attempt more)",
    )
    parser.add_argument("--error", metavar="TEXT", help="why it is retried (shown by `status`)")


async def ack(ctx: Context) -> int:
    """POST /v1/ack: finish (``completed``) or re-queue (``retry``) a leased message."""
    args = ctx.args
    answer = await ctx.client.ack_outcome(args.message_id, args.lease_id, args.outcome, args.error)
    ctx.console.emit(
        answer,
        lambda: ctx.console.line(
            f"{args.message_id}: {answer.get('status')} (attempts {answer.get('attempts')})"
        ),
    )
    return 0
