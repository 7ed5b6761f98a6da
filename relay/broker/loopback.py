"""Connections to a site held in memory: raw HTTP in, the answer's bytes out, or an
HTTP client agent (:class:`MemoryAgent`, :class:`MemoryHTTP` for treq) on top.

The warm-up (:mod:`relay.broker.warmup`) and the test harnesses (:mod:`relay.testing`)
serve requests through the broker's real site, channel and request classes
without a socket. ``twisted.internet.testing.StringTransport`` does the same for
tests, but production code does not import Twisted's testing helpers, so this
module holds the few methods of a transport that a site's protocols use.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from treq.client import HTTPClient
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer, IPushProducer, IStreamClientEndpoint, ITransport
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer

PEER = IPv4Address("TCP", "127.0.0.1", 40000)
HOST = IPv4Address("TCP", "127.0.0.1", 19121)


@implementer(ITransport, IConsumer, IPushProducer)
class MemoryTransport:
    """The server side of an in-memory connection: keeps what is written."""

    disconnecting = False
    connected = True

    def __init__(self, peer: Any = PEER, host: Any = HOST) -> None:
        self.peer = peer
        self.host = host
        self.written: List[bytes] = []
        self.producer: Any = None
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writeSequence(self, data: Any) -> None:  # noqa: N802 (the interface's name)
        self.written.extend(data)

    def loseConnection(self) -> None:  # noqa: N802
        self.disconnecting = True

    def abortConnection(self) -> None:  # noqa: N802
        self.disconnecting = True

    def getPeer(self) -> Any:  # noqa: N802
        return self.peer

    def getHost(self) -> Any:  # noqa: N802
        return self.host

    def registerProducer(self, producer: Any, streaming: bool) -> None:  # noqa: N802
        self.producer = producer

    def unregisterProducer(self) -> None:  # noqa: N802
        self.producer = None

    def pauseProducing(self) -> None:  # noqa: N802
        pass

    def resumeProducing(self) -> None:  # noqa: N802
        pass

    def stopProducing(self) -> None:  # noqa: N802
        self.disconnecting = True

    def take(self) -> bytes:
        """Everything written since the last call."""
        data = b"".join(self.written)
        self.written.clear()
        return data


def connect(site: Any, peer: Any = PEER, host: Any = HOST) -> Tuple[Any, MemoryTransport]:
    """A new connection of ``site`` from ``peer``: its protocol and its transport."""
    protocol = site.buildProtocol(peer)
    transport = MemoryTransport(peer, host)
    protocol.makeConnection(transport)
    return protocol, transport


def disconnect(protocol: Any, reason: Optional[Failure] = None) -> None:
    """The client went away."""
    if reason is None:
        from twisted.internet.error import ConnectionDone

        reason = Failure(ConnectionDone())
    protocol.connectionLost(reason)


class _Pair:
    """A client protocol and a site's server protocol joined in memory."""

    def __init__(self, site: Any, client: Any, peer: Any, host: Any) -> None:
        self.server, self.server_side = connect(site, peer, host)
        self.client = client
        self.client_side = MemoryTransport(host, peer)
        self.closed = False
        self.pumping = False
        client.makeConnection(self.client_side)

    def pump(self) -> bool:
        """Move what either side wrote to the other until neither writes; False
        once the connection is closed.

        A side reading may start other requests, which pump again: a pair already
        being pumped is left to the pump in progress, so each side reads in order.
        """
        if self.pumping or self.closed:
            return not self.closed
        self.pumping = True
        try:
            moved = True
            while moved:
                moved = False
                answer = self.server_side.take()
                if answer:
                    self.client.dataReceived(answer)
                    moved = True
                sent = self.client_side.take()
                if sent:
                    self.server.dataReceived(sent)
                    moved = True
        finally:
            self.pumping = False
        if self.server_side.disconnecting or self.client_side.disconnecting:
            from twisted.internet.error import ConnectionDone

            self.closed = True
            self.server_side.connected = self.client_side.connected = False
            disconnect(self.server)
            self.client.connectionLost(Failure(ConnectionDone()))
            return False
        return True


@implementer(IStreamClientEndpoint)
class _Endpoint:
    def __init__(self, agent: MemoryAgent) -> None:
        self.agent = agent

    def connect(self, factory: Any) -> Deferred:
        agent = self.agent
        pair = _Pair(agent.site, factory.buildProtocol(agent.host), agent.peer, agent.host)
        agent.pairs.append(pair)
        return succeed(pair.client)


@implementer(IAgent, IAgentEndpointFactory)
class MemoryAgent:
    """An HTTP client agent whose every request is a new connection to ``site``,
    held in memory: twisted.web's own ``Agent`` on one side, the site's own
    protocols on the other.

    What either side writes moves on :meth:`flush`; ``request`` flushes once, so an
    answer the site gives at once is there when it returns, and one it gives later
    (a long poll, an event stream) arrives on a later :meth:`flush`.
    """

    def __init__(self, site: Any, reactor: Any, peer: Any = PEER, host: Any = HOST) -> None:
        self.site = site
        self.peer = peer
        self.host = host
        self.pairs: List[_Pair] = []
        self._agent = Agent.usingEndpointFactory(reactor, self,
                                                 HTTPConnectionPool(reactor, persistent=False))

    def endpointForURI(self, uri: Any) -> _Endpoint:  # noqa: N802 (the interface's name)
        return _Endpoint(self)

    def request(self, method: bytes, uri: bytes, headers: Optional[Headers] = None,
                bodyProducer: Any = None) -> Deferred:  # noqa: N803
        d = self._agent.request(method, uri, headers, bodyProducer)
        self.flush()
        return d

    def flush(self) -> None:
        """Deliver what each open connection's two sides wrote since the last flush."""
        for pair in list(self.pairs):
            if not pair.pump() and pair in self.pairs:
                self.pairs.remove(pair)

    def hang_up(self) -> None:
        """Every open connection's client goes away."""
        for pair in self.pairs:
            pair.client_side.loseConnection()
        self.flush()


@implementer(IBodyProducer)
class BytesProducer:
    """A request body written at once (``chunked`` hides its length)."""

    def __init__(self, data: Any, chunked: bool = False) -> None:
        chunks = [data] if isinstance(data, bytes) else list(data)
        self.chunks = [chunk for chunk in chunks if chunk]
        self.length = UNKNOWN_LENGTH if chunked else sum(len(c) for c in self.chunks)

    def startProducing(self, consumer: Any) -> Deferred:  # noqa: N802
        for chunk in self.chunks:
            consumer.write(chunk)
        return succeed(None)

    def pauseProducing(self) -> None:  # noqa: N802
        pass

    def resumeProducing(self) -> None:  # noqa: N802
        pass

    def stopProducing(self) -> None:  # noqa: N802
        pass


class MemoryHTTP(HTTPClient):
    """A treq client of ``site`` over a :class:`MemoryAgent`."""

    def __init__(self, site: Any, reactor: Any) -> None:
        self.memory = MemoryAgent(site, reactor)
        super().__init__(self.memory, data_to_body_producer=BytesProducer)

    def flush(self) -> None:
        self.memory.flush()

    def hang_up(self) -> None:
        self.memory.hang_up()
