"""Commands about the broker and who is on it: ``handshake``, ``register``, ``peers``."""

from __future__ import annotations

import argparse
import json
from typing import Any, Tuple

from relay.agent.runtime import card_of
from relay.cli.command import Context, card_arguments
from relay.cli.output import table
from relay.client.settings import UsageError
from relay.wire.protocol import KEEP_CARD, SELFCHECK_AGENT


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


REGISTER_DESCRIPTION = """\
Register this agent (a heartbeat: it shows as online in `relay peers` for 90 s).
--description and --skill publish its peer card (v1.2), which replaces the
card published before; without them the published card is kept, and
--remove-card takes it down."""


def register_arguments(parser: argparse.ArgumentParser) -> None:
    """The peer card."""
    card_arguments(parser, "what this agent does, for its peer card")
    parser.add_argument(
        "--remove-card", action="store_true", help="take down the published peer card"
    )


async def register(ctx: Context) -> int:
    """POST /register: register this agent, or heartbeat it; publish its card."""
    args = ctx.args
    card: Any = KEEP_CARD
    if args.remove_card:
        if args.description is not None or args.skills:
            raise UsageError("--remove-card takes no --description or --skill")
        card = None
    elif args.description is not None or args.skills:
        card = card_of(args.description, args.skills) or {}
    answer = await ctx.client.register(card=card)

    def readable() -> None:
        line = f"registered {answer.get('agent', ctx.client.agent)}"
        if card is None:
            line += " (card removed)"
        elif card is not KEEP_CARD:
            line += " with its card"
        ctx.console.line(line)

    ctx.console.emit(answer, readable)
    return 0


def peers_arguments(parser: argparse.ArgumentParser) -> None:
    """Whether to list the agents of past ``selfcheck`` runs too."""
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list the throwaway agents of past `relay selfcheck` runs",
    )


async def peers(ctx: Context) -> int:
    """GET /peers: a table of the registered agents, when each was last seen, and the
    skills and description of their peer cards.

    The protocol cannot remove an agent, so the throwaway agents of
    ``selfcheck`` stay registered (offline after 90 s): the readable table
    leaves them out unless ``--all``. ``--json`` is the broker's answer as is.
    """
    console = ctx.console
    answer = await ctx.client.all_peers()
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
            cards = any(isinstance(peer.get("card"), dict) for peer in shown)
            headers = ["AGENT", "ONLINE", "LAST SEEN"]
            if cards:
                headers += ["SKILLS", "DESCRIPTION"]
            rows = []
            for peer in shown:
                row = [
                    peer.get("agent"),
                    "yes" if peer.get("online") else "no",
                    console.age(peer.get("lastSeen")),
                ]
                if cards:
                    card = peer.get("card") if isinstance(peer.get("card"), dict) else {}
                    skills = card.get("skills") if isinstance(card.get("skills"), list) else []
                    row.append(", ".join(str(skill) for skill in skills))
                    row.append(" ".join(str(card.get("description") or "").split()))
                rows.append(row)
            for line in table(rows, headers):
                console.line(line)
        if hidden:
            console.line(f"({hidden} selfcheck agents not shown; `relay peers --all` lists them)")
        # REACH §13: the operator's teams, addressed as group:NAME and role:NAME
        for key in ("groups", "roles"):
            teams = [t for t in answer.get(key) or [] if isinstance(t, dict)]
            if teams:
                console.line()
                rows = [[f"{key[:-1]}:{t.get('name')}",
                         ", ".join(str(m) for m in t.get("members") or [])] for t in teams]
                for line in table(rows, [key[:-1].upper(), "MEMBERS"]):
                    console.line(line)

    console.emit(answer, readable)
    return 0
