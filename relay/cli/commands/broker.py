"""Commands about the broker and who is on it: ``handshake``, ``register``, ``peers``."""

from __future__ import annotations

import argparse
import json
import re
from typing import Tuple

from relay.cli.command import Context
from relay.cli.output import table

# The throwaway agents of `relay selfcheck`: selfcheck-<8 hex digits>-a and -b.
SELFCHECK_AGENT = re.compile(r"selfcheck-[0-9a-f]{8}-[ab]\Z")


def selfcheck_agent_names(tag: str) -> Tuple[str, str]:
    """The two agent names of the ``selfcheck`` run ``tag`` (8 hex digits)."""
    return f"selfcheck-{tag}-a", f"selfcheck-{tag}-b"


async def handshake(ctx: Context) -> int:
    """GET /: the broker's protocol version, storage and capabilities."""
    client, console = ctx.client, ctx.console
    info = await client.handshake()

    def readable() -> None:
        console.line(
            f"{info.get('broker', 'broker')} {info.get('version', '?')} at {client.broker_url}: "
            f"protocol {info['protocol']}"
        )
        if info.get("storage"):
            console.line(f"storage: {info['storage']}")
        capabilities = info.get("capabilities")
        if isinstance(capabilities, dict) and capabilities:
            enabled = ", ".join(
                name if value is True else f"{name}={json.dumps(value)}"
                for name, value in sorted(capabilities.items())
                if value
            )
            console.line(f"capabilities: {enabled or 'none'}")

    console.emit(info, readable)
    return 0


async def register(ctx: Context) -> int:
    """POST /register: register this agent, or heartbeat it."""
    answer = await ctx.client.register()
    ctx.console.emit(
        answer, lambda: ctx.console.line(f"registered {answer.get('agent', ctx.client.agent)}")
    )
    return 0


def peers_arguments(parser: argparse.ArgumentParser) -> None:
    """Whether to list the agents of past ``selfcheck`` runs too."""
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list the throwaway agents of past `relay selfcheck` runs",
    )


async def peers(ctx: Context) -> int:
    """GET /peers: a table of the registered agents, when each was last seen.

    The protocol cannot remove an agent, so the throwaway agents of
    ``selfcheck`` stay registered (offline after 90 s): the readable table
    leaves them out unless ``--all``. ``--json`` is the broker's answer as is.
    """
    console = ctx.console
    answer = await ctx.client.peers()
    listed = [peer for peer in answer.get("peers") or [] if isinstance(peer, dict)]

    def readable() -> None:
        shown = [
            peer
            for peer in listed
            if ctx.args.all or not SELFCHECK_AGENT.match(str(peer.get("agent")))
        ]
        hidden = len(listed) - len(shown)
        if not shown:
            console.line("no registered agents")
        else:
            rows = [
                (
                    peer.get("agent"),
                    "yes" if peer.get("online") else "no",
                    console.age(peer.get("lastSeen")),
                )
                for peer in shown
            ]
            for line in table(rows, ("AGENT", "ONLINE", "LAST SEEN")):
                console.line(line)
        if hidden:
            console.line(f"({hidden} selfcheck agents not shown; `relay peers --all` lists them)")

    console.emit(answer, readable)
    return 0
