"""The broker's TLS listeners in process: ``ssl:`` and ``relay-tls:`` endpoints parsed,
client certificates asked for by ``broker.tlsClientCA``, keys and certificates checked
at start, the rate limit of each address family, and only forward-secret suites with no
client renegotiation.

The certificates are made at test time (tests/support/tls.py); the real process is
tests/processes/test_tls.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import SSL
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor
from twisted.logger import capturedLogs

from relay.broker.api import _peer_host
from relay.broker.tls import parse_ssl_endpoint, server_endpoints
from relay.rules.auth import RateLimiter
from relay.wire.errors import ConfigError, RelayError
from relay.wire.protocol import is_loopback_host
from tests.support.tls import (
    REQUEST_TIMEOUT,
    make_certificate,
    make_pki,
    new_key,
    ssl_listen,
    write_cert,
    write_key,
)


def _listened_context(endpoint) -> SSL.Context:
    return endpoint.options.getContext()


@pytest.fixture(scope="module")
def rsa_listener(tmp_path_factory) -> Any:
    """An ``ssl:`` listener with an RSA key: the only kind a static-RSA suite could use."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    from relay.broker.tls import TLSListener

    d = tmp_path_factory.mktemp("rsa")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_key(d / "server.key", key)  # type: ignore[arg-type]
    write_cert(d / "server.crt", make_certificate("127.0.0.1", key, names=("127.0.0.1",)))  # type: ignore[arg-type]
    return TLSListener(port=0, private_key=str(d / "server.key"),
                       cert_key=str(d / "server.crt"), interface="127.0.0.1")


def _handshake(port: int, ciphers: str, renegotiate: bool = False) -> str:
    """A TLS 1.2 client offering only ``ciphers``: the suite it got, then (with
    ``renegotiate``) ``"renegotiated"`` or ``"renegotiation refused"``."""
    context = SSL.Context(SSL.TLS_CLIENT_METHOD)
    context.set_max_proto_version(SSL.TLS1_2_VERSION)
    context.set_cipher_list(ciphers.encode("ascii"))
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) as sock:
        # pyOpenSSL needs a blocking socket; the kernel's receive timeout bounds the reads.
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", int(REQUEST_TIMEOUT), 0))
        connection = SSL.Connection(context, sock)
        connection.set_connect_state()
        try:
            connection.do_handshake()
        except SSL.Error:
            return "refused"
        suite = connection.get_cipher_name()
        if not renegotiate:
            return suite
        connection.sendall(b"ping")
        assert connection.recv(4) == b"ping"
        assert connection.renegotiate()
        try:
            connection.do_handshake()
            connection.sendall(b"pong")
            answer = connection.recv(4)
        except (SSL.Error, OSError):
            return "renegotiation refused"
        if connection.total_renegotiations() and answer == b"pong":
            return "renegotiated"
        return "renegotiation refused"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A directory of PEM files: ca, server, client, other-ca, other-client, stray.key."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_parse_ssl_endpoint_positional_and_named() -> None:
    listener = parse_ssl_endpoint("ssl:19443:/k/server.pem:backlog=7:interface=\\:\\:1")
    assert (listener.port, listener.private_key, listener.cert_key) == (
        19443,
        "/k/server.pem",
        "/k/server.pem",
    )
    assert (listener.interface, listener.backlog) == ("::1", 7)


@pytest.mark.parametrize(
    "description, reason",
    [
        ("ssl:19443", "privateKey=PATH is required"),
        ("ssl:privateKey=/k", "the port is missing"),
        ("ssl:99999:privateKey=/k", "port must be a number from 0 to 65535"),
        ("ssl:1:privateKey=/k:caCerts=/x", "unknown ssl: endpoint option 'caCerts'"),
        ("ssl:1:privateKey=/k:sslmethod=NOPE", "unknown sslmethod 'NOPE'"),
        ("ssl:1:privateKey=/k:port=2", "port is given twice"),
    ],
)
def test_parse_ssl_endpoint_errors(description: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_ssl_endpoint(description)
    assert caught.value.key == "broker.listen"
    assert reason in caught.value.reason


def test_client_ca_makes_every_ssl_listener_require_a_certificate(pki: Path) -> None:
    reactor = MemoryReactor()
    tls = ssl_listen(1, "127.0.0.1", str(pki))
    endpoints = server_endpoints(reactor, [tls, "tcp:2:interface=127.0.0.1"], str(pki / "ca.crt"))
    mode = _listened_context(endpoints[0]).get_verify_mode()
    assert mode & SSL.VERIFY_PEER and mode & SSL.VERIFY_FAIL_IF_NO_PEER_CERT
    endpoints[1].listen(object())
    assert [p[:1] for p in reactor.tcpServers] == [(2,)]

    plain = server_endpoints(MemoryReactor(), [tls])[0]
    assert _listened_context(plain).get_verify_mode() == SSL.VERIFY_NONE


def test_client_ca_without_an_ssl_listener_is_an_error(pki: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        server_endpoints(MemoryReactor(), ["tcp:2:interface=127.0.0.1"], str(pki / "ca.crt"))
    assert caught.value.key == "broker.tlsClientCA"


def test_encrypted_key_and_unreadable_file_refused(tmp_path: Path, pki: Path) -> None:
    key = serialization.load_pem_private_key((pki / "server.key").read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    description = f"ssl:1:privateKey={encrypted}:certKey={pki / 'server.crt'}"
    with pytest.raises(ConfigError, match="the private key is encrypted"):
        server_endpoints(MemoryReactor(), [description])

    if os.geteuid() == 0:
        return
    unreadable = tmp_path / "unreadable.key"
    shutil.copy(pki / "server.key", unreadable)
    unreadable.chmod(0)
    description = f"ssl:1:privateKey={unreadable}:certKey={pki / 'server.crt'}"
    with pytest.raises(ConfigError, match=f"{unreadable}: cannot read: Permission denied"):
        server_endpoints(MemoryReactor(), [description])


def test_malformed_or_missing_key_refused_with_the_path(tmp_path: Path, pki: Path) -> None:
    broken = tmp_path / "broken.key"
    broken.write_text("-----BEGIN PRIVATE KEY-----\nbm90IGRlcg==\n-----END PRIVATE KEY-----\n")
    certificate = pki / "server.crt"
    with pytest.raises(ConfigError) as caught:
        server_endpoints(MemoryReactor(), [f"ssl:1:privateKey={broken}:certKey={certificate}"])
    assert caught.value.reason.startswith(f"{broken}: malformed PEM private key")
    with pytest.raises(ConfigError) as caught:
        server_endpoints(MemoryReactor(), [f"ssl:1:privateKey={certificate}"])
    assert caught.value.reason == f"{certificate}: no PEM private key found"


def test_expired_certificate_logs_a_warning(tmp_path: Path) -> None:
    key = new_key()
    ca_key = new_key()
    ca = make_certificate("ca", ca_key)
    expired = make_certificate("server", key, (ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH,
                               days=-1)
    write_key(tmp_path / "s.key", key)
    write_cert(tmp_path / "s.crt", expired)
    with capturedLogs() as events:
        server_endpoints(
            MemoryReactor(), [f"ssl:1:privateKey={tmp_path}/s.key:certKey={tmp_path}/s.crt"]
        )
    assert any("expired" in e["log_format"] for e in events)


@pytest.mark.parametrize(
    "address, loopback",
    [
        (IPv4Address("TCP", "127.0.0.1", 5), True),
        (IPv4Address("TCP", "127.8.9.10", 5), True),
        (IPv4Address("TCP", "192.0.2.7", 5), False),
        (IPv6Address("TCP", "::1", 5), True),
        (IPv6Address("TCP", "2001:db8::1", 5), False),
        (IPv6Address("TCP", "::ffff:127.0.0.1", 5), True),
        (IPv6Address("TCP", "::ffff:192.0.2.7", 5), False),
        (IPv6Address("TCP", "fe80::1%eth0", 5), False),
    ],
)
def test_rate_limit_class_of_each_address_family(address, loopback: bool) -> None:
    class Request:
        def getClientAddress(self):
            return address

    host = _peer_host(Request())
    assert host == address.host
    assert is_loopback_host(host) is loopback
    limiter = RateLimiter(Clock(), loopback=3, remote=1)
    assert limiter.limit_for(host) == (3 if loopback else 1)
    limiter.hit(host)
    if loopback:
        limiter.hit(host)
    else:
        with pytest.raises(RelayError) as caught:
            limiter.hit(host)
        assert caught.value.code == "rate_limited"


@pytest_twisted.ensureDeferred
async def test_only_forward_secret_suites_and_no_client_renegotiation(rsa_listener) -> None:
    from twisted.internet import reactor
    from twisted.internet.protocol import Factory, Protocol
    from twisted.internet.threads import deferToThread

    from relay.broker.tls import TLSServerEndpoint, certificate_options

    class Echo(Protocol):
        def dataReceived(self, data: bytes) -> None:  # noqa: N802 (Twisted's name)
            self.transport.write(data)

    options = certificate_options(rsa_listener)
    endpoint = TLSServerEndpoint(reactor, 0, options, 50, "127.0.0.1")
    listening = await endpoint.listen(Factory.forProtocol(Echo))
    port = listening.getHost().port
    try:
        static_rsa = ("AES128-SHA:AES256-SHA:AES128-SHA256:AES256-SHA256:AES128-GCM-SHA256"
                      ":AES256-GCM-SHA384")
        assert await deferToThread(_handshake, port, static_rsa) == "refused"
        assert (await deferToThread(_handshake, port, "ECDHE-RSA-AES128-GCM-SHA256")
                == "ECDHE-RSA-AES128-GCM-SHA256")
        assert (await deferToThread(_handshake, port, "ECDHE-RSA-AES128-GCM-SHA256", True)
                == "renegotiation refused")
    finally:
        await listening.stopListening()


def test_the_relay_tls_endpoint_type_is_a_twisted_plugin(pki: Path) -> None:
    """``relay-tls:`` comes from Twisted's plugin scan; ``clientCA`` asks for
    client certificates as ``broker.tlsClientCA`` does for ``ssl:``."""
    from twisted.internet.endpoints import serverFromString

    key, cert, ca = pki / "server.key", pki / "server.crt", pki / "ca.crt"
    endpoint = serverFromString(
        MemoryReactor(), f"relay-tls:1:privateKey={key}:certKey={cert}:clientCA={ca}")
    mode = _listened_context(endpoint).get_verify_mode()
    assert mode & SSL.VERIFY_PEER and mode & SSL.VERIFY_FAIL_IF_NO_PEER_CERT
    plain = serverFromString(MemoryReactor(), f"relay-tls:1:privateKey={key}:certKey={cert}")
    assert _listened_context(plain).get_verify_mode() == SSL.VERIFY_NONE
