"""Read-only v1.1 views: ``status``, ``recent``, ``query``."""

from __future__ import annotations

import argparse

from relay.cli.command import Context, positive_int
from relay.cli.output import print_messages, table


def status_arguments(parser: argparse.ArgumentParser) -> None:
    """One or more message ids."""
    parser.add_argument("message_ids", metavar="ID", nargs="+")


async def status(ctx: Context) -> int:
    """POST /v1/status: a table of the delivery status of messages."""
    console = ctx.console
    answer = await ctx.client.status(ctx.args.message_ids)
    messages = answer.get("messages") or []

    def readable() -> None:
        if not messages:
            console.line("no such messages")
            return
        rows = [
            tuple(m.get(key) for key in ("id", "status", "attempts", "from", "to", "kind", "ts"))
            for m in messages
        ]
        for line in table(rows, ("ID", "STATUS", "ATTEMPTS", "FROM", "TO", "KIND", "TS")):
            console.line(line)

    console.emit(answer, readable)
    return 0


def recent_arguments(parser: argparse.ArgumentParser) -> None:
    """How many messages."""
    parser.add_argument("--limit", type=positive_int)


async def recent(ctx: Context) -> int:
    """POST /v1/recent: this agent's most recent messages, any status."""
    answer = await ctx.client.recent(limit=ctx.args.limit)
    messages = answer.get("messages") or []
    ctx.console.emit(answer, lambda: print_messages(ctx.console, messages, "no messages"))
    return 0


def query_arguments(parser: argparse.ArgumentParser) -> None:
    """The filters and how many messages."""
    parser.add_argument("--kind")
    parser.add_argument("--status")
    parser.add_argument("--from", dest="from_")
    parser.add_argument("--to")
    parser.add_argument("--limit", type=positive_int)


async def query(ctx: Context) -> int:
    """POST /v1/messages/query: messages matching the filters."""
    args = ctx.args
    answer = await ctx.client.query(
        kind=args.kind, status=args.status, from_=args.from_, to=args.to, limit=args.limit
    )
    messages = answer.get("messages") or []
    ctx.console.emit(
        answer, lambda: print_messages(ctx.console, messages, "no matching messages")
    )
    return 0
