"""The ``--exec`` handler of ``twistd relay-agent``: a shell command run per request.

The command reads the request on its standard input and writes the reply on its
standard output; a non-zero exit, a signal or running out of time fails the
request (:class:`ExecFailed`, whose message names the command and what happened;
the last lines of its standard error go to the agent's log only).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Optional, Sequence, Tuple

from twisted.internet import defer, error, protocol
from twisted.python.failure import Failure

from relay.agent.runtime import Message

EXEC_TIMEOUT_SECONDS = 300.0
# What the log shows of a failed --exec command's standard error: its last lines.
EXEC_ERROR_LINES = 5
EXEC_ERROR_LINE_CHARS = 300
EXEC_ERROR_BYTES = 4096


class ExecFailed(Exception):
    """The command exited non-zero, was killed, or ran out of time.

    Its message names the command and what happened to it (this is the error the
    broker keeps); :attr:`error_output` holds the last lines the command wrote
    on its standard error, for the agent's log only.
    """

    def __init__(self, what: str, error_output: Sequence[str] = ()) -> None:
        super().__init__(what)
        self.error_output = tuple(error_output)


class _Collect(protocol.ProcessProtocol):
    def __init__(self, command: str, stdin: bytes, done: defer.Deferred) -> None:
        self.command = command
        self.stdin = stdin
        self.done = done
        self.stdout = bytearray()
        self.stderr = bytearray()  # its tail only

    def connectionMade(self) -> None:
        self.transport.write(self.stdin)
        self.transport.closeStdin()

    def outReceived(self, data: bytes) -> None:
        self.stdout.extend(data)

    def errReceived(self, data: bytes) -> None:
        """Keep the tail of standard error: the command's own words when it fails."""
        self.stderr.extend(data)
        if len(self.stderr) > 2 * EXEC_ERROR_BYTES:
            del self.stderr[:-EXEC_ERROR_BYTES]

    def failed(self, what: str) -> ExecFailed:
        """An :class:`ExecFailed` naming the command, with its last error lines."""
        return ExecFailed(f"command {_shown_command(self.command)} {what}",
                          error_tail(bytes(self.stderr)))

    def processEnded(self, reason: Failure) -> None:
        if self.done.called:
            return
        if reason.check(error.ProcessDone):
            self.done.callback(bytes(self.stdout))
        elif reason.check(error.ProcessTerminated):
            value = reason.value
            if value.exitCode is not None:
                self.done.errback(self.failed(f"exited with status {value.exitCode}"))
            else:
                self.done.errback(self.failed(f"was killed by signal {value.signal}"))
        else:
            self.done.errback(reason)


def _shown_command(command: str) -> str:
    """The command as errors name it: in backquotes, one line, at most 120 characters."""
    flat = " ".join(command.split())
    return f"`{flat if len(flat) <= 120 else flat[:119] + '…'}`"


def error_tail(stderr: bytes) -> Tuple[str, ...]:
    """The last :data:`EXEC_ERROR_LINES` non-blank lines of a command's error output,
    each at most :data:`EXEC_ERROR_LINE_CHARS` characters, control characters escaped."""
    text = stderr[-EXEC_ERROR_BYTES:].decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    shown = []
    for line in lines[-EXEC_ERROR_LINES:]:
        line = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in line)
        if len(line) > EXEC_ERROR_LINE_CHARS:
            line = line[: EXEC_ERROR_LINE_CHARS - 1] + "…"
        shown.append(line)
    return tuple(shown)


def exec_input(message: Message) -> bytes:
    """What an ``--exec`` command reads: the body's ``text``, else the JSON body."""
    body = message.get("body")
    if isinstance(body, dict) and isinstance(body.get("text"), str):
        return body["text"].encode("utf-8")
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


class ExecHandler:
    """A handler that runs a shell command per request.

    The command reads the request (see :func:`exec_input`) on stdin and writes
    the reply text on stdout (one trailing newline is dropped). A non-zero
    exit or exceeding ``timeout`` fails the request (``retry``). The
    environment adds ``RELAY_MESSAGE_ID``, ``RELAY_FROM``, ``RELAY_KIND`` and
    ``RELAY_ROOT_ID``.
    """

    def __init__(
        self,
        command: str,
        *,
        reactor: Any,
        timeout: float = EXEC_TIMEOUT_SECONDS,
        env: Optional[Dict[str, str]] = None,
    ) -> None:
        self.command = command
        self.timeout = timeout
        self._reactor = reactor
        self._env = dict(os.environ if env is None else env)

    def __call__(self, message: Message) -> defer.Deferred:
        done: defer.Deferred = defer.Deferred()
        env = dict(self._env)
        env.update(
            {
                "RELAY_MESSAGE_ID": str(message.get("id", "")),
                "RELAY_FROM": str(message.get("from", "")),
                "RELAY_KIND": str(message.get("kind") or "message"),
                "RELAY_ROOT_ID": str(message.get("rootId") or message.get("id", "")),
            }
        )
        collector = _Collect(self.command, exec_input(message), done)
        process = self._reactor.spawnProcess(
            collector, "/bin/sh", ["/bin/sh", "-c", self.command], env=env
        )

        def expire() -> None:
            if done.called:
                return
            with contextlib.suppress(error.ProcessExitedAlready):
                process.signalProcess("KILL")
            done.errback(collector.failed(f"timed out after {self.timeout:g}s"))

        timer = self._reactor.callLater(self.timeout, expire)

        def stop_timer(result: Any) -> Any:
            if timer.active():
                timer.cancel()
            return result

        done.addBoth(stop_timer)
        done.addCallback(_reply_text)
        return done


def _reply_text(stdout: bytes) -> str:
    text = stdout.decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\n") else text
