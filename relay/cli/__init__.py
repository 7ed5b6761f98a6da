"""The ``relay`` command: talk to a dsh-agent-relay broker from a shell.

Connection settings come from flags (before or after the subcommand), then
the environment, then ``~/.dsh-relay.json`` (see :mod:`relay.client.settings`).
The subcommands are the entries of :data:`relay.cli.commands.COMMANDS`.

Exit status: 0 on success, 1 on a broker or network error, 2 on a usage error,
130 when stopped by Ctrl-C.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import signal
import sys
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, TextIO, Tuple

from twisted.internet import defer

from relay.cli.command import Context
from relay.cli.output import Console, printable
from relay.cli.parser import Exit, parse
from relay.cli.state import STATE_FILE, BrokerMemory
from relay.client.client import RETRY_DELAYS_SECONDS, RelayClient
from relay.client.settings import UsageError
from relay.wire.errors import RelayError

__all__ = ["main", "run"]

# The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells use.
INTERRUPTED = 130


async def run(
    reactor: Any,
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    home: Optional[Path] = None,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
    http: Any = None,
    stdin: Optional[TextIO] = None,
    interactive: Optional[bool] = None,
) -> int:
    """Run one ``relay`` command line on ``reactor``; the exit status.

    ``env``, ``home``, ``out``, ``err`` and ``stdin`` default to the process's
    own; ``http`` replaces the HTTP client (tests pass :class:`relay.broker.loopback.MemoryHTTP`).
    ``interactive`` (default: whether ``err`` is a terminal) prints a line on
    ``err`` before each retry.
    """
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    stdin = sys.stdin if stdin is None else stdin
    if interactive is None:
        interactive = bool(getattr(err, "isatty", lambda: False)())
    try:
        inv = parse(argv, env, home)
    except UsageError as error:
        err.write(printable_lines(error.lines()))
        return 2
    except Exit as done:
        (out if done.status == 0 else err).write(done.message)
        return done.status
    console = Console(out, err, inv.json, reactor.seconds)
    settings = inv.settings

    def retrying(error: RelayError, delay: float, retry: int, retries: int) -> None:
        console.warn(f"retrying in {delay:g} s ({retry}/{retries}): {error.code}: {error.message}")

    def new_client(agent: str) -> RelayClient:
        memory = BrokerMemory(home / STATE_FILE, settings.broker_url, agent)
        now = reactor.seconds()
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
            retry_refused_loopback=False,
            on_retry=retrying if interactive else None,
            info=memory.info(now),
            registered_at=memory.registered_at(now),
        )

    ctx = Context(inv.args, settings, console, home, reactor, new_client, stdin, inv.parser,
                  env, http)
    try:
        try:
            return await inv.command.run(ctx)
        finally:
            _remember(ctx, home)
    except UsageError as error:
        err.write(printable_lines(error.lines()))
        return 2
    except RelayError as failure:
        error = await _with_suggestion(ctx, failure)
        if inv.json:
            console.document({"error": {"status": error.status, **error.to_body()["error"]}})
        console.warn(f"error: {error.code}: {error.message}")
        return 1
    except BrokenPipeError:
        # The reader went away (`relay recv | head -1`): nothing more to say.
        _discard(out)
        return 1


async def _with_suggestion(ctx: Context, error: RelayError) -> RelayError:
    """``error``, with "did you mean NAME?" when it names an agent that never
    registered and a registered agent's name is close to it."""
    target = getattr(ctx.args, "target", None)
    if error.code != "no_such_agent" or not isinstance(target, str):
        return error
    try:
        answer = await ctx.client.peers()
    except RelayError:
        return error
    peers = answer.get("peers") if isinstance(answer, dict) else None
    names = [str(p.get("agent")) for p in peers or [] if isinstance(p, dict)]
    close = difflib.get_close_matches(target, names, n=1, cutoff=0.6)
    if not close:
        return error
    return RelayError(error.status, error.code, f"{error.message}; did you mean {close[0]}?")


def _remember(ctx: Context, home: Path) -> None:
    """Keep what the command's client learnt (the handshake, a registration) for the
    next run, so that a script of commands does not repeat them (:class:`BrokerMemory`)."""
    client = ctx.__dict__.get("client")  # only when the command made one
    if client is None:
        return
    with contextlib.suppress(OSError):  # a read-only home: the next run asks again
        BrokerMemory(home / STATE_FILE, client.broker_url, client.agent).save(
            ctx.clock.seconds(), client.info, client.registered_at)


def _discard(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null, so that flushing it at exit is quiet."""
    try:
        fileno = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def printable_lines(text: str) -> str:
    """``text`` (lines ending in newlines) with control characters escaped in each line."""
    return "".join(printable(line) + "\n" for line in text.splitlines())


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``relay`` console script.

    Ctrl-C (SIGINT) stops the command at once, its requests and retries
    included, and exits with status 130, as a shell expects of an interrupted
    command; a second Ctrl-C ends the process without waiting.
    """
    from twisted.internet.task import react

    arguments: Tuple[str, ...] = tuple(sys.argv[1:] if argv is None else argv)

    def start(reactor: Any) -> defer.Deferred:
        command = defer.Deferred.fromCoroutine(run(reactor, arguments))
        interrupted: List[bool] = []

        def interrupt(signum: int, frame: Any) -> None:
            interrupted.append(True)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            reactor.callFromThread(command.cancel)

        # In place of the reactor's own handler (installed when it starts), which
        # stops the reactor: that closes the connections, and the command took
        # the closed ones for a failing broker and retried them.
        reactor.callWhenRunning(signal.signal, signal.SIGINT, interrupt)

        def finish(status: int) -> None:
            if interrupted:
                raise SystemExit(INTERRUPTED)
            if status:
                raise SystemExit(status)

        def cancelled(failure: Any) -> None:
            failure.trap(defer.CancelledError)
            raise SystemExit(INTERRUPTED)

        return command.addCallbacks(finish, cancelled)

    react(start)
