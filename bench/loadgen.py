"""Load generator for any dsh-agent-relay broker, speaking only the wire protocol.

It knows nothing about the broker beyond spec v1.0 (+ the v1.1 additive endpoints): it
signs every request per spec section 3 (HMAC-SHA256 over ``METHOD\\nPATH\\nTS\\nBODY``)
and drives the broker over real loopback sockets with keep-alive connections, one
connection per worker process, so the generator itself is not the bottleneck.

The HTTP client is a minimal HTTP/1.1 keep-alive client on raw sockets (the standard
library's ``http.client`` parses headers through the ``email`` package, which costs more
CPU per request than the brokers being measured on a two-core machine).

Scenarios (each prints one JSON line, then a readable table)::

    python bench/loadgen.py send        --url URL --secret S [-c 8] [-d 10]
    python bench/loadgen.py pull-ack    --url URL --secret S [-w 4] [--messages N]
    python bench/loadgen.py poll        --url URL --secret S [-w 2] [--limit 50]
    python bench/loadgen.py e2e-latency --url URL --secret S [--rate 200]
    python bench/loadgen.py lifecycle   --url URL --secret S [--senders 4] [-w 4]
    python bench/loadgen.py request-reply --url URL --secret S [--askers 1]
    python bench/loadgen.py many-agents --url URL --secret S [--agents 1000] [--holders 500]
    python bench/loadgen.py depth       --url URL --secret S [--levels 0,1000,10000]
    python bench/loadgen.py ceiling     --url URL            (same as send, any server)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from array import array
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:19121"
BODY_BYTES = 200
SOCKET_TIMEOUT = 60.0
# request-reply: a round trip without an answer by then counts as unanswered.
REQUEST_TIMEOUT_SECONDS = 30.0
# ``python -c TWISTD ...`` is ``twistd ...`` run by that interpreter.
TWISTD = "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()"

JsonDict = Dict[str, Any]


# --------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------


class HttpError(Exception):
    """The server closed the connection or answered something that is not HTTP/1.x."""


def sign(key: bytes, method: str, path: str, ts: str, body: bytes) -> str:
    """Hex HMAC-SHA256 of ``method\\npath\\nts\\nbody`` with the shared secret ``key``."""
    msg = f"{method}\n{path}\n{ts}\n".encode() + body
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def request_bytes(method: str, path: str, body: bytes, agent: Optional[str], key: bytes,
                  host_header: bytes) -> bytes:
    """One HTTP/1.1 request, signed per spec section 3 when ``agent`` is given."""
    head = [f"{method} {path} HTTP/1.1\r\nHost: ".encode(), host_header, b"\r\n"]
    if body or method in ("POST", "PUT"):
        head.append(
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        )
    if agent is not None:
        ts = str(int(time.time()))
        sig = sign(key, method, path, ts, body)
        head.append(
            f"X-Relay-Agent: {agent}\r\nX-Relay-Timestamp: {ts}\r\n"
            f"X-Relay-Signature: {sig}\r\n".encode()
        )
    head.append(b"\r\n")
    return b"".join(head) + body


def parse_head(raw: bytes) -> Tuple[int, int, bool, bool]:
    """``(status, content length or -1, chunked, close)`` of a response head (no CRLFCRLF)."""
    lines = raw.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1."):
        raise HttpError(f"not an HTTP response: {lines[0][:40]!r}")
    status = int(lines[0][9:12])
    length = -1
    chunked = False
    close = lines[0].startswith("HTTP/1.0")
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding":
            chunked = "chunked" in value.lower()
        elif name == "connection":
            close = value.strip().lower() == "close"
    return status, length, chunked, close


class Target:
    """Where the broker is and how to sign for it (picklable, passed to workers)."""

    def __init__(self, url: str, secret: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// loopback URLs are supported, got {url!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.secret = secret
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the load generator only drives loopback brokers, got {self.host}")

    def __repr__(self) -> str:
        return f"Target({self.url!r})"


class Conn:
    """One keep-alive HTTP/1.1 connection that signs requests for the relay (spec section 3)."""

    def __init__(self, target: Target, timeout: float = SOCKET_TIMEOUT) -> None:
        self.target = target
        self.timeout = timeout
        self.key = target.secret.encode("utf-8")
        self.host_header = f"{target.host}:{target.port}".encode("ascii")
        self.sock: Optional[socket.socket] = None
        self.buf = b""
        self.requests = 0

    def connect(self) -> None:
        """Open (or reopen) the TCP connection with Nagle disabled."""
        self.close()
        sock = socket.create_connection((self.target.host, self.target.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.buf = b""

    def close(self) -> None:
        """Close the connection if open."""
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def sign(self, method: str, path: str, ts: str, body: bytes) -> str:
        """Hex HMAC-SHA256 of ``method\\npath\\nts\\nbody`` with the shared secret."""
        return sign(self.key, method, path, ts, body)

    def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        agent: Optional[str] = None,
    ) -> Tuple[int, bytes]:
        """Send one request (signed when ``agent`` is given) and return (status, body).

        A request that fails because the server had closed an idle keep-alive connection
        is retried once on a fresh connection (message ids make sends idempotent).
        """
        data = request_bytes(method, path, body, agent, self.key, self.host_header)
        for attempt in (0, 1):
            if self.sock is None:
                self.connect()
            assert self.sock is not None
            try:
                self.sock.sendall(data)
                status, payload, close = self._read_response(method)
            except (ConnectionError, HttpError):
                self.close()
                if attempt:
                    raise
                continue
            self.requests += 1
            if close:
                self.close()
            return status, payload
        raise HttpError("unreachable")

    def _fill(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(262144)
        if not chunk:
            raise HttpError("connection closed by server")
        self.buf += chunk

    def _read_response(self, method: str) -> Tuple[int, bytes, bool]:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            self._fill()
        status, length, chunked, close = parse_head(self.buf[:end])
        self.buf = self.buf[end + 4 :]
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, b"", close
        if chunked:
            return status, self._read_chunked(), close
        if length >= 0:
            while len(self.buf) < length:
                self._fill()
            payload, self.buf = self.buf[:length], self.buf[length:]
            return status, payload, close
        # No length and not chunked: the body runs until the server closes.
        assert self.sock is not None
        while True:
            chunk = self.sock.recv(262144)
            if not chunk:
                break
            self.buf += chunk
        payload, self.buf = self.buf, b""
        return status, payload, True

    def _read_chunked(self) -> bytes:
        parts: List[bytes] = []
        while True:
            while True:
                nl = self.buf.find(b"\r\n")
                if nl >= 0:
                    break
                self._fill()
            size = int(self.buf[:nl].split(b";")[0], 16)
            self.buf = self.buf[nl + 2 :]
            if size == 0:
                # Trailers (normally none) end with an empty line.
                while True:
                    nl = self.buf.find(b"\r\n")
                    if nl < 0:
                        self._fill()
                        continue
                    line, self.buf = self.buf[:nl], self.buf[nl + 2 :]
                    if not line:
                        return b"".join(parts)
            while len(self.buf) < size + 2:
                self._fill()
            parts.append(self.buf[:size])
            self.buf = self.buf[size + 2 :]

    def call(self, method: str, path: str, obj: Any = None, agent: Optional[str] = None
             ) -> Tuple[int, Any]:
        """Like :meth:`request` with a JSON body and a JSON-decoded answer (or None)."""
        body = b"" if obj is None else json.dumps(obj, separators=(",", ":")).encode()
        status, payload = self.request(method, path, body, agent)
        try:
            decoded = json.loads(payload) if payload else None
        except ValueError:
            decoded = None
        return status, decoded


class AsyncConn:
    """:class:`Conn` on asyncio streams: one keep-alive connection among many in a process.

    Used where one process holds hundreds of connections (``many-agents``); the
    request bytes and the response parsing are the same as :class:`Conn`'s.
    """

    def __init__(self, target: Target, timeout: float = SOCKET_TIMEOUT) -> None:
        self.target = target
        self.timeout = timeout
        self.key = target.secret.encode("utf-8")
        self.host_header = f"{target.host}:{target.port}".encode("ascii")
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def connect(self) -> None:
        """Open (or reopen) the connection (asyncio sets TCP_NODELAY on TCP sockets)."""
        self.close()
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(self.target.host, self.target.port), self.timeout)

    def close(self) -> None:
        """Close the connection if open."""
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      agent: Optional[str] = None) -> Tuple[int, bytes]:
        """Send one request and return (status, body); retried once on a closed
        keep-alive connection, like :meth:`Conn.request`."""
        data = request_bytes(method, path, body, agent, self.key, self.host_header)
        for attempt in (0, 1):
            if self.writer is None:
                await self.connect()
            assert self.writer is not None
            try:
                self.writer.write(data)
                status, payload, close = await asyncio.wait_for(self._read(method),
                                                                self.timeout)
            except (ConnectionError, asyncio.IncompleteReadError, HttpError):
                self.close()
                if attempt:
                    raise
                continue
            if close:
                self.close()
            return status, payload
        raise HttpError("unreachable")

    async def _read(self, method: str) -> Tuple[int, bytes, bool]:
        assert self.reader is not None
        reader = self.reader
        head = await reader.readuntil(b"\r\n\r\n")
        status, length, chunked, close = parse_head(head[:-4])
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, b"", close
        if chunked:
            parts: List[bytes] = []
            while True:
                line = await reader.readuntil(b"\r\n")
                size = int(line[:-2].split(b";")[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass
                    return status, b"".join(parts), close
                parts.append((await reader.readexactly(size + 2))[:-2])
        if length >= 0:
            return status, await reader.readexactly(length), close
        return status, await reader.read(), True


# --------------------------------------------------------------------------------------
# Protocol helpers
# --------------------------------------------------------------------------------------


def handshake(target: Target) -> JsonDict:
    """``GET /`` (unauthenticated): protocol, capabilities and storage of the broker."""
    conn = Conn(target, timeout=5.0)
    try:
        status, doc = conn.call("GET", "/")
    finally:
        conn.close()
    if status != 200 or not isinstance(doc, dict):
        raise HttpError(f"GET / answered {status}")
    return doc


def long_poll_max(info: JsonDict) -> int:
    """Maximum ``waitSeconds`` the broker advertises in ``capabilities.longPoll`` (0: none)."""
    caps = info.get("capabilities")
    if not isinstance(caps, dict):
        return 0
    value = caps.get("longPoll")
    if value is True:
        return 20
    if isinstance(value, dict):
        for key in ("maxWaitSeconds", "maxWait", "max"):
            if isinstance(value.get(key), (int, float)):
                return int(value[key])
        return 20
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return 0


def register(target: Target, agents: Sequence[str]) -> None:
    """``POST /register`` every agent used by a scenario, failing loudly on an error."""
    conn = Conn(target)
    try:
        for agent in agents:
            status, doc = conn.call("POST", "/register", {"agent": agent}, agent)
            if status != 200:
                raise HttpError(f"POST /register for {agent} answered {status}: {doc}")
    finally:
        conn.close()


def make_body(to: str, pad: int = BODY_BYTES, extra: Optional[JsonDict] = None) -> JsonDict:
    """A shorthand envelope with a client-side UUID whose JSON is about ``pad`` bytes."""
    env: JsonDict = {"id": str(uuid.uuid4()), "to": to, "body": {"text": ""}}
    if extra:
        env["body"].update(extra)
    base = len(json.dumps(env, separators=(",", ":")))
    env["body"]["text"] = "x" * max(0, pad - base)
    return env


def run_id() -> str:
    """A short prefix that keeps agent names of separate runs apart."""
    return uuid.uuid4().hex[:6]


# --------------------------------------------------------------------------------------
# Worker plumbing
# --------------------------------------------------------------------------------------


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _worker_main(index: int, fn: Callable[..., JsonDict], args: Tuple[Any, ...],
                 queue: Any) -> None:
    try:
        result = fn(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent, never swallowed
        result = {"exception": traceback.format_exc()}
    queue.put((index, result))


def run_workers(fn: Callable[..., JsonDict], arg_list: Sequence[Tuple[Any, ...]],
                timeout: float) -> List[JsonDict]:
    """Run ``fn(*args)`` in one process per entry and collect their result dicts."""
    ctx = _context()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_main, args=(i, fn, args, queue), daemon=True)
        for i, args in enumerate(arg_list)
    ]
    for proc in procs:
        proc.start()
    results: List[Optional[JsonDict]] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers did not finish within {timeout:.0f}s")
            index, result = queue.get(timeout=left)
            results[index] = result
    finally:
        for proc in procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
    for result in results:
        if result and "exception" in result:
            raise RuntimeError("a load-generator worker failed:\n" + result["exception"])
    return [r for r in results if r is not None]


def _count(errors: Dict[str, int], key: Any) -> None:
    errors[str(key)] = errors.get(str(key), 0) + 1


def _merge_errors(results: Sequence[JsonDict]) -> Dict[str, int]:
    total: Dict[str, int] = {}
    for res in results:
        for key, n in res.get("errors", {}).items():
            total[key] = total.get(key, 0) + n
    return total


def percentiles(values: Sequence[float]) -> JsonDict:
    """p50/p90/p99/max/mean of seconds, returned in milliseconds (3 decimals)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    data = sorted(values)
    n = len(data)

    def pick(p: float) -> float:
        return round(data[min(n - 1, int(p * n))] * 1000.0, 3)

    return {
        "n": n,
        "p50": pick(0.50),
        "p90": pick(0.90),
        "p99": pick(0.99),
        "max": round(data[-1] * 1000.0, 3),
        "mean": round(sum(data) / n * 1000.0, 3),
    }


def _window(start_at: float, warmup: float, duration: float) -> Tuple[float, float]:
    return start_at + warmup, start_at + warmup + duration


class WindowProbe:
    """Samples a counter (e.g. the broker's CPU seconds) at the window's start and end.

    Runs in the parent on two timer threads while the workers run, so the ratio
    ``(end - start) / (window length)`` covers exactly the measured window.
    """

    def __init__(self, probe: Optional[Callable[[], float]], lo: float, hi: float) -> None:
        self.values: Dict[str, float] = {}
        self.lo, self.hi = lo, hi
        self.timers: List[threading.Timer] = []
        if probe is None:
            return
        for key, at in (("lo", lo), ("hi", hi)):
            timer = threading.Timer(max(0.0, at - time.time()), self._take, (probe, key))
            timer.daemon = True
            timer.start()
            self.timers.append(timer)

    def _take(self, probe: Callable[[], float], key: str) -> None:
        self.values[key] = probe()
        self.values[key + "At"] = time.time()

    def delta(self) -> Optional[float]:
        """Counter increase over the window (None without both samples)."""
        for timer in self.timers:
            timer.join(timeout=5)
        v = self.values
        if "lo" not in v or "hi" not in v:
            return None
        return v["hi"] - v["lo"]

    def us_per(self, count: int) -> Optional[float]:
        """Counter increase over the window per operation, in millionths (CPU seconds
        per request -> CPU microseconds per request); None without samples or ops."""
        d = self.delta()
        if d is None or count <= 0:
            return None
        return round(d / count * 1e6, 1)

    def busy(self) -> Optional[float]:
        """Counter increase per second of the window (None without both samples)."""
        for timer in self.timers:
            timer.join(timeout=5)
        v = self.values
        if "lo" not in v or "hi" not in v or v["hiAt"] <= v["loAt"]:
            return None
        return round((v["hi"] - v["lo"]) / (v["hiAt"] - v["loAt"]), 2)


def _start_time(lead: float = 0.6) -> float:
    return time.time() + lead


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------------------
# Workers (run in child processes)
# --------------------------------------------------------------------------------------


def _send_worker(target: Target, agent: str, to: Sequence[str], start_at: float,
                 end_at: float, count: int, pad: int, record: bool) -> JsonDict:
    """Closed-loop sender: POST /messages until ``end_at`` or ``count`` sends."""
    conn = Conn(target)
    conn.connect()
    done = array("d")
    lats = array("d")
    errors: Dict[str, int] = {}
    template = make_body(to[0], pad)
    text = template["body"]["text"]
    n = 0
    ok = 0
    _sleep_until(start_at)
    cpu0 = time.process_time()
    while (count <= 0 or n < count) and (end_at <= 0 or time.time() < end_at):
        env = {"id": str(uuid.uuid4()), "to": to[n % len(to)], "body": {"text": text}}
        body = json.dumps(env, separators=(",", ":")).encode()
        t0 = time.time()
        status, _ = conn.request("POST", "/messages", body, agent)
        t1 = time.time()
        n += 1
        if status in (200, 201):
            ok += 1
            if record:
                done.append(t1)
                lats.append(t1 - t0)
        else:
            _count(errors, status)
    cpu = time.process_time() - cpu0
    conn.close()
    return {"done": done, "lats": lats, "errors": errors, "sent": n, "ok": ok,
            "finished": time.time(), "cpu": cpu}


def _pull_ack_worker(target: Target, agent: str, start_at: float, end_at: float,
                     limit: int) -> JsonDict:
    """Pull batches of ``limit`` (POST /v1/pull) and ack each message completed."""
    conn = Conn(target)
    conn.connect()
    acked = array("d")
    errors: Dict[str, int] = {}
    pulls = 0
    empty_at = 0.0
    pull_body = json.dumps({"limit": limit}).encode()
    _sleep_until(start_at)
    while time.time() < end_at:
        status, payload = conn.request("POST", "/v1/pull", pull_body, agent)
        pulls += 1
        if status != 200:
            _count(errors, f"pull {status}")
            if status == 404:
                break
            continue
        messages = json.loads(payload).get("messages") or []
        if not messages:
            empty_at = time.time()
            break
        for msg in messages:
            ack = {"messageId": msg["id"], "leaseId": msg.get("leaseId"),
                   "outcome": "completed"}
            st, _ = conn.request("POST", "/v1/ack",
                                 json.dumps(ack, separators=(",", ":")).encode(), agent)
            if st == 200:
                acked.append(time.time())
            else:
                _count(errors, f"ack {st}")
    conn.close()
    return {"acked": acked, "pulls": pulls, "errors": errors, "empty_at": empty_at}


def _poll_worker(target: Target, agent: str, start_at: float, end_at: float,
                 limit: int) -> JsonDict:
    """v1.0 drain: GET /messages?since=<cursor>&limit=<n> until an empty page, repeated.

    Polling does not change a message's state, so after the empty page that ends a
    drain the worker starts over from no cursor; that keeps the measurement bounded in
    time with a modest prefill. Every request is recorded, empty pages included.
    """
    conn = Conn(target)
    conn.connect()
    pages = array("d")
    counts = array("l")
    errors: Dict[str, int] = {}
    cursor: Optional[str] = None
    drains = 0
    _sleep_until(start_at)
    while time.time() < end_at:
        path = f"/messages?limit={limit}" if cursor is None else \
            f"/messages?since={cursor}&limit={limit}"
        status, payload = conn.request("GET", path, b"", agent)
        if status != 200:
            _count(errors, status)
            continue
        doc = json.loads(payload)
        messages = doc.get("messages") or []
        pages.append(time.time())
        counts.append(len(messages))
        if messages:
            cursor = doc.get("cursor") or messages[-1]["id"]
        else:
            cursor = None
            drains += 1
    conn.close()
    return {"pages": pages, "counts": counts, "errors": errors, "drains": drains}


def _latency_sender(target: Target, agent: str, to: str, rate: float, start_at: float,
                    end_at: float, pad: int, total: Any) -> JsonDict:
    """Open-loop sender at a fixed rate; each body carries its send time."""
    conn = Conn(target)
    conn.connect()
    errors: Dict[str, int] = {}
    lats = array("d")
    interval = 1.0 / rate
    n = 0
    late = 0
    _sleep_until(start_at)
    try:
        while True:
            due = start_at + n * interval
            if due >= end_at:
                break
            now = time.time()
            if due > now:
                time.sleep(due - now)
            elif now - due > interval:
                late += 1
            env = make_body(to, pad, {"seq": n, "sentAt": 0.0})
            t0 = time.time()
            env["body"]["sentAt"] = t0
            status, _ = conn.request(
                "POST", "/messages", json.dumps(env, separators=(",", ":")).encode(), agent)
            lats.append(time.time() - t0)
            n += 1
            if status not in (200, 201):
                _count(errors, status)
    finally:
        with total.get_lock():
            total.value = n
        conn.close()
    return {"sent": n, "late": late, "errors": errors, "lats": lats}


def _latency_receiver(target: Target, agent: str, wait: int, interval: float,
                      start_at: float, deadline: float, total: Any,
                      use_pull: bool, send_end: float) -> JsonDict:
    """Receive with long-poll pulls (``wait`` > 0), interval pulls, or v1.0 polling.

    After the sender's schedule ends (``send_end``) long-polls wait at most one second,
    so the last, empty wait does not hold the scenario for the full ``wait``.
    """
    conn = Conn(target)
    conn.connect()
    errors: Dict[str, int] = {}
    seen: Dict[int, float] = {}
    duplicates = 0
    receives = 0
    acks = 0
    cursor: Optional[str] = None
    pull_doc: JsonDict = {"limit": 50}
    if wait > 0:
        pull_doc["waitSeconds"] = wait
    pull_body = json.dumps(pull_doc).encode()
    tail_body = json.dumps({**pull_doc, "waitSeconds": min(wait, 1)} if wait else pull_doc
                           ).encode()
    _sleep_until(start_at)
    while time.time() < deadline:
        with total.get_lock():
            expected = total.value
        if 0 <= expected <= len(seen):
            break
        if use_pull:
            body = pull_body if time.time() < send_end else tail_body
            status, payload = conn.request("POST", "/v1/pull", body, agent)
        else:
            path = "/messages?limit=200" + (f"&since={cursor}" if cursor else "")
            status, payload = conn.request("GET", path, b"", agent)
        now = time.time()
        receives += 1
        if status != 200:
            _count(errors, f"receive {status}")
            time.sleep(interval)
            continue
        doc = json.loads(payload)
        messages = doc.get("messages") or []
        for msg in messages:
            body = msg.get("body") or {}
            seq = body.get("seq")
            if not isinstance(seq, int):
                continue
            if seq in seen:
                duplicates += 1
            else:
                seen[seq] = now - float(body.get("sentAt", now))
        if use_pull:
            for msg in messages:
                ack = {"messageId": msg["id"], "leaseId": msg.get("leaseId"),
                       "outcome": "completed"}
                st, _ = conn.request(
                    "POST", "/v1/ack", json.dumps(ack, separators=(",", ":")).encode(), agent)
                acks += 1
                if st != 200:
                    _count(errors, f"ack {st}")
        elif messages:
            cursor = doc.get("cursor") or messages[-1]["id"]
        if wait <= 0:
            time.sleep(interval)
    conn.close()
    return {"latency": dict(seen), "duplicates": duplicates, "receives": receives,
            "acks": acks, "errors": errors}


def _asker(target: Target, agent: str, worker: str, by_parent: bool, wait: int,
           interval: float, start_at: float, lo: float, hi: float, pad: int) -> JsonDict:
    """Closed-loop asker: what ``relay ask`` does, one request at a time, until ``hi``.

    Each round trip sends a ``kind: "request"`` and waits for its answer: with
    long-poll pulls by parent and the ack of the answer (``pullFilter``), or with
    read-only queries every ``interval`` seconds (a v1.1 broker). Round trips that
    start in ``[lo, hi]`` are measured, from before the send to the end of the wait,
    with the requests they took.
    """
    conn = Conn(target)
    conn.connect()
    lats = array("d")
    errors: Dict[str, int] = {}
    rounds = requests = unanswered = 0
    _sleep_until(start_at)
    while time.time() < hi:
        env = make_body(worker, pad)
        env["kind"] = "request"
        request_id = env["id"]
        t0 = time.time()
        status, _ = conn.request("POST", "/messages",
                                 json.dumps(env, separators=(",", ":")).encode(), agent)
        sent = 1  # the requests of this round trip
        if status not in (200, 201):
            _count(errors, f"send {status}")
            continue
        answered = False
        deadline = t0 + REQUEST_TIMEOUT_SECONDS
        while not answered and time.time() < deadline:
            if by_parent:
                pull = {"limit": 1, "leaseSeconds": 60, "parentId": request_id}
                if wait:
                    pull["waitSeconds"] = wait
                status, doc = conn.call("POST", "/v1/pull", pull, agent)
                sent += 1
                messages = (doc or {}).get("messages") or [] if status == 200 else []
                for msg in messages:
                    ack = {"messageId": msg["id"], "leaseId": msg.get("leaseId"),
                           "outcome": "completed"}
                    st, _ = conn.call("POST", "/v1/ack", ack, agent)
                    sent += 1
                    if st != 200:
                        _count(errors, f"ack {st}")
                    answered = True
            else:
                query = {"kind": "reply", "from": worker, "limit": 200}
                status, doc = conn.call("POST", "/v1/messages/query", query, agent)
                sent += 1
                messages = (doc or {}).get("messages") or [] if status == 200 else []
                answered = any(m.get("parentId") == request_id for m in messages)
            if status != 200:
                _count(errors, f"wait {status}")
            if not answered and (not by_parent or not wait):
                time.sleep(interval)
        took = time.time() - t0
        if not answered:
            unanswered += 1
        elif lo <= t0 <= hi:
            lats.append(took)
            rounds += 1
            requests += sent
    conn.close()
    return {"lats": lats, "rounds": rounds, "requests": requests, "unanswered": unanswered,
            "errors": errors}


class WorkerAgent:
    """The relay's agent runtime (``twistd relay-agent``) answering as ``agent`` with
    ``bench/echo_handler.py``, started with ``python`` (an interpreter that has the
    relay installed)."""

    def __init__(self, target: Target, agent: str, python: str, concurrency: int) -> None:
        self.home = tempfile.mkdtemp(prefix="relay-bench-agent-")
        python = os.path.abspath(python) if os.sep in python else python  # runs in bench/
        self.log_path = os.path.join(self.home, "agent.log")
        env = dict(os.environ, HOME=self.home, DSH_RELAY_SECRET=target.secret)
        env.pop("DSH_RELAY_SECRET_FILE", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [python, "-c", TWISTD, "-n", "--pidfile=", "relay-agent",
                 "--agent", agent, "--broker", target.url, "--handler", "echo_handler:echo",
                 "--concurrency", str(concurrency), "--poll-interval", "0.05",
                 "--receipts-dir", self.home],
                cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )

    def wait_registered(self, target: Target, agent: str, timeout: float = 30.0) -> None:
        """Until ``GET /peers`` lists ``agent`` online; the agent log on failure."""
        conn = Conn(target)
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    break
                status, doc = conn.call("GET", "/peers", None, agent)
                peers = (doc or {}).get("peers") or [] if status == 200 else []
                if any(p.get("agent") == agent and p.get("online") for p in peers):
                    return
                time.sleep(0.1)
        finally:
            conn.close()
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            log = fh.read()[-3000:]
        self.stop()
        raise HttpError(f"the worker agent did not register:\n{log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.home, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Scenarios (run in the parent; each returns one JSON-able dict)
# --------------------------------------------------------------------------------------


def prefill(target: Target, to: Sequence[str], count: int, concurrency: int = 8,
            pad: int = BODY_BYTES, sender: str = "") -> JsonDict:
    """Store ``count`` messages for the agents ``to`` through POST /messages, concurrently.

    The recipients must be registered already; the senders are registered here.
    """
    if count <= 0:
        return {"count": 0, "seconds": 0.0, "rate": 0.0}
    concurrency = max(1, min(concurrency, count))
    senders = [f"{sender or 'fill-' + run_id()}-{i}" for i in range(concurrency)]
    register(target, senders)
    share = [count // concurrency + (1 if i < count % concurrency else 0)
             for i in range(concurrency)]
    t0 = time.time()
    results = run_workers(
        _send_worker,
        [(target, senders[i], list(to), 0.0, 0.0, share[i], pad, False)
         for i in range(concurrency)],
        timeout=max(120.0, count / 50.0),
    )
    seconds = time.time() - t0
    ok = sum(r["ok"] for r in results)
    errors = _merge_errors(results)
    if ok < count:
        raise RuntimeError(f"prefill stored {ok} of {count} messages; errors: {errors}")
    return {"count": ok, "seconds": round(seconds, 2), "rate": round(ok / seconds, 1)}


def scenario_send(target: Target, concurrency: int = 8, duration: float = 10.0,
                  warmup: float = 2.0, pad: int = BODY_BYTES, name: str = "send",
                  do_register: bool = True,
                  cpu: Optional[Callable[[], float]] = None) -> JsonDict:
    """``send``: C closed-loop senders POSTing ~200-byte messages to one sink agent."""
    prefix = run_id()
    senders = [f"send-{prefix}-{i}" for i in range(concurrency)]
    sink = f"sink-{prefix}"
    if do_register:
        register(target, [sink, *senders])
    start = _start_time()
    lo, hi = _window(start, warmup, duration)
    probe = WindowProbe(cpu, lo, hi)
    results = run_workers(
        _send_worker,
        [(target, s, [sink], start, hi, 0, pad, True) for s in senders],
        timeout=warmup + duration + 60,
    )
    lats: List[float] = []
    count = 0
    for res in results:
        for t, lat in zip(res["done"], res["lats"]):
            if lo <= t <= hi:
                count += 1
                lats.append(lat)
    return {
        "scenario": name, "url": target.url, "concurrency": concurrency,
        "seconds": duration, "requests": count, "rate": round(count / duration, 1),
        "unit": "req/s", "latencyMs": percentiles(lats), "errors": _merge_errors(results),
        "stored": sum(r["ok"] for r in results),
        "loadgenCpuUsPerRequest": round(
            sum(r["cpu"] for r in results) / max(sum(r["sent"] for r in results), 1) * 1e6, 1),
        "serverCpuBusy": probe.busy(),
        "serverCpuUsPerRequest": probe.us_per(count),
    }


def scenario_pull_ack(target: Target, workers: int = 4, duration: float = 10.0,
                      warmup: float = 1.0, messages: int = 30000, limit: int = 10,
                      fill_concurrency: int = 8,
                      cpu: Optional[Callable[[], float]] = None) -> JsonDict:
    """``pull-ack``: W workers of one agent lease batches of ``limit`` and ack each.

    The agent's queue is prefilled with ``messages`` first; the rate counts acks in the
    measurement window (cut short if the queue drains).
    """
    prefix = run_id()
    agent = f"work-{prefix}"
    register(target, [agent])
    fill = prefill(target, [agent], messages, fill_concurrency)
    start = _start_time()
    lo, hi = _window(start, warmup, duration)
    probe = WindowProbe(cpu, lo, hi)
    results = run_workers(
        _pull_ack_worker,
        [(target, agent, start, hi, limit) for _ in range(workers)],
        timeout=warmup + duration + 60,
    )
    empties = [r["empty_at"] for r in results if r["empty_at"]]
    drained = bool(empties)
    if drained:
        hi = min(hi, min(empties))
    span = max(hi - lo, 1e-9)
    count = sum(1 for r in results for t in r["acked"] if lo <= t <= hi)
    # The probe's window is the full one: after a drain the broker idles (no CPU).
    cpu_us = probe.us_per(sum(1 for r in results for t in r["acked"] if lo <= t <= probe.hi))
    total_acked = sum(len(r["acked"]) for r in results)
    pulls = sum(r["pulls"] for r in results)
    return {
        "scenario": "pull-ack", "url": target.url, "workers": workers, "batch": limit,
        "seconds": round(span, 2), "messages": count, "rate": round(count / span, 1),
        "unit": "msg/s", "drained": drained, "prefill": fill,
        "requestsPerMessage": round((pulls + total_acked) / max(total_acked, 1), 3),
        "serverCpuBusy": None if drained else probe.busy(),
        "serverCpuUsPerMessage": cpu_us,
        "errors": _merge_errors(results),
        "note": "window cut short: prefill more (--messages)" if span < 1.0 else "",
    }


def scenario_poll(target: Target, workers: int = 2, duration: float = 10.0,
                  warmup: float = 1.0, messages: int = 10000, limit: int = 50,
                  fill_concurrency: int = 8) -> JsonDict:
    """``poll``: W v1.0 clients, each draining its own prefilled inbox with GET /messages.

    Each worker drains its inbox page by page and starts over when it reaches the end
    (v1.0 polling leaves messages queued), so the rate is messages returned per second.
    """
    prefix = run_id()
    agents = [f"poll-{prefix}-{i}" for i in range(workers)]
    register(target, agents)
    fill = prefill(target, agents, messages, fill_concurrency)
    start = _start_time()
    lo, hi = _window(start, warmup, duration)
    results = run_workers(
        _poll_worker,
        [(target, a, start, hi, limit) for a in agents],
        timeout=warmup + duration + 60,
    )
    count = 0
    pages = 0
    for res in results:
        for t, n in zip(res["pages"], res["counts"]):
            if lo <= t <= hi:
                count += n
                pages += 1
    return {
        "scenario": "poll", "url": target.url, "workers": workers, "limit": limit,
        "seconds": duration, "messages": count, "requests": pages,
        "rate": round(count / duration, 1), "unit": "msg/s",
        "requestRate": round(pages / duration, 1),
        "drains": sum(r["drains"] for r in results), "prefill": fill,
        "errors": _merge_errors(results),
    }


def scenario_e2e(target: Target, rate: float = 200.0, duration: float = 10.0,
                 warmup: float = 1.0, poll_interval: float = 0.1,
                 force_interval: bool = False,
                 receive_target: Optional[Target] = None) -> JsonDict:
    """``e2e-latency``: one sender at ``rate`` msg/s, one receiver; delivery latency.

    With ``receive_target`` the receiver uses that broker (another broker on the
    same database) and the sender ``target``.

    The receiver long-polls ``POST /v1/pull`` with ``waitSeconds`` when ``GET /``
    advertises ``capabilities.longPoll``, otherwise it pulls every ``poll_interval``
    seconds (or polls ``GET /messages`` against a broker without ``/v1/pull``).
    """
    info = handshake(target)
    max_wait = 0 if force_interval else long_poll_max(info)
    wait = min(max_wait, 5)
    prefix = run_id()
    sender, receiver = f"lat-s-{prefix}", f"lat-r-{prefix}"
    register(target, [sender, receiver])
    conn = Conn(target)
    status, _ = conn.call("POST", "/v1/pull", {"limit": 1}, receiver)
    conn.close()
    use_pull = status != 404
    mode = "long-poll" if wait else ("interval-pull" if use_pull else "interval-poll")
    start = _start_time()
    end = start + warmup + duration
    ctx = _context()
    total = ctx.Value("l", -1)
    deadline = end + wait + 5.0
    sender_args = (target, sender, receiver, rate, start, end, BODY_BYTES, total)
    receiver_args = (receive_target or target, receiver, wait, poll_interval, start, deadline,
                     total, use_pull, end)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_main, args=(0, _latency_sender, sender_args, queue)),
        ctx.Process(target=_worker_main, args=(1, _latency_receiver, receiver_args, queue)),
    ]
    for proc in procs:
        proc.start()
    results: Dict[int, JsonDict] = {}
    try:
        for _ in procs:
            index, res = queue.get(timeout=deadline - time.time() + 30)
            if "exception" in res:
                raise RuntimeError("e2e worker failed:\n" + res["exception"])
            results[index] = res
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
    sent, recv = results[0], results[1]
    first_measured = int(warmup * rate)
    lats = [lat for seq, lat in recv["latency"].items() if seq >= first_measured]
    delivered = len(recv["latency"])
    return {
        "scenario": "e2e-latency", "url": target.url, "mode": mode, "waitSeconds": wait,
        "pollInterval": None if wait else poll_interval, "rate": rate, "seconds": duration,
        "sent": sent["sent"], "delivered": delivered, "lost": sent["sent"] - delivered,
        "duplicates": recv["duplicates"], "senderLate": sent["late"],
        "latencyMs": percentiles(lats),
        "sendLatencyMs": percentiles(list(sent["lats"])),
        "requestsPerMessage": round(recv["receives"] / max(delivered, 1), 3),
        "requestsPerMessageWithAcks": round(
            (recv["receives"] + recv["acks"]) / max(delivered, 1), 3),
        "errors": {**sent["errors"], **recv["errors"]},
    }


def scenario_request_reply(target: Target, askers: int = 1, duration: float = 10.0,
                           warmup: float = 1.0, worker_python: str = sys.executable,
                           worker_concurrency: int = 4, poll_interval: float = 0.05,
                           force_interval: bool = False) -> JsonDict:
    """``request-reply``: the round trip of ``relay ask`` through the broker.

    A worker agent (the relay's agent runtime with an echo handler, see
    :class:`WorkerAgent`) serves; ``askers`` closed-loop askers each send a
    request and wait for its answer as ``RelayClient.request`` does (see
    :func:`_asker`). Reports the round-trip latency and the round trips per second.
    """
    info = handshake(target)
    caps = info.get("capabilities") if isinstance(info.get("capabilities"), dict) else {}
    by_parent = bool(caps.get("pullFilter"))
    wait = 0 if force_interval else min(long_poll_max(info), 20)
    if not by_parent:
        wait = 0
    mode = ("pull-by-parent, long-poll" if wait else "pull-by-parent, interval"
            ) if by_parent else "query-poll (v1.1)"
    prefix = run_id()
    worker = f"rr-w-{prefix}"
    names = [f"rr-a-{prefix}-{i}" for i in range(askers)]
    register(target, names)
    agent = WorkerAgent(target, worker, worker_python, worker_concurrency)
    try:
        agent.wait_registered(target, worker)
        start = _start_time()
        lo, hi = _window(start, warmup, duration)
        results = run_workers(
            _asker,
            [(target, name, worker, by_parent, wait, poll_interval, start, lo, hi, BODY_BYTES)
             for name in names],
            timeout=warmup + duration + REQUEST_TIMEOUT_SECONDS + 60,
        )
    finally:
        agent.stop()
    lats = [lat for res in results for lat in res["lats"]]
    rounds = sum(res["rounds"] for res in results)
    return {
        "scenario": "request-reply", "url": target.url, "mode": mode, "waitSeconds": wait,
        "askers": askers, "workerConcurrency": worker_concurrency, "seconds": duration,
        "roundTrips": rounds, "rate": round(rounds / duration, 1), "unit": "round trips/s",
        "latencyMs": percentiles(lats),
        "askerRequestsPerRoundTrip": round(
            sum(res["requests"] for res in results) / max(rounds, 1), 2),
        "unanswered": sum(res["unanswered"] for res in results),
        "errors": _merge_errors(results),
    }


def _roles(role: str, *args: Any) -> JsonDict:
    """Run the worker function named ``role`` (lets one :func:`run_workers` mix roles)."""
    return _ROLES[role](*args)


# ---- lifecycle: send -> pull -> ack ------------------------------------------------


def _life_sender(target: Target, agent: str, to: str, start_at: float, end_at: float,
                 pad: int) -> JsonDict:
    """Closed-loop sender whose bodies carry their send time (``sentAt``)."""
    conn = Conn(target)
    conn.connect()
    done = array("d")
    errors: Dict[str, int] = {}
    text = make_body(to, pad)["body"]["text"]
    n = ok = 0
    _sleep_until(start_at)
    while time.time() < end_at:
        t0 = time.time()
        env = {"id": str(uuid.uuid4()), "to": to, "body": {"sentAt": t0, "text": text}}
        status, _ = conn.request("POST", "/messages",
                                 json.dumps(env, separators=(",", ":")).encode(), agent)
        n += 1
        if status in (200, 201):
            ok += 1
            done.append(time.time())
        else:
            _count(errors, f"send {status}")
    conn.close()
    return {"sent": n, "ok": ok, "done": done, "errors": errors}


def _life_worker(target: Target, agent: str, start_at: float, end_at: float, limit: int,
                 wait: int) -> JsonDict:
    """Pull batches as ``agent`` (a short long-poll where advertised) and ack each one;
    records each ack's completion time and the message's whole cycle."""
    conn = Conn(target)
    conn.connect()
    acked = array("d")
    cycles = array("d")
    errors: Dict[str, int] = {}
    pulls = empty = 0
    doc: JsonDict = {"limit": limit}
    if wait:
        doc["waitSeconds"] = wait
    pull_body = json.dumps(doc).encode()
    _sleep_until(start_at)
    while time.time() < end_at:
        status, payload = conn.request("POST", "/v1/pull", pull_body, agent)
        pulls += 1
        if status != 200:
            _count(errors, f"pull {status}")
            if status == 404:
                break
            time.sleep(0.01)
            continue
        messages = json.loads(payload).get("messages") or []
        if not messages:
            empty += 1
            if not wait:
                time.sleep(0.005)
            continue
        for msg in messages:
            ack = {"messageId": msg["id"], "leaseId": msg.get("leaseId"),
                   "outcome": "completed"}
            st, _ = conn.request("POST", "/v1/ack",
                                 json.dumps(ack, separators=(",", ":")).encode(), agent)
            now = time.time()
            if st == 200:
                acked.append(now)
                sent_at = (msg.get("body") or {}).get("sentAt")
                cycles.append(now - float(sent_at) if isinstance(sent_at, (int, float))
                              else -1.0)
            else:
                _count(errors, f"ack {st}")
    conn.close()
    return {"acked": acked, "cycles": cycles, "pulls": pulls, "empty": empty,
            "errors": errors}


def scenario_lifecycle(target: Target, senders: int = 4, workers: int = 4,
                       duration: float = 10.0, warmup: float = 1.0, limit: int = 10,
                       cpu: Optional[Callable[[], float]] = None) -> JsonDict:
    """``lifecycle``: messages per second through send -> pull -> ack.

    ``senders`` closed-loop senders send to one agent whose queue starts empty while
    ``workers`` workers of that agent pull batches of ``limit`` (long-polling 1 s
    where ``GET /`` advertises it) and ack each message. Only messages acknowledged
    inside the window count: each completed its whole cycle in this run.
    """
    info = handshake(target)
    wait = min(long_poll_max(info), 1)
    prefix = run_id()
    names = [f"life-s-{prefix}-{i}" for i in range(senders)]
    agent = f"life-r-{prefix}"
    register(target, [agent, *names])
    start = _start_time()
    lo, hi = _window(start, warmup, duration)
    probe = WindowProbe(cpu, lo, hi)
    results = run_workers(
        _roles,
        [("life-sender", target, n, agent, start, hi, BODY_BYTES) for n in names]
        + [("life-worker", target, agent, start, hi, limit, wait) for _ in range(workers)],
        timeout=warmup + duration + 60,
    )
    sends, works = results[:senders], results[senders:]
    count = 0
    cycles: List[float] = []
    for res in works:
        for t, c in zip(res["acked"], res["cycles"]):
            if lo <= t <= hi:
                count += 1
                if c >= 0:
                    cycles.append(c)
    sent_in = sum(1 for r in sends for t in r["done"] if lo <= t <= hi)
    total_sent = sum(r["ok"] for r in sends)
    total_acked = sum(len(r["acked"]) for r in works)
    requests = sum(r["sent"] for r in sends) + sum(r["pulls"] + len(r["acked"]) for r in works)
    return {
        "scenario": "lifecycle", "url": target.url, "senders": senders, "workers": workers,
        "batch": limit, "waitSeconds": wait, "seconds": duration, "messages": count,
        "rate": round(count / duration, 1), "unit": "msg/s (sent, pulled and acked)",
        "sendRate": round(sent_in / duration, 1),
        "backlogAtEnd": total_sent - total_acked,
        "cycleLatencyMs": percentiles(cycles),
        "requestsPerMessage": round(requests / max(total_acked, 1), 3),
        "emptyPulls": sum(r["empty"] for r in works),
        "serverCpuBusy": probe.busy(), "serverCpuUsPerMessage": probe.us_per(count),
        "errors": _merge_errors(results),
    }


# ---- many-agents: a thousand agents, hundreds of held long-polls ------------------


async def _sleep_until_async(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _connect_all(conns: Sequence[AsyncConn], parallel: int = 32) -> int:
    """Open every connection, ``parallel`` at a time; returns how many opened."""
    gate = asyncio.Semaphore(parallel)
    opened = 0

    async def one(conn: AsyncConn) -> None:
        nonlocal opened
        async with gate:
            try:
                await conn.connect()
                opened += 1
            except (OSError, asyncio.TimeoutError):
                pass

    await asyncio.gather(*(one(c) for c in conns))
    return opened


async def _many_receivers_async(target: Target, agents: Sequence[str], wait: int,
                                interval: float, start_at: float, lo: float, hi: float,
                                stop_at: float, limit: int) -> JsonDict:
    conns = [AsyncConn(target, timeout=max(SOCKET_TIMEOUT, wait + 30.0)) for _ in agents]
    opened = await _connect_all(conns)
    cpu0 = time.process_time()
    lats = array("d")
    seen: set = set()
    stats = {"pulls": 0, "empty": 0, "acks": 0, "duplicates": 0, "delivered": 0}
    errors: Dict[str, int] = {}
    doc: JsonDict = {"limit": limit}
    if wait:
        doc["waitSeconds"] = wait
    pull_body = json.dumps(doc).encode()

    async def receive(conn: AsyncConn, agent: str, phase: float) -> None:
        await _sleep_until_async(start_at + phase)
        while time.time() < stop_at:
            began = time.time()
            try:
                status, payload = await conn.request("POST", "/v1/pull", pull_body, agent)
            except (OSError, HttpError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                    asyncio.LimitOverrunError) as exc:
                _count(errors, f"pull {type(exc).__name__}")
                await asyncio.sleep(0.5)
                continue
            now = time.time()
            stats["pulls"] += 1
            if status != 200:
                _count(errors, f"pull {status}")
                await asyncio.sleep(0.5)
                continue
            messages = json.loads(payload).get("messages") or []
            if not messages:
                stats["empty"] += 1
            for msg in messages:
                if msg["id"] in seen:
                    stats["duplicates"] += 1
                    continue
                seen.add(msg["id"])
                sent_at = (msg.get("body") or {}).get("sentAt")
                if isinstance(sent_at, (int, float)) and lo <= sent_at <= hi:
                    stats["delivered"] += 1
                    lats.append(now - sent_at)
            for msg in messages:
                ack = {"messageId": msg["id"], "leaseId": msg.get("leaseId"),
                       "outcome": "completed"}
                try:
                    st, _ = await conn.request(
                        "POST", "/v1/ack", json.dumps(ack, separators=(",", ":")).encode(),
                        agent)
                except (OSError, HttpError, asyncio.IncompleteReadError,
                        asyncio.TimeoutError) as exc:
                    _count(errors, f"ack {type(exc).__name__}")
                    continue
                stats["acks"] += 1
                if st != 200:
                    _count(errors, f"ack {st}")
            if not wait:
                await asyncio.sleep(max(0.0, interval - (time.time() - began)))

    rng = random.Random()
    spread = interval if not wait else 0.5
    tasks = [asyncio.ensure_future(receive(c, a, rng.random() * spread))
             for c, a in zip(conns, agents)]
    await _sleep_until_async(stop_at)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for conn in conns:
        conn.close()
    return {"lats": lats, "connected": opened, "errors": errors,
            "cpu": time.process_time() - cpu0, **stats}


async def _many_senders_async(target: Target, agents: Sequence[str],
                              recipients: Sequence[str], rate_each: float, start_at: float,
                              lo: float, hi: float, pad: int) -> JsonDict:
    conns = [AsyncConn(target) for _ in agents]
    opened = await _connect_all(conns)
    cpu0 = time.process_time()
    text = make_body(recipients[0], pad)["body"]["text"]
    stats = {"sent": 0, "sentInWindow": 0, "late": 0}
    errors: Dict[str, int] = {}
    lats = array("d")
    interval = 1.0 / rate_each

    async def send(conn: AsyncConn, agent: str, rng: random.Random) -> None:
        due = start_at + rng.random() * interval
        while due < hi:
            await _sleep_until_async(due)
            t0 = time.time()
            if t0 - due > interval:
                stats["late"] += 1
            env = {"id": str(uuid.uuid4()), "to": rng.choice(recipients),
                   "body": {"sentAt": t0, "text": text}}
            try:
                status, _ = await conn.request(
                    "POST", "/messages", json.dumps(env, separators=(",", ":")).encode(),
                    agent)
            except (OSError, HttpError, asyncio.IncompleteReadError,
                    asyncio.TimeoutError) as exc:
                _count(errors, f"send {type(exc).__name__}")
                status = 0
            stats["sent"] += 1
            if status in (200, 201):
                if lo <= t0 <= hi:
                    stats["sentInWindow"] += 1
                    lats.append(time.time() - t0)
            elif status:
                _count(errors, f"send {status}")
            due += interval

    await asyncio.gather(*(send(c, a, random.Random(i))
                           for i, (c, a) in enumerate(zip(conns, agents))))
    for conn in conns:
        conn.close()
    return {"lats": lats, "connected": opened, "errors": errors,
            "cpu": time.process_time() - cpu0, **stats}


def _many_receivers(*args: Any) -> JsonDict:
    """The receivers of ``many-agents``: one process, one connection per agent."""
    return asyncio.run(_many_receivers_async(*args))


def _many_senders(*args: Any) -> JsonDict:
    """The senders of ``many-agents``: one process, one connection per sender."""
    return asyncio.run(_many_senders_async(*args))


class RssSampler:
    """Samples a server's RSS (``rss()["rssMB"]``) every ``every`` seconds on a thread."""

    def __init__(self, rss: Optional[Callable[[], JsonDict]], every: float) -> None:
        self.samples: List[Tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if rss is not None:
            self._thread = threading.Thread(target=self._run, args=(rss, every), daemon=True)
            self._thread.start()

    def _run(self, rss: Callable[[], JsonDict], every: float) -> None:
        while True:
            value = rss().get("rssMB")
            if value:
                self.samples.append((time.time(), float(value)))
            if self._stop.wait(every):
                return

    def stop(self) -> None:
        """Stop sampling (one last sample is taken on the way out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self, lo: float, hi: float, points: int = 60) -> Optional[JsonDict]:
        """RSS at the window's start and end, its largest value, and up to ``points``
        samples as ``[seconds since the window's start, MB]``."""
        inside = [(t, v) for t, v in self.samples if lo - 1.0 <= t <= hi + 1.0]
        if not inside:
            return None
        step = max(1, len(inside) // points)
        return {
            "startMB": inside[0][1], "endMB": inside[-1][1],
            "maxMB": max(v for _, v in inside),
            "growthMB": round(inside[-1][1] - inside[0][1], 1),
            "samples": [[round(t - lo, 1), v] for t, v in inside[::step]],
        }


def scenario_many_agents(target: Target, agents: int = 1000, holders: int = 500,
                         senders: int = 50, rate: float = 200.0, duration: float = 20.0,
                         warmup: float = 2.0, poll_interval: float = 1.0, limit: int = 10,
                         rss: Optional[Callable[[], JsonDict]] = None,
                         cpu: Optional[Callable[[], float]] = None,
                         sample_seconds: float = 1.0) -> JsonDict:
    """``many-agents``: ``agents`` registered, ``holders`` of them waiting for messages,
    ``senders`` others sending at ``rate`` msg/s in all to random holders.

    Holders long-poll ``POST /v1/pull`` with ``waitSeconds`` where ``GET /``
    advertises ``capabilities.longPoll`` (the longest wait up to 20 s), otherwise pull
    every ``poll_interval`` seconds; each acks what it receives. Reports delivery
    latency, messages sent in the window but not delivered, and with ``rss`` /
    ``cpu`` the broker's RSS over time and its CPU per delivered message.
    """
    if senders + holders > agents:
        raise ValueError("senders + holders must not exceed agents")
    info = handshake(target)
    wait = min(long_poll_max(info), 20)
    mode = f"long-poll {wait}s" if wait else f"interval-pull {poll_interval:g}s"
    prefix = run_id()
    names = [f"many-{prefix}-{i}" for i in range(agents)]
    t0 = time.time()
    register(target, names)
    register_seconds = time.time() - t0
    holding, sending = names[:holders], names[holders:holders + senders]
    start = _start_time(3.0)  # time to open every connection first
    lo, hi = _window(start, warmup, duration)
    stop_at = hi + (0 if wait else poll_interval) + 2.0
    probe = WindowProbe(cpu, lo, hi)
    sampler = RssSampler(rss, sample_seconds)
    try:
        results = run_workers(
            _roles,
            [("many-receivers", target, holding, wait, poll_interval, start, lo, hi,
              stop_at, limit),
             ("many-senders", target, sending, holding, rate / senders, start, lo, hi,
              BODY_BYTES)],
            timeout=stop_at - time.time() + 120,
        )
    finally:
        sampler.stop()
    recv, sent = results
    undelivered = sent["sentInWindow"] - recv["delivered"]
    return {
        "scenario": "many-agents", "url": target.url, "mode": mode, "waitSeconds": wait,
        "agents": agents, "holders": holders, "senders": senders, "targetRate": rate,
        "seconds": duration, "registerSeconds": round(register_seconds, 2),
        "connected": {"holders": recv["connected"], "senders": sent["connected"]},
        "sent": sent["sentInWindow"], "delivered": recv["delivered"],
        "undelivered": undelivered, "duplicates": recv["duplicates"],
        "rate": round(recv["delivered"] / duration, 1), "unit": "msg/s delivered",
        "latencyMs": percentiles(list(recv["lats"])),
        "sendLatencyMs": percentiles(list(sent["lats"])),
        "senderLate": sent["late"], "pulls": recv["pulls"], "emptyPulls": recv["empty"],
        # Both load-generator processes, from their first request to their last.
        "loadgenCpuBusy": round((recv["cpu"] + sent["cpu"]) / max(stop_at - start, 1e-9), 2),
        "serverCpuBusy": probe.busy(),
        "serverCpuUsPerMessage": probe.us_per(recv["delivered"]),
        "rssOverTime": sampler.summary(lo, hi),
        "errors": _merge_errors(results),
    }


_ROLES: Dict[str, Callable[..., JsonDict]] = {
    "life-sender": _life_sender, "life-worker": _life_worker,
    "many-receivers": _many_receivers, "many-senders": _many_senders,
}


def best_of(docs: Sequence[JsonDict]) -> JsonDict:
    """The result with the highest ``rate``, with every run's rate listed in ``runs``.

    Other load on the machine can only lower a rate, so the best of a few short runs
    is the least disturbed one.
    """
    best = dict(max(docs, key=lambda d: d.get("rate") or 0.0))
    best["runs"] = [d.get("rate") for d in docs]
    return best


Fresh = Callable[[], ContextManager[Tuple[Target, Optional[Callable[[], JsonDict]]]]]


def scenario_depth(target: Optional[Target], levels: Sequence[int], concurrency: int = 8,
                   workers: int = 4, duration: float = 5.0, pull_messages: int = 15000,
                   rate: float = 200.0, fill_concurrency: int = 8,
                   rss: Optional[Callable[[], JsonDict]] = None,
                   include_e2e: bool = True, log: Callable[[str], None] = print,
                   fresh: Optional[Fresh] = None, repeat: int = 1) -> JsonDict:
    """``depth``: pull-ack, send and e2e-latency with messages already stored for others.

    With ``fresh`` (a factory of context managers yielding ``(target, rss)``), every
    level gets a new broker, is prefilled from empty to the level's count for ten other
    registered agents, and is measured in the order pull-ack, send, e2e-latency, so the
    levels differ only in the prefill. Without it, levels are cumulative on ``target``:
    the store is topped up to each count, and the messages the earlier measurements
    stored are counted in ``storedBefore``. With ``repeat`` > 1, pull-ack and send run
    that many times per level and the best rate is kept (the runs' own messages stay
    stored and are counted in ``storedTotal``).
    """
    rows: List[JsonDict] = []
    filled = 0
    stored_by_runs = 0
    others: List[str] = []
    for level in sorted(levels):
        ctx: ContextManager[Any] = fresh() if fresh is not None else \
            contextlib.nullcontext((target, rss))
        with ctx as (tgt, level_rss):
            if fresh is not None or not others:
                others = [f"other-{run_id()}-{i}" for i in range(10)]
                register(tgt, others)
                filled = stored_by_runs = 0
            fill = prefill(tgt, others, level - filled, fill_concurrency)
            filled = max(filled, level)
            if fill["count"]:
                log(f"  depth {level}: prefilled {fill['count']} in {fill['seconds']}s "
                    f"({fill['rate']} msg/s)")
            row: JsonDict = {"depth": level, "prefill": fill,
                             "storedBefore": filled + stored_by_runs}
            cpu = _cpu_probe(level_rss)
            pulls = [scenario_pull_ack(tgt, workers, duration, 0.5, pull_messages, 10,
                                       fill_concurrency, cpu=cpu) for _ in range(repeat)]
            stored_by_runs += sum(p["prefill"]["count"] for p in pulls)
            row["pullAck"] = best_of(pulls)
            sends = [scenario_send(tgt, concurrency, duration, 1.0, cpu=cpu)
                     for _ in range(repeat)]
            stored_by_runs += sum(x["stored"] for x in sends)
            row["send"] = best_of(sends)
            if include_e2e:
                e2e = scenario_e2e(tgt, rate, duration, 0.5)
                stored_by_runs += e2e["sent"]
                row["e2e"] = e2e
            if level_rss is not None:
                row["rss"] = level_rss()
            row["storedTotal"] = filled + stored_by_runs
        log("  " + _depth_line(row))
        rows.append(row)
    return {"scenario": "depth", "url": target.url if target else "fresh broker per level",
            "freshPerLevel": fresh is not None, "levels": rows}


def _cpu_probe(rss: Optional[Callable[[], JsonDict]]) -> Optional[Callable[[], float]]:
    """The server's CPU seconds from an ``rss()`` reader that reports ``cpuSeconds``."""
    if rss is None or "cpuSeconds" not in rss():
        return None
    return lambda: float(rss()["cpuSeconds"])


def _depth_line(row: JsonDict) -> str:
    parts = [f"depth {row['depth']:>8}", f"send {row['send']['rate']:>8.1f} req/s",
             f"pull-ack {row['pullAck']['rate']:>8.1f} msg/s"]
    if "e2e" in row:
        lat = row["e2e"]["latencyMs"]
        parts.append(f"e2e p50 {lat['p50']} p99 {lat['p99']} ms")
    if "rss" in row:
        parts.append(f"rss {row['rss'].get('peakMB')} MB")
    return " | ".join(parts)


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def _flatten(doc: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    rows: List[Tuple[str, Any]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            rows.extend(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            rows.extend(_flatten(value, f"{prefix}[{i}]"))
    else:
        rows.append((prefix, doc))
    return rows


def table(doc: JsonDict) -> str:
    """A readable two-column table of every figure in a scenario result."""
    rows = [(k, v) for k, v in _flatten(doc) if v not in ("", None, {})]
    width = max((len(k) for k, _ in rows), default=10)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def emit(doc: JsonDict, out: Any = None) -> None:
    """Print one JSON line, then the readable table."""
    out = out or sys.stdout
    try:
        print(json.dumps(doc, separators=(",", ":")), file=out)
        print(table(doc), file=out, flush=True)
    except BrokenPipeError:
        # The reader (e.g. ``| head -1``) has what it wanted.
        sys.stderr.close()


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["send", "pull-ack", "poll", "e2e-latency",
                                        "lifecycle", "request-reply", "many-agents",
                                        "depth", "ceiling"])
    p.add_argument("--url", default=os.environ.get("RELAY_URL", DEFAULT_URL))
    p.add_argument("--secret", default=os.environ.get("RELAY_SECRET", ""),
                   help="shared secret (or $RELAY_SECRET)")
    p.add_argument("-c", "--concurrency", type=int, default=8, help="senders (send)")
    p.add_argument("-w", "--workers", type=int, default=4, help="pull/poll workers")
    p.add_argument("-d", "--duration", type=float, default=10.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    p.add_argument("--messages", type=int, default=30000,
                   help="prefill for pull-ack / poll (total)")
    p.add_argument("--limit", type=int, default=0,
                   help="batch: pull limit (default 10) or poll limit (default 50)")
    p.add_argument("--rate", type=float, default=200.0, help="e2e-latency send rate")
    p.add_argument("--poll-interval", type=float, default=None,
                   help="receiver interval when the broker has no long-poll "
                        "(default 0.1 s; 1 s in many-agents)")
    p.add_argument("--no-long-poll", action="store_true",
                   help="e2e-latency: poll on an interval even if long-poll is advertised")
    p.add_argument("--levels", default="0,1000,10000,100000",
                   help="depth: comma-separated prefilled message counts")
    p.add_argument("--fill-concurrency", type=int, default=8)
    p.add_argument("--askers", type=int, default=1, help="request-reply: concurrent askers")
    p.add_argument("--senders", type=int, default=0,
                   help="lifecycle (default 4) / many-agents (default 50): senders")
    p.add_argument("--agents", type=int, default=1000, help="many-agents: registered agents")
    p.add_argument("--holders", type=int, default=500,
                   help="many-agents: agents waiting for messages (long-poll)")
    p.add_argument("--worker-python", default=sys.executable,
                   help="request-reply: the interpreter that runs the worker agent")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one scenario from the command line."""
    args = _parser().parse_args(argv)
    if not args.secret and args.scenario != "ceiling":
        print("loadgen: --secret (or RELAY_SECRET) is required", file=sys.stderr)
        return 2
    target = Target(args.url, args.secret or "ceiling")
    if args.scenario in ("send", "ceiling"):
        doc = scenario_send(target, args.concurrency, args.duration, args.warmup,
                            name=args.scenario, do_register=args.scenario == "send")
    elif args.scenario == "pull-ack":
        doc = scenario_pull_ack(target, args.workers, args.duration, args.warmup,
                                args.messages, args.limit or 10, args.fill_concurrency)
    elif args.scenario == "poll":
        doc = scenario_poll(target, args.workers, args.duration, args.warmup,
                            min(args.messages, 10000), args.limit or 50, args.fill_concurrency)
    elif args.scenario == "e2e-latency":
        doc = scenario_e2e(target, args.rate, args.duration, args.warmup,
                           args.poll_interval or 0.1, args.no_long_poll)
    elif args.scenario == "lifecycle":
        doc = scenario_lifecycle(target, args.senders or 4, args.workers, args.duration,
                                 args.warmup, args.limit or 10)
    elif args.scenario == "many-agents":
        doc = scenario_many_agents(target, args.agents, args.holders, args.senders or 50,
                                   args.rate, args.duration, args.warmup,
                                   args.poll_interval or 1.0)
    elif args.scenario == "request-reply":
        doc = scenario_request_reply(target, args.askers, args.duration, args.warmup,
                                     args.worker_python, force_interval=args.no_long_poll)
    else:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
        doc = scenario_depth(target, levels, args.concurrency, args.workers, args.duration,
                             args.messages, args.rate, args.fill_concurrency)
    emit(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
