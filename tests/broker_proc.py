"""Run the real ``twistd -n relay`` process for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, Optional, Tuple

import yaml

from relay.signing import sign

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BrokerProcess:
    """A broker subprocess on a free loopback port with a temp config."""

    def __init__(self, directory: str, secret: str = "e2e-secret-0123456789",
                 **broker: Any) -> None:
        self.directory = directory
        self.secret = secret
        self.port = free_port()
        self.config_path = os.path.join(directory, "relay.yaml")
        values: Dict[str, Any] = {
            "listen": [f"tcp:{self.port}:interface=127.0.0.1"],
            "secret": secret,
            "storage": "memory",
            "dataDir": os.path.join(directory, "data"),
            "rateLimitLoopback": 1_000_000,
        }
        values.update(broker)
        with open(self.config_path, "w") as f:
            yaml.safe_dump({"broker": values}, f)
        self.log_path = os.path.join(directory, "broker.log")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, preexec_fn: Optional[Callable[[], None]] = None) -> subprocess.Popen:
        """Start the process (``preexec_fn`` runs in the child first: a umask, limits)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [TWISTD, "-n", "--pidfile=", "relay", "--config", self.config_path],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
                preexec_fn=preexec_fn,
            )
        return self.proc

    def exit_status(self, timeout: float = 20.0) -> Tuple[int, str]:
        """Start a broker that must stop by itself: its exit status and its output."""
        proc = self.spawn()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the broker kept running: {self.log()}") from None
        return code, self.log()

    def start(self, timeout: float = 20.0,
              preexec_fn: Optional[Callable[[], None]] = None) -> BrokerProcess:
        self.spawn(preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"broker did not start: {self.log()}")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def request(self, agent: str, method: str, path: str, body: Any = None,
                timeout: float = 10.0) -> Tuple[int, Any]:
        raw = b"" if body is None else json.dumps(body).encode("utf-8")
        ts = int(time.time())
        headers = {
            "X-Relay-Agent": agent,
            "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(self.secret, method, path, ts, raw),
            "Content-Type": "application/json",
        }
        req = urllib.request.Request(self.url + path, data=raw or None, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")
