"""The human inbox (REACH §15): the static page the main listener serves under
``/inbox/``.

The page is three files shipped in this package (``static/``), read once when the
broker starts. They hold no data and need no authentication: a person types their
agent name and secret into the page, which keeps the secret in the tab
(``sessionStorage``) and signs every request it makes with WebCrypto, exactly as
any other client signs (spec §3). What it shows, it fetches with those signed
requests.

Every file is answered with a Content-Security-Policy that allows nothing but the
page's own files and requests to its own origin: no inline script, no other site,
no frames around it. Another party's text is always put in the page as text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Dict, Mapping, Optional

from twisted.web import http

from relay.wire import errors

# The page's name under /inbox/ -> (its file in static/, its content type)
FILES: Mapping[str, tuple] = {
    "": ("index.html", b"text/html; charset=utf-8"),
    "inbox.js": ("inbox.js", b"text/javascript; charset=utf-8"),
    "inbox.css": ("inbox.css", b"text/css; charset=utf-8"),
    "icon.svg": ("icon.svg", b"image/svg+xml"),
}

CONTENT_SECURITY_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    # Revalidated on every load (a conditional GET answered 304 while unchanged), so
    # the page of an upgraded broker is never an old copy.
    (b"cache-control", b"no-cache"),
)


@dataclass(frozen=True)
class StaticFile:
    """One file of the page: its bytes, content type and entity tag."""

    body: bytes
    content_type: bytes
    etag: bytes


def load() -> Dict[str, StaticFile]:
    """The page's files by their name under ``/inbox/`` (``""`` is the page itself)."""
    folder = resources.files(__name__).joinpath("static")
    files = {}
    for name, (filename, content_type) in FILES.items():
        body = folder.joinpath(filename).read_bytes()
        etag = b'"' + hashlib.sha256(body).hexdigest()[:32].encode("ascii") + b'"'
        files[name] = StaticFile(body, content_type, etag)
    return files


def serve(request, files: Mapping[str, StaticFile], name: str) -> bytes:
    """Answer ``request`` with the file ``name`` of ``files`` (a conditional GET that
    names its current entity tag gets ``304``); RelayError ``404`` for any other name."""
    found: Optional[StaticFile] = files.get(name)
    if found is None:
        raise errors.not_found(f"no file {name!r} in the inbox page")
    for header, value in HEADERS:
        request.setHeader(header, value)
    request.setHeader(b"content-type", found.content_type)
    if request.setETag(found.etag) == http.CACHED:
        return b""
    request.setHeader(b"content-length", b"%d" % len(found.body))
    return found.body
