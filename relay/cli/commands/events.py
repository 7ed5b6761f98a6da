"""``relay events``: this agent's event stream (REACH §11), one line per event."""

from __future__ import annotations

import argparse
import math
from typing import Any, Mapping

from relay.cli.command import Context, positive_int
from relay.cli.output import one_line
from relay.client.sse import MESSAGE, RESET, STATUS, RelayEvent
from relay.wire.errors import RelayError

EVENTS_DESCRIPTION = """\
Follow this agent's events until interrupted (or --count events): a message
addressed to it became deliverable ("message": its id, sender and kind), a
message it sent changed state ("status"), or the stream started over from the
present ("reset": pull to re-sync). Events never carry a message body; take the
messages with `relay pull` or `relay recv`. The stream reconnects by itself
after the last event shown (an agent locked after authentication failures waits
out the lock, saying so); --since ID resumes after an event id an earlier run
printed. Needs a broker that advertises events (`relay handshake`)."""


def events_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to start and when to stop."""
    parser.add_argument(
        "--since", metavar="ID",
        help="resume after this event id (default: from now on)")
    parser.add_argument("--count", type=positive_int, metavar="N", help="stop after N events")


def waiting_time(seconds: float) -> str:
    """``seconds`` as a person reads a wait: "45 s", "5 min"."""
    if seconds >= 60:
        return f"{math.ceil(seconds / 60)} min"
    return f"{math.ceil(seconds)} s"


def event_line(event: RelayEvent) -> str:
    """One event as one line: its type and id, then who and what (never a body;
    what other agents chose, such as their names, on one line)."""
    data: Mapping[str, Any] = event.data
    head = f"{one_line(event.type)} {one_line(event.id)}"
    if event.type == MESSAGE:
        kind = data.get("kind") or "message"
        return (f"{head} from {one_line(data.get('from'))} ({one_line(kind)}) "
                f"[{one_line(data.get('id'))}]")
    if event.type == STATUS:
        return (f"{head} [{one_line(data.get('id'))}] to {one_line(data.get('to'))}: "
                f"{one_line(data.get('status'))} (attempts {one_line(data.get('attempts'))})")
    if event.type == RESET:
        return f"{head}: {one_line(data.get('reason'))}; pull to re-sync"
    return head


async def events(ctx: Context) -> int:
    """One line (or JSON object) per event until interrupted (or ``--count`` events)."""
    args, client, console = ctx.args, ctx.client, ctx.console
    def state(connected: bool) -> None:
        if not connected:
            console.warn("event stream lost; reconnecting")

    def wait(refusal: RelayError, seconds: float) -> None:
        console.warn(f"{one_line(refusal.message)}; the stream tries again in "
                     f"{waiting_time(seconds)}")

    stream = client.events(since=args.since, on_state=state, on_wait=wait)
    if not console.as_json:
        console.warn(f"events of {client.agent} at {client.broker_url}; Ctrl+C to stop")
    shown = 0
    try:
        async for event in stream:
            if console.as_json:
                console.document({"id": event.id, "event": event.type, "data": event.data})
            else:
                console.line(event_line(event))
            shown += 1
            if args.count is not None and shown >= args.count:
                break
    finally:
        stream.close()
    return 0
