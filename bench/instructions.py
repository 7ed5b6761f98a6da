"""Instructions per request of the broker's hot path, counted by callgrind.

Wall time on a shared machine moves by ten percent from run to run; the count of
instructions executed does not (it moves by about one percent: hash seeds and ids
are random). For each scenario and backend this runs ``bench/inproc.py`` twice
under ``valgrind --tool=callgrind``: once serving the requests, once with
``--baseline`` (the same requests prepared, none served), and prints the
difference per request. It counts user-space instructions only: the system calls
of SQLite's commits and of the sockets are not in it, so use it to compare two
versions of the code, and the suite for the figures themselves. Each pair of runs
takes about a minute (valgrind runs Python some fifty times slower).

    .venv/bin/python bench/instructions.py [--scenarios send,pull-ack]
        [--backends memory,sqlite] [--requests 1100]   (scenarios: send, send-stream,
        pull-ack, v2-send, v2-pull-ack)

``pull-ack`` counts per request (a pull of 10 and its 10 acks are 11 requests),
as ``bench/inproc.py`` does; on sqlite every request has its own commit.
``v2-send`` and ``v2-pull-ack`` are the same on the v2/v3 wire (a pull of 8 and
its 8 acks are 9 requests). ``send-stream`` is ``send`` while the recipient holds
its event stream open: the difference to ``send`` is what a ``message`` event
costs to read and write to its stream.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from typing import Optional, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
_COLLECTED = re.compile(r"Collected : (\d+)")


def instructions(python: str, scenario: str, backend: str, requests: int,
                 baseline: bool) -> int:
    """Instructions one ``bench/inproc.py`` run executes, as callgrind counts them."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python,
            os.path.join(BENCH_DIR, "inproc.py"), "--no-ceiling", "--scenario", scenario,
            "--backends", backend, "--requests", str(requests)]
    if baseline:
        argv.append("--baseline")
    run = subprocess.run(argv, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(BENCH_DIR))
    found = _COLLECTED.search(run.stderr)
    if found is None:
        raise SystemExit(f"callgrind reported no count:\n{run.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print instructions per request for each scenario and backend."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="send,pull-ack")
    parser.add_argument("--backends", default="memory,sqlite")
    parser.add_argument("--requests", type=int, default=1100)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    for scenario in [s for s in args.scenarios.split(",") if s]:
        batch = {"pull-ack": 11, "v2-pull-ack": 9}.get(scenario, 1)
        served = args.requests // batch * batch
        for backend in [b for b in args.backends.split(",") if b]:
            with_requests = instructions(args.python, scenario, backend, args.requests, False)
            without = instructions(args.python, scenario, backend, args.requests, True)
            per_request = (with_requests - without) / served
            print(f"{scenario:9s} {backend:8s} {per_request:10,.0f} instructions/request",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
