"""TLS listeners, client certificates and the start-time safety rails.

The certificates are made here, at test time: a throwaway CA, a server
certificate for 127.0.0.1, ::1 and localhost, client certificates, and a
second CA nobody trusts. The end-to-end tests run the real
``twistd -n relay`` process and talk to it with the standard library's
``http.client`` and ``ssl``.
"""

from __future__ import annotations

import datetime
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from ipaddress import ip_address
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import pytest_twisted
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
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
from relay.wire.signing import sign

SECRET = "tls-test-secret-0123"
TWISTD = str(Path(sys.executable).with_name("twistd"))
START_TIMEOUT = 20.0
REQUEST_TIMEOUT = 5.0


# -- a throwaway PKI ----------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: Optional[Tuple[x509.Certificate, ec.EllipticCurvePrivateKey]] = None,
    usage: Optional[x509.ObjectIdentifier] = None,
    names: Tuple[str, ...] = (),
    days: int = 2,
) -> x509.Certificate:
    """A certificate for ``key``: a self-signed CA without ``issuer``, else a leaf."""
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name = issuer[0].subject if issuer else _name(subject)
    signing_key = issuer[1] if issuer else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=max(0, -days) + 1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()), False
        )
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
    else:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), False)
    if names:
        entries: List[x509.GeneralName] = []
        for name in names:
            try:
                entries.append(x509.IPAddress(ip_address(name)))
            except ValueError:
                entries.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(entries), False)
    return builder.sign(signing_key, hashes.SHA256())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _write_cert(path: Path, certificate: x509.Certificate) -> None:
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A directory of PEM files: ca, server, client, other-ca, other-client, stray.key."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_ca_key = _new_key(), _new_key()
    ca = _certificate("relay test CA", ca_key)
    other_ca = _certificate("untrusted CA", other_ca_key)
    _write_cert(d / "ca.crt", ca)
    _write_cert(d / "other-ca.crt", other_ca)
    leaves = {
        "server": (
            (ca, ca_key),
            ExtendedKeyUsageOID.SERVER_AUTH,
            ("127.0.0.1", "::1", "localhost"),
        ),
        "client": ((ca, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH, ()),
        "other-client": ((other_ca, other_ca_key), ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    }
    for name, (issuer, usage, names) in leaves.items():
        key = _new_key()
        _write_key(d / f"{name}.key", key)
        _write_cert(d / f"{name}.crt", _certificate(name, key, issuer, usage, names))
    _write_key(d / "stray.key", _new_key())
    return d


@pytest.fixture
def workdir(tmp_path: Path, pki: Path) -> Path:
    """A fresh directory holding a copy of the PKI under ``tls/``."""
    shutil.copytree(pki, tmp_path / "tls")
    return tmp_path


# -- the real broker process -------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ipv6_available() -> bool:
    try:
        free_port("::1")
    except OSError:
        return False
    return True


def dual_stack_available() -> bool:
    """Whether a socket bound to ``::`` also accepts IPv4 connections (IPv4-mapped peers)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:
            server.bind(("::", 0))
            server.listen(1)
            socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=1).close()
    except OSError:
        return False
    return True


def write_config(directory: Path, **broker: Any) -> Path:
    values: Dict[str, Any] = {"secret": SECRET, "storage": "memory"}
    values.update(broker)
    path = directory / "relay.yaml"
    path.write_text(yaml.safe_dump({"broker": values}))
    return path


class Broker:
    """A running ``twistd -n relay`` process; its output goes to ``twistd.log``."""

    def __init__(self, directory: Path, config: Path) -> None:
        self.log_path = directory / "twistd.log"
        self.err_path = directory / "twistd.err"
        with open(self.log_path, "wb") as out, open(self.err_path, "wb") as err:
            self.process = subprocess.Popen(
                [TWISTD, "-n", "--pidfile", str(directory / "twistd.pid"), "relay",
                 "--config", str(config)],
                cwd=str(directory),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") + self.err_path.read_text(
            errors="replace"
        )

    def wait_listening(self, addresses: List[Tuple[str, int]]) -> None:
        """Return once every address accepts connections; fail if the process exits."""
        deadline = time.monotonic() + START_TIMEOUT
        pending = list(addresses)
        while pending:
            if self.process.poll() is not None:
                pytest.fail(f"broker exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"broker did not listen on {pending} in time:\n{self.log()}")
            host, port = pending[0]
            try:
                socket.create_connection((host, port), timeout=0.5).close()
            except OSError:
                time.sleep(0.05)
            else:
                pending.pop(0)

    def wait_exit(self) -> Tuple[int, str]:
        """The exit status and the standard error of a broker that must stop by itself."""
        try:
            status = self.process.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"broker kept running:\n{self.log()}")
        return status, self.err_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def start_broker(directory: Path, addresses: List[Tuple[str, int]], **broker: Any) -> Broker:
    process = Broker(directory, write_config(directory, **broker))
    try:
        process.wait_listening(addresses)
    except BaseException:
        process.stop()
        raise
    return process


@pytest.fixture
def running() -> Iterator[List[Broker]]:
    """Brokers started by a test; every one is stopped afterwards."""
    brokers: List[Broker] = []
    yield brokers
    for broker in brokers:
        broker.stop()


def client_context(
    ca: Optional[Path], cert: Optional[Path] = None, key: Optional[Path] = None
) -> ssl.SSLContext:
    """A verifying client context; ``ca=None`` means the system trust store."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def call(
    port: int,
    method: str,
    path: str,
    body: Optional[Dict[str, Any]] = None,
    agent: Optional[str] = "alpha",
    host: str = "127.0.0.1",
    context: Optional[ssl.SSLContext] = None,
) -> Tuple[int, Any]:
    """One signed request (spec §3); HTTPS when ``context`` is given."""
    raw = json.dumps(body).encode("utf-8") if body is not None else b""
    headers = {"Content-Type": "application/json; charset=utf-8"}
    if agent is not None:
        ts = int(time.time())
        headers.update(
            {
                "X-Relay-Agent": agent,
                "X-Relay-Timestamp": str(ts),
                "X-Relay-Signature": sign(SECRET, method, path, ts, raw),
            }
        )
    if context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=REQUEST_TIMEOUT, context=context
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request(method, path, body=raw or None, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def handshake(port: int, context: ssl.SSLContext, server_hostname: str) -> None:
    """A TLS handshake with the broker on 127.0.0.1, naming the server ``server_hostname``."""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) as raw:
        context.wrap_socket(raw, server_hostname=server_hostname).close()


def ssl_listen(port: int, interface: str, directory: str = "tls") -> str:
    escaped = interface.replace(":", "\\:")
    return (
        f"ssl:{port}:interface={escaped}:privateKey={directory}/server.key"
        f":certKey={directory}/server.crt"
    )


# -- end to end ----------------------------------------------------------------


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


# -- in process ----------------------------------------------------------------


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


def _listened_context(endpoint) -> SSL.Context:
    return endpoint.options.getContext()


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
    key = _new_key()
    ca_key = _new_key()
    ca = _certificate("ca", ca_key)
    expired = _certificate("server", key, (ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, days=-1)
    _write_key(tmp_path / "s.key", key)
    _write_cert(tmp_path / "s.crt", expired)
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


# -- cipher suites and renegotiation --------------------------------------------------


@pytest.fixture(scope="module")
def rsa_listener(tmp_path_factory) -> Any:
    """An ``ssl:`` listener with an RSA key: the only kind a static-RSA suite could use."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    from relay.broker.tls import TLSListener

    d = tmp_path_factory.mktemp("rsa")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(d / "server.key", key)  # type: ignore[arg-type]
    _write_cert(d / "server.crt", _certificate("127.0.0.1", key, names=("127.0.0.1",)))  # type: ignore[arg-type]
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
