"""The HTTP layer over real sockets: body limits, slow clients, form bodies."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from relay.wire.signing import sign
from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = BrokerProcess(str(tmp_path_factory.mktemp("http")), requestReadSeconds=2).start()
    yield b
    b.kill()


def raw_exchange(broker, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", broker.port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")]
                if length and len(body) >= length[0]:
                    break
        return b"".join(chunks)


def status_and_body(response: bytes):
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_declared_oversize_body_gets_the_uniform_400(broker):
    size = 1024 * 1024 + 1
    request = (b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % size) + b"x" * size
    status, body = status_and_body(raw_exchange(broker, request))
    assert status == 400 and body["error"]["code"] == "bad_request"


def test_chunked_oversize_body_gets_the_uniform_400(broker):
    chunk = b"y" * 65536
    parts = [b"POST /v1/pull HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for _ in range(17):
        parts.append(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    parts.append(b"0\r\n\r\n")
    status, body = status_and_body(raw_exchange(broker, b"".join(parts)))
    assert status == 400 and body["error"]["code"] == "bad_request"


def test_exactly_one_mebibyte_is_not_too_large(broker):
    size = 1024 * 1024
    request = (b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % size
               ) + b" " * size
    status, body = status_and_body(raw_exchange(broker, request))
    assert status == 401, "an unsigned body of the maximum size reaches authentication"


def test_form_bodies_are_not_parsed(broker):
    body = b"--b\r\nContent-Disposition: form-data; name=x\r\n\r\n"
    request = (b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: multipart/form-data; boundary=b\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    status, reply = status_and_body(raw_exchange(broker, request))
    assert status == 401 and reply["error"]["code"] == "unauthenticated"


def test_a_trickling_client_is_timed_out_without_blocking_others(broker):
    slow = socket.create_connection(("127.0.0.1", broker.port), timeout=60)
    slow.sendall(b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        started = time.monotonic()
        status, info = broker.request("alpha", "GET", "/")
        assert status == 200 and time.monotonic() - started < 5
        deadline = time.monotonic() + 10
        received = b""
        slow.settimeout(1)
        while time.monotonic() < deadline:
            try:
                slow.sendall(b"X")
            except OSError:
                break
            try:
                chunk = slow.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            received += chunk
        assert received.startswith(b"HTTP/1.1 408"), received[:100]
    finally:
        slow.close()


@pytest.fixture(scope="module")
def default_broker(tmp_path_factory):
    b = BrokerProcess(str(tmp_path_factory.mktemp("one-read"))).start()
    yield b
    b.kill()


# -- an answer larger than the socket takes ------------------------------------------------


@pytest.mark.process
def test_an_answer_larger_than_the_socket_takes_arrives_whole(default_broker) -> None:
    """What the socket does not take at once is queued after it, so a slow reader
    still gets every byte in order."""
    assert default_broker.request("beta", "POST", "/register", {"agent": "beta"})[0] == 200
    assert default_broker.request("alpha", "POST", "/register", {"agent": "alpha"})[0] == 200
    for i in range(40):
        body = {"id": f"big-{i}", "to": "beta", "body": {"text": f"{i:04d}" * 5000}}
        assert default_broker.request("alpha", "POST", "/messages", body)[0] == 201
    raw = json.dumps({"agent": "beta", "limit": 50}).encode()
    ts = int(time.time())
    request = (b"POST /v1/pull HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: beta\r\n"
               b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\nContent-Length: %d\r\n\r\n%s"
               % (ts, sign(default_broker.secret, "POST", "/v1/pull", ts, raw).encode(), len(raw),
                  raw))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", default_broker.port))
        s.sendall(request)
        time.sleep(0.5)  # the broker's first send fills what the socket holds
        s.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
        assert length > 800_000
        while len(body) < length:
            chunk = s.recv(65536)
            assert chunk, "the connection closed before the answer was whole"
            body += chunk
    messages = json.loads(body)["messages"]
    assert [m["id"] for m in messages] == [f"big-{i}" for i in range(40)]
    assert all(m["body"]["text"] == f"{i:04d}" * 5000 for i, m in enumerate(messages))


# -- a client that shuts its sending side ----------------------------------------------------


@pytest.mark.process
def test_a_send_after_which_the_client_shut_its_side_is_answered(default_broker) -> None:
    """``shutdown(SHUT_WR)`` after the request (what ``nc -N`` and some scripts do):
    the send, answered after SQLite's commit, still gets its 201, then the close."""
    assert default_broker.request("beta", "POST", "/register", {"agent": "beta"})[0] == 200
    raw = json.dumps({"id": "half-closed", "to": "beta", "body": {"n": 1}}).encode()
    ts = int(time.time())
    request = (b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: alpha\r\n"
               b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\nContent-Length: %d\r\n\r\n%s"
               % (ts, sign(default_broker.secret, "POST", "/messages", ts, raw).encode(),
                  len(raw), raw))
    with socket.create_connection(("127.0.0.1", default_broker.port), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status, body = status_and_body(data)
    assert status == 201 and body["id"] == "half-closed"
