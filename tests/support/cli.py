"""The ``relay`` command run by the tests: in process with its output kept
(:func:`run_cli`, :class:`Terminal` on the in-memory broker), or as a process
(:func:`python_relay`).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from twisted.internet import defer

from relay.cli import run
from relay.testing import SECRET
from tests.support import REPO
from tests.support.client import Net, result_of


class Outcome:
    """What a command run by :func:`run_cli` returned and printed."""

    def __init__(self, status: int, out: str, err: str) -> None:
        self.status = status
        self.out = out
        self.err = err

    def json(self) -> Any:
        return json.loads(self.out)


async def run_cli(
    argv: List[str],
    home: Path,
    env: Optional[Mapping[str, str]] = None,
    http: Any = None,
) -> Outcome:
    from twisted.internet import reactor

    out, err = io.StringIO(), io.StringIO()
    status = await run(reactor, argv, env=env or {}, home=home, out=out, err=err, http=http)
    return Outcome(status, out.getvalue(), err.getvalue())


def in_process(argv: List[str], home: Path, **kwargs: Any) -> defer.Deferred:
    return defer.Deferred.fromCoroutine(run_cli(argv, home, **kwargs))


def python_relay(
    argv: List[str], home: Path, env: Optional[Dict[str, str]] = None, timeout: float = 60
) -> Tuple[int, str, str]:
    """Run ``python -m relay.cli`` as a separate process."""
    full_env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "PYTHONPATH": str(REPO),
    }
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-m", "relay.cli", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=str(home),
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr


class Done:
    """What a command run on a :class:`Terminal` returned and printed."""

    def __init__(self, status: int, out: str, err: str) -> None:
        self.status = status
        self.out = out
        self.err = err

    def json(self) -> Any:
        return json.loads(self.out)

    def __repr__(self) -> str:
        return f"<Done {self.status} out={self.out!r} err={self.err!r}>"


class Terminal(Net):
    """``relay`` command lines as several agents on one in-memory broker."""

    def __init__(self, home: Path, **broker: Any) -> None:
        super().__init__(**broker)
        self.home = home

    def begin(self, agent: str, *argv: str, stdin: str = "") -> defer.Deferred:
        out, err = io.StringIO(), io.StringIO()
        flags = ["--broker", "http://127.0.0.1:19121", "--secret", SECRET, "--agent", agent]
        d = defer.Deferred.fromCoroutine(
            run(self.clock, [*argv, *flags], env={}, home=self.home, out=out, err=err,
                http=self.http, stdin=io.StringIO(stdin), interactive=False)
        )
        d.addCallback(lambda status: Done(status, out.getvalue(), err.getvalue()))
        self.settle()
        return d

    def __call__(self, agent: str, *argv: str, stdin: str = "") -> Done:
        return result_of(self.begin(agent, *argv, stdin=stdin))
