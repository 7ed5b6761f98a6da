"""The v2/v3 wire in memory: the broker's API over any store, and :class:`V2Client`s
speaking to it through ``treq.testing.RequestTraversalAgent`` with time on a
``task.Clock``."""

from __future__ import annotations

from typing import Any, Optional

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import LoopingCall

from relay.testing import SECRET
from tests.http_support import BASE, Broker
from tests.v2_client import V2Client


class V2Broker(Broker):
    """The in-memory harness of the seed wire, with v2/v3 clients. While it runs, the
    server's late writes (a store that commits later) are delivered every few ms."""

    def __init__(self, clock=None, store=None, config=None, **broker: Any) -> None:
        super().__init__(clock, store, config, **broker)
        self.http = HTTPClient(self.agent)
        self._pump = LoopingCall(self.flush)
        self._pump.clock = reactor
        self._pump.start(0.002, now=False)
        if not hasattr(self.api.auth, "verify_v2"):
            self.api.v2.auth = pending_verify_v2(self.config, self.clock)

    def stop(self) -> None:
        if self._pump.running:
            self._pump.stop()

    def client(self, agent: str, secret: str = SECRET, key_id: Optional[str] = None
               ) -> V2Client:
        return V2Client(BASE.decode(), agent, secret, key_id, http=self.http,
                        now=self.clock.seconds)


def pending_verify_v2(config, clock):
    """Until relay.auth.Authenticator.verify_v2 lands: the keyring check of
    relay.wire2.signing, without the lockout."""
    from relay import errors
    from relay.auth import Signed
    from relay.wire2.signing import Refusal, SigningKey, check_request, read_agent

    class Verifier:
        def verify_v2(self, method, path, headers, body, source=""):
            try:
                agent = read_agent(headers)
                entry = config.agents.get(agent)
                if entry is None and any(a.secret for a in config.agents.values()):
                    raise errors.unknown_agent()
                ring = entry.keys if entry is not None and entry.keys else {
                    "legacy": SigningKey(tuple(config.secrets))}
                verified = check_request(ring, agent, headers, method, path, body,
                                         clock.seconds())
            except Refusal as refusal:
                raise refusal.error from None
            return Signed(agent, None, verified.timestamp, source)

    return Verifier()
