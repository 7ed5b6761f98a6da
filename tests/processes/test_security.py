"""The broker process's own defences (docs/SECURITY.md), against the real ``twistd -n
relay``: no remote listener without TLS, no short secret, the Host rule of a loopback
listener (the inbox page included), private data files, the connection caps, a body of
too many values, and the free disk floor.

What the routes refuse is in tests/api (the quotas in test_send.py, the cap on agents in
test_register.py, a replayed nonce in test_every_route.py).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import stat
import time
from importlib import resources
from typing import Any, List, Tuple

import pytest

from tests.support.processes import BrokerProcess, free_port

CONNECT_SECONDS = 5


def raw_request(port: int, request: bytes, timeout: float = CONNECT_SECONDS) -> bytes:
    """Send ``request`` as it is and read the whole answer (the broker closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def status_and_body(answer: bytes) -> Tuple[int, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.strip() else None


def get(port: int, path: str, host: str) -> Tuple[int, Any]:
    request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
               .encode("latin-1"))
    return status_and_body(raw_request(port, request))


@pytest.fixture
def brokers():
    started: List[BrokerProcess] = []
    yield started
    for broker in started:
        broker.kill()


def start(tmp_path, brokers, preexec_fn=None, **config: Any) -> BrokerProcess:
    broker = BrokerProcess(str(tmp_path), **config)
    brokers.append(broker)
    return broker.start(preexec_fn=preexec_fn)


# -- listener safety -----------------------------------------------------------------


@pytest.mark.parametrize("listen", [
    "TCP6:{port}:interface=\\:\\:", "Tcp6:{port}:interface=\\:\\:", "TCP:{port}",
    "systemd:domain=INET:index=0",
])
@pytest.mark.process
def test_an_endpoint_that_may_be_remote_does_not_start_without_tls(tmp_path, listen):
    broker = BrokerProcess(str(tmp_path), listen=[listen.format(port=free_port())])
    code, output = broker.exit_status()
    assert code == 78, output
    lines = [line for line in output.splitlines() if "config error" in line]
    assert len(lines) == 1 and "broker.listen" in lines[0], output
    with pytest.raises(OSError):
        socket.create_connection(("::1", broker.port), timeout=0.5).close()


@pytest.mark.process
def test_a_short_secret_stops_the_start_with_one_line(tmp_path):
    broker = BrokerProcess(str(tmp_path), secret="qzx")
    code, output = broker.exit_status()
    assert code == 78
    (line,) = [line for line in output.splitlines() if "config error" in line]
    assert "broker.secret" in line and "at least 16 bytes" in line
    assert "qzx" not in output, "the secret is not shown"


# -- DNS rebinding -----------------------------------------------------------------------


@pytest.mark.process
def test_a_loopback_listener_answers_only_to_loopback_names_and_allowed_hosts(tmp_path,
                                                                             brokers):
    broker = start(tmp_path, brokers, allowedHosts=["relay.internal"])
    port = broker.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}",
                 f"relay.internal:{port}", "RELAY.INTERNAL"):
        assert get(port, "/", host)[0] == 200, host
    for host in (f"attacker.example:{port}", "127.0.0.1.attacker.example",
                 f"localhost.attacker.example:{port}", "relay.internal.attacker.example"):
        code, body = get(port, "/peers", host)
        assert code == 403, host
        assert body["error"]["code"] == "forbidden" and "Host" in body["error"]["message"]
    # Each name is judged once and remembered: asked again, in turn, the same answers.
    for _ in range(2):
        assert get(port, "/", "relay.internal")[0] == 200
        assert get(port, "/", "attacker.example")[0] == 403


# -- data at rest ----------------------------------------------------------------------


def _umask_022() -> None:
    os.umask(0o022)


@pytest.mark.parametrize("storage, files", [
    ("sqlite", ["relay.db", "relay.db-wal", "relay.db-shm"]),
    ("jsonl", ["messages.jsonl"]),
])
@pytest.mark.process
def test_the_data_directory_and_files_are_private_whatever_the_umask(tmp_path, brokers,
                                                                    storage, files):
    broker = start(tmp_path, brokers, preexec_fn=_umask_022, storage=storage)
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    assert broker.request("alpha", "POST", "/messages", {"to": "beta", "body": {}})[0] == 201
    data = tmp_path / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name in files:
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name


@pytest.mark.process
def test_a_config_with_secrets_readable_by_others_is_warned_about(tmp_path, brokers):
    broker = BrokerProcess(str(tmp_path))
    os.chmod(broker.config_path, 0o644)
    brokers.append(broker)
    broker.start()
    assert "holds secrets and is readable by other users: chmod 600 it" in broker.log()


# -- connections -------------------------------------------------------------------------


def _hold(port: int, count: int) -> List[socket.socket]:
    held = []
    for _ in range(count):
        held.append(socket.create_connection(("127.0.0.1", port), timeout=CONNECT_SECONDS))
    return held


def _refused(held: List[socket.socket]) -> Tuple[int, int]:
    """How many of ``held`` were answered 503 busy and closed, and how many closed
    unanswered (a burst past the answers in flight); the others are kept open."""
    answered = closed = 0
    for sock in held:
        sock.settimeout(0.05)
        try:
            answer = sock.recv(4096)
        except (socket.timeout, TimeoutError):
            continue
        except ConnectionResetError:
            answer = b""
        if answer.startswith(b"HTTP/1.1 503"):
            assert b'"code":"busy"' in answer.replace(b" ", b"")
            answered += 1
        else:
            assert answer == b""
            closed += 1
    return answered, closed


@pytest.mark.process
def test_connections_over_the_cap_are_refused_cheaply_and_logged_once(tmp_path, brokers):
    broker = start(tmp_path, brokers, maxConnections=8)
    held = _hold(broker.port, 30)
    try:
        time.sleep(0.3)
        answered, closed = _refused(held)
        assert (answered + closed, closed) == (22, 0)
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + CONNECT_SECONDS
    while broker.request("a", "GET", "/peers")[0] != 200:
        assert time.monotonic() < deadline, "served again once idle sockets are gone"
        time.sleep(0.05)
    refusals = [line for line in broker.log().splitlines() if "refused" in line]
    assert len(refusals) == 1 and "broker.maxConnections" in refusals[0], refusals


def _few_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))


@pytest.mark.process
def test_the_cap_stays_below_the_open_files_limit(tmp_path, brokers):
    broker = start(tmp_path, brokers, preexec_fn=_few_open_files, storage="sqlite")
    assert "at most 96 connections: the open-files limit is 160" in broker.log()
    held = _hold(broker.port, 200)
    try:
        time.sleep(0.5)
        answered, closed = _refused(held)
        assert answered + closed == 200 - 96 and answered >= 16
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + CONNECT_SECONDS
    while broker.request("a", "GET", "/peers")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "EMFILE" not in broker.log() and "Too many open files" not in broker.log()


# -- amplification and quotas --------------------------------------------------------------


@pytest.mark.process
def test_a_body_of_hundreds_of_thousands_of_values_is_400_and_others_are_served(tmp_path,
                                                                               brokers):
    broker = start(tmp_path, brokers)
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    body = {"x": [{}] * 250_000}  # just under 1 MiB
    started = time.monotonic()
    code, answer = broker.request("alpha", "POST", "/messages", {"to": "beta", "body": body})
    assert code == 400 and answer["error"]["code"] == "bad_request"
    assert "values" in answer["error"]["message"]
    assert broker.request("gamma", "GET", "/peers")[0] == 200
    assert time.monotonic() - started < 5


@pytest.mark.process
def test_new_messages_are_503_below_the_free_disk_floor(tmp_path, brokers):
    broker = start(tmp_path, brokers, storage="sqlite", minFreeDiskMB=2**40)
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    code, body = broker.request("alpha", "POST", "/messages", {"to": "beta"})
    assert code == 503 and body["error"]["code"] == "busy"
    assert "broker.minFreeDiskMB" in body["error"]["message"]
    assert broker.request("beta", "POST", "/v1/pull", {})[0] == 200, "draining still works"


STATIC = resources.files("relay.broker.inbox").joinpath("static")


# -- the inbox page under the Host rule (REACH §15) ----------------------------------------


@pytest.mark.process
def test_the_page_obeys_the_host_rule(tmp_path):
    broker = BrokerProcess(str(tmp_path)).start()
    try:
        port = broker.port
        answer = raw_request(port, (f"GET /inbox/ HTTP/1.1\r\nHost: localhost:{port}\r\n"
                                    "Connection: close\r\n\r\n").encode("latin-1"))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert body == STATIC.joinpath("index.html").read_bytes()
        assert b"\r\ncontent-length: %d\r\n" % len(body) in head.lower()
        for path in ("/inbox/", "/inbox/inbox.js", "/inbox"):
            code, body = get(port, path, f"attacker.example:{port}")
            assert code == 403 and body["error"]["code"] == "forbidden", path
    finally:
        broker.stop()
