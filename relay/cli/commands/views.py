"""Read-only views: ``status``, ``recent``, ``query`` (v1.1) and ``thread`` (v1.2)."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence

from relay.cli.command import Context, positive_int
from relay.cli.commands.messages import KINDS
from relay.cli.output import print_messages, table

STATUSES = ("queued", "leased", "done", "failed")
BOXES = ("inbox", "sent", "all")


def status_arguments(parser: argparse.ArgumentParser) -> None:
    """One or more message ids."""
    parser.add_argument("message_ids", metavar="ID", nargs="+", help="a message id")


async def status(ctx: Context) -> int:
    """POST /v1/status: a table of the delivery status of messages, with the last error
    and, from a v1.2 broker, the deliveries and when a message is due or expires."""
    console = ctx.console
    answer = await ctx.client.status(ctx.args.message_ids)
    messages = _with_copies(answer.get("messages") or [])

    def readable() -> None:
        if not messages:
            console.line("no such messages")
            return
        columns = [
            ("ID", lambda m: m.get("id")),
            ("STATUS", lambda m: m.get("status")),
            ("ATTEMPTS", lambda m: m.get("attempts")),
        ]
        optional = [
            ("DELIVERIES", "deliveries", lambda m: m.get("deliveries")),
            ("GROUP SEND", "sentAs", lambda m: m.get("sentAs")),
        ]
        columns += [(h, f) for h, key, f in optional if any(key in m for m in messages)]
        columns += [
            ("FROM", lambda m: m.get("from")),
            ("TO", lambda m: m.get("to")),
            ("KIND", lambda m: m.get("kind")),
            ("SENT", lambda m: console.age(m.get("ts"))),
        ]
        timed = [
            ("DUE", "notBefore", lambda m: _when(console, m.get("notBefore"))),
            ("EXPIRES", "expiresAt", lambda m: _when(console, m.get("expiresAt"))),
            ("LAST ERROR", "error", lambda m: " ".join(str(m.get("error") or "").split())),
        ]
        columns += [(h, f) for h, key, f in timed if any(m.get(key) for m in messages)]
        rows = [[show(m) for _, show in columns] for m in messages]
        for line in table(rows, [header for header, _ in columns]):
            console.line(line)

    console.emit(answer, readable)
    return 0


def _with_copies(entries: List[Any]) -> List[Dict[str, Any]]:
    """The status entries with each group send (REACH §13) as a row per copy, which
    names the sent id and the group."""
    out: List[Dict[str, Any]] = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        copies = entry.get("copies")
        if not isinstance(copies, list):
            out.append(entry)
            continue
        sent_as = f"{entry.get('id')} ({entry.get('via')})"
        out += [{"id": c.get("id"), "status": c.get("status"), "to": c.get("to"),
                 "sentAs": sent_as} for c in copies if isinstance(c, dict)]
    return out


def _when(console: Any, value: Any) -> str:
    return "" if value is None else console.age(value)


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
    parser.add_argument(
        "--box",
        choices=BOXES,
        help="messages received (inbox, the default), sent, or both (v1.2)",
    )
    parser.add_argument(
        "--root", metavar="ID", help="only the conversation that ID started (v1.2)"
    )
    parser.add_argument("--parent", metavar="ID", help="only the answers to ID (v1.2)")


async def query(ctx: Context) -> int:
    """POST /v1/messages/query: messages matching the filters.

    Readable output also shows the last error of each message that has been
    retried or has failed, from ``/v1/status`` (an envelope does not carry it).
    """
    args = ctx.args
    answer = await ctx.client.query(
        kind=args.kind,
        status=args.status,
        from_=args.from_,
        to=args.to,
        limit=args.limit,
        box=args.box,
        root_id=args.root,
        parent_id=args.parent,
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


def thread_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT``, where to start and how many messages."""
    parser.add_argument("root_id", metavar="ROOT", help="the first message of the conversation")
    parser.add_argument(
        "--since", metavar="ID", help="only the messages after ID (the cursor of a page)"
    )
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="at most N messages (broker default 50)"
    )


async def thread(ctx: Context) -> int:
    """POST /v1/thread: a conversation this agent took part in, oldest first."""
    args, console = ctx.args, ctx.console
    answer = await ctx.client.thread(args.root_id, since=args.since, limit=args.limit)
    messages = answer.get("messages") or []

    def readable() -> None:
        print_messages(console, messages, "no messages in this conversation")
        if messages and answer.get("cursor") and len(messages) == (args.limit or 50):
            console.line(f"(more with --since {answer['cursor']})")

    console.emit(answer, readable)
    return 0
