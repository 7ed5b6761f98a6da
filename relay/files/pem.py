"""PEM certificates and private keys from files: for the broker's listeners and the client.

Every problem with a file is its own :class:`PEMError` subclass, so each side
words it for its reader: the broker as a config error naming the key, the
client as a ``RelayError`` naming the flag. Nothing here knows which side
asked.
"""

from __future__ import annotations

import re
from typing import Any, List, Sequence

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from OpenSSL import crypto
from twisted.internet import ssl

_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----", re.DOTALL
)
_PRIVATE_KEY = re.compile(
    rb"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----\r?\n.*?-----END \1PRIVATE KEY-----", re.DOTALL
)


class PEMError(Exception):
    """A file that does not give the certificates or the key asked for."""


class Unreadable(PEMError):
    """The file cannot be read; :attr:`error` is the ``OSError``."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or error.__class__.__name__)
        self.error = error

    @property
    def reason(self) -> str:
        """The operating system's reason, e.g. ``No such file or directory``."""
        return str(self)


class NoCertificate(PEMError):
    """The file holds no PEM certificate."""


class MalformedCertificate(PEMError):
    """A PEM certificate in the file does not parse; the text is the parser's reason."""


class NoPrivateKey(PEMError):
    """The file holds no PEM private key."""


class EncryptedKey(PEMError):
    """The private key is protected by a passphrase."""


class MalformedKey(PEMError):
    """The PEM private key does not parse; the text is the parser's reason."""


def read(path: str) -> bytes:
    """The bytes of the file ``path``; :class:`Unreadable` when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise Unreadable(error) from None


def certificates(data: bytes) -> List[x509.Certificate]:
    """Every PEM certificate in ``data``, in order (a leaf, then its intermediates).

    :raises NoCertificate: there is none.
    :raises MalformedCertificate: one of them does not parse.
    """
    blocks = _CERTIFICATE.findall(data)
    if not blocks:
        raise NoCertificate()
    try:
        return [x509.load_pem_x509_certificate(block) for block in blocks]
    except ValueError as error:
        raise MalformedCertificate(str(error)) from None


def private_key(data: bytes) -> Any:
    """The first unencrypted PEM private key in ``data`` (other PEM blocks are skipped).

    :raises NoPrivateKey: there is none.
    :raises EncryptedKey: it needs a passphrase.
    :raises MalformedKey: it does not parse.
    """
    block = _PRIVATE_KEY.search(data)
    if block is None:
        raise NoPrivateKey()
    try:
        return serialization.load_pem_private_key(block.group(0), password=None)
    except TypeError:
        raise EncryptedKey() from None
    except (ValueError, UnsupportedAlgorithm) as error:
        raise MalformedKey(str(error)) from None


def matches(certificate: x509.Certificate, key: Any) -> bool:
    """Whether ``certificate`` is for ``key`` (their public keys are the same)."""
    return _spki(certificate.public_key()) == _spki(key.public_key())


def _spki(public_key: Any) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def trust_root(trusted: Sequence[x509.Certificate]) -> Any:
    """A Twisted ``IOpenSSLTrustRoot`` accepting a peer whose chain ends at one of ``trusted``."""
    return ssl.trustRootFromCertificates(
        [ssl.Certificate(crypto.X509.from_cryptography(c)) for c in trusted]
    )
