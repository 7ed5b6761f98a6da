"""The ``relay`` command line: global flags, one subparser per table entry, settings.

The global flags (connection settings, ``--retries``, ``--json``) are accepted
before and after the subcommand; given twice, the later one wins.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, NoReturn, Optional, Sequence, Tuple

from relay.cli.command import Command, retries
from relay.cli.commands import COMMANDS
from relay.client import RETRY_DELAYS_SECONDS
from relay.settings import (
    DEFAULT_BROKER_URL,
    ENV_AGENT,
    ENV_SECRET,
    FLAG_KEYS,
    Settings,
    UsageError,
    resolve_settings,
)

PROG = "relay"
DESCRIPTION = "Talk to a dsh-agent-relay broker (wire protocol 1.0)."


class Exit(Exception):
    """argparse finished the command line itself (``--help``): exit with :attr:`status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of ending the process.

    A usage problem is a :class:`UsageError` holding the usage line and the
    error, as argparse would print them; ``--help`` is an :class:`Exit`.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.format_usage().strip()}\n{self.prog}: error: {message}")

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        raise Exit(status, message or "")


def _global_flags() -> argparse.ArgumentParser:
    # SUPPRESS: a flag not given after the subcommand must not reset one given before it.
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = common.add_argument_group("connection and output")
    group.add_argument("--broker", metavar="URL", help=f"broker URL (default {DEFAULT_BROKER_URL})")
    group.add_argument("--agent", metavar="NAME", help="this agent's name")
    group.add_argument("--secret", metavar="SECRET", help="the HMAC secret")
    group.add_argument("--secret-file", metavar="PATH", help="a file holding the HMAC secret")
    group.add_argument(
        "--ca-file", metavar="PATH", help="PEM CA bundle to trust for https (default: system)"
    )
    group.add_argument(
        "--client-cert",
        metavar="PATH",
        help="PEM client certificate for https brokers that ask for one (may hold the key)",
    )
    group.add_argument("--client-key", metavar="PATH", help="PEM private key of --client-cert")
    group.add_argument(
        "--retries",
        type=retries,
        metavar="N",
        help="retries of a transient failure, 0-3 (default 3: after 2, 4 and 8 s)",
    )
    group.add_argument("--json", action="store_true", help="print one JSON document")
    return common


def build_parser(
    commands: Sequence[Command],
) -> Tuple[argparse.ArgumentParser, Dict[str, argparse.ArgumentParser]]:
    """The ``relay`` parser and, by command name, each subcommand's parser.

    A parsed command line has the chosen :class:`Command` as ``command``.
    """
    common = _global_flags()
    parser = _Parser(prog=PROG, description=DESCRIPTION, parents=[common])
    sub = parser.add_subparsers(metavar="COMMAND", required=True, parser_class=_Parser)
    parsers: Dict[str, argparse.ArgumentParser] = {}
    for command in commands:
        subparser = sub.add_parser(
            command.name, help=command.help, description=command.help, parents=[common]
        )
        command.arguments(subparser)
        subparser.set_defaults(command=command)
        parsers[command.name] = subparser
    return parser, parsers


@dataclass(frozen=True)
class Invocation:
    """A parsed command line with its resolved settings."""

    command: Command
    args: argparse.Namespace
    settings: Settings
    json: bool
    retries: int


def parse(argv: Sequence[str], env: Mapping[str, str], home: Path) -> Invocation:
    """Parse ``argv``; :class:`UsageError` on a usage problem."""
    parser, parsers = build_parser(COMMANDS)
    args = parser.parse_args(list(argv))
    command: Command = args.command
    flags: Dict[str, Any] = {key: getattr(args, key, None) for key in FLAG_KEYS}
    settings = resolve_settings(flags, env, home)
    if command.needs_agent and not settings.agent:
        parsers[command.name].error(f"no agent name: pass --agent NAME or set {ENV_AGENT}")
    if command.needs_secret and not settings.secret:
        parsers[command.name].error(
            f"no secret: pass --secret, --secret-file, or set {ENV_SECRET} (see `relay init`)"
        )
    return Invocation(
        command,
        args,
        settings,
        json=bool(getattr(args, "json", False)),
        retries=getattr(args, "retries", len(RETRY_DELAYS_SECONDS)),
    )
