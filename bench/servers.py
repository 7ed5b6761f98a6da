"""Start, watch and stop the processes a benchmark measures: the broker and the ceilings.

The broker is started exactly as an operator would: ``twistd -n relay --config FILE``,
with a temporary config (loopback, a free port, a random secret, a temporary
``dataDir`` and a loopback rate limit high enough not to interfere). Its resident set
size is read from ``/proc/<pid>/status`` (``VmHWM`` is the kernel's peak; a sampling
thread also keeps the largest ``VmRSS`` seen).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

from loadgen import TWISTD, Conn, Target

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)


REFERENCE_ENTRY = os.path.join("broker", "src", "index.js")


class StartError(Exception):
    """A server did not come up; the message carries the end of its log."""


def server_env() -> Dict[str, str]:
    """The environment of a started server: PyPy gets the nursery ``make run-pypy`` uses
    (see the Makefile), unless ``PYPY_GC_NURSERY`` is already set."""
    env = dict(os.environ)
    env.setdefault("PYPY_GC_NURSERY", "4MB")
    return env


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_status(pid: int) -> Dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of a process in MB (empty if it is gone)."""
    out: Dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (0.0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """One child process with its log file, readiness check and RSS sampler."""

    def __init__(self, name: str, argv: List[str], url: str, workdir: str,
                 secret: str = "") -> None:
        self.name = name
        self.argv = argv
        self.url = url
        self.workdir = workdir
        self.secret = secret
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.peak_rss = 0.0
        self._stop_sampler = threading.Event()
        self._sampler: Optional[threading.Thread] = None

    @property
    def target(self) -> Target:
        """The load generator's view of this server."""
        return Target(self.url, self.secret or "ceiling")

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> Server:
        """Spawn the process and wait until ``GET /`` answers (any status below 500)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO_DIR, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=server_env())
        deadline = time.monotonic() + timeout
        target = Target(self.url, "x")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartError(f"{self.name} exited with {self.proc.returncode}:\n"
                                 + self.log_tail())
            try:
                conn = Conn(target, timeout=2.0)
                status, _ = conn.request("GET", "/")
                conn.close()
                if status < 500:
                    self._sampler = threading.Thread(target=self._sample, daemon=True)
                    self._sampler.start()
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise StartError(f"{self.name} did not answer GET / within {timeout:.0f}s:\n"
                         + self.log_tail())

    def _sample(self) -> None:
        while not self._stop_sampler.wait(0.2):
            rss = read_status(self.pid).get("VmRSS")
            if rss is None:
                return
            self.peak_rss = max(self.peak_rss, rss)

    def rss(self) -> Dict[str, Any]:
        """Current RSS, the kernel's peak (VmHWM) and the sampled peak, in MB."""
        status = read_status(self.pid)
        cur = status.get("VmRSS", 0.0)
        self.peak_rss = max(self.peak_rss, cur)
        return {"rssMB": round(cur, 1), "peakMB": round(max(status.get("VmHWM", 0.0),
                                                            self.peak_rss), 1),
                "cpuSeconds": round(cpu_seconds(self.pid), 2)}

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the server's log (stdout, stderr and twistd log)."""
        text = ""
        for path in (self.log_path, os.path.join(self.workdir, "twistd.log")):
            try:
                with open(path, errors="replace") as fh:
                    text += "".join(fh.readlines()[-lines:])
            except OSError:
                continue
        return text

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        self._stop_sampler.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def broker(python: str, storage: str, workdir: str, extra: Optional[Dict[str, Any]] = None,
           profile: Optional[str] = None) -> Server:
    """A broker ``Server`` (not yet started) for ``storage`` in a fresh data dir.

    With ``profile``, twistd runs the reactor under cProfile and saves pstats there
    when the broker stops (``twistd --profile FILE --savestats``).
    """
    port = free_port()
    secret = secrets.token_hex(32)
    data_dir = tempfile.mkdtemp(prefix=f"data-{storage}-", dir=workdir)
    conf: Dict[str, Any] = {"broker": {
        "host": "127.0.0.1", "port": port, "secret": secret, "storage": storage,
        "dataDir": data_dir, "rateLimitLoopback": 100000000,
        # The prefilled queues hold more than an inbox may by default.
        "inboxMaxMessages": 0, "inboxMaxBytes": 0, **(extra or {}),
    }}
    run_dir = tempfile.mkdtemp(prefix=f"broker-{storage}-", dir=workdir)
    config = os.path.join(run_dir, "relay.yaml")
    with open(config, "w") as fh:
        json.dump(conf, fh, indent=2)  # JSON is valid YAML
    argv = [python, "-c", TWISTD, "-n", "--pidfile", os.path.join(run_dir, "twistd.pid"),
            "--logfile", os.path.join(run_dir, "twistd.log")]
    if profile:
        argv += ["--profile", profile, "--profiler", "cprofile", "--savestats"]
    argv += ["relay", "--config", config]
    return Server(f"broker-{storage}", argv, f"http://127.0.0.1:{port}", run_dir, secret)


def reference_dir_problem(path: str) -> str:
    """Why ``path`` is not a checkout of the reference broker ("" when it is one)."""
    if not os.path.isfile(os.path.join(path, REFERENCE_ENTRY)):
        return f"{path} has no {REFERENCE_ENTRY} (expected a checkout of the reference broker)"
    return ""


def reference_broker(node: str, checkout: str, workdir: str, storage: str = "jsonl") -> Server:
    """The reference broker (Node.js, same wire protocol) as a ``Server``, not yet started.

    ``node broker/src/index.js --config FILE`` from the checkout ``checkout``, with the
    settings :func:`broker` gives ours: loopback, a free port, a random secret, a fresh
    ``dataDir`` and the loopback rate limit out of the way (the reference has no inbox
    quotas or connection caps). Its config reader takes a YAML subset, not JSON, so the
    file is written as plain ``key: value`` lines.
    """
    port = free_port()
    secret = secrets.token_hex(32)
    data_dir = tempfile.mkdtemp(prefix="data-reference-", dir=workdir)
    run_dir = tempfile.mkdtemp(prefix="broker-reference-", dir=workdir)
    config = os.path.join(run_dir, "relay.yaml")
    settings = {"host": "127.0.0.1", "port": port, "secret": secret,
                "rateLimitLoopback": 100000000, "storage": storage, "persist": True,
                "dataDir": data_dir}
    with open(config, "w") as fh:
        fh.write("broker:\n")
        for key, value in settings.items():
            text = (str(value).lower() if isinstance(value, bool)
                    else str(value) if isinstance(value, int) else f'"{value}"')
            fh.write(f"  {key}: {text}\n")
    argv = [node, os.path.join(os.path.abspath(checkout), REFERENCE_ENTRY), "--config", config]
    return Server("broker-reference", argv, f"http://127.0.0.1:{port}", run_dir, secret)


def ceiling(python: str, kind: str, workdir: str) -> Server:
    """A ceiling ``Server`` (not yet started): bare twisted.web or bare Klein."""
    port = free_port()
    argv = [python, os.path.join(BENCH_DIR, "ceiling.py"), "--kind", kind, "--port", str(port)]
    return Server(f"ceiling-{kind}", argv, f"http://127.0.0.1:{port}", workdir)


def workspace() -> str:
    """A temporary directory for configs, data and logs (removed by :func:`cleanup`)."""
    return tempfile.mkdtemp(prefix="relay-bench-")


def cleanup(path: str) -> None:
    """Remove a workspace made by :func:`workspace`."""
    shutil.rmtree(path, ignore_errors=True)


def _cpu_times() -> List[int]:
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:]]


def busy_note(sample: float = 1.0) -> str:
    """A warning when other processes are using the CPU right now (figures will be noisy).

    Samples ``/proc/stat`` for ``sample`` seconds before anything is started.
    """
    try:
        before = _cpu_times()
        time.sleep(sample)
        after = _cpu_times()
    except (OSError, ValueError):
        return ""
    delta = [y - x for x, y in zip(before, after)]
    total = sum(delta)
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)
    busy_cores = (total - idle) / total * (os.cpu_count() or 1) if total else 0.0
    if busy_cores < 0.2:
        return ""
    return (f"warning: other processes were using {busy_cores:.1f} cores before the run; "
            "figures will be lower and noisier than on an idle machine")


def default_python() -> str:
    """The interpreter of the repo's venv if present, else the running one."""
    venv = os.path.join(REPO_DIR, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable
