"""The ``relay`` command: talk to a dsh-agent-relay broker from a shell.

Connection settings come from flags (before or after the subcommand), then
the environment, then ``~/.dsh-relay.json`` (see :mod:`relay.settings`).
The subcommands are the entries of :data:`relay.cli.commands.COMMANDS`.

Exit status: 0 on success, 1 on a broker or network error, 2 on a usage error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TextIO, Tuple

from twisted.internet import defer

from relay.cli.command import Context
from relay.cli.output import Console
from relay.cli.parser import Exit, parse
from relay.client import RETRY_DELAYS_SECONDS, RelayClient
from relay.errors import RelayError
from relay.settings import UsageError

__all__ = ["main", "run"]


async def run(
    reactor: Any,
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    home: Optional[Path] = None,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
    http: Any = None,
) -> int:
    """Run one ``relay`` command line on ``reactor``; the exit status.

    ``env``, ``home``, ``out`` and ``err`` default to the process's own;
    ``http`` replaces the HTTP client (tests pass ``StubTreq``).
    """
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        inv = parse(argv, env, home)
    except UsageError as error:
        err.write(f"{error}\n")
        return 2
    except Exit as done:
        (out if done.status == 0 else err).write(done.message)
        return done.status
    console = Console(out, err, inv.json)
    settings = inv.settings

    def new_client(agent: str) -> RelayClient:
        return RelayClient(
            settings.broker_url,
            agent,
            settings.secret or "",
            clock=reactor,
            reactor=reactor,
            http=http,
            ca_file=settings.ca_file,
            client_cert=settings.client_cert,
            client_key=settings.client_key,
            retry_delays=RETRY_DELAYS_SECONDS[: inv.retries],
        )

    ctx = Context(inv.args, settings, console, home, reactor, new_client, env, http)
    try:
        return await inv.command.run(ctx)
    except UsageError as error:
        err.write(f"{error}\n")
        return 2
    except RelayError as error:
        if inv.json:
            console.document({"error": {"status": error.status, **error.to_body()["error"]}})
        err.write(f"error: {error.code}: {error.message}\n")
        return 1


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``relay`` console script."""
    from twisted.internet.task import react

    arguments: Tuple[str, ...] = tuple(sys.argv[1:] if argv is None else argv)

    def start(reactor: Any) -> defer.Deferred:
        def finish(status: int) -> None:
            if status:
                raise SystemExit(status)

        return defer.Deferred.fromCoroutine(run(reactor, arguments)).addCallback(finish)

    react(start)
