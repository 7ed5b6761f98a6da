"""The relay's TLS listener: the ``relay-tls:`` endpoint-string parser plugin.

It takes the options of Twisted's own ``ssl:`` server endpoint (``port``,
``privateKey``, ``certKey``, ``sslmethod``, ``interface``, ``backlog``,
``extraCertChain``, ``dhParameters``) and ``clientCA``; the ``ssl:`` strings of
the relay's config are served by it (:func:`relay.rules.endpoints.twisted_description`).
Every file it names is read and checked before the broker listens, so a
missing, unreadable, malformed or mismatched key or certificate stops the start
with the path and the reason. With ``clientCA`` (``broker.tlsClientCA``), the
listener requires a client certificate signed by a CA in that file and refuses
any other client during the handshake. A client that speaks plain HTTP to it
gets a plain ``400`` saying the port speaks TLS.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from cryptography import x509
from OpenSSL import SSL, crypto
from twisted.internet import ssl
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import (
    IProtocolFactory,
    IStreamServerEndpoint,
    IStreamServerEndpointStringParser,
)
from twisted.logger import Logger
from twisted.plugin import IPlugin
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.filepath import FilePath
from zope.interface import implementer

from relay.broker.site import closing_response
from relay.files import pem
from relay.rules.endpoints import (
    TLS_PREFIX,
    server_endpoints,
    split_endpoint,
    unescape_endpoint_value,
)
from relay.wire.errors import ConfigError

__all__ = ["TLSListener", "TLSListenerParser", "TLSServerEndpoint", "parse_ssl_endpoint",
           "server_endpoints"]

log = Logger(namespace="relay.tls")

LISTEN_KEY = "broker.listen"
CLIENT_CA_KEY = "broker.tlsClientCA"

# The parameters of Twisted's ``ssl:`` server parser, in positional order.
_SSL_PARAMETERS = (
    "port",
    "privateKey",
    "certKey",
    "sslmethod",
    "interface",
    "backlog",
    "extraCertChain",
    "dhParameters",
)
_DEFAULT_BACKLOG = 50
# TLS 1.2 suites with forward secrecy only: ECDHE or DHE key exchange, never the
# static-RSA suites (AES128-SHA and the like) that Twisted's defaults still allow.
# TLS 1.3 suites are all forward-secret.
FORWARD_SECRET_CIPHERS = (
    "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:ECDHE+AES:DHE+AES"
    ":!aNULL:!eNULL:!MD5:!DSS:!PSK:!SRP:!kRSA"
)


@dataclass(frozen=True)
class TLSListener:
    """The settings of one ``ssl:`` endpoint string; file paths as given."""

    port: int
    private_key: str
    cert_key: str
    interface: str = ""
    backlog: int = _DEFAULT_BACKLOG
    sslmethod: Optional[str] = None
    extra_cert_chain: Optional[str] = None
    dh_parameters: Optional[str] = None
    client_ca: Optional[str] = None


def parse_ssl_endpoint(description: str) -> TLSListener:
    """The settings of an ``ssl:`` (or ``relay-tls:``) endpoint string; ConfigError
    when malformed."""
    args, kwargs = [], {}
    for part in split_endpoint(description)[1:]:
        name, sep, value = part.partition("=")
        if sep:
            if name in kwargs:
                raise ConfigError(LISTEN_KEY, f"{description!r}: {name} is given twice")
            kwargs[name] = unescape_endpoint_value(value)
        else:
            args.append(unescape_endpoint_value(part))
    return listener_settings(description, args, kwargs)


def listener_settings(description: str, args: Sequence[str],
                      kwargs: Dict[str, str]) -> TLSListener:
    """The settings of a TLS listener from its endpoint string's arguments, as
    Twisted's ``ssl:`` parser reads them; ConfigError when malformed.

    ``privateKey`` is required (``certKey`` defaults to it, for a file that holds
    both).
    """
    if len(args) > len(_SSL_PARAMETERS):
        raise ConfigError(LISTEN_KEY, f"{description!r}: too many arguments")
    values: Dict[str, str] = dict(zip(_SSL_PARAMETERS, args))
    for name, value in kwargs.items():
        if name not in _SSL_PARAMETERS and name != "clientCA":
            raise ConfigError(
                LISTEN_KEY, f"{description!r}: unknown ssl: endpoint option {name!r}"
            )
        if name in values:
            raise ConfigError(LISTEN_KEY, f"{description!r}: {name} is given twice")
        values[name] = value

    port = _number(description, values, "port", None, 0, 65535)
    private_key = values.get("privateKey")
    if not private_key:
        raise ConfigError(LISTEN_KEY, f"{description!r}: privateKey=PATH is required")
    sslmethod = values.get("sslmethod")
    if sslmethod is not None and not (
        sslmethod.endswith("_METHOD") and isinstance(getattr(SSL, sslmethod, None), int)
    ):
        raise ConfigError(LISTEN_KEY, f"{description!r}: unknown sslmethod {sslmethod!r}")
    return TLSListener(
        port=port,
        private_key=private_key,
        cert_key=values.get("certKey") or private_key,
        interface=values.get("interface", ""),
        backlog=_number(description, values, "backlog", _DEFAULT_BACKLOG, 1, 65535),
        sslmethod=sslmethod,
        extra_cert_chain=values.get("extraCertChain") or None,
        dh_parameters=values.get("dhParameters") or None,
        client_ca=values.get("clientCA") or None,
    )


def _number(
    description: str, values: Dict[str, str], name: str, default: Optional[int], lo: int, hi: int
) -> int:
    raw = values.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(LISTEN_KEY, f"{description!r}: the port is missing")
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise ConfigError(
            LISTEN_KEY, f"{description!r}: {name} must be a number from {lo} to {hi}"
        )
    return int(raw)


def _config_error(key: str, path: str, problem: pem.PEMError, what: str = "") -> ConfigError:
    """``problem`` with the file ``path``, worded for the broker's config error line."""
    if isinstance(problem, pem.Unreadable):
        if isinstance(problem.error, FileNotFoundError):
            reason = "file not found"
        elif isinstance(problem.error, IsADirectoryError):
            reason = "is a directory, not a file"
        else:
            reason = f"cannot read: {problem.reason}"
    elif isinstance(problem, pem.NoPrivateKey):
        reason = "no PEM private key found"
    elif isinstance(problem, pem.EncryptedKey):
        reason = "the private key is encrypted; the broker needs it unencrypted"
    elif isinstance(problem, pem.MalformedKey):
        reason = f"malformed PEM private key: {problem}"
    elif isinstance(problem, pem.NoCertificate):
        reason = f"no PEM certificate found ({what})"
    else:
        reason = f"malformed PEM certificate ({what})"
    return ConfigError(key, f"{path}: {reason}")


def _load_private_key(path: str) -> Any:
    try:
        return pem.private_key(pem.read(path))
    except pem.PEMError as problem:
        raise _config_error(LISTEN_KEY, path, problem) from None


def _load_certificates(key: str, path: str, what: str) -> List[x509.Certificate]:
    try:
        return pem.certificates(pem.read(path))
    except pem.PEMError as problem:
        raise _config_error(key, path, problem, what) from None


def _validity(certificate: x509.Certificate) -> Tuple[datetime.datetime, datetime.datetime]:
    if hasattr(certificate, "not_valid_after_utc"):
        return certificate.not_valid_before_utc, certificate.not_valid_after_utc
    utc = datetime.timezone.utc
    return (
        certificate.not_valid_before.replace(tzinfo=utc),
        certificate.not_valid_after.replace(tzinfo=utc),
    )


def _warn_validity(path: str, certificate: x509.Certificate, now: datetime.datetime) -> None:
    not_before, not_after = _validity(certificate)
    if now > not_after:
        log.warn(
            "TLS certificate {path} expired on {date}; clients will refuse it",
            path=path,
            date=not_after.isoformat(),
        )
    elif now < not_before:
        log.warn(
            "TLS certificate {path} is not valid before {date}; clients will refuse it",
            path=path,
            date=not_before.isoformat(),
        )


def load_client_ca(path: str) -> Any:
    """The trust root for client certificates: every certificate in the PEM file ``path``."""
    return pem.trust_root(_load_certificates(CLIENT_CA_KEY, path, "client CA"))


def certificate_options(
    listener: TLSListener,
    client_ca: Optional[Any] = None,
    now: Optional[datetime.datetime] = None,
) -> ssl.CertificateOptions:
    """The TLS server settings of ``listener``, with every file loaded and checked.

    With ``client_ca``, a client must present a certificate that chains to it.
    Raises ConfigError naming the file and the problem.
    """
    key = _load_private_key(listener.private_key)
    certificate = _load_certificates(LISTEN_KEY, listener.cert_key, "server certificate")[0]
    if not pem.matches(certificate, key):
        raise ConfigError(
            LISTEN_KEY,
            f"{listener.cert_key}: the certificate does not match the private key "
            f"{listener.private_key}",
        )
    _warn_validity(
        listener.cert_key, certificate, now or datetime.datetime.now(datetime.timezone.utc)
    )
    chain = None
    if listener.extra_cert_chain is not None:
        chain = [
            crypto.X509.from_cryptography(c)
            for c in _load_certificates(
                LISTEN_KEY, listener.extra_cert_chain, "extraCertChain"
            )
        ]
    kwargs: Dict[str, object] = {}
    if listener.dh_parameters is not None:
        try:
            pem.read(listener.dh_parameters)
        except pem.Unreadable as problem:
            raise _config_error(LISTEN_KEY, listener.dh_parameters, problem) from None
        kwargs["dhParameters"] = ssl.DiffieHellmanParameters.fromFile(
            FilePath(listener.dh_parameters)
        )
    if listener.sslmethod is not None:
        kwargs["method"] = getattr(SSL, listener.sslmethod)
    if client_ca is not None:
        kwargs["trustRoot"] = client_ca
    options = ssl.CertificateOptions(
        privateKey=crypto.PKey.from_cryptography_key(key),
        certificate=crypto.X509.from_cryptography(certificate),
        extraCertChain=chain,
        acceptableCiphers=ssl.AcceptableCiphers.fromOpenSSLCipherString(FORWARD_SECRET_CIPHERS),
        **kwargs,
    )
    try:
        # Clients may not renegotiate: OpenSSL refuses it by default, and
        # tests/site/test_tls.py pins that (setting the option here would change the
        # context after Twisted has made a connection of it, which pyOpenSSL refuses).
        options.getContext()
    except SSL.Error as e:
        files = ", ".join(
            p for p in (listener.cert_key, listener.extra_cert_chain, listener.dh_parameters) if p
        )
        raise ConfigError(LISTEN_KEY, f"{files}: OpenSSL refused the settings: {e}") from None
    return options


PLAIN_HTTP_ON_TLS_PORT_RESPONSE = closing_response(
    b"400 Bad Request",
    b"bad_request",
    b"this port speaks TLS: use an https:// URL (is this the https port?)",
)


def _looks_like_plain_http(data: bytes) -> bool:
    """Whether a connection's first bytes are an HTTP request line, not a TLS record.

    Every HTTP method starts with an upper-case letter; a TLS record starts
    with its content type (22 for a handshake), an SSLv2 hello with 0x80.
    """
    return data[:1].isalpha() and data[:1].isupper()


class _TLSOrPlainAnswer(TLSMemoryBIOFactory.protocol):  # type: ignore[misc, valid-type]
    """TLS, except that a client speaking plain HTTP gets a plain ``400`` at once.

    Without it an ``http://`` URL pointed at the TLS port gets its connection
    dropped with no word, which clients report as a network failure and retry.
    """

    _first_bytes = True

    def dataReceived(self, data: bytes) -> None:
        if self._first_bytes:
            self._first_bytes = False
            if _looks_like_plain_http(data):
                self.transport.write(PLAIN_HTTP_ON_TLS_PORT_RESPONSE)
                self.transport.loseConnection()
                return
        super().dataReceived(data)


class _TLSServerFactory(TLSMemoryBIOFactory):
    protocol = _TLSOrPlainAnswer


@implementer(IStreamServerEndpoint)
class TLSServerEndpoint:
    """A TLS listener (what ``reactor.listenSSL`` builds) that answers plain HTTP clearly.

    :param options: the TLS server settings (:func:`certificate_options`).
    """

    def __init__(
        self, reactor: Any, port: int, options: ssl.CertificateOptions, backlog: int,
        interface: str,
    ) -> None:
        self.options = options
        self._tcp = TCP4ServerEndpoint(reactor, port, backlog=backlog, interface=interface)

    def listen(self, protocolFactory: IProtocolFactory) -> Any:  # noqa: N803 (the interface's name)
        """Listen; each connection speaks TLS to ``protocolFactory``'s protocol."""
        return self._tcp.listen(_TLSServerFactory(self.options, False, protocolFactory))


@implementer(IPlugin, IStreamServerEndpointStringParser)
class TLSListenerParser:
    """The ``relay-tls:`` endpoint-string parser (a Twisted plugin, found through
    ``twisted/plugins/relay_endpoints.py``)."""

    prefix = TLS_PREFIX

    def parseStreamServer(self, reactor: Any, *args: str,  # noqa: N802 (the interface's name)
                          **kwargs: str) -> TLSServerEndpoint:
        """A checked TLS listener; ConfigError naming the file and the problem."""
        description = ":".join([TLS_PREFIX, *args, *(f"{k}={v}" for k, v in kwargs.items())])
        listener = listener_settings(description, args, kwargs)
        client_ca = load_client_ca(listener.client_ca) if listener.client_ca else None
        options = certificate_options(listener, client_ca)
        return TLSServerEndpoint(reactor, listener.port, options, listener.backlog,
                                 listener.interface)
