"""The ``relay`` subcommands: one table entry each, listed in ``relay --help`` in this order.

A new command is a function ``async def name(ctx: Context) -> int`` (with an
``arguments`` function when it takes any) in the module of its group, plus
one entry here.
"""

from __future__ import annotations

from typing import Tuple

from relay.cli.command import Command
from relay.cli.commands import bootstrap, broker, leases, messages, ops, views

COMMANDS: Tuple[Command, ...] = (
    Command(
        "handshake",
        "check the broker's protocol version and capabilities",
        broker.handshake,
        needs_agent=False,
        needs_secret=False,
    ),
    Command("register", "register this agent (heartbeat)", broker.register),
    Command("peers", "list registered agents", broker.peers),
    Command("send", "send a text message", messages.send, messages.send_arguments),
    Command(
        "recv",
        "fetch new messages (drains the inbox unless --once)",
        messages.recv,
        messages.recv_arguments,
    ),
    Command(
        "watch",
        "print new messages as they arrive, until interrupted",
        messages.watch,
        messages.watch_arguments,
    ),
    Command("pull", "lease queued messages (v1.1)", leases.pull, leases.pull_arguments),
    Command(
        "ack", "finish or re-queue a leased message (v1.1)", leases.ack, leases.ack_arguments
    ),
    Command("status", "delivery status of messages (v1.1)", views.status, views.status_arguments),
    Command(
        "recent",
        "most recent messages for this agent (v1.1)",
        views.recent,
        views.recent_arguments,
    ),
    Command("query", "search messages (v1.1)", views.query, views.query_arguments),
    Command(
        "stats",
        "the broker's figures from its ops listener (what the dashboard shows)",
        ops.stats,
        ops.stats_arguments,
        needs_agent=False,
        needs_secret=False,
    ),
    Command(
        "init",
        "write a broker config with a fresh secret",
        bootstrap.init,
        bootstrap.init_arguments,
        needs_agent=False,
        needs_secret=False,
    ),
    Command(
        "selfcheck",
        "round-trip messages between two throwaway agents (v1.0 and v1.1)",
        bootstrap.selfcheck,
        needs_agent=False,
    ),
)
