"""``relay mcp``: serve the relay as MCP tools on standard input and output."""

from __future__ import annotations

import argparse

from relay.agent import card_of
from relay.cli.command import Context, card_arguments
from relay.mcp import unavailable
from relay.mcp.tools import RelayTools

MCP_DESCRIPTION = """\
Run a Model Context Protocol server on standard input and output, for a coding
agent (Claude Code, Codex, Cursor, Gemini CLI, ...) to use the relay as tools:
relay_peers, relay_send, relay_request, relay_wait_reply, relay_inbox,
relay_reply, relay_done and more (docs/MCP.md). The server acts as the one
agent of --agent and --secret-file (or the DSH_RELAY_* variables); no tool can
act as another. It handshakes and registers at start (refusing a broker of
another protocol), heartbeats while the session lives, and releases the
messages the model still holds when the session ends. Needs the mcp extra
(Python 3.10 or later; README.md, "Installing")."""


def mcp_arguments(parser: argparse.ArgumentParser) -> None:
    """The peer card."""
    card_arguments(
        parser, "what this agent does, published in its peer card (relay_peers shows it)")


async def mcp(ctx: Context) -> int:
    """Serve MCP over stdio as the configured agent until the client ends the session."""
    problem = unavailable()
    if problem is not None:
        ctx.console.warn(f"error: {problem}")
        return 1
    from relay.mcp.server import serve

    console = ctx.console

    def note(line: str) -> None:
        console.warn(f"relay mcp: {line}")

    tools = RelayTools(
        ctx.client,
        ctx.clock,
        card=card_of(ctx.args.description, ctx.args.skills),
        note=note,
    )
    info = await tools.start()
    note(
        f"agent {tools.agent} on {ctx.client.broker_url} ({info.get('broker', 'broker')} "
        f"{info.get('version', '?')}, protocol {info['protocol']}); serving MCP on stdio"
    )
    await serve(ctx.clock, tools)
    return 0
