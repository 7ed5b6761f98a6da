"""Read-only v1.1 views: ``status``, ``recent``, ``query``."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence

from relay.cli.command import Context, positive_int
from relay.cli.commands.messages import KINDS
from relay.cli.output import print_messages, table

STATUSES = ("queued", "leased", "done", "failed")


def status_arguments(parser: argparse.ArgumentParser) -> None:
    """One or more message ids."""
    parser.add_argument("message_ids", metavar="ID", nargs="+", help="a message id")


async def status(ctx: Context) -> int:
    """POST /v1/status: a table of the delivery status of messages, with the last error."""
    console = ctx.console
    answer = await ctx.client.status(ctx.args.message_ids)
    messages = answer.get("messages") or []

    def readable() -> None:
        if not messages:
            console.line("no such messages")
            return
        headers = ["ID", "STATUS", "ATTEMPTS", "FROM", "TO", "KIND", "SENT"]
        with_error = any(m.get("error") for m in messages)
        if with_error:
            headers.append("LAST ERROR")
        rows = []
        for m in messages:
            row = [m.get(key) for key in ("id", "status", "attempts", "from", "to", "kind")]
            row.append(console.age(m.get("ts")))
            if with_error:
                row.append(" ".join(str(m.get("error") or "").split()))
            rows.append(row)
        for line in table(rows, headers):
            console.line(line)

    console.emit(answer, readable)
    return 0


def recent_arguments(parser: argparse.ArgumentParser) -> None:
    """How many messages."""
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="at most N messages (broker default 50)"
    )


async def recent(ctx: Context) -> int:
    """POST /v1/recent: this agent's most recent messages, any status."""
    answer = await ctx.client.recent(limit=ctx.args.limit)
    messages = answer.get("messages") or []
    ctx.console.emit(answer, lambda: print_messages(ctx.console, messages, "no messages"))
    return 0


def query_arguments(parser: argparse.ArgumentParser) -> None:
    """The filters and how many messages."""
    parser.add_argument("--kind", choices=KINDS, help="only messages of this kind")
    parser.add_argument("--status", choices=STATUSES, help="only messages in this state")
    parser.add_argument("--from", dest="from_", metavar="AGENT", help="only messages from AGENT")
    parser.add_argument("--to", metavar="AGENT", help="only messages to AGENT")
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="at most N messages (broker default 50)"
    )


async def query(ctx: Context) -> int:
    """POST /v1/messages/query: messages matching the filters.

    Readable output also shows the last error of each message that has been
    retried or has failed, from ``/v1/status`` (an envelope does not carry it).
    """
    args = ctx.args
    answer = await ctx.client.query(
        kind=args.kind, status=args.status, from_=args.from_, to=args.to, limit=args.limit
    )
    messages = answer.get("messages") or []
    if ctx.console.as_json:
        ctx.console.document(answer)
        return 0
    shown = await _with_errors(ctx, messages)
    print_messages(ctx.console, shown, "no matching messages")
    return 0


async def _with_errors(ctx: Context, messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``messages``, those that were retried or failed with their last ``error``."""
    troubled = [
        str(m["id"])
        for m in messages
        if m.get("id") and (m.get("status") == "failed" or _count(m.get("attempts")) > 0)
    ]
    if not troubled:
        return list(messages)
    answer = await ctx.client.status(troubled)
    errors = {
        entry.get("id"): entry.get("error")
        for entry in answer.get("messages") or []
        if isinstance(entry, dict) and entry.get("error")
    }
    return [
        dict(m, error=errors[m.get("id")]) if m.get("id") in errors else dict(m) for m in messages
    ]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
