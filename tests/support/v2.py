"""The v2/v3 wire in memory: the broker's API over any store, and :class:`V2Client`s
speaking to it through ``treq.testing.RequestTraversalAgent`` with time on a
``task.Clock``."""

from __future__ import annotations

from typing import Any, Optional

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import LoopingCall

from relay.testing import SECRET
from tests.support.api import BASE, Broker
from tests.support.v2_client import V2Client


class V2Broker(Broker):
    """The in-memory harness of the seed wire, with v2/v3 clients. While it runs, the
    server's late writes (a store that commits later) are delivered every few ms."""

    def __init__(self, clock=None, store=None, config=None, **broker: Any) -> None:
        super().__init__(clock, store, config, **broker)
        self.http = HTTPClient(self.agent)
        self._pump = LoopingCall(self.flush)
        self._pump.clock = reactor
        self._pump.start(0.002, now=False)

    def stop(self) -> None:
        if self._pump.running:
            self._pump.stop()

    def client(self, agent: str, secret: str = SECRET, key_id: Optional[str] = None
               ) -> V2Client:
        return V2Client(BASE.decode(), agent, secret, key_id, http=self.http,
                        now=self.clock.seconds)


def assert_v2_error(reply, status: int, code: str) -> None:
    """The error body of the v2/v3 wire: ``status`` and ``code``, and a message."""
    assert reply.code == status, reply
    assert set(reply.json) == {"error"} and set(reply.json["error"]) == {"code", "message"}
    assert reply.json["error"]["code"] == code, reply
    assert reply.json["error"]["message"]


async def leased_request(broker, sender="alpha", to="beta", body="hello", **fields):
    """A v2 request from ``sender``, pulled by ``to``: ``(sender's client, to's client,
    the request's id, the message as pulled)``."""
    a, b = broker.client(sender), broker.client(to)
    sent = await a.send_request(to, body, **fields)
    assert sent.code == 200, sent
    (message,) = await b.pull()
    return a, b, sent.json["message_id"], message


async def swept(broker, client, message_id: str, stored: bool = True) -> None:
    """Sweep, and wait until ``message_id`` is stored (or gone): on PostgreSQL a sweep
    the clock started may hold the rows (SKIP LOCKED) until its commit."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    await broker.broker.sweep_expired()
    for _ in range(500):
        (entry,) = await client.status(message_id)
        if (entry["status"] != "not_found") == stored:
            return
        await deferLater(reactor, 0.01)
    raise AssertionError(f"{message_id} is {'not ' if stored else ''}stored")
