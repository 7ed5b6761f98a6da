"""Client-side test support: an in-memory broker behind a recording HTTP client, and
the same broker seen as a v1.1 broker (the reference's capabilities).

Time is a ``task.Clock``; HTTP goes to the broker's own site in memory
(:class:`relay.broker.loopback.MemoryHTTP`).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import pytest
from twisted.internet import defer
from twisted.python.failure import Failure
from twisted.web.client import ResponseNeverReceived
from twisted.web.resource import Resource

from relay.broker.loopback import MemoryHTTP
from relay.broker.site import RelaySite
from relay.client.client import RelayClient
from relay.testing import SECRET
from relay.wire.errors import RelayError

# What the reference broker (v1.1) advertises.
V11_INFO = {
    "protocol": "1.0",
    "broker": "dsh-agent-relay",
    "version": "0.3.0",
    "capabilities": {"leaseDelivery": True, "requestReply": True, "filteredQuery": True,
                     "sqlitePersistence": False},
    "storage": "memory",
}
# The request fields v1.2 adds, by path, and its new paths.
V12_FIELDS = {
    "/messages": {"ttlSeconds", "delaySeconds"},
    "/register": {"card"},
    "/v1/pull": {"parentId"},
    "/v1/ack": {"reply", "retryAfterSeconds"},
    "/v1/messages/query": {"box", "rootId", "parentId"},
}
V12_PATHS = {"/v1/lease/renew", "/v1/requeue", "/v1/cancel", "/v1/thread"}

Request = Tuple[str, str, Dict[str, List[str]], bytes]


def assert_v11_requests(requests: List[Request]) -> None:
    """No v1.2 path, field or nonce in ``requests`` (method, path, headers, body)."""
    for _, path, headers, raw in requests:
        assert path.split("?")[0] not in V12_PATHS, path
        assert not any(name.lower() == "x-relay-nonce" for name in headers), path
        if raw:
            assert not set(json.loads(raw)) & V12_FIELDS.get(path, set()), (path, raw)


class SeenAsV11(Resource):
    """The broker's resource, except that ``GET /`` answers as a v1.1 broker does:
    clients that handshake through it use none of v1.2.

    With ``long_poll`` it advertises this broker's long polling too (an extension
    older than v1.2), so that waits behave as they do on this broker.
    """

    isLeaf = True

    def __init__(self, resource: Any, long_poll: bool = False) -> None:
        super().__init__()
        self.resource = resource
        self.info = json.loads(json.dumps(V11_INFO))
        if long_poll:
            self.info["capabilities"]["longPoll"] = {"maxWaitSeconds": 20}

    def render(self, request: Any) -> Any:
        if request.method == b"GET" and request.path == b"/":
            request.setHeader(b"content-type", b"application/json; charset=utf-8")
            return json.dumps(self.info).encode("utf-8")
        return self.resource.render(request)


def relay_stub(resource: Any, clock: Any) -> MemoryHTTP:
    """A treq client of ``resource`` served in memory by the broker's own site."""
    return MemoryHTTP(RelaySite(resource, reactor=clock), clock)


class Recording:
    """A treq stand-in that records every request and passes it on.

    ``drop_answers`` makes the next answers get lost on the way back, after the
    broker has acted on the request (as a connection reset would).
    """

    def __init__(self, http: Any) -> None:
        self.http = http
        self.requests: List[Tuple[str, str, Dict[str, List[str]], bytes]] = []
        self.drop_answers = 0

    def request(self, method: str, url: str, headers: Any = None, data: Any = None,
                **kwargs: Any) -> defer.Deferred:
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        self.requests.append((method, path, dict(headers or {}), data or b""))
        d = self.http.request(method, url, headers=headers, data=data, **kwargs)
        if self.drop_answers:
            self.drop_answers -= 1

            def lose(response: Any) -> Failure:
                return Failure(ResponseNeverReceived([Failure(ConnectionResetError())]))

            d.addCallback(lose)
        return d

    def paths(self) -> List[Tuple[str, str]]:
        return [(method, path) for method, path, _, _ in self.requests]

    def bodies(self, path: str) -> List[Dict[str, Any]]:
        return [json.loads(raw) for _, p, _, raw in self.requests if p == path and raw]

    def header(self, index: int, name: str) -> Optional[str]:
        values = self.requests[index][2].get(name)
        return values[0] if values else None


class Net:
    """An in-memory broker, a recording HTTP client and a Clock.

    With ``v11`` the broker is seen as a v1.1 broker (:class:`SeenAsV11`, with
    long polling when ``long_poll``).
    """

    def __init__(self, v11: bool = False, long_poll: bool = False, **broker: Any) -> None:
        from relay.testing import make_api

        self.api, _, self.clock = make_api(**broker)
        resource = self.api.resource()
        self.stub = relay_stub(SeenAsV11(resource, long_poll) if v11 else resource, self.clock)
        self.http = Recording(self.stub)

    def client(self, agent: str, **kwargs: Any) -> RelayClient:
        return RelayClient("http://127.0.0.1:19121", agent, SECRET, clock=self.clock,
                           http=self.http, **kwargs)

    def settle(self, seconds: float = 0.0) -> None:
        for _ in range(5):
            self.stub.flush()
        if seconds:
            self.clock.advance(seconds)
            for _ in range(5):
                self.stub.flush()

    def start(self, d: Any) -> defer.Deferred:
        d = defer.ensureDeferred(d)
        self.settle()
        return d

    def run(self, d: Any) -> Any:
        """The result of a call that completes without the clock moving."""
        return result_of(self.start(d))


def result_of(d: defer.Deferred) -> Any:
    results: List[Any] = []
    d.addBoth(results.append)
    assert results, "the call did not complete"
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


def failure_of(d: defer.Deferred, kind: type = RelayError) -> Any:
    with pytest.raises(kind) as info:
        result_of(d)
    return info.value
