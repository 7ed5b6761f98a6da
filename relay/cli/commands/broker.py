"""Commands about the broker and who is on it: ``handshake``, ``register``, ``peers``."""

from __future__ import annotations

import json

from relay.cli.command import Context
from relay.cli.output import table


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


async def peers(ctx: Context) -> int:
    """GET /peers: a table of the registered agents."""
    console = ctx.console
    answer = await ctx.client.peers()
    listed = answer.get("peers") or []

    def readable() -> None:
        if not listed:
            console.line("no registered agents")
            return
        rows = [
            (peer.get("agent"), "yes" if peer.get("online") else "no", peer.get("lastSeen"))
            for peer in listed
        ]
        for line in table(rows, ("AGENT", "ONLINE", "LAST SEEN")):
            console.line(line)

    console.emit(answer, readable)
    return 0
