"""Slow and abusive clients, and attacks on authentication (issue 8), against the
real ``twistd -n relay`` process on loopback.

Every wait is bounded; every broker process is killed at the end. The rate
limit and lockout tables are also driven directly through :mod:`relay.rules.auth`
with a ``task.Clock`` (thousands of addresses cannot come from loopback).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Dict, List, Optional, Tuple

import pytest
import yaml

from relay.wire.signing import sign
from tests.support.processes import BrokerProcess

READ_SECONDS = 2


def rss_kb(pid: int) -> int:
    """The resident set size of process ``pid`` in KiB (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def read_response(sock: socket.socket, timeout: float) -> bytes:
    """Everything the broker sends on ``sock`` until it closes or ``timeout`` passes."""
    sock.settimeout(0.5)
    chunks: List[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse(response: bytes) -> List[Tuple[int, Any]]:
    """The (status, JSON body) of every response in ``response``, in order."""
    out = []
    rest = response
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.split(b"\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body, rest = rest[:length], rest[length:]
        out.append((int(lines[0].split(b" ")[1]), json.loads(body) if body else None))
    return out


def assert_section_6(status: int, body: Any, code: Optional[str] = None) -> None:
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    if code is not None:
        assert body["error"]["code"] == code, body


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = BrokerProcess(str(tmp_path_factory.mktemp("abuse")), requestReadSeconds=READ_SECONDS)
    b.start()
    try:
        for agent in ("alpha", "beta"):
            assert b.request(agent, "POST", "/register", {})[0] == 200
        yield b
    finally:
        b.kill()


def served_quickly(broker: BrokerProcess, limit: float = 2.0) -> float:
    """One signed round trip by another client; asserts it took under ``limit`` seconds."""
    started = time.monotonic()
    status, _ = broker.request("alpha", "POST", "/messages", {"to": "beta"}, timeout=limit + 3)
    took = time.monotonic() - started
    assert status == 201 and took < limit, (status, took)
    return took


# -- slow clients --------------------------------------------------------------------------


def trickle(broker: BrokerProcess, data: bytes, result: Dict[str, Any]) -> None:
    """Send ``data`` one byte every 0.1 s until the broker answers or closes."""
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        s.settimeout(0.1)
        received = b""
        started = time.monotonic()
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
            except OSError:
                break
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            received += chunk
            break
        received += read_response(s, 5)
        result["elapsed"] = time.monotonic() - started
        result["response"] = received


@pytest.mark.parametrize("part", ["headers", "body"])
@pytest.mark.process
def test_one_byte_at_a_time_is_timed_out_and_others_are_served(broker, part):
    body = json.dumps({"to": "beta", "body": {"pad": "x" * 200}}).encode()
    head = (b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    results: List[Dict[str, Any]] = [{} for _ in range(8)]
    threads = []
    for result in results:
        # "body": the headers arrive whole, then the body trickles in.
        data = head + body if part == "headers" else body
        threads.append(threading.Thread(target=_slow_client,
                                        args=(part, head, broker, data, result)))
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        for _ in range(5):
            served_quickly(broker)
    finally:
        for t in threads:
            t.join(30)
    for result in results:
        responses = parse(result["response"])
        assert responses, result
        status, reply = responses[0]
        assert status == 408, (status, reply)
        assert_section_6(status, reply, "request_timeout")
        assert result["elapsed"] < READ_SECONDS + 3, result["elapsed"]


def _slow_client(part: str, head: bytes, broker: BrokerProcess, data: bytes,
                 result: Dict[str, Any]) -> None:
    if part == "headers":
        trickle(broker, data, result)
        return
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        s.sendall(head)
        started = time.monotonic()
        s.settimeout(0.1)
        received = b""
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
                received = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            break
        received += read_response(s, 5)
        result["elapsed"] = time.monotonic() - started
        result["response"] = received


# -- lying and oversized bodies ------------------------------------------------------------


def signed_head(broker: BrokerProcess, path: str, raw: bytes, length: int,
                agent: str = "alpha") -> bytes:
    ts = int(time.time())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Relay-Agent: {agent}\r\nX-Relay-Timestamp: {ts}\r\n"
            f"X-Relay-Signature: {sign(broker.secret, 'POST', path, ts, raw)}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.process
def test_content_length_shorter_than_the_body(broker):
    """The extra bytes are read as a next request: refused with §6 bodies, never a 5xx."""
    raw = json.dumps({"to": "beta", "id": str(uuid.uuid4())}).encode()
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        s.sendall(signed_head(broker, "/messages", raw, 5) + raw)
        responses = parse(read_response(s, READ_SECONDS + 4))
    assert responses, "no answer"
    status, reply = responses[0]
    assert_section_6(status, reply)
    for status, reply in responses[1:]:
        assert_section_6(status, reply)
    served_quickly(broker)


@pytest.mark.process
def test_content_length_longer_than_the_body(broker):
    """The broker waits for the missing bytes no longer than requestReadSeconds."""
    raw = json.dumps({"to": "beta"}).encode()
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        started = time.monotonic()
        s.sendall(signed_head(broker, "/messages", raw, len(raw) + 1000) + raw)
        responses = parse(read_response(s, READ_SECONDS + 4))
        elapsed = time.monotonic() - started
    assert [r[0] for r in responses] == [408], responses
    assert_section_6(*responses[0], "request_timeout")
    assert elapsed < READ_SECONDS + 3


@pytest.mark.process
def test_huge_declared_content_length_is_refused_without_buffering(broker):
    before = rss_kb(broker.proc.pid)
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        s.sendall(b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Length: 99999999999\r\n\r\n")
        s.sendall(b"x" * (4 << 20))
        responses = parse(read_response(s, READ_SECONDS + 4))
    assert responses and responses[0][0] in (400, 408), responses
    assert_section_6(*responses[0])
    assert rss_kb(broker.proc.pid) - before < 16 * 1024


@pytest.mark.process
def test_chunked_body_over_one_mebibyte(broker):
    """8 MiB of chunks: a §6 400, and the broker's memory does not grow with it."""
    before = rss_kb(broker.proc.pid)
    raw = b"{" + b" " * 1000
    path = "/messages"
    ts = int(time.time())
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            f"X-Relay-Agent: alpha\r\nX-Relay-Timestamp: {ts}\r\n"
            f"X-Relay-Signature: {sign(broker.secret, 'POST', path, ts, raw)}\r\n\r\n").encode()
    chunk = b"z" * 65536
    with socket.create_connection(("127.0.0.1", broker.port), timeout=20) as s:
        s.sendall(head)
        for _ in range(128):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        s.sendall(b"0\r\n\r\n")
        responses = parse(read_response(s, 3))
    assert responses, "no answer"
    status, reply = responses[0]
    assert status == 400
    assert_section_6(status, reply, "bad_request")
    assert "exceeds" in reply["error"]["message"]
    assert rss_kb(broker.proc.pid) - before < 16 * 1024
    served_quickly(broker)


@pytest.mark.process
def test_hundreds_of_idle_connections_bounded_memory(broker):
    served_quickly(broker)
    before = rss_kb(broker.proc.pid)
    sockets = []
    try:
        for i in range(600):
            s = socket.create_connection(("127.0.0.1", broker.port), timeout=5)
            if i % 3 == 1:
                s.sendall(b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            elif i % 3 == 2:
                s.sendall(b"POST /messages HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{")
            sockets.append(s)
        for _ in range(5):
            served_quickly(broker)
        grown = rss_kb(broker.proc.pid) - before
        assert grown < 32 * 1024, f"RSS grew {grown} KiB for 600 connections"
        # The ones that started a request are answered 408 and closed in time.
        time.sleep(READ_SECONDS + 1)
        closed = 0
        for i, s in enumerate(sockets):
            if i % 3 == 0:
                continue
            response = read_response(s, 0.6 if closed == 0 else 0.05)
            if response.startswith(b"HTTP/1.1 408"):
                closed += 1
        assert closed >= 390, closed
    finally:
        for s in sockets:
            s.close()
    served_quickly(broker)


# -- authentication --------------------------------------------------------------------------


def send_raw(broker: BrokerProcess, method: str, path: str, raw: bytes,
             headers: Dict[str, str]) -> Tuple[int, Any]:
    req = urllib.request.Request(broker.url + path, data=raw or None, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def signed(secret: str, agent: str, method: str, path: str, raw: bytes,
           ts: Optional[int] = None) -> Dict[str, str]:
    ts = int(time.time()) if ts is None else ts
    return {"X-Relay-Agent": agent, "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(secret, method, path, ts, raw),
            "Content-Type": "application/json"}


@pytest.mark.process
def test_replay_outside_the_window_fails(broker):
    raw = json.dumps({"to": "beta", "id": str(uuid.uuid4())}).encode()
    for age, expected in ((-301, 401), (301, 401), (3600, 401), (-10**6, 401)):
        headers = signed(broker.secret, "beta", "POST", "/messages", raw,
                         int(time.time()) - age)
        status, reply = send_raw(broker, "POST", "/messages", raw, headers)
        assert status == expected, (age, reply)
        assert_section_6(status, reply, "unauthenticated")
    served_quickly(broker)
    # The same request signed now works: only the window refused it.
    headers = signed(broker.secret, "beta", "POST", "/register", b"")
    assert send_raw(broker, "POST", "/register", b"", headers)[0] == 200


@pytest.mark.process
def test_a_signature_does_not_authorise_another_request(broker):
    """Headers signed for one request fail for any other method, path, query or body.

    With one shared secret the agent name is not part of the signing string, so
    each attempt uses a fresh name: none of them gets locked out.
    """
    raw = json.dumps({"to": "beta", "body": {"n": 1}}).encode()
    headers = signed(broker.secret, "gamma", "POST", "/messages", raw)
    others = [
        ("POST", "/messages", json.dumps({"to": "beta", "body": {"n": 2}}).encode()),
        ("POST", "/messages", raw + b" "),
        ("POST", "/messages?x=1", raw),
        ("POST", "/Messages", raw),
        ("POST", "/v1/pull", raw),
        ("POST", "/messages/x/ack", raw),
        ("PUT", "/messages", raw),
        ("GET", "/messages", b""),
        ("GET", "/peers", b""),
    ]
    for i, (method, path, body) in enumerate(others):
        status, reply = send_raw(broker, method, path, body,
                                 dict(headers, **{"X-Relay-Agent": f"sig{i}"}))
        assert status == 401, (method, path, reply)
        assert_section_6(status, reply, "unauthenticated")
    status, _ = send_raw(broker, "POST", "/messages", raw, headers)
    assert status == 201, "the request it was made for"


@pytest.mark.process
def test_cycling_agent_names_keeps_the_broker_bounded(broker):
    """Thousands of bad logins under fresh names: memory bounded, real agents unaffected.

    (The tables' hard bound is proven on relay.rules.auth below; here the process must
    not grow past a JIT's warm-up noise, and must keep serving.)
    """

    def attack(count: int) -> None:
        for i in range(count):
            name = f"attacker-{i}-{uuid.uuid4().hex[:8]}"
            headers = signed("wrong", name, "GET", "/peers", b"")
            status, reply = send_raw(broker, "GET", "/peers", b"", headers)
            assert status == 401, reply

    attack(1000)  # warm-up (PyPy's JIT)
    before = rss_kb(broker.proc.pid)
    attack(3000)
    assert rss_kb(broker.proc.pid) - before < 24 * 1024
    served_quickly(broker)


# -- per-agent secrets and ACLs ------------------------------------------------------------

SECRETS = {"alpha": "alpha-secret-0123", "beta": "beta-secret-01234", "gamma": "gamma-secret-0123",
           "delta": "delta-secret-0123"}


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory):
    b = BrokerProcess(str(tmp_path_factory.mktemp("acl")), requestReadSeconds=READ_SECONDS)
    with open(b.config_path) as f:
        config = yaml.safe_load(f)
    config["agents"] = {
        "alpha": {"secret": SECRETS["alpha"], "allowed_targets": ["beta"]},
        "beta": {"secret": SECRETS["beta"], "allowed_targets": ["gamma"]},
        "gamma": {"secret": SECRETS["gamma"]},
        "delta": {"secret": SECRETS["delta"]},
    }
    with open(b.config_path, "w") as f:
        yaml.safe_dump(config, f)
    b.start()
    try:
        for agent in SECRETS:
            assert as_agent(b, agent, "POST", "/register", {})[0] == 200
        yield b
    finally:
        b.kill()


def as_agent(broker: BrokerProcess, agent: str, method: str, path: str, body: Any = None,
             secret: Optional[str] = None) -> Tuple[int, Any]:
    raw = b"" if body is None else json.dumps(body).encode()
    key = secret if secret is not None else SECRETS.get(agent, "none")
    return send_raw(broker, method, path, raw, signed(key, agent, method, path, raw))


@pytest.mark.process
def test_per_agent_secrets_isolate_agents(acl_broker):
    b = acl_broker
    # beta's secret cannot sign for alpha, nor alpha's for beta.
    status, reply = as_agent(b, "alpha", "POST", "/v1/pull", {}, secret=SECRETS["beta"])
    assert_section_6(status, reply, "unauthenticated")
    status, reply = as_agent(b, "beta", "GET", "/messages", secret=SECRETS["alpha"])
    assert_section_6(status, reply, "unauthenticated")
    # The old shared secret signs for nobody; an unconfigured name is unknown_agent.
    status, reply = as_agent(b, "alpha", "GET", "/peers", secret=b.secret)
    assert_section_6(status, reply, "unauthenticated")
    status, reply = as_agent(b, "mallory", "GET", "/peers", secret=b.secret)
    assert_section_6(status, reply, "unknown_agent")
    # Locking delta out (5 failures) leaves the others alone.
    for _ in range(6):
        as_agent(b, "delta", "GET", "/peers", secret="guess")
    status, reply = as_agent(b, "delta", "GET", "/peers")
    assert_section_6(status, reply, "locked")
    assert as_agent(b, "alpha", "GET", "/peers")[0] == 200
    # alpha's messages to beta are invisible to gamma (the recipient is the signer).
    status, sent = as_agent(b, "alpha", "POST", "/messages", {"to": "beta"})
    assert status == 201
    status, pulled = as_agent(b, "gamma", "POST", "/v1/pull", {"limit": 200})
    assert status == 200 and sent["id"] not in {m["id"] for m in pulled["messages"]}
    status, reply = as_agent(b, "gamma", "POST", "/v1/pull", {"agent": "beta"})
    assert_section_6(status, reply, "bad_request")
    status, states = as_agent(b, "gamma", "POST", "/v1/status", {"messageIds": [sent["id"]]})
    assert states["messages"][0]["status"] == "not_found"
    status, reply = as_agent(b, "gamma", "POST", f"/messages/{sent['id']}/ack", {})
    assert_section_6(status, reply, "forbidden")


@pytest.mark.process
def test_acls_hold_on_every_path_that_creates_a_message(acl_broker):
    b = acl_broker
    # POST /messages: alpha may send to beta only.
    assert as_agent(b, "alpha", "POST", "/messages", {"to": "beta"})[0] == 201
    status, reply = as_agent(b, "alpha", "POST", "/messages", {"to": "gamma"})
    assert_section_6(status, reply, "forbidden")
    # The v1.0 receipt: gamma may send to anyone, beta only to gamma.
    status, sent = as_agent(b, "alpha", "POST", "/messages", {"to": "beta", "ack": True})
    assert status == 201
    before = inbox_ids(b, "alpha")
    status, reply = as_agent(b, "beta", "POST", f"/messages/{sent['id']}/ack", {"status": "ok"})
    assert_section_6(status, reply, "forbidden")
    assert inbox_ids(b, "alpha") == before, "a refused receipt stored nothing"
    # A full envelope claiming type "ack" is still a send under the ACL.
    status, reply = as_agent(b, "beta", "POST", "/messages",
                             {"to": "alpha", "type": "ack", "replyTo": sent["id"]})
    assert_section_6(status, reply, "forbidden")
    # And an allowed pair works on both paths.
    status, to_gamma = as_agent(b, "beta", "POST", "/messages", {"to": "gamma"})
    assert status == 201
    status, receipt = as_agent(b, "gamma", "POST", f"/messages/{to_gamma['id']}/ack", {})
    assert status == 201
    assert receipt["id"] in inbox_ids(b, "beta")


def inbox_ids(b: BrokerProcess, agent: str) -> set:
    status, reply = as_agent(b, agent, "POST", "/v1/recent", {"limit": 200})
    assert status == 200, reply
    return {m["id"] for m in reply["messages"]}
