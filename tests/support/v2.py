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

