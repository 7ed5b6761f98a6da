#!/usr/bin/env python3
"""Run the README's quick start, as written, in a fresh clone of this checkout's HEAD.

Every command of the ``sh`` blocks of README.md's "Quick start" section runs
in order in ``bash`` from the clone's root, as a newcomer would type it:

- ``make run`` and ``twistd -n ...`` do not return: each starts in the
  background, as in its own terminal, and the next command waits until it is
  ready (the broker answers ``GET /`` on 127.0.0.1:19121; the agent has
  registered);
- ``make test`` is skipped: ``.ci/run`` runs it itself, on its own clean clone;
- ``. FILE`` and ``export`` lines hold for the commands after them (the
  user's environment); ``cd`` holds within its block (its terminal).

It then checks what the commands printed, that no message is left queued or
leased (the quick start completes what it sends), that ``git status`` shows nothing
the commands left behind (``.gitignore`` covers it), and stops every process
it started. The broker listens on the README's port, 19121: a lock file
keeps two runs on one machine apart, and a port already taken stops the run
with that reason. Exit status 0 when everything passed.

Usage: python3 .ci/quickstart.py [--keep]   (--keep leaves the clone in place)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
PORT = 19121
OPS_PORT = 19122  # conf/relay.yaml's ops listener
LOCK = Path(tempfile.gettempdir()) / f"dsh-agent-relay-quickstart-{PORT}.lock"
INSTALL_SECONDS = 900.0  # `make run` creates the venv and installs everything first
READY_SECONDS = 60.0
COMMAND_SECONDS = 120.0
# What the quick start's commands must print (a fragment of their standard output).
EXPECTED = {
    "pull --done": "hello",
    'ask worker "what is 2 + 2?"': "you said: what is 2 + 2?",
}


def quick_start_blocks(readme: str) -> List[List[str]]:
    """The command lines of each ``sh`` block in the "Quick start" section."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    commands = []
    for block in blocks:
        lines = []
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                lines.append(line)
        commands.append(lines)
    return commands


class Run:
    """One quick-start run in ``clone``: the background processes and the results."""

    def __init__(self, clone: Path) -> None:
        self.clone = clone
        self.background: List[Tuple[str, subprocess.Popen]] = []
        self.passed: List[str] = []
        self.failed: List[str] = []
        self.environment: List[str] = []
        self.logs = clone.parent / "logs"
        self.logs.mkdir()

    def script(self, directory: List[str], line: str, background: bool = False) -> str:
        steps = ["set -euo pipefail", f"cd {shlex.quote(str(self.clone))}"]
        steps += self.environment + directory
        steps.append(f"exec {line}" if background else line)
        return "\n".join(steps)

    def start(self, directory: List[str], line: str) -> None:
        log = open(self.logs / f"{len(self.background)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            ["bash", "-c", self.script(directory, line, background=True)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.background.append((line, process))
        if line.startswith("make run"):
            self.wait(line, process, INSTALL_SECONDS, broker_answers)
        else:
            agent = re.search(r"--agent\s+(\S+)", line)
            name = agent.group(1) if agent else ""
            self.wait(line, process, READY_SECONDS, lambda: self.registered(name))

    def wait(self, line: str, process: subprocess.Popen, seconds: float, ready) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.fail(line, f"exited with status {process.returncode}")
                return
            if ready():
                self.ok(line)
                return
            time.sleep(0.2)
        self.fail(line, f"not ready after {seconds:g} s")

    def registered(self, agent: str) -> bool:
        relay = self.clone / ".venv" / "bin" / "relay"
        done = subprocess.run(
            [str(relay), "--agent", "quickstart-probe", "--secret-file", "conf/relay.secret",
             "--retries", "0", "peers", "--json"],
            cwd=self.clone, capture_output=True, text=True, timeout=COMMAND_SECONDS,
        )
        if done.returncode != 0:
            return False
        peers = json.loads(done.stdout).get("peers", [])
        return any(p.get("agent") == agent and p.get("online") for p in peers)

    def run(self, directory: List[str], line: str) -> None:
        try:
            done = subprocess.run(
                ["bash", "-c", self.script(directory, line)],
                capture_output=True, text=True, timeout=COMMAND_SECONDS,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            self.fail(line, f"did not finish in {COMMAND_SECONDS:g} s")
            return
        if done.returncode != 0:
            self.fail(line, f"exit status {done.returncode}: {done.stderr.strip()}")
            return
        for ending, fragment in EXPECTED.items():
            if line.endswith(ending) and fragment not in done.stdout:
                self.fail(line, f"printed {done.stdout!r}, not {fragment!r}")
                return
        self.ok(line)

    def ok(self, line: str) -> None:
        print(f"ok    {line}", flush=True)
        self.passed.append(line)

    def fail(self, line: str, why: str) -> None:
        print(f"FAIL  {line}: {why}", flush=True)
        self.failed.append(line)

    def stop(self) -> None:
        for _, process in reversed(self.background):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(30)

    def show_logs(self) -> None:
        for log in sorted(self.logs.iterdir()):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")


def broker_answers() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=1) as answer:
            return json.loads(answer.read()).get("protocol") == "1.0"
    except (OSError, ValueError):
        return False


def pending_messages() -> Dict[str, int]:
    """Messages still queued or leased, per agent, from the shipped ops listener."""
    with urllib.request.urlopen(f"http://127.0.0.1:{OPS_PORT}/api/overview", timeout=10) as answer:
        overview = json.loads(answer.read())
    return {row["agent"]: row["queued"] + row["leased"] for row in overview["agents"]
            if row["queued"] + row["leased"]}


def port_taken() -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", PORT)) == 0


def main(argv: List[str]) -> int:
    keep = "--keep" in argv
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if port_taken():
            print(f"quickstart: 127.0.0.1:{PORT} is already in use; the README's broker "
                  "needs it (stop the broker running there)", file=sys.stderr)
            return 1
        work = Path(tempfile.mkdtemp(prefix="dsh-agent-relay-quickstart-"))
        clone = work / "dsh-agent-relay"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        print(f"quickstart: README.md of {git_head()} in {clone}", flush=True)
        run = Run(clone)
        try:
            for block in quick_start_blocks((clone / "README.md").read_text()):
                directory: List[str] = []
                for line in block:
                    if run.failed:
                        break
                    if line == "make test":
                        print(f"skip  {line} (.ci/run runs it on its own clean clone)")
                    elif line.startswith(". ") or line.startswith("export "):
                        run.environment.append(line)
                    elif line.startswith("cd "):
                        directory.append(line)
                    elif line.startswith("make run") or line.split()[:2] == ["twistd", "-n"]:
                        run.start(directory, line)
                    else:
                        run.run(directory, line)
            if not run.failed:
                pending = pending_messages()
                if pending:
                    run.fail("the queues", f"the quick start left messages pending: {pending}")
                else:
                    run.ok("the queues (nothing left queued or leased)")
            leftovers = untracked(clone)
            if leftovers:
                run.fail("git status", f"files not covered by .gitignore: {leftovers}")
            elif not run.failed:
                run.ok("git status (nothing left behind)")
        finally:
            run.stop()
            if run.failed:
                run.show_logs()
            if not keep:
                subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"quickstart: {len(run.passed)} passed, {len(run.failed)} failed")
    return 1 if run.failed else 0


def git_head() -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()


def untracked(clone: Path) -> Optional[Dict[str, str]]:
    status = subprocess.run(
        ["git", "-C", str(clone), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True, text=True, check=True,
    ).stdout
    return {line[3:]: line[:2] for line in status.splitlines()} or None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
