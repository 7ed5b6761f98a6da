"""The ``relay`` subcommands: one table entry each, listed in ``relay --help`` in this order.

A new command is a function ``async def name(ctx: Context) -> int`` (with an
``arguments`` function when it takes any) in the module of its group, plus
one entry here.
"""

from __future__ import annotations

from typing import Tuple

from relay.cli.command import Command
from relay.cli.commands import (
    bootstrap,
    broker,
    completion,
    deadletters,
    events,
    leases,
    mcp,
    messages,
    ops,
    views,
)

COMMANDS: Tuple[Command, ...] = (
    Command(
        "handshake",
        "check the broker's protocol version and capabilities",
        broker.handshake,
        needs_agent=False,
        needs_secret=False,
    ),
    Command(
        "register",
        "register this agent (heartbeat), with its peer card",
        broker.register,
        broker.register_arguments,
        description=broker.REGISTER_DESCRIPTION,
    ),
    Command(
        "peers",
        "list registered agents, when each was last seen, and their cards",
        broker.peers,
        broker.peers_arguments,
    ),
    Command(
        "send",
        "send a message (text, standard input, a file or a JSON body)",
        messages.send,
        messages.send_arguments,
        description=messages.SEND_DESCRIPTION,
    ),
    Command(
        "ask",
        "send a request and wait for the answer",
        messages.ask,
        messages.ask_arguments,
        description=messages.ASK_DESCRIPTION,
    ),
    Command(
        "recv",
        "fetch new messages (drains the inbox unless --once)",
        messages.recv,
        messages.recv_arguments,
        description=messages.RECV_DESCRIPTION,
    ),
    Command(
        "watch",
        "print new messages as they arrive, until interrupted",
        messages.watch,
        messages.watch_arguments,
    ),
    Command(
        "events",
        "follow this agent's events: messages to pull, statuses of its own (REACH §11)",
        events.events,
        events.events_arguments,
        description=events.EVENTS_DESCRIPTION,
    ),
    Command(
        "pull",
        "lease queued messages (v1.1)",
        leases.pull,
        leases.pull_arguments,
        description=leases.PULL_DESCRIPTION,
    ),
    Command(
        "ack", "finish or re-queue a leased message (v1.1)", leases.ack, leases.ack_arguments
    ),
    Command("renew", "extend a lease (v1.2)", leases.renew, leases.renew_arguments),
    Command(
        "release",
        "give a leased message back without using an attempt (v1.2)",
        leases.release,
        leases.release_arguments,
    ),
    Command(
        "reject",
        "fail a leased message at once: it can never succeed (v1.2)",
        leases.reject,
        leases.reject_arguments,
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
        "thread",
        "the messages of one conversation, oldest first (v1.2)",
        views.thread,
        views.thread_arguments,
    ),
    Command(
        "dead",
        "this agent's dead letters, with their errors (v1.2)",
        deadletters.dead,
        deadletters.dead_arguments,
        description=deadletters.DEAD_DESCRIPTION,
    ),
    Command(
        "requeue",
        "put a failed message back in the queue (v1.2)",
        deadletters.requeue,
        deadletters.requeue_arguments,
    ),
    Command(
        "cancel",
        "withdraw a message this agent sent (v1.2)",
        deadletters.cancel,
        deadletters.cancel_arguments,
    ),
    Command(
        "mcp",
        "serve the relay as MCP tools on stdio, for a coding agent (needs the mcp extra)",
        mcp.mcp,
        mcp.mcp_arguments,
        description=mcp.MCP_DESCRIPTION,
    ),
    Command(
        "stats",
        "the broker's figures from its ops listener (what the dashboard shows)",
        ops.stats,
        ops.stats_arguments,
        needs_agent=False,
        needs_secret=False,
    ),
    Command(
        "unlock",
        "clear an agent's authentication lockout (through the ops listener)",
        ops.unlock,
        ops.unlock_arguments,
        needs_agent=False,
        needs_secret=False,
        description=ops.UNLOCK_DESCRIPTION,
    ),
    Command(
        "init",
        "write a broker config and a fresh secret in a directory of their own",
        bootstrap.init,
        bootstrap.init_arguments,
        needs_agent=False,
        needs_secret=False,
        description=bootstrap.INIT_DESCRIPTION,
    ),
    Command(
        "selfcheck",
        "round-trip messages between two throwaway agents (v1.0 and v1.1)",
        bootstrap.selfcheck,
        needs_agent=False,
    ),
    Command(
        "completion",
        "print the bash or zsh completion script",
        completion.completion,
        completion.completion_arguments,
        needs_agent=False,
        needs_secret=False,
        description=completion.COMPLETION_DESCRIPTION,
    ),
)
