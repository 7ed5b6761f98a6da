"""Commands that send and read messages: ``send``, ``recv``, ``watch``."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping, Optional, Sequence

from relay.cli.command import Context, positive_float, positive_int
from relay.cli.output import print_messages, watch_line
from relay.cli.state import STATE_FILE, CursorState
from relay.errors import RelayError
from relay.polling import drain, poll

DEFAULT_RECV_LIMIT = 50
# A recv drain stops after this many pages even if the broker keeps answering.
MAX_DRAIN_PAGES = 1000
DEFAULT_WATCH_INTERVAL_SECONDS = 2.0
WATCH_HEARTBEAT_SECONDS = 60.0
WATCH_PAGE_LIMIT = 50


def send_arguments(parser: argparse.ArgumentParser) -> None:
    """``TARGET CONTENT`` and the envelope's optional fields."""
    parser.add_argument("target", metavar="TARGET")
    parser.add_argument("content", metavar="CONTENT")
    parser.add_argument("--ack", action="store_true", help="ask the receiver for a receipt")
    parser.add_argument("--kind", choices=["message", "request", "reply"])
    parser.add_argument("--reply-to", metavar="ID", help="the id this message answers")
    parser.add_argument("--root-id", metavar="ID", help="the first message of the conversation")
    parser.add_argument("--id", dest="message_id", metavar="ID", help="a message id (idempotency)")


async def send(ctx: Context) -> int:
    """POST /messages: a ``{"text": CONTENT}`` message; ``--kind reply`` sets ``parentId`` too."""
    args = ctx.args
    answer = await ctx.client.send(
        args.target,
        {"text": args.content},
        message_id=args.message_id,
        kind=args.kind,
        reply_to=args.reply_to,
        parent_id=args.reply_to if args.kind == "reply" else None,
        root_id=args.root_id,
        ack=args.ack,
    )

    def readable() -> None:
        note = " (already accepted earlier)" if answer.get("duplicate") else ""
        ctx.console.line(f"sent {answer.get('id')} to {args.target}{note}")

    ctx.console.emit(answer, readable)
    return 0


def recv_arguments(parser: argparse.ArgumentParser) -> None:
    """The page size, one page only, and forgetting the cursor."""
    parser.add_argument("--limit", type=positive_int, default=DEFAULT_RECV_LIMIT)
    parser.add_argument("--once", action="store_true", help="fetch one page only")
    parser.add_argument("--reset", action="store_true", help="forget the saved cursor first")


async def recv(ctx: Context) -> int:
    """GET /messages from the saved cursor until the inbox is drained; sends asked-for receipts."""
    args, client, console = ctx.args, ctx.client, ctx.console
    state = _cursor_state(ctx)
    if args.reset:
        state.set(None)
    client.cursor = state.get()

    async def page() -> Sequence[Dict[str, Any]]:
        answer = await client.recv(limit=args.limit)
        return answer.get("messages") or []

    received = await drain(page, 1 if args.once else MAX_DRAIN_PAGES)
    await _send_receipts(ctx, received)
    state.set(client.cursor)
    console.emit(
        {"count": len(received), "messages": received, "cursor": client.cursor},
        lambda: print_messages(console, received, "no new messages"),
    )
    return 0


def watch_arguments(parser: argparse.ArgumentParser) -> None:
    """The poll interval and a message count to stop after."""
    parser.add_argument("--interval", type=positive_float, default=DEFAULT_WATCH_INTERVAL_SECONDS)
    parser.add_argument("--count", type=positive_int, help="stop after N messages")


async def watch(ctx: Context) -> int:
    """One line per new message until interrupted (or ``--count`` messages)."""
    args, client, console, clock = ctx.args, ctx.client, ctx.console, ctx.clock
    state = _cursor_state(ctx)
    client.cursor = state.get()
    try:
        await client.handshake()
    except RelayError as error:
        if error.code == "protocol_mismatch":
            raise
        console.warn(f"warning: handshake failed ({error.code}); polling every {args.interval}s")
    await client.register()
    last_heartbeat = clock.seconds()
    wait = client.long_poll_seconds
    if not console.as_json:
        mode = f"long-poll up to {wait:g}s" if wait else f"every {args.interval:g}s"
        console.warn(f"watching {client.agent} at {client.broker_url} ({mode}); Ctrl+C to stop")
    shown = 0

    async def fetch(wait: Optional[float]) -> Sequence[Dict[str, Any]]:
        nonlocal last_heartbeat
        now = clock.seconds()
        if now - last_heartbeat >= WATCH_HEARTBEAT_SECONDS:
            await client.register()
            last_heartbeat = now
        answer = await client.recv(limit=WATCH_PAGE_LIMIT, wait=wait)
        return answer.get("messages") or []

    async def show(messages: Sequence[Dict[str, Any]]) -> None:
        nonlocal shown
        for message in messages[: None if args.count is None else args.count - shown]:
            if console.as_json:
                console.document(message)
            else:
                console.line(watch_line(message))
            shown += 1
        await _send_receipts(ctx, messages)
        state.set(client.cursor)

    await poll(
        fetch,
        show,
        clock=clock,
        wait=wait,
        interval=args.interval,
        running=lambda: args.count is None or shown < args.count,
        on_error=lambda error: console.warn(f"warning: {error.code}: {error.message}"),
    )
    return 0


def _cursor_state(ctx: Context) -> CursorState:
    return CursorState(ctx.home / STATE_FILE, ctx.client.broker_url, ctx.client.agent)


async def _send_receipts(ctx: Context, messages: Sequence[Mapping[str, Any]]) -> None:
    """The v1.0 receipt for every message that asked for one (best effort)."""
    for message in messages:
        if message.get("ack") and message.get("type", "message") == "message":
            try:
                await ctx.client.ack(str(message["id"]), "ok")
            except RelayError as error:
                ctx.console.warn(f"warning: no receipt sent for {message.get('id')}: {error.code}")
