"""Run the real ``twistd -n relay`` process for end-to-end tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from relay.wire.signing import sign

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BrokerProcess:
    """A broker subprocess on a free loopback port with a temp config (``broker`` keys,
    and other top-level ``sections``: agents, roles, ...)."""

    def __init__(self, directory: str, secret: str = "e2e-secret-0123456789",
                 agents: Optional[Dict[str, Any]] = None,
                 sections: Optional[Dict[str, Any]] = None, **broker: Any) -> None:
        """``agents`` is the config's ``agents`` section; :meth:`request` signs as
        each of them with its own ``secret`` (the shared one for an agent without);
        ``sections`` are other top-level sections (roles, groups, ...)."""
        self.directory = directory
        self.secret = secret
        self.secrets: Dict[str, str] = {name: entry["secret"]
                                        for name, entry in (agents or {}).items()
                                        if entry.get("secret")}
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
        config: Dict[str, Any] = dict(sections or {}, broker=values)
        if agents is not None:
            config["agents"] = agents
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
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
            "X-Relay-Signature": sign(self.secrets.get(agent, self.secret), method, path, ts,
                                      raw),
            "Content-Type": "application/json",
        }
        req = urllib.request.Request(self.url + path, data=raw or None, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


class EventReader:
    """An open ``GET /v1/events`` stream of a broker process, read in a thread: each
    SSE record (``{"id", "event", "data"}``) or ``"keepalive"`` in arrival order."""

    def __init__(self, broker: BrokerProcess, agent: str, since: Optional[str] = None,
                 last_event_id: Optional[str] = None) -> None:
        path = "/v1/events" + (f"?since={since}" if since is not None else "")
        ts = int(time.time())
        headers = {"X-Relay-Agent": agent, "X-Relay-Timestamp": str(ts),
                   "X-Relay-Signature": sign(broker.secret, "GET", path, ts, b"")}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self.conn = http.client.HTTPConnection("127.0.0.1", broker.port, timeout=30)
        self.conn.request("GET", path, headers=headers)
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.items: queue.Queue[Any] = queue.Queue()
        if self.status == 200:
            threading.Thread(target=self._read, daemon=True).start()
        else:
            self.error = json.loads(self.response.read())

    def _read(self) -> None:
        block: List[str] = []
        try:
            while True:
                line = self.response.readline()
                if not line:
                    break
                text = line.decode("utf-8").rstrip("\n")
                if text:
                    block.append(text)
                    continue
                if block == [": keepalive"]:
                    self.items.put("keepalive")
                elif block:
                    fields = dict(item.split(": ", 1) for item in block)
                    self.items.put({"id": fields["id"], "event": fields["event"],
                                    "data": json.loads(fields["data"])})
                block = []
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            # AttributeError: the connection was closed under the reader
            pass
        self.items.put(None)  # closed

    def next(self, timeout: float = 10.0, keepalives: bool = False) -> Any:
        """The next record (None once the stream closed); keepalives skipped unless asked."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.items.get(timeout=max(0.0, deadline - time.monotonic()))
            if item != "keepalive" or keepalives:
                return item

    def take(self, count: int, timeout: float = 10.0) -> List[Dict[str, Any]]:
        return [self.next(timeout) for _ in range(count)]

    def close(self) -> None:
        # Shut the socket down first: the reader thread's readline holds the buffer's
        # lock until data arrives, which close() would wait for (the next keepalive).
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
