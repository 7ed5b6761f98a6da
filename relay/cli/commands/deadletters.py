"""Dead letters (v1.2): ``dead`` lists them, ``requeue`` puts one back, ``cancel``
withdraws a message this agent sent."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence

from relay.cli.command import Context, positive_int
from relay.cli.output import table

DEAD_DESCRIPTION = """\
List this agent's dead letters: the failed messages it received or sent,
newest first, with the error that failed them (a handler's reject or last
retry, "delivered N times without completion", a cancel's reason).
`relay requeue ID` puts one back in the queue. A v1.1 broker lists the
received ones only."""


def dead_arguments(parser: argparse.ArgumentParser) -> None:
    """How many messages."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="at most N messages (broker default 50)"
    )


async def dead(ctx: Context) -> int:
    """POST /v1/messages/query ``status: failed`` (inbox and sent), with each error."""
    client, console = ctx.client, ctx.console
    await client.handshake()
    if client.advertises("threads"):
        answer = await client.query(status="failed", box="all", limit=ctx.args.limit)
    else:
        console.warn("warning: the broker lacks threads (query by box): received messages only")
        answer = await client.query(status="failed", limit=ctx.args.limit)
    messages = await with_status(ctx, answer.get("messages") or [])
    agent = client.agent

    def readable() -> None:
        if not messages:
            console.line("no dead letters")
            return
        rows = [
            (
                m.get("id"),
                "sent" if m.get("from") == agent else "received",
                m.get("to") if m.get("from") == agent else m.get("from"),
                m.get("kind"),
                console.age(m.get("ts")),
                m.get("attempts"),
                m.get("deliveries"),
                " ".join(str(m.get("error") or "").split()),
            )
            for m in messages
        ]
        headers = ("ID", "BOX", "PEER", "KIND", "SENT", "ATTEMPTS", "DELIVERIES", "ERROR")
        for line in table(rows, headers):
            console.line(line)
        console.line("(`relay requeue ID` puts a message back in the queue)")

    console.emit({"messages": messages, "count": len(messages)}, readable)
    return 0


async def with_status(ctx: Context, messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``messages`` with the ``error`` and ``deliveries`` of their ``/v1/status`` entries."""
    ids = [str(m["id"]) for m in messages if m.get("id")]
    if not ids:
        return list(messages)
    answer = await ctx.client.status(ids)
    entries = {
        entry.get("id"): entry
        for entry in answer.get("messages") or []
        if isinstance(entry, dict)
    }
    merged = []
    for message in messages:
        entry = entries.get(message.get("id")) or {}
        extra = {key: entry[key] for key in ("error", "deliveries") if key in entry}
        merged.append({**message, **extra})
    return merged


def requeue_arguments(parser: argparse.ArgumentParser) -> None:
    """The message."""
    parser.add_argument("message_id", metavar="ID", help="a failed message")


async def requeue(ctx: Context) -> int:
    """POST /v1/requeue: a failed message is queued again, attempts and deliveries 0."""
    answer = await ctx.client.requeue(ctx.args.message_id)
    ctx.console.emit(
        answer, lambda: ctx.console.line(f"{ctx.args.message_id}: {answer.get('status')}")
    )
    return 0


def cancel_arguments(parser: argparse.ArgumentParser) -> None:
    """The message and the reason."""
    parser.add_argument("message_id", metavar="ID", help="a message this agent sent")
    parser.add_argument(
        "--reason", metavar="TEXT", help='why (default "cancelled by sender"; `status` shows it)'
    )


async def cancel(ctx: Context) -> int:
    """POST /v1/cancel: withdraw a queued or leased message this agent sent."""
    answer = await ctx.client.cancel(ctx.args.message_id, ctx.args.reason)
    ctx.console.emit(
        answer,
        lambda: ctx.console.line(f"{ctx.args.message_id}: {answer.get('status')} (cancelled)"),
    )
    return 0
