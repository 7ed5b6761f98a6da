"""The ``relay`` command line: global flags, one subparser per table entry, settings.

The global flags (connection settings, ``--retries``, ``--json``) are accepted
before and after the subcommand; given twice, the later one wins.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, NoReturn, Optional, Sequence, Tuple

import shtab

from relay import __version__
from relay.cli.command import Command, retries
from relay.cli.commands import COMMANDS
from relay.client.client import RETRY_DELAYS_SECONDS
from relay.client.settings import (
    DEFAULT_BROKER_URL,
    ENV_AGENT,
    ENV_BROKER,
    ENV_CA_FILE,
    ENV_CLIENT_CERT,
    ENV_CLIENT_KEY,
    ENV_SECRET,
    ENV_SECRET_FILE,
    FLAG_KEYS,
    SETTINGS_FILE,
    Settings,
    UsageError,
    resolve_settings,
)
from relay.wire.protocol import PROTOCOL_VERSION

PROG = "relay"
DESCRIPTION = "Talk to a dsh-agent-relay broker (wire protocol 1.0)."
EPILOG = (
    f"Settings come from the flags, then the {ENV_BROKER}, {ENV_AGENT}, {ENV_SECRET}, ... "
    f"variables, then ~/{SETTINGS_FILE}. Exit status: 0 success, 1 broker or network error, "
    "2 usage error. `relay COMMAND --help` describes a command."
)


class Exit(Exception):
    """argparse finished the command line itself (``--help``): exit with :attr:`status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of ending the process or printing.

    A usage problem is a :class:`UsageError` holding the usage line and an
    ``error:`` line; ``--help`` and ``--version`` are an :class:`Exit`
    carrying the text to print.
    """

    _printed = ""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)", self.format_usage().strip())

    def _print_message(self, message: str, file: Any = None) -> None:
        self._printed += message

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        raise Exit(status, self._printed + (message or ""))


def _global_flags() -> argparse.ArgumentParser:
    # SUPPRESS: a flag not given after the subcommand must not reset one given before it.
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = common.add_argument_group("connection and output")
    group.add_argument(
        "--broker",
        "--url",
        metavar="URL",
        help=f"broker URL (or {ENV_BROKER}; default {DEFAULT_BROKER_URL})",
    )
    group.add_argument("--agent", metavar="NAME", help=f"this agent's name (or {ENV_AGENT})")
    group.add_argument(
        "--secret", metavar="SECRET", help=f"the HMAC secret (or {ENV_SECRET}; prefer a file)"
    )
    group.add_argument(
        "--secret-file",
        metavar="PATH",
        help=f"a file holding the HMAC secret, e.g. conf/relay.secret (or {ENV_SECRET_FILE})",
    )
    group.add_argument(
        "--ca-file",
        metavar="PATH",
        help=f"PEM CA bundle to trust for https (or {ENV_CA_FILE}; default: the system store)",
    )
    group.add_argument(
        "--client-cert",
        metavar="PATH",
        help="PEM client certificate for https brokers that ask for one; may hold the key "
        f"(or {ENV_CLIENT_CERT})",
    )
    group.add_argument(
        "--client-key",
        metavar="PATH",
        help=f"PEM private key of --client-cert (or {ENV_CLIENT_KEY})",
    )
    group.add_argument(
        "--retries",
        type=retries,
        metavar="N",
        help="retries of a transient failure, 0-3 (default 3: after 2, 4 and 8 s)",
    )
    group.add_argument(
        "--json", action="store_true", help="print JSON documents instead of readable text"
    )
    complete_paths(common)
    return common


def complete_paths(parser: argparse.ArgumentParser) -> None:
    """Make the shell complete file names for every option whose metavar is ``PATH``."""
    for action in parser._actions:
        if action.metavar == "PATH":
            action.complete = shtab.FILE  # type: ignore[attr-defined]


def build_parser(
    commands: Sequence[Command],
) -> Tuple[argparse.ArgumentParser, Dict[str, argparse.ArgumentParser]]:
    """The ``relay`` parser and, by command name, each subcommand's parser.

    A parsed command line has the chosen :class:`Command` as ``command``.
    """
    common = _global_flags()
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, parents=[common])
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {__version__} (wire protocol {PROTOCOL_VERSION})",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(
        title="commands", metavar="COMMAND", required=True, parser_class=_Parser
    )
    parsers: Dict[str, argparse.ArgumentParser] = {}
    for command in commands:
        subparser = sub.add_parser(
            command.name,
            help=command.help,
            description=command.description or command.help,
            parents=[common],
        )
        command.arguments(subparser)
        complete_paths(subparser)
        subparser.set_defaults(command=command)
        parsers[command.name] = subparser
    return parser, parsers


@dataclass(frozen=True)
class Invocation:
    """A parsed command line with its resolved settings and the parser that read it."""

    command: Command
    args: argparse.Namespace
    settings: Settings
    json: bool
    retries: int
    parser: argparse.ArgumentParser


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
            f"no secret: pass --secret-file PATH (the broker's conf/relay.secret) or --secret, "
            f"or set {ENV_SECRET_FILE} or {ENV_SECRET}"
        )
    return Invocation(
        command,
        args,
        settings,
        json=bool(getattr(args, "json", False)),
        retries=getattr(args, "retries", len(RETRY_DELAYS_SECONDS)),
        parser=parser,
    )
