"""TLS listeners of the real ``twistd -n relay`` process: a verified round trip, client
certificates required, the rate limit of the real peer address, and the start-time
safety rails (no plaintext remote listener, bad keys and certificates refused).

The certificates are made at test time (tests/support/tls.py); the listeners' options
in process are tests/site/test_tls.py.
"""

from __future__ import annotations

import shutil
import ssl
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from tests.support.tls import (
    Broker,
    call,
    client_context,
    dual_stack_available,
    free_port,
    handshake,
    ipv6_available,
    make_pki,
    ssl_listen,
    start_broker,
    write_config,
)


@pytest.fixture
def workdir(tmp_path: Path, pki: Path) -> Path:
    """A fresh directory holding a copy of the PKI under ``tls/``."""
    shutil.copytree(pki, tmp_path / "tls")
    return tmp_path


@pytest.fixture
def running() -> Iterator[List[Broker]]:
    """Brokers started by a test; every one is stopped afterwards."""
    brokers: List[Broker] = []
    yield brokers
    for broker in brokers:
        broker.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A directory of PEM files: ca, server, client, other-ca, other-client, stray.key."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.process
def test_round_trip_over_verified_tls(workdir: Path, running: List[Broker]) -> None:
    port = free_port()
    listen = [ssl_listen(port, "127.0.0.1")]
    running.append(start_broker(workdir, [("127.0.0.1", port)], listen=listen))
    trusted = client_context(workdir / "tls" / "ca.crt")

    status, info = call(port, "GET", "/", agent=None, host="localhost", context=trusted)
    assert (status, info["protocol"]) == (200, "1.0")
    assert call(port, "POST", "/register", {"agent": "alpha"}, "alpha", context=trusted)[0] == 200
    assert call(port, "POST", "/register", {"agent": "beta"}, "beta", context=trusted)[0] == 200
    status, sent = call(
        port, "POST", "/messages", {"to": "beta", "body": {"text": "over tls"}}, context=trusted
    )
    assert status == 201
    status, inbox = call(port, "GET", "/messages", agent="beta", context=trusted)
    assert status == 200
    assert [(m["id"], m["from"], m["body"]) for m in inbox["messages"]] == [
        (sent["id"], "alpha", {"text": "over tls"})
    ]

    untrusted = client_context(workdir / "tls" / "other-ca.crt")
    with pytest.raises(ssl.SSLCertVerificationError):
        call(port, "GET", "/", agent=None, context=untrusted)
    with pytest.raises(ssl.SSLCertVerificationError):
        call(port, "GET", "/", agent=None, context=client_context(None))
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        handshake(port, trusted, server_hostname="relay.example")


@pytest.mark.process
def test_client_certificate_required(workdir: Path, running: List[Broker]) -> None:
    port = free_port()
    running.append(
        start_broker(
            workdir,
            [("127.0.0.1", port)],
            listen=[ssl_listen(port, "127.0.0.1")],
            tlsClientCA="tls/ca.crt",
        )
    )
    tls = workdir / "tls"
    without = client_context(tls / "ca.crt")
    foreign = client_context(tls / "ca.crt", tls / "other-client.crt", tls / "other-client.key")
    with_cert = client_context(tls / "ca.crt", tls / "client.crt", tls / "client.key")

    for refused in (without, foreign):
        # TLS 1.3 lets the client write before the server has judged its certificate:
        # the refusal then reaches it as an alert, a reset or a closed pipe.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            call(port, "POST", "/register", {"agent": "alpha"}, context=refused)
    assert call(port, "POST", "/register", {"agent": "alpha"}, context=with_cert) == (
        200,
        {"ok": True, "agent": "alpha", "ts": pytest.approx(time.time(), abs=5)},
    )


@pytest.mark.process
def test_rate_limit_class_from_the_real_peer_address(workdir: Path, running: List[Broker]) -> None:
    """Loopback peers over IPv4, IPv6 and IPv4-mapped IPv6 all get the loopback limit.

    The remote limit is 1 per minute, so a second request classed remote is refused.
    """
    targets = [("127.0.0.1", "127.0.0.1")]
    if ipv6_available():
        targets.append(("::1", "::1"))
    if dual_stack_available():
        targets.append(("::", "127.0.0.1"))
    ports = {interface: free_port("::1" if ":" in interface else "127.0.0.1")
             for interface, _ in targets}
    running.append(
        start_broker(
            workdir,
            [(host, ports[interface]) for interface, host in targets],
            listen=[ssl_listen(ports[interface], interface) for interface, _ in targets],
            rateLimitLoopback=1000,
            rateLimitRemote=1,
        )
    )
    trusted = client_context(workdir / "tls" / "ca.crt")
    for interface, host in targets:
        for _ in range(3):
            status, body = call(ports[interface], "GET", "/peers", host=host, context=trusted)
            assert status == 200, (interface, host, body)


@pytest.mark.process
def test_plaintext_remote_bind_refused(tmp_path: Path) -> None:
    port = free_port()
    broker = Broker(tmp_path, write_config(tmp_path, listen=[f"tcp:{port}:interface=0.0.0.0"]))
    status, stderr = broker.wait_exit()
    assert status == 78  # EX_CONFIG: a supervisor does not restart it
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("relay: config error: broker.listen: plaintext endpoint")
    assert "0.0.0.0" in lines[0]


@pytest.mark.process
def test_allow_insecure_remote_starts_with_a_warning(tmp_path: Path, running: List[Broker]) -> None:
    port = free_port()
    broker = start_broker(
        tmp_path,
        [("127.0.0.1", port)],
        listen=[f"tcp:{port}:interface=0.0.0.0"],
        allowInsecureRemote=True,
    )
    running.append(broker)
    assert call(port, "GET", "/", agent=None)[0] == 200
    assert "broker.allowInsecureRemote is set" in broker.log()


@pytest.mark.parametrize(
    "broker, path, reason",
    [
        ({"listen": ["ssl:{port}:privateKey=tls/missing.key:certKey=tls/server.crt"]},
         "tls/missing.key", "file not found"),
        ({"listen": ["ssl:{port}:privateKey=tls/stray.key:certKey=tls/server.crt"]},
         "tls/server.crt", "does not match the private key"),
        ({"listen": ["ssl:{port}:privateKey=tls/server.key:certKey=tls/server.key"]},
         "tls/server.key", "no PEM certificate found"),
        ({"listen": ["ssl:{port}:privateKey=tls/server.key:certKey=tls/server.crt"],
          "tlsClientCA": "tls/none.crt"},
         "tls/none.crt", "file not found"),
    ],
    ids=["missing-key", "mismatched-key", "no-certificate", "missing-client-ca"],
)
@pytest.mark.process
def test_bad_key_or_certificate_refused_at_start(
    workdir: Path, broker: Dict[str, Any], path: str, reason: str
) -> None:
    port = free_port()
    settings = dict(broker, listen=[s.format(port=port) for s in broker["listen"]])
    status, stderr = Broker(workdir, write_config(workdir, **settings)).wait_exit()
    assert status == 78
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("relay: config error: broker.")
    assert f"{workdir / path}: " in lines[0]
    assert reason in lines[0]
