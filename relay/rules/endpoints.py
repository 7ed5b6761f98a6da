"""Twisted endpoint strings: what the relay reads of them, and the listeners they make.

Every endpoint string of the relay's config is tokenised here (split on its
unescaped colons, as Twisted does) when the relay needs to know what it binds:
its type, its interface, its port, the files it names. Listening goes through
:func:`twisted.internet.endpoints.serverFromString` for every string: an
``ssl:`` string of ``broker.listen`` or ``broker.opsListen`` is served by the
relay's own ``relay-tls:`` parser plugin (:mod:`relay.broker.tls`, registered in
``twisted/plugins/relay_endpoints.py``), which takes the same options plus
``clientCA``, checks every file before the broker listens, and answers a
plain-HTTP client with a plain ``400``.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IStreamServerEndpoint

from relay.wire.errors import ConfigError
from relay.wire.protocol import is_loopback_host

# The relay's TLS listener (relay.broker.tls.TLSListenerParser); ``ssl:`` strings are served by it.
TLS_PREFIX = "relay-tls"
TLS_KINDS = frozenset({"ssl", TLS_PREFIX})
PATH_OPTIONS = frozenset({"privateKey", "certKey", "extraCertChain", "dhParameters",
                          "caCertsDir", "clientCA"})


def _resolve(base_dir: str, path: str) -> str:
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


def split_endpoint(description: str) -> List[str]:
    """Split an endpoint string on its unescaped colons, keeping the escapes."""
    parts, current, escaped = [], [], False
    for ch in description:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            current.append(ch)
            escaped = True
        elif ch == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def unescape_endpoint_value(value: str) -> str:
    """An endpoint-string value with its ``\\:`` and ``\\\\`` escapes undone."""
    return value.replace("\\:", ":").replace("\\\\", "\\")


def escape_endpoint_value(value: str) -> str:
    """``value`` with ``:`` and ``\\`` escaped for an endpoint string."""
    return value.replace("\\", "\\\\").replace(":", "\\:")


def resolve_endpoint_paths(description: str, base_dir: str) -> str:
    """Make the file options of an endpoint string absolute, relative to ``base_dir``."""
    parts = split_endpoint(description)
    out = [parts[0]]
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if sep and name in PATH_OPTIONS and value:
            value = escape_endpoint_value(_resolve(base_dir, unescape_endpoint_value(value)))
            part = f"{name}={value}"
        out.append(part)
    return ":".join(out)


# Where the ``interface`` argument of each endpoint type sits among its positional ones.
_INTERFACE_POSITION = {"tcp": 2, "tcp6": 2, "ssl": 5, TLS_PREFIX: 5}


def endpoint_kind(description: str) -> str:
    """The type of an endpoint string, as Twisted matches it (case-insensitively)."""
    return split_endpoint(description)[0].strip().lower()


def listen_interface(description: str) -> Optional[str]:
    """The interface a ``tcp``, ``tcp6`` or ``ssl`` endpoint string binds (``0.0.0.0``
    or ``::`` when it names none); None for any other endpoint type."""
    parts = split_endpoint(description)
    kind = endpoint_kind(description)
    position = _INTERFACE_POSITION.get(kind)
    if position is None:
        return None
    interface = None
    positional = 0
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if sep:
            if name == "interface":
                interface = unescape_endpoint_value(value)
        else:
            positional += 1
            if positional == position:
                interface = unescape_endpoint_value(part)
    if not interface:
        return "::" if kind == "tcp6" else "0.0.0.0"
    return interface


def _unix_path(description: str) -> Optional[str]:
    parts = split_endpoint(description)[1:]
    for part in parts:
        name, sep, value = part.partition("=")
        if sep and name == "address":
            return unescape_endpoint_value(value)
    positional = [p for p in parts if "=" not in p]
    return unescape_endpoint_value(positional[0]) if positional else None


def beyond_loopback(description: str) -> Optional[str]:
    """What an endpoint string exposes beyond this machine, or None when it is
    provably local: a ``tcp``/``tcp6``/``ssl`` endpoint on a loopback interface, or a
    ``unix`` socket at a filesystem path. The interface of any other TCP endpoint,
    and ``unknown <type>`` for every other endpoint type (``systemd``, plugins, an
    abstract unix socket), which counts as remote."""
    kind = endpoint_kind(description)
    if kind == "unix":
        path = _unix_path(description)
        if path and not path.startswith(("\0", "@")):  # not an abstract socket
            return None
        return "unknown unix address"
    interface = listen_interface(description)
    if interface is None:
        return f"unknown endpoint type {kind!r}"
    return None if is_loopback_host(interface) else interface


def plaintext_remote(description: str) -> Optional[str]:
    """What a plaintext endpoint exposes beyond loopback (see :func:`beyond_loopback`),
    or None: an ``ssl`` endpoint is never plaintext."""
    if endpoint_kind(description) in TLS_KINDS:
        return None
    return beyond_loopback(description)


def endpoint_option(description: str, name: str, position: int) -> Optional[str]:
    """The value of option ``name`` of an endpoint string, given as ``name=value`` or
    as its ``position``-th positional argument (1 for the first); None when absent."""
    positional = 0
    for part in split_endpoint(description)[1:]:
        key, sep, value = part.partition("=")
        if sep:
            if key == name:
                return unescape_endpoint_value(value)
        else:
            positional += 1
            if positional == position:
                return unescape_endpoint_value(part)
    return None


def twisted_description(description: str, client_ca: Optional[str] = None) -> str:
    """The endpoint string to give ``serverFromString``: an ``ssl:`` string names the
    relay's TLS listener instead, with ``clientCA`` when a client CA is set."""
    if endpoint_kind(description) not in TLS_KINDS:
        return description
    rest = split_endpoint(description)[1:]
    if client_ca is not None:
        rest.append("clientCA=" + escape_endpoint_value(client_ca))
    return ":".join([TLS_PREFIX] + rest)


def server_endpoints(reactor, descriptions: Sequence[str], client_ca: Optional[str] = None,
                     key: str = "broker.listen") -> List[IStreamServerEndpoint]:
    """One endpoint per endpoint string, in order; ConfigError naming ``key`` for a
    malformed string or a bad file, and when a client CA is set but no TLS listener
    would use it."""
    if client_ca is not None and not any(endpoint_kind(d) in TLS_KINDS for d in descriptions):
        raise ConfigError("broker.tlsClientCA",
                          f"is set, but {key} has no ssl: endpoint to apply it to")
    endpoints = []
    for description in descriptions:
        try:
            endpoints.append(serverFromString(reactor, twisted_description(description,
                                                                           client_ca)))
        except ConfigError as error:
            if error.key == "broker.tlsClientCA":
                raise
            raise ConfigError(key, error.reason) from None
        except (ValueError, KeyError, TypeError) as error:  # a malformed endpoint string
            raise ConfigError(key, f"{description!r}: {error}") from None
    return endpoints
