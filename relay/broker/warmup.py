"""A short self-exercise of the request path before the broker listens.

A JIT (PyPy) compiles the code that runs often; a freshly started PyPy broker
serves its first tens of seconds slower than CPython until it has. Serving a few
thousand signed requests to a scratch broker at start moves that cost before the
first client arrives. The scratch broker has its own store (the configured
backend in a temporary directory, or memory for a backend that lives outside
this process), a throwaway secret and a clock of its own; requests go through the
same site, channel, router, authenticator and broker classes as real ones, over
an in-memory transport. Nothing of it touches the real store, the listeners or
the counters, and nothing remains of it afterwards.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from twisted.internet.task import Clock
from twisted.logger import Logger

from relay.broker.loopback import MemoryTransport, connect, disconnect
from relay.rules.config import Config, parse_config
from relay.wire.signing import sign

log = Logger(namespace="relay.warmup")

# Backends whose scratch copy can live in a temporary directory of this process.
LOCAL_BACKENDS = frozenset({"memory", "sqlite", "jsonl"})
PYPY_DEFAULT_SECONDS = 6.0
# PyPy compiles a loop after 1039 iterations and a function after 1619 calls by
# default; a request runs hundreds of distinct functions, so a fresh broker served
# ~600 req/s after 4 s of warm-up where a warm one serves ~3,600. With lower
# thresholds the same warm-up reaches the warm rate in about 6 s (bench/README.md).
PYPY_JIT_PARAMS = "threshold=100,function_threshold=150,trace_eagerness=20"


def default_seconds() -> float:
    """How long to exercise when the config does not say: ``RELAY_WARMUP_SECONDS``
    when set (the test suite sets 0), else a few seconds under a JIT and nothing
    under CPython (which has nothing to compile)."""
    override = os.environ.get("RELAY_WARMUP_SECONDS")
    if override:
        try:
            return max(0.0, min(60.0, float(override)))
        except ValueError:
            log.warn("RELAY_WARMUP_SECONDS is not a number; ignored")
    return PYPY_DEFAULT_SECONDS if platform.python_implementation() == "PyPy" else 0.0


class _Scratch:
    """A throwaway broker (built by :func:`relay.broker.assembly.assemble`, without
    listeners), fed raw HTTP over in-memory connections of its own site."""

    def __init__(self, config: Config, clock: Clock) -> None:
        from relay.broker.assembly import assemble
        from relay.store.plugins import open_configured_store

        self.config = config
        self.clock = clock
        self.store = open_configured_store(config, clock)
        self.site = assemble(config, self.store, clock, listen=False).site
        # Two connections: a long poll waits on one while a send on the other wakes it.
        self.connections: List[Tuple[Any, MemoryTransport]] = [connect(self.site),
                                                               connect(self.site)]

    def start(self, method: str, path: str, agent: str, value: Any = None,
              connection: int = 0) -> None:
        """Send one signed request on connection ``connection``."""
        body = b"" if value is None else json.dumps(value).encode("utf-8")
        now = int(self.clock.seconds())
        signature = sign(self.config.secret, method, path, now, body)
        self.connections[connection][0].dataReceived(
            b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"X-Relay-Agent: %s\r\nX-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (method.encode(), path.encode(), agent.encode(), now, signature.encode(),
               len(body), body))
        self.clock.advance(0)

    def answer(self, connection: int = 0) -> Any:
        """The decoded JSON answer waiting on ``connection`` (None when empty)."""
        raw = self.connections[connection][1].take()
        head, _, payload = raw.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 2"):
            raise RuntimeError("warm-up request refused: " + head.split(b"\r\n", 1)[0].decode(
                "latin-1"))
        return json.loads(payload) if payload else None

    def request(self, method: str, path: str, agent: str, value: Any = None) -> Any:
        """Send one signed request; the decoded JSON answer (None when it had none)."""
        self.start(method, path, agent, value)
        return self.answer()

    def send(self) -> None:
        self.request("POST", "/messages", "alpha",
                     {"id": str(uuid.uuid4()), "to": "beta", "kind": "request",
                      "body": {"text": "warm-up " + "x" * 100}})

    def ack(self, messages: List[Dict[str, Any]]) -> None:
        for message in messages:
            self.request("POST", "/v1/ack", "beta",
                         {"messageId": message["id"], "leaseId": message["leaseId"],
                          "outcome": "completed"})

    def round(self) -> int:
        """One round of what agents do most: send, poll, pull and ack, a long poll
        woken by a send, register, list peers."""
        for _ in range(10):
            self.send()
        self.request("GET", "/messages?limit=5", "beta")
        pulled = self.request("POST", "/v1/pull", "beta", {"agent": "beta", "limit": 10})
        self.ack(pulled["messages"])
        self.start("POST", "/v1/pull", "beta", {"agent": "beta", "limit": 10, "waitSeconds": 5},
                   connection=1)
        self.send()
        woken = self.answer(connection=1)
        self.ack(woken["messages"])
        self.request("POST", "/register", "beta", {"agent": "beta"})
        self.request("GET", "/peers", "alpha")
        return 16 + len(pulled["messages"]) + len(woken["messages"])

    def close(self) -> None:
        for protocol, _ in self.connections:
            disconnect(protocol)
        self.store.close()


def exercise(config: Config, seconds: float,
             timer: Callable[[], float] = time.monotonic) -> int:
    """Serve the request path of ``config``'s backend to a scratch broker for about
    ``seconds``; returns how many requests were served (0 when ``seconds`` is 0)."""
    if seconds <= 0:
        return 0
    scratch_dir = tempfile.mkdtemp(prefix="relay-warmup-")
    storage = config.storage_backend if config.storage_backend in LOCAL_BACKENDS else "memory"
    scratch_config = parse_config({"broker": {
        "secret": secrets.token_hex(32),
        "storage": storage,
        "dataDir": os.path.join(scratch_dir, "data"),
        "rateLimitLoopback": 2**31 - 1,
        "inboxMaxMessages": 0,
        "minFreeDiskMB": 0,
        "sync": "off",
    }}, scratch_dir)
    clock = Clock()
    clock.advance(time.time())
    scratch: Optional[_Scratch] = None
    served = 0
    try:
        scratch = _Scratch(scratch_config, clock)
        scratch.store.register("alpha", clock.seconds())
        scratch.store.register("beta", clock.seconds())
        clock.advance(0)
        deadline = timer() + seconds
        while timer() < deadline:
            served += scratch.round()
            clock.advance(0.001)
    finally:
        if scratch is not None:
            scratch.close()
        shutil.rmtree(scratch_dir, ignore_errors=True)
    return served


def tune_jit() -> bool:
    """Under PyPy, compile hot code sooner (:data:`PYPY_JIT_PARAMS`); True when set."""
    try:
        import pypyjit  # type: ignore[import-not-found]
    except ImportError:
        return False
    pypyjit.set_param(PYPY_JIT_PARAMS)
    return True


def warm_up(config: Config, seconds: Optional[float]) -> int:
    """Exercise the request path before listening (``seconds`` None: the default of
    this interpreter); logs how long it took. A failure is logged and ignored: the
    broker serves, only less warm. Returns how many requests were served."""
    tune_jit()
    wanted = default_seconds() if seconds is None else seconds
    if wanted <= 0:
        return 0
    started = time.monotonic()
    try:
        served = exercise(config, wanted)
    except Exception as error:  # the broker must start whatever the warm-up met
        log.warn("warm-up skipped: {kind}: {error}", kind=type(error).__name__, error=error)
        return 0
    log.info("warmed up the request path: {count} requests in {seconds:.1f} s",
             count=served, seconds=time.monotonic() - started)
    return served
