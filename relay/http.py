"""The HTTP layer under the Klein app: bounded request bodies, bounded request
reading time, and a quiet site.

A connection that opens with a TLS handshake (an ``https://`` URL pointed at a
plain port) gets a plain ``400`` at once and is closed. A request body over
1 MiB is counted but not kept: the app answers
``400 bad_request`` once the request is complete, so memory stays bounded
whatever ``Content-Length`` or chunked upload a client sends. A request must
arrive whole within ``REQUEST_READ_SECONDS`` of its first byte, so a client
trickling headers or a body cannot hold a connection; idle keep-alive
connections close after ``IDLE_SECONDS``.

Most requests arrive whole in one read: those are parsed in one pass and their
answer goes out in one write, straight to the socket when nothing is queued
before it (see :class:`RelayChannel`). Every other request takes twisted.web's
own parser and writer, and both ways answer byte for byte alike.
"""

from __future__ import annotations

import re
import time
from io import BytesIO
from typing import Collection, Dict, List, Optional, Sequence, Set, Tuple

from twisted.internet import tcp
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, resource, server
from twisted.web.http import NO_BODY_CODES, unquote
from twisted.web.http_headers import Headers

from relay.protocol import MAX_BODY_BYTES, address_group, is_loopback_host

log = Logger(namespace="relay.http")

REQUEST_READ_SECONDS = 30.0
MAX_CONNECTIONS = 10_000
MAX_CONNECTIONS_PER_ADDRESS = 256
# Refused connections answered 503 at once; past this many still open, the excess
# is closed without an answer (each holds a descriptor until its answer is sent).
MAX_REFUSING = 32
REAP_SECONDS = 0.5
IDLE_SECONDS = 60.0


def closing_response(status: bytes, code: bytes, message: bytes) -> bytes:
    """A whole HTTP response carrying the §6 error body, for a connection about to close."""
    body = b'{"error":{"code":"%s","message":"%s"}}' % (code, message)
    return (
        b"HTTP/1.1 " + status + b"\r\n"
        b"content-type: application/json; charset=utf-8\r\n"
        b"cache-control: no-store\r\n"
        b"connection: close\r\n"
        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n\r\n" + body
    )


BUSY_RESPONSE = closing_response(
    b"503 Service Unavailable", b"busy", b"too many connections; try again later"
)
TIMEOUT_RESPONSE = closing_response(
    b"408 Request Timeout", b"request_timeout", b"request not received in time"
)
BAD_REQUEST_RESPONSE = closing_response(
    b"400 Bad Request", b"bad_request", b"malformed HTTP request"
)
TLS_ON_PLAIN_PORT_RESPONSE = closing_response(
    b"400 Bad Request",
    b"bad_request",
    b"this port speaks plain HTTP, not TLS: use an http:// URL, or the broker's https port",
)
# A TLS connection starts with a handshake record: content type 22, version 3.x.
_TLS_HANDSHAKE = b"\x16\x03"


# The header-name canonicaliser of twisted.web's own parser, so both ways accept
# and name headers exactly alike. A Twisted without it (or one keeping request
# headers differently) leaves every request to twisted.web's parser.
try:
    from twisted.web.http_headers import _nameEncoder
except ImportError:  # pragma: no cover - depends on the installed Twisted
    _nameEncoder = None
# The names it has canonicalised already: read first, sparing a call per header line.
_KNOWN_NAMES = getattr(_nameEncoder, "_canonicalHeaderCache", None)
if not isinstance(_KNOWN_NAMES, dict):  # pragma: no cover - depends on the installed Twisted
    _KNOWN_NAMES = {}

# What twisted.web's parser accepts, narrowed: a request line of a token, a
# target of bytes 33 to 176 and HTTP/1.1 (HTTP/1.0 is left to twisted.web), then
# header lines of a token, a colon and a value without NUL, CR or LF, unfolded.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_HEAD = re.compile(rb"(%s) ([\x21-\xb0]+) (HTTP/1\.1)\r\n((?:%s:[^\x00\r\n]*\r\n)*)\r\n"
                   % (_TOKEN, _TOKEN))


def _headers_keep_canonical_names() -> bool:
    if _nameEncoder is None:
        return False
    probe = Headers()
    probe.addRawHeader(b"x-relay-probe", b"1")
    return getattr(probe, "_rawHeaders", None) == {b"X-Relay-Probe": [b"1"]}


ONE_READ_PARSING = _headers_keep_canonical_names()


def canonical_name(name: bytes) -> bytes:
    """A header name as twisted.web keys it (``b"x-relay-agent"`` -> ``b"X-Relay-Agent"``)."""
    return _nameEncoder.encode(name) if ONE_READ_PARSING else name


def first_header(headers: Headers, name: bytes) -> Optional[bytes]:
    """The first value of the header ``name``, given by :func:`canonical_name`:
    one dict look-up where twisted.web keys headers so, ``getRawHeaders`` elsewhere."""
    values = headers._rawHeaders.get(name) if ONE_READ_PARSING else headers.getRawHeaders(name)
    return values[0] if values else None


def set_headers(headers: Headers, pairs: Sequence[Tuple[bytes, bytes]]) -> None:
    """Set each ``(name, value)`` (names given by :func:`canonical_name`, values
    without CR or LF) as ``setRawHeaders`` does, without its checks per call."""
    if ONE_READ_PARSING:
        raw = headers._rawHeaders
        for name, value in pairs:
            raw[name] = [value]
    else:
        for name, value in pairs:
            headers.setRawHeaders(name, [value])


# A request the one-read path leaves to twisted.web: these need its machinery
# (a chunked body, a 100-continue answer) or its refusal (two lengths).
_HANDED_OVER = frozenset((b"Transfer-Encoding", b"Expect"))

WholeRequest = Tuple[bytes, bytes, bytes, List[Tuple[bytes, bytes]], int, int]


def parse_whole_request(data: bytes, max_headers: int, max_size: int) -> Optional[WholeRequest]:
    """``(method, uri, version, headers, length, body_start)`` when ``data`` is exactly
    one whole, plain HTTP/1.1 request: a valid request line, valid headers (names
    canonicalised as twisted.web does), no more than ``max_headers`` of them and
    ``max_size`` bytes of head, at most one ``Content-Length`` and then all of the
    body, nothing after it. ``None`` for anything else (a malformed request included):
    twisted.web's own parser then reads it and answers as it always does."""
    end = data.find(b"\r\n\r\n", 0, max_size + 4)
    if end < 0 or end > max_size:
        return None
    head = _HEAD.match(data)
    if head is None:
        return None
    method, uri, version, lines = head.groups()
    lines = lines.split(b"\r\n")
    lines.pop()  # after the last line's CRLF
    if len(lines) > max_headers:
        return None
    headers = []
    length = -1
    known = _KNOWN_NAMES
    encode = _nameEncoder.encode
    for line in lines:
        name, _, value = line.partition(b":")
        name = known.get(name) or encode(name)
        value = value.strip(b" \t")
        if name in _HANDED_OVER:
            return None
        if name == b"Content-Length":
            if length >= 0 or not value.isdigit():
                return None
            length = int(value)
        headers.append((name, value))
    start = end + 4
    if len(data) - start != max(length, 0):
        return None  # the body is still coming, or another request follows
    return method, uri, version, headers, max(length, 0), start


def host_name(header: bytes) -> str:
    """The host of a ``Host`` header, without its port or IPv6 brackets, lowercased."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def names_this_machine(request, allowed: Collection[str] = ()) -> bool:
    """False when ``request`` reached a loopback listener naming another host in its
    ``Host`` header (DNS rebinding: a web page in the user's browser, whose name now
    resolves to 127.0.0.1). Loopback names and addresses pass, and ``allowed``; a
    request without ``Host`` (HTTP/1.0) or on any other listener passes too."""
    local = getattr(request.getHost(), "host", None)
    if local is None or not is_loopback_host(local):
        return True
    headers = request.requestHeaders.getRawHeaders(b"host")
    if not headers:
        return True
    name = host_name(headers[0])
    return name in allowed or is_loopback_host(name) or name.endswith(".localhost")


_SERVER = canonical_name(b"server")
_DATE = canonical_name(b"date")


class _HTTPDate:
    """The ``Date`` header's value at a time, formatted once per second."""

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def __call__(self, now: float) -> bytes:
        second = int(now)
        if second != self.second:
            self.value = http.datetimeToString(second)
            self.second = second
        return self.value


http_date = _HTTPDate()


class RelayRequest(server.Request):
    """A request that keeps at most ``MAX_BODY_BYTES`` of its body in memory.

    ``route`` names the route that handled it (set by the app; ``unmatched``
    otherwise) and ``started`` when its headers were complete, for the metrics.
    """

    body_limit = MAX_BODY_BYTES
    body_too_large = False
    _received = 0
    route = "unmatched"
    started: Optional[float] = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Never parse form or multipart bodies into request.args: bodies are JSON.
        self._parsePOSTFormSubmission = False

    def process(self) -> None:
        """twisted.web's ``Request.process``, its two default headers (``Server``,
        ``Date``) set without a ``setHeader`` each and the date formatted once a
        second rather than per request."""
        if not ONE_READ_PARSING:
            return super().process()
        self.site = self.channel.site
        raw = self.responseHeaders._rawHeaders
        raw[_SERVER] = [server.version]
        raw[_DATE] = [http_date(time.time())]
        self.prepath = []
        segments = self.path[1:].split(b"/")
        # unquote gives back a segment without an escape as it is
        self.postpath = list(map(unquote, segments)) if b"%" in self.path else segments
        if self.path == b"*":
            self._handleStar()
            return None
        try:
            resrc = self.site.getResourceFor(self)
            if resource._IEncodingResource.providedBy(resrc):
                encoder = resrc.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            self.render(resrc)
        except BaseException:
            self.processingFailed(Failure())
        return None

    def gotLength(self, length: Optional[int]) -> None:
        site = getattr(self.channel, "site", None)
        if site is not None:
            self.started = site.reactor.seconds()
        self.content = BytesIO()
        self._received = 0
        self.body_too_large = length is not None and length > self.body_limit

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self.body_limit:
            self.body_too_large = True
        if not self.body_too_large:
            self.content.write(data)

    def raw_body(self) -> bytes:
        """The request body as received (empty when it was too large)."""
        return b"" if self.body_too_large else self.content.getvalue()

    def write(self, data: bytes) -> None:
        """Write a response; a whole one (its length and type set, nothing special
        about it) leaves as one piece: status line, headers and body together."""
        if (self.startedWriting or not ONE_READ_PARSING or self._encoder or self._inFakeHead
                or self.method == b"HEAD" or self.code in NO_BODY_CODES
                or self.lastModified is not None or self.etag is not None or self.cookies
                or self.finished or self._disconnected):
            return super().write(data)
        raw = self.responseHeaders._rawHeaders
        if b"Content-Length" not in raw or b"Content-Type" not in raw:
            return super().write(data)
        self.startedWriting = 1
        head = [b"%s %d %s\r\n" % (self.clientproto, self.code, self.code_message)]
        for name, values in raw.items():
            for value in values:
                head.append(b"%s: %s\r\n" % (name, value))
        head.append(b"\r\n")
        head.append(data)
        self.sentLength += len(data)
        self.channel.write(b"".join(head))


class RelayChannel(http.HTTPChannel):
    """An HTTP channel that gives each request a deadline to arrive whole.

    The channel notes when a request's first byte arrived, and when it last went
    idle; the site's reaper (:meth:`RelaySite.reap`) answers ``408`` to the ones
    reading too long and closes the ones idle too long. A timestamp per request is
    cheaper than a timer per request.
    """

    request_read_seconds = REQUEST_READ_SECONDS
    reading_since: Optional[float] = None
    idle_since = 0.0
    _first_bytes = True
    _host = None
    _peer = None

    def dataReceived(self, data: bytes) -> None:
        if self._first_bytes:
            self._first_bytes = False
            if data.startswith(_TLS_HANDSHAKE):
                # An https client on a plain port: a plain answer makes its TLS
                # library fail at once ("wrong version number") instead of
                # waiting for a request line that never comes.
                self.transport.write(TLS_ON_PLAIN_PORT_RESPONSE)
                self.transport.loseConnection()
                return
        if (ONE_READ_PARSING and self.line_mode and not self._handlingRequest
                and not self._buffer and not self._busyReceiving and not self.requests
                and self.persistent and self._HTTPChannel__first_line == 1):
            whole = parse_whole_request(data, self.maxHeaders, self.totalHeadersSize)
            if whole is not None:
                self._serve_whole(data, *whole)
                return
        if self.reading_since is None and not self._handlingRequest:
            self.reading_since = self.site.reactor.seconds()
        super().dataReceived(data)

    def _serve_whole(self, data: bytes, method: bytes, uri: bytes, version: bytes,
                     headers: List[Tuple[bytes, bytes]], length: int, start: int) -> None:
        """Serve a request that arrived whole in one read, leaving the channel as
        twisted.web's parser would have left it (see HTTPChannel.lineReceived,
        headerReceived, allHeadersReceived and allContentReceived)."""
        request = self.requestFactory(self, len(self.requests))
        self.requests.append(request)
        raw = request.requestHeaders._rawHeaders
        for name, value in headers:
            values = raw.get(name)
            if values is None:
                raw[name] = [value]
            else:
                values.append(value)
        if b"Cookie" in raw:
            request.parseCookies()
        self.persistent = self.checkPersistence(request, version)
        request.gotLength(length)
        if length:
            request.handleContentChunk(data[start:])
        if self.timeOut:
            self._savedTimeOut = self.setTimeout(None)
        self._handlingRequest = True
        self.setRawMode()  # what arrives meanwhile waits for requestDone
        self.reading_since = None
        request.requestReceived(method, uri, version)

    def getHost(self):
        """The local address, asked of the socket once per connection."""
        if self._host is None:
            self._host = self.transport.getHost()
        return self._host

    def getPeer(self):
        """The remote address, built once per connection."""
        if self._peer is None:
            self._peer = self.transport.getPeer()
        return self._peer

    def write(self, data: bytes) -> None:
        """Send ``data`` now when nothing is queued before it, else queue it.

        Twisted queues every write for the reactor's next turn, which registers
        the socket for writing and unregisters it once sent: two system calls per
        answer that a socket with room spares. Whatever the socket does not take
        at once (or a TLS connection's data) goes through the transport as usual.
        """
        transport = self.transport
        if (transport.__class__ is not tcp.Server or transport.TLS or transport.dataBuffer
                or transport._tempDataBuffer or transport.disconnecting
                or not transport.connected or transport._writeDisconnected):
            transport.write(data)
            return
        try:
            sent = transport.socket.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            transport.write(data)  # the transport finds and reports the failure
            return
        if sent < len(data):
            transport.write(data[sent:])

    def allContentReceived(self) -> None:
        self.reading_since = None
        super().allContentReceived()

    def connectionMade(self) -> None:
        super().connectionMade()
        self.idle_since = self.site.reactor.seconds()

    def requestDone(self, request) -> None:
        self.idle_since = self.site.reactor.seconds()
        super().requestDone(request)

    def connectionLost(self, reason) -> None:
        self.reading_since = None
        forget = getattr(self.site, "forget", None)  # absent under a plain Site
        if forget is not None:
            forget(self)
        super().connectionLost(reason)

    def _respondToBadRequestAndDisconnect(self) -> None:
        """Twisted's answer to a malformed request (request line, headers, framing):
        the same ``400`` with the §6 body instead of an empty one."""
        self.transport.write(BAD_REQUEST_RESPONSE)
        self.loseConnection()

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request or header line over ``MAX_LENGTH``: the §6 ``400``, not a bare close."""
        self._respondToBadRequestAndDisconnect()

    def read_too_slow(self) -> None:
        """Answer ``408`` and close: the request did not arrive in time."""
        self.reading_since = None
        self.transport.write(TIMEOUT_RESPONSE)
        self.transport.loseConnection()


class _Refused(Protocol):
    """A connection over the limits: one ``503`` with the §6 body, then closed."""

    def __init__(self, refusing: Set[_Refused]) -> None:
        self.refusing = refusing
        refusing.add(self)

    def connectionMade(self) -> None:
        self.transport.write(BUSY_RESPONSE)
        self.transport.loseConnection()

    def connectionLost(self, reason: object = None) -> None:
        self.refusing.discard(self)


class RelaySite(server.Site):
    """A Site that builds :class:`RelayRequest`, writes no access log by default, and
    holds at most ``max_connections`` connections, at most ``max_per_address`` of
    them from one remote address (IPv6: one /64; loopback counts toward the total
    only). A connection over a limit is answered ``503 busy`` and closed at once
    (closed unanswered while ``MAX_REFUSING`` such answers are in flight), and the
    refusals are logged at most once a minute, as a count."""

    requestFactory = RelayRequest
    protocol = RelayChannel
    noisy = False

    def __init__(self, resource, access_log: bool = False, timeout: float = IDLE_SECONDS,
                 request_read_seconds: float = REQUEST_READ_SECONDS, reactor=None,
                 counters=None, max_connections: int = MAX_CONNECTIONS,
                 max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS) -> None:
        # Idle connections are closed by the reaper, from a timestamp each channel
        # keeps: Twisted's own idle timer is one timer cancelled and set again per
        # request.
        super().__init__(resource, timeout=None, reactor=reactor)
        self.idle_seconds = timeout
        self.request_read_seconds = request_read_seconds
        self.access_log = access_log
        # A relay.ops.counters.Counters that hears of every answered request, or None.
        self.counters = counters
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.channels: Set[RelayChannel] = set()
        self.per_address: Dict[str, int] = {}
        self.refusing: Set[_Refused] = set()  # refused connections not yet closed
        self.refused = 0
        self._refusals_logged_at: Optional[float] = None
        self._reaper = LoopingCall(self.reap)
        self._reaper.clock = self.reactor

    def buildProtocol(self, addr):
        host = getattr(addr, "host", None)
        group = None if host is None or is_loopback_host(host) else address_group(host)
        if len(self.channels) >= self.max_connections or (
                group is not None and self.per_address.get(group, 0) >= self.max_per_address):
            self._refuse()
            if len(self.refusing) >= MAX_REFUSING:
                return None  # closed at once: a burst cannot take every descriptor
            return _Refused(self.refusing)
        channel = super().buildProtocol(addr)
        channel.request_read_seconds = self.request_read_seconds
        channel.address_group = group
        self.channels.add(channel)
        if group is not None:
            self.per_address[group] = self.per_address.get(group, 0) + 1
        return channel

    def _refuse(self) -> None:
        self.refused += 1
        now = self.reactor.seconds()
        if self._refusals_logged_at is None or now - self._refusals_logged_at >= 60:
            log.warn("refused {count} connection(s) over the connection limits "
                     "(broker.maxConnections, broker.maxConnectionsPerAddress) since the "
                     "last report", count=self.refused)
            self._refusals_logged_at = now
            self.refused = 0

    def forget(self, channel: RelayChannel) -> None:
        """A connection closed."""
        if channel in self.channels:
            self.channels.discard(channel)
            group = getattr(channel, "address_group", None)
            if group is not None:
                left = self.per_address.get(group, 1) - 1
                if left:
                    self.per_address[group] = left
                else:
                    self.per_address.pop(group, None)

    def reap(self) -> None:
        """Time out every request that has been arriving for too long, and close
        every connection idle for ``idle_seconds`` (no request arriving or
        being answered)."""
        now = self.reactor.seconds()
        idle = self.idle_seconds
        for channel in list(self.channels):
            since = channel.reading_since
            if since is not None:
                if now - since >= channel.request_read_seconds:
                    channel.read_too_slow()
            elif idle and not channel._handlingRequest and now - channel.idle_since >= idle:
                channel.idle_since = float("inf")  # closing: once is enough
                channel.timeoutConnection()

    def startFactory(self) -> None:
        super().startFactory()
        if not self._reaper.running:
            self._reaper.start(REAP_SECONDS, now=False)

    def stopFactory(self) -> None:
        if self._reaper.running:
            self._reaper.stop()
        super().stopFactory()

    def log(self, request: http.Request) -> None:
        """Called by twisted.web once a request is answered: count it, log it if asked."""
        if self.counters is not None:
            started = getattr(request, "started", None)
            seconds = 0.0 if started is None else self.reactor.seconds() - started
            self.counters.http_answered(getattr(request, "route", "unmatched"), request.code,
                                        seconds)
        if self.access_log:
            super().log(request)
