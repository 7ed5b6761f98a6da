"""The client's TLS: how https connections to the broker are trusted, and what a
failed handshake is called.

https always verifies the broker's certificate, against the system trust store
or a given CA file, and its host name, and presents a client certificate when
one is configured. :func:`describe_tls_failure` turns a refused handshake into
one sentence that says what to change (the CA file, the client certificate, the
URL's scheme or host).
"""

from __future__ import annotations

import functools
import os
from typing import Any, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from relay.client.settings import ENV_CA_FILE, ENV_CLIENT_CERT
from relay.files import pem
from relay.wire.errors import RelayError

# TLS alerts from a broker that refused this client's certificate (or its absence).
_CLIENT_CERTIFICATE_ALERTS = (
    "certificate required",
    "unknown ca",
    "bad certificate",
    "certificate unknown",
    "certificate expired",
    "certificate revoked",
    "unsupported certificate",
    "access denied",
)


# What OpenSSL says when the other side answered a ClientHello in plain text.
_PLAIN_HTTP_REASONS = (
    "wrong version number",
    "packet length too long",
    "http request",
    "unknown protocol",
    "record layer failure",
)


def _bad_file(code: str, what: str, path: str, problem: pem.PEMError) -> RelayError:
    """The RelayError for ``problem`` with the file ``path``.

    ``what`` names the file (``CA file``, ``client key``) for a read failure or a
    certificate problem.
    """
    if isinstance(problem, pem.Unreadable):
        text = f"cannot read {what} {path}: {problem.reason}"
    elif isinstance(problem, pem.NoCertificate):
        text = f"no PEM certificate found in {what} {path}"
    elif isinstance(problem, pem.MalformedCertificate):
        text = f"malformed certificate in {what} {path}: {problem}"
    elif isinstance(problem, pem.NoPrivateKey):
        text = f"no PEM private key found in {path}"
    elif isinstance(problem, pem.EncryptedKey):
        text = f"the private key in {path} is encrypted; the client needs it unencrypted"
    else:
        text = f"malformed private key in {path}: {problem}"
    return RelayError(0, code, text)


def load_trust_root(ca_file: str) -> Any:
    """A trust root holding every certificate of the PEM bundle ``ca_file``.

    An unreadable file, or one without a well-formed PEM certificate, is a
    ``RelayError(0, "bad_ca_file", ...)`` naming the path.
    """
    try:
        return pem.trust_root(pem.certificates(pem.read(os.path.expanduser(ca_file))))
    except pem.PEMError as problem:
        raise _bad_file("bad_ca_file", "CA file", ca_file, problem) from None


def load_client_certificate(
    cert_file: str, key_file: Optional[str] = None
) -> Tuple[Any, List[Any]]:
    """This client's certificate and key, and the intermediates to send after it.

    ``cert_file`` holds the PEM certificate, then any intermediate certificates;
    the unencrypted PEM key is in ``key_file``, or in ``cert_file`` itself when
    ``key_file`` is ``None``. Returns a Twisted ``PrivateCertificate`` and a list
    of pyOpenSSL ``X509`` intermediates. Every problem is a
    ``RelayError(0, "bad_client_cert", ...)`` naming the path.
    """
    from OpenSSL import crypto
    from twisted.internet.ssl import Certificate, KeyPair, PrivateCertificate

    code = "bad_client_cert"
    try:
        cert_data = pem.read(os.path.expanduser(cert_file))
        chain = pem.certificates(cert_data)
    except pem.PEMError as problem:
        raise _bad_file(code, "client certificate", cert_file, problem) from None
    if key_file is None:
        key_path = cert_file
        try:
            key = pem.private_key(cert_data)
        except pem.NoPrivateKey:
            raise RelayError(
                0, code, f"no PEM private key found in {cert_file}; give the key with --client-key"
            ) from None
        except pem.PEMError as problem:
            raise _bad_file(code, "client certificate", cert_file, problem) from None
    else:
        key_path = key_file
        try:
            key = pem.private_key(pem.read(os.path.expanduser(key_file)))
        except pem.PEMError as problem:
            raise _bad_file(code, "client key", key_file, problem) from None
    if not pem.matches(chain[0], key):
        raise RelayError(
            0, code, f"the client certificate {cert_file} does not match the key in {key_path}"
        )
    certificate = PrivateCertificate.fromCertificateAndKeyPair(
        Certificate(crypto.X509.from_cryptography(chain[0])),
        KeyPair(crypto.PKey.from_cryptography_key(key)),
    )
    return certificate, [crypto.X509.from_cryptography(c) for c in chain[1:]]


@implementer(IPolicyForHTTPS)
class ClientTLSPolicy:
    """How https connections to the broker verify it, and prove who this client is.

    The broker's certificate must chain to ``trust_root`` (a CA bundle, or the
    system trust store) and name the host of the URL; there is no mode without
    verification. ``client_certificate`` is presented when the broker asks.
    """

    def __init__(
        self,
        trust_root: Any,
        client_certificate: Any = None,
        extra_chain: Sequence[Any] = (),
    ) -> None:
        self.trust_root = trust_root
        self.client_certificate = client_certificate
        self.extra_chain = list(extra_chain)

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        """The connection creator for ``hostname:port``: verify it, maybe present ours."""
        from twisted.internet.ssl import optionsForClientTLS

        extra = {"extraCertChain": self.extra_chain} if self.extra_chain else None
        return _NamesChecked(
            optionsForClientTLS(
                hostname.decode("ascii"),
                trustRoot=self.trust_root,
                clientCertificate=self.client_certificate,
                extraCertificateOptions=extra,
            ),
            hostname.decode("ascii"),
        )


@functools.cache
def _names_unchecked_error() -> type:
    """The error of a broker certificate that names no host (made once)."""
    from service_identity import VerificationError

    class NoSubjectAltName(VerificationError):
        """The broker's certificate names no host (it has no subjectAltName)."""

    return NoSubjectAltName


class _NamesChecked:
    """Twisted's client connection creator, its host name check made strict.

    Twisted's check logs, and then lets the handshake go on, when the broker's
    certificate has no subjectAltName at all (service_identity raises its
    ``CertificateError`` there, which Twisted does not expect): any certificate of
    the trusted CA without names — an agent's client certificate, say — would pass
    for the broker. This creator's check refuses it, and otherwise decides as
    Twisted's does.
    """

    def __init__(self, creator: Any, hostname: str) -> None:
        from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
        from zope.interface import directlyProvides

        self.creator = creator
        self.hostname = hostname
        directlyProvides(self, IOpenSSLClientConnectionCreator)

    def clientConnectionForTLS(self, tls_protocol: Any) -> Any:
        from OpenSSL.SSL import VERIFY_FAIL_IF_NO_PEER_CERT, VERIFY_PEER
        from service_identity import CertificateError, VerificationError
        from service_identity.hazmat import DNS_ID, IPAddress_ID, verify_service_identity
        from service_identity.pyopenssl import extract_patterns
        from twisted.internet.abstract import isIPAddress, isIPv6Address
        from twisted.python.failure import Failure

        connection = self.creator.clientConnectionForTLS(tls_protocol)
        literal = isIPAddress(self.hostname) or isIPv6Address(self.hostname)
        wanted = IPAddress_ID(self.hostname) if literal else DNS_ID(self.hostname)
        protocol = [tls_protocol]  # dropped after the leaf's check: no reference cycle

        def verify(conn: Any, cert: Any, errno: int, depth: int, ok: int) -> bool:
            if not ok or depth != 0:
                return bool(ok)
            try:
                verify_service_identity(extract_patterns(cert), [wanted], [])
            except CertificateError:
                error: BaseException = _names_unchecked_error()(errors=[])
            except VerificationError as mismatch:
                error = mismatch
            else:
                protocol.clear()
                return True
            if protocol:
                protocol.pop().failVerification(Failure(error))
            return False

        connection.set_verify(VERIFY_PEER | VERIFY_FAIL_IF_NO_PEER_CERT, verify)
        return connection


def client_tls_policy(
    ca_file: Optional[str] = None,
    client_cert: Optional[str] = None,
    client_key: Optional[str] = None,
) -> ClientTLSPolicy:
    """The https policy: trust ``ca_file`` (else the system store), present ``client_cert``.

    Reads and checks every file now, so a bad path fails before any connection
    with a RelayError naming it (``bad_ca_file`` or ``bad_client_cert``).
    """
    from twisted.internet.ssl import platformTrust

    if client_key is not None and client_cert is None:
        raise RelayError(
            0, "bad_client_cert", f"a client key ({client_key}) needs a client certificate"
        )
    trust_root = load_trust_root(ca_file) if ca_file is not None else platformTrust()
    certificate: Any = None
    chain: List[Any] = []
    if client_cert is not None:
        certificate, chain = load_client_certificate(client_cert, client_key)
    return ClientTLSPolicy(trust_root, certificate, chain)


def make_http_client(
    reactor: Any,
    ca_file: Optional[str] = None,
    client_cert: Optional[str] = None,
    client_key: Optional[str] = None,
) -> Any:
    """A treq HTTPClient whose https connections always verify the broker.

    :param ca_file: a PEM CA bundle to trust instead of the system trust store.
    :param client_cert: a PEM client certificate (optionally followed by its
        intermediates, and holding the key when ``client_key`` is not given).
    :param client_key: the PEM private key of ``client_cert``.
    :raises RelayError: ``bad_ca_file`` / ``bad_client_cert`` naming the path.
    """
    from treq.client import HTTPClient
    from twisted.web.client import Agent, HTTPConnectionPool

    policy = client_tls_policy(ca_file, client_cert, client_key)
    pool = HTTPConnectionPool(reactor, persistent=True)
    return HTTPClient(Agent(reactor, contextFactory=policy, pool=pool))


def tls_failure(failure: BaseException) -> Optional[BaseException]:
    """The TLS error (OpenSSL's or a host name mismatch) inside a connection failure."""
    from OpenSSL import SSL
    from service_identity import VerificationError

    pending: List[BaseException] = [failure]
    while pending:
        current = pending.pop()
        if isinstance(current, (SSL.Error, VerificationError)):
            return current
        for reason in getattr(current, "reasons", None) or []:
            value = getattr(reason, "value", None)
            if isinstance(value, BaseException):
                pending.append(value)
    return None


def _openssl_reasons(error: BaseException) -> str:
    """OpenSSL's reason strings, e.g. ``certificate verify failed``."""
    reasons = []
    details = error.args[0] if error.args and isinstance(error.args[0], list) else []
    for entry in details:
        if isinstance(entry, tuple) and entry and entry[-1]:
            reasons.append(str(entry[-1]))
    return "; ".join(reasons) or str(error) or error.__class__.__name__


def describe_tls_failure(
    error: BaseException,
    broker_url: str,
    ca_file: Optional[str] = None,
    client_cert: Optional[str] = None,
) -> str:
    """What went wrong in the TLS handshake with ``broker_url``, and what to do about it."""
    from service_identity import VerificationError

    where = f"TLS handshake with {broker_url} failed"
    if isinstance(error, _names_unchecked_error()):
        return (
            f"{where}: the broker's certificate names no host (it has no subjectAltName); "
            "reissue it with the names and addresses clients connect to"
        )
    if isinstance(error, VerificationError):
        host = urlsplit(broker_url).hostname
        return (
            f"{where}: the broker's certificate is not valid for {host!r} ({error}); "
            "connect with a name or address listed in its subjectAltName, or reissue it"
        )
    reason = _openssl_reasons(error)
    if "certificate verify failed" in reason:
        if ca_file is not None:
            return (
                f"{where}: the broker's certificate does not verify against the CA file "
                f"{ca_file} ({reason}); --ca-file must hold the CA that signed it"
            )
        return (
            f"{where}: the broker's certificate does not verify against the system trust "
            f"store ({reason}); pass --ca-file (or set {ENV_CA_FILE}) with the CA that signed it"
        )
    if any(alert in reason for alert in _CLIENT_CERTIFICATE_ALERTS):
        if client_cert is None:
            return (
                f"{where}: the broker requires a client certificate and none was given "
                f"({reason}); pass --client-cert and --client-key (or set {ENV_CLIENT_CERT})"
            )
        return (
            f"{where}: the broker refused the client certificate {client_cert} ({reason}); "
            "it must be signed by the CA in the broker's tlsClientCA"
        )
    if any(sign in reason for sign in _PLAIN_HTTP_REASONS):
        plain = urlsplit(broker_url)._replace(scheme="http").geturl()
        return (
            f"{where}: the broker speaks plain HTTP here, not TLS ({reason}); "
            f"is this the https port? For plain HTTP use {plain}"
        )
    hint = "check that the URL is the broker's https port"
    if client_cert is None:
        hint += "; if the broker requires client certificates, pass --client-cert"
    return f"{where} ({reason}); {hint}"
