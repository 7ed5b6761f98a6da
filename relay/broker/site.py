"""The HTTP site under the broker's Klein apps, on twisted.web's public API.

twisted.web parses every request and writes every answer. What the relay adds is
connection policy, in the places Twisted offers for it:

- :class:`RelaySite` (a ``Site``) builds :class:`RelayRequest`, holds at most
  ``max_connections`` connections (at most ``max_per_address`` from one remote
  address), gives every request ``request_read_seconds`` to arrive whole
  (``408`` after that), so a client trickling headers or a body cannot hold a
  connection, and closes keep-alive connections idle for ``idle_seconds``. Its
  reaper finds both from two timestamps each :class:`RelayChannel` keeps:
  twisted.web's own idle timeout would cancel and schedule a timer per request.
- :class:`RelayRequest` keeps at most 1 MiB of a body in memory (the app answers
  ``400`` for more) and never parses form bodies.
- :class:`Connection` (a ``twisted.protocols.policies.ProtocolWrapper``) answers
  a TLS handshake on a plain port with a plain ``400``, and gives twisted.web's
  refusal of a malformed request (an empty ``400``) the §6 body. Twisted has no
  public hook for the text of that refusal, so the wrapper recognises its bytes;
  a Twisted that words it differently still answers ``400``, without the body.
"""

from __future__ import annotations

from io import BytesIO
from typing import Collection, Dict, Optional, Set

from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.web import http, server
from zope.interface import implementer

from relay.wire.protocol import MAX_BODY_BYTES, address_group, is_loopback_host

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
# What twisted.web writes before closing a connection whose request it cannot parse.
_TWISTED_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\n\r\n"


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
    header = request.getHeader(b"host")
    if header is None:
        return True
    name = host_name(header)
    return name in allowed or is_loopback_host(name) or name.endswith(".localhost")


class RelayRequest(server.Request):
    """A request that keeps at most ``MAX_BODY_BYTES`` of its body in memory and
    leaves form bodies unparsed (bodies are JSON).

    ``route`` names the route that handled it (set by the app; ``unmatched``
    otherwise) and ``started`` when its headers were complete, for the metrics.
    """

    body_limit = MAX_BODY_BYTES
    body_too_large = False
    received = 0
    route = "unmatched"
    started: Optional[float] = None

    def __init__(self, channel, *args, **kwargs) -> None:
        kwargs["parsePOSTFormSubmission"] = False
        super().__init__(channel, *args, **kwargs)

    def gotLength(self, length: Optional[int]) -> None:
        site = getattr(self.channel, "site", None)
        if site is not None:
            self.started = site.reactor.seconds()
        self.content = BytesIO()
        self.received = 0
        self.body_too_large = length is not None and length > self.body_limit

    def handleContentChunk(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.body_limit:
            self.body_too_large = True
        if not self.body_too_large:
            self.content.write(data)

    def process(self) -> None:
        """Serve the request; an asterisk-form target (``GET *``: only ``OPTIONS *``
        may have one) is the §6 ``400`` and the connection closes, where twisted.web
        would answer ``405`` with no body. So is a request with two ``Host`` headers
        (RFC 9112 §3.2): the Host rule reads the last, a proxy may route by the first."""
        hosts = self.requestHeaders.getRawHeaders(b"host")
        if (self.path == b"*" and self.method != b"OPTIONS") or (hosts and len(hosts) > 1):
            self.channel.transport.write(BAD_REQUEST_RESPONSE)
            self.channel.transport.loseConnection()
            return
        super().process()


class RelayChannel(http.HTTPChannel):
    """An HTTP channel that notes when a request began to arrive and when it last
    went idle, for the site's reaper (:meth:`RelaySite.reap`): a timestamp per
    request is cheaper than a timer per request."""

    request_read_seconds = REQUEST_READ_SECONDS
    reading_since: Optional[float] = None
    idle_since = 0.0
    answering = False
    read_closed = False
    _host = None
    _peer = None
    _secure: Optional[bool] = None

    def dataReceived(self, data: bytes) -> None:
        if self.reading_since is None and not self.answering:
            self.reading_since = self.site.reactor.seconds()
        super().dataReceived(data)

    def allContentReceived(self) -> None:
        self.reading_since = None
        self.answering = True
        super().allContentReceived()

    def requestDone(self, request) -> None:
        self.answering = False
        self.idle_since = self.site.reactor.seconds()
        super().requestDone(request)
        if self.read_closed and not self.answering:  # no pipelined request began
            self.loseConnection()

    def readConnectionLost(self) -> None:
        """The client shut its sending side after its request (``shutdown(SHUT_WR)``,
        ``nc -N``): the request it sent whole is answered, then the connection closes;
        one not sent whole never will be, so it closes at once. (twisted.web's channel
        is not half-closeable: the transport would call :meth:`connectionLost` and the
        answer of a request answered later would be lost.)"""
        self.read_closed = True
        self.reading_since = None
        if not self.answering:
            self.loseConnection()

    def writeConnectionLost(self) -> None:
        """The connection can no longer carry an answer."""
        self.loseConnection()

    def connectionMade(self) -> None:
        super().connectionMade()
        self.idle_since = self.site.reactor.seconds()

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

    def isSecure(self) -> bool:
        """Whether the connection is TLS, asked of the transport once per connection."""
        if self._secure is None:
            self._secure = super().isSecure()
        return self._secure

    def connectionLost(self, reason) -> None:
        self.reading_since = None
        super().connectionLost(reason)

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request or header line over ``MAX_LENGTH``: the §6 ``400``, not a bare close."""
        self.transport.write(BAD_REQUEST_RESPONSE)
        self.transport.loseConnection()

    def read_too_slow(self) -> None:
        """Answer ``408`` and close: the request did not arrive in time."""
        self.reading_since = None
        self.transport.write(TIMEOUT_RESPONSE)
        self.transport.loseConnection()


@implementer(IHalfCloseableProtocol)
class Connection(ProtocolWrapper):
    """One accepted connection of a :class:`RelaySite`, around its channel; a client
    may shut its sending side and still read its answer (plain TCP: a TLS connection
    ends as a whole)."""

    first_bytes = True

    def __init__(self, site: RelaySite, channel: RelayChannel, group: Optional[str]) -> None:
        super().__init__(site, channel)
        self.channel = channel
        self.address_group = group

    def dataReceived(self, data: bytes) -> None:
        if self.first_bytes:
            self.first_bytes = False
            if data.startswith(_TLS_HANDSHAKE):
                # An https client on a plain port: a plain answer makes its TLS
                # library fail at once ("wrong version number") instead of
                # waiting for a request line that never comes.
                self.transport.write(TLS_ON_PLAIN_PORT_RESPONSE)
                self.transport.loseConnection()
                return
        self.wrappedProtocol.dataReceived(data)

    def readConnectionLost(self) -> None:
        self.channel.readConnectionLost()

    def writeConnectionLost(self) -> None:
        self.channel.writeConnectionLost()

    def write(self, data: bytes) -> None:
        if data == _TWISTED_BAD_REQUEST:
            data = BAD_REQUEST_RESPONSE
        self.transport.write(data)


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
        super().__init__(resource, timeout=None, reactor=reactor)
        self.idle_seconds = timeout
        self.request_read_seconds = request_read_seconds
        self.access_log = access_log
        # Hears of every answered request (``http_answered``), or None.
        self.counters = counters
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.connections: Set[Connection] = set()
        self.per_address: Dict[str, int] = {}
        self.refusing: Set[_Refused] = set()  # refused connections not yet closed
        self.refused = 0
        self._refusals_logged_at: Optional[float] = None
        self._reaper = LoopingCall(self.reap)
        self._reaper.clock = self.reactor

    def configure(self, access_log: bool, max_per_address: int) -> None:
        """Apply the settings a reload may change."""
        self.access_log = access_log
        self.max_per_address = max_per_address

    def buildProtocol(self, addr):
        host = getattr(addr, "host", None)
        group = None if host is None or is_loopback_host(host) else address_group(host)
        if len(self.connections) >= self.max_connections or (
                group is not None and self.per_address.get(group, 0) >= self.max_per_address):
            self._refuse()
            if len(self.refusing) >= MAX_REFUSING:
                return None  # closed at once: a burst cannot take every descriptor
            return _Refused(self.refusing)
        channel = super().buildProtocol(addr)
        channel.request_read_seconds = self.request_read_seconds
        connection = Connection(self, channel, group)
        # Counted from here, not from makeConnection: the limits hold for the
        # connections accepted in one reactor turn too.
        self.connections.add(connection)
        if group is not None:
            self.per_address[group] = self.per_address.get(group, 0) + 1
        return connection

    def registerProtocol(self, connection: Connection) -> None:
        """A connection began (called by :class:`Connection`); it was counted when built."""

    def unregisterProtocol(self, connection: Connection) -> None:
        """A connection closed (called by :class:`Connection`)."""
        self.forget(connection)

    def forget(self, connection: Connection) -> None:
        """Stop counting ``connection``."""
        if connection in self.connections:
            self.connections.discard(connection)
            group = connection.address_group
            if group is not None:
                left = self.per_address.get(group, 1) - 1
                if left:
                    self.per_address[group] = left
                else:
                    self.per_address.pop(group, None)

    def _refuse(self) -> None:
        self.refused += 1
        now = self.reactor.seconds()
        if self._refusals_logged_at is None or now - self._refusals_logged_at >= 60:
            log.warn("refused {count} connection(s) over the connection limits "
                     "(broker.maxConnections, broker.maxConnectionsPerAddress) since the "
                     "last report", count=self.refused)
            self._refusals_logged_at = now
            self.refused = 0

    def reap(self) -> None:
        """Answer ``408`` to every request that has been arriving for too long, and
        close every connection idle for ``idle_seconds`` (no request arriving or
        being answered)."""
        now = self.reactor.seconds()
        idle = self.idle_seconds
        for connection in list(self.connections):
            channel = connection.channel
            since = channel.reading_since
            if since is not None:
                if now - since >= channel.request_read_seconds:
                    channel.read_too_slow()
            elif idle and not channel.answering and now - channel.idle_since >= idle:
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
