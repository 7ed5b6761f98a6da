"""What a ``relay`` subcommand is: its table entry, what it runs with, its argument types."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, TextIO

from twisted.internet.interfaces import IReactorTime

from relay.cli.output import Console
from relay.client.client import RETRY_DELAYS_SECONDS, RelayClient
from relay.client.settings import Settings


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """A command that takes only the global flags."""


def card_arguments(parser: argparse.ArgumentParser, description_help: str) -> None:
    """``--description`` and ``--skill``: the peer card a command registers with."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--description", metavar="TEXT", help=description_help)
    parser.add_argument(
        "--skill",
        dest="skills",
        action="append",
        default=[],
        metavar="NAME",
        help="a skill for its peer card (repeat for more)",
    )


@dataclass(frozen=True)
class Command:
    """One subcommand: an entry of :data:`relay.cli.commands.COMMANDS`.

    :param name: what is typed after ``relay``.
    :param help: one line, for ``relay --help`` and the command's own help.
    :param run: does the work; returns the exit status. Broker and network
        failures are raised as ``RelayError`` (exit status 1), usage problems
        as ``UsageError`` (exit status 2).
    :param arguments: adds the command's own arguments to its parser.
    :param needs_agent: refuse to run without an agent name.
    :param needs_secret: refuse to run without a secret.
    :param description: the command's own ``--help`` text, when one line is not enough.
    """

    name: str
    help: str
    run: Callable[[Context], Awaitable[int]]
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    needs_agent: bool = True
    needs_secret: bool = True
    description: str = ""


@dataclass
class Context:
    """What a command runs with."""

    args: argparse.Namespace
    settings: Settings
    console: Console
    home: Path
    clock: IReactorTime
    new_client: Callable[[str], RelayClient]
    stdin: TextIO
    # The parser that read this command line (``relay completion`` prints its script).
    parser: argparse.ArgumentParser
    env: Mapping[str, str] = field(default_factory=dict)
    # an HTTP client replacing the default (tests pass relay.broker.loopback.MemoryHTTP)
    http: Any = None

    @cached_property
    def client(self) -> RelayClient:
        """The client of the configured agent, made on first use."""
        return self.new_client(self.settings.agent or "")


# -- argument types ----------------------------------------------------------------


def _whole_number(value: str, least: int) -> int:
    """``value`` as a whole number of at least ``least``, or the argparse error."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}: {value}")
    return number


def positive_int(value: str) -> int:
    """An argparse type: a whole number of at least 1."""
    return _whole_number(value, 1)


def non_negative_int(value: str) -> int:
    """An argparse type: a whole number of at least 0."""
    return _whole_number(value, 0)


def port_number(value: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    number = positive_int(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535: {value}")
    return number


def positive_float(value: str) -> float:
    """An argparse type: a number above 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return number


def retries(value: str) -> int:
    """An argparse type: how many of the client's retry delays to use."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not 0 <= number <= len(RETRY_DELAYS_SECONDS):
        raise argparse.ArgumentTypeError(f"must be 0 to {len(RETRY_DELAYS_SECONDS)}: {value}")
    return number
