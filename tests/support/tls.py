"""TLS for the tests: a throwaway PKI made at test time (a CA, a server certificate for
127.0.0.1, ::1 and localhost, client certificates, and a second CA nobody trusts), and
``twistd -n relay`` processes with TLS listeners, talked to with the standard library's
``http.client`` and ``ssl``.
"""

from __future__ import annotations

import datetime
import http.client
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from ipaddress import ip_address
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from relay.wire.signing import sign

# -- a throwaway PKI -----------------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_certificate(
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


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def write_cert(path: Path, certificate: x509.Certificate) -> None:
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def make_pki(d: Path) -> Path:
    """A directory of PEM files: ca, server, client, other-ca, other-client, stray.key."""
    ca_key, other_ca_key = new_key(), new_key()
    ca = make_certificate("relay test CA", ca_key)
    other_ca = make_certificate("untrusted CA", other_ca_key)
    write_cert(d / "ca.crt", ca)
    write_cert(d / "other-ca.crt", other_ca)
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
        key = new_key()
        write_key(d / f"{name}.key", key)
        write_cert(d / f"{name}.crt", make_certificate(name, key, issuer, usage, names))
    write_key(d / "stray.key", new_key())
    return d


# -- the real broker process ---------------------------------------------------------------


SECRET = "tls-test-secret-0123"


TWISTD = str(Path(sys.executable).with_name("twistd"))


START_TIMEOUT = 20.0


REQUEST_TIMEOUT = 5.0


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
