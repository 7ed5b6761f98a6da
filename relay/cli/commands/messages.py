"""Commands that send and read messages: ``send``, ``ask``, ``recv``, ``watch``."""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, TextIO

from relay.cli.command import Context, non_negative_int, positive_float, positive_int
from relay.cli.output import body_text, print_messages, table, watch_line
from relay.cli.state import STATE_FILE, CursorState
from relay.client.client import (
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    MAX_OPTIONS,
    answer_of,
    question_body,
)
from relay.client.polling import drain, poll
from relay.client.settings import UsageError
from relay.wire.errors import RelayError
from relay.wire.protocol import MAX_PRIORITY

KINDS = ("message", "request", "reply")

DEFAULT_RECV_LIMIT = 50
# A recv drain stops after this many pages even if the broker keeps answering.
MAX_DRAIN_PAGES = 1000
DEFAULT_WATCH_INTERVAL_SECONDS = 2.0
WATCH_HEARTBEAT_SECONDS = 60.0
WATCH_PAGE_LIMIT = 50


# `relay send --id KEY` sends the message id UUIDv5(this namespace, sender + "\n" + KEY).
SEND_ID_NAMESPACE = uuid.UUID("de9918a3-1536-499b-96d8-8533cdb1ea8e")


def message_id_for(sender: str, key: str) -> str:
    """The message id of ``relay send --id KEY``: a UUID derived from the sender and
    the key, so the same key from the same agent is always the same message, and no
    agent can choose (or guess from a meaningful key) another agent's ids."""
    return str(uuid.uuid5(SEND_ID_NAMESPACE, f"{sender}\n{key}"))


SEND_DESCRIPTION = """\
Send one message to TARGET. CONTENT is the text of the body {"text": CONTENT};
"-" reads it from standard input and "@PATH" from a file (one trailing newline
is dropped); "@@..." stands for a text that starts with "@". With --json-body,
CONTENT (or the input or file it names) is the whole body, a JSON object.
A --kind request registers the sender first, so that the reply can reach it.
--id KEY is an idempotency key: the message id is a UUID derived from this
agent's name and KEY, so sending with the same KEY again is a no-op."""


def _content_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "content", metavar="CONTENT", help='the text, "-" (standard input) or "@PATH" (a file)'
    )
    parser.add_argument(
        "--json-body", action="store_true", help="CONTENT is the body itself, a JSON object"
    )


def _ttl_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--ttl",
        type=positive_int,
        metavar="SECONDS",
        help=f"{what} expires after SECONDS unless handled (v1.2; "
        "default: the broker's messageTtlDays)",
    )


def send_arguments(parser: argparse.ArgumentParser) -> None:
    """``TARGET CONTENT`` and the envelope's optional fields."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="TARGET",
                        help="the receiving agent, group:NAME for a copy to each member "
                        "of a configured group, or role:NAME (one member of the role "
                        "takes it) (v1.3)")
    _content_arguments(parser)
    parser.add_argument("--ack", action="store_true", help="ask the receiver for a receipt")
    parser.add_argument(
        "--kind",
        choices=KINDS,
        help="message (the default), request (opens a conversation) or reply",
    )
    parser.add_argument("--reply-to", metavar="ID", help="the id this message answers")
    parser.add_argument("--root-id", metavar="ID", help="the first message of the conversation")
    parser.add_argument(
        "--id",
        dest="key",
        metavar="KEY",
        help="an idempotency key: the same KEY from this agent is the same message "
        "(default: a fresh UUID)",
    )
    _ttl_argument(parser, "the message")
    parser.add_argument(
        "--delay",
        type=non_negative_int,
        metavar="SECONDS",
        help="deliver the message SECONDS from now, not before (v1.2)",
    )
    parser.add_argument(
        "--priority",
        type=priority_level,
        metavar="N",
        help="0-9: pulls lease higher priorities first (v1.3; default 0)",
    )


def priority_level(value: str) -> int:
    """An argparse type: a priority, an integer from 0 to 9."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if not 0 <= number <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_PRIORITY}")
    return number


def read_content(value: str, stdin: TextIO) -> str:
    """The text CONTENT stands for: itself, standard input (``-``) or a file (``@PATH``)."""
    if value.startswith("@@"):
        return value[1:]
    if value == "-":
        text = stdin.read()
    elif value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(
                f"cannot read {path}: {error.strerror} (write @@ for a text starting with @)"
            ) from None
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not UTF-8 text") from None
    else:
        return value
    return text[:-1] if text.endswith("\n") else text


def message_body(content: str, json_body: bool, stdin: TextIO) -> Dict[str, Any]:
    """The body to send: ``{"text": ...}``, or with ``json_body`` the JSON object given."""
    text = read_content(content, stdin)
    if not json_body:
        return {"text": text}
    try:
        body = json.loads(text)
    except ValueError as error:
        raise UsageError(f"--json-body: not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise UsageError("--json-body: the body must be a JSON object")
    return body


async def send(ctx: Context) -> int:
    """POST /messages: a ``{"text": CONTENT}`` message; ``--kind reply`` sets ``parentId`` too."""
    args = ctx.args
    body = message_body(args.content, args.json_body, ctx.stdin)
    # The reply to a request is a message to this agent, and only a registered
    # agent can receive one (spec §2, `to`): register (heartbeat) first, unless
    # a run of the last minute did.
    if args.kind == "request" and ctx.client.registered_at is None:
        await ctx.client.register()
    answer = await ctx.client.send(
        args.target,
        body,
        message_id=None if args.key is None else message_id_for(ctx.client.agent, args.key),
        kind=args.kind,
        reply_to=args.reply_to,
        parent_id=args.reply_to if args.kind == "reply" else None,
        root_id=args.root_id,
        ack=args.ack,
        ttl_seconds=args.ttl,
        delay_seconds=args.delay,
        priority=args.priority,
    )

    def readable() -> None:
        note = " (already accepted earlier)" if answer.get("duplicate") else ""
        copies = answer.get("copies")
        if not isinstance(copies, list):
            ctx.console.line(f"sent {answer.get('id')} to {args.target}{note}")
            return
        count = f"{len(copies)} cop{'y' if len(copies) == 1 else 'ies'}"
        ctx.console.line(f"sent {answer.get('id')} to {args.target}: {count}{note}")
        rows = [[c.get("to"), c.get("id")] for c in copies if isinstance(c, dict)]
        for line in table(rows, ["TO", "COPY ID"]) if rows else ():
            ctx.console.line("  " + line)

    ctx.console.emit(answer, readable)
    return 0


ASK_DESCRIPTION = """\
Send CONTENT to AGENT as a request and wait for the answer, then print it
(the reply's text, or its JSON body). CONTENT is read as for `relay send`.
To ask a person (an agent with human: true, who answers in the inbox page),
--question sends CONTENT as {"question": CONTENT} and each --option adds a
button the person may pick ({"question", "options"}); their answer is printed
as they gave it: the option picked or the text they wrote.
Exit status 1, with one line saying why, when the request fails (the
broker's failure notice, or a person's reject with their reason), when no
answer comes within --timeout, or when the broker cannot be reached. A v1.1
broker is polled for the answer, which then stays queued in this agent's inbox."""


def ask_arguments(parser: argparse.ArgumentParser) -> None:
    """``AGENT CONTENT``, the body options and how long to wait."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="AGENT", help="the agent to ask")
    _content_arguments(parser)
    parser.add_argument(
        "--timeout",
        "--wait",
        type=positive_float,
        default=DEFAULT_REQUEST_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"how long to wait for the answer (default {DEFAULT_REQUEST_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--question",
        action="store_true",
        help='CONTENT is a question to a person: the body {"question": CONTENT}',
    )
    parser.add_argument(
        "--option",
        dest="options",
        action="append",
        metavar="TEXT",
        help=f"an answer the person may pick, shown as a button (1 to {MAX_OPTIONS}; "
        "implies --question)",
    )
    _ttl_argument(parser, "the request")


async def ask(ctx: Context) -> int:
    """Request and wait: ``RelayClient.request`` (``ask`` for a question to a
    person); prints the answer."""
    args = ctx.args
    if args.question or args.options:
        if args.json_body:
            raise UsageError("--json-body does not go with --question or --option")
        try:
            body = question_body(read_content(args.content, ctx.stdin), args.options)
        except ValueError as error:
            raise UsageError(str(error)) from None
    else:
        body = message_body(args.content, args.json_body, ctx.stdin)
    reply = await ctx.client.request(args.target, body, args.timeout, ttl_seconds=args.ttl)
    ctx.console.emit(reply, lambda: _print_answer(ctx, reply))
    return 0


def _print_answer(ctx: Context, reply: Mapping[str, Any]) -> None:
    answer = answer_of(reply)
    text = answer if answer is not None else body_text(reply.get("body"))
    for line in text.splitlines() or [""]:
        ctx.console.line(line)


RECV_DESCRIPTION = """\
Fetch the messages that arrived since the last recv or watch (a v1.0 cursor,
kept in ~/.dsh-relay-state.json) and send the receipts asked for, once.
Reading changes nothing at the broker: a message read here is still queued,
and `relay pull` still leases it. Use pull and ack for work that must be done
exactly once (docs/CLIENT.md)."""


def recv_arguments(parser: argparse.ArgumentParser) -> None:
    """The page size, one page only, and forgetting the cursor."""
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_RECV_LIMIT,
        metavar="N",
        help=f"messages per page (default {DEFAULT_RECV_LIMIT}; the broker caps it at 200)",
    )
    parser.add_argument("--once", action="store_true", help="fetch one page only")
    parser.add_argument(
        "--reset",
        action="store_true",
        help="forget the saved cursor and read the inbox from its start "
        "(receipts already sent are not sent again)",
    )


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
    await _send_receipts(ctx, state, received)
    state.set(client.cursor)
    console.emit(
        {"count": len(received), "messages": received, "cursor": client.cursor},
        lambda: print_messages(console, received, "no new messages"),
    )
    return 0


def watch_arguments(parser: argparse.ArgumentParser) -> None:
    """The poll interval and a message count to stop after."""
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=DEFAULT_WATCH_INTERVAL_SECONDS,
        metavar="SECONDS",
        help="seconds between polls when the broker cannot long-poll "
        f"(default {DEFAULT_WATCH_INTERVAL_SECONDS:g})",
    )
    parser.add_argument("--count", type=positive_int, metavar="N", help="stop after N messages")


async def watch(ctx: Context) -> int:
    """One line per new message until interrupted (or ``--count`` messages)."""
    args, client, console, clock = ctx.args, ctx.client, ctx.console, ctx.clock
    state = _cursor_state(ctx)
    client.cursor = state.get()
    try:
        if client.info is None:  # else a run of the last minute made it
            await client.handshake()
    except RelayError as error:
        if error.code == "protocol_mismatch":
            raise
        console.warn(f"warning: handshake failed ({error.code}); polling every {args.interval}s")
    if client.registered_at is None:
        await client.register()
    last_heartbeat = clock.seconds() if client.registered_at is None else client.registered_at
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
                console.line(watch_line(message, console.now()))
            shown += 1
        await _send_receipts(ctx, state, messages)
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


async def _send_receipts(
    ctx: Context, state: CursorState, messages: Sequence[Mapping[str, Any]]
) -> None:
    """The v1.0 receipt for every message that asked for one, once (best effort).

    The broker stores a new receipt for each ``POST /messages/<id>/ack``, so a
    message read again (``recv --reset``) must not be acknowledged again.
    """
    for message in messages:
        if not message.get("ack") or message.get("type", "message") != "message":
            continue
        message_id = str(message["id"])
        if state.receipt_sent(message_id):
            continue
        try:
            await ctx.client.ack(message_id, "ok")
        except RelayError as error:
            ctx.console.warn(f"warning: no receipt sent for {message_id}: {error.code}")
            continue
        state.note_receipt(message_id, ctx.clock.seconds())
