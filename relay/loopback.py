"""A connection to a site held in memory: raw HTTP in, the answer's bytes out.

The warm-up (:mod:`relay.warmup`) and the test harness (:mod:`relay.testing`)
serve requests through the broker's real site, channel and request classes
without a socket. ``twisted.internet.testing.StringTransport`` does the same for
tests, but production code does not import Twisted's testing helpers, so this
module holds the few methods of a transport that a site's protocols use.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IConsumer, IPushProducer, ITransport
from twisted.python.failure import Failure
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
