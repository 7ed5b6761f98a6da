"""HTTP-level test support for the API tests: raw, signed requests in memory.

Requests go through the broker's own site (as :func:`relay.broker.assembly.assemble`
builds it) over :class:`relay.broker.loopback.MemoryAgent`: no sockets, and time is a
``task.Clock``. The path is sent and signed byte for byte as given, so query
strings and odd ids reach the broker exactly as a client wrote them.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock, deferLater
from twisted.web.client import readBody
from twisted.web.http_headers import Headers

from relay.broker.assembly import assemble
from relay.broker.loopback import BytesProducer, MemoryAgent
from relay.testing import SECRET, START, make_api, make_config
from relay.wire.signing import sign

BASE = b"http://127.0.0.1:19121"


class Reply:
    """One HTTP response: status, headers, parsed JSON (None when empty)."""

    def __init__(self, code: int, headers: Headers, raw: bytes) -> None:
        self.code = code
        self.headers = headers
        self.raw = raw
        # GET /v1/events streams; the inbox page's files are no JSON either
        is_json = (self.header("content-type") or "").startswith("application/json")
        self.json: Any = json.loads(raw) if raw and is_json else None

    def header(self, name: str) -> Optional[str]:
        values = self.headers.getRawHeaders(name)
        return values[0] if values else None

    @property
    def error_code(self) -> Optional[str]:
        if isinstance(self.json, dict) and isinstance(self.json.get("error"), dict):
            return self.json["error"].get("code")
        return None

    def __repr__(self) -> str:
        return f"<Reply {self.code} {self.raw[:300]!r}>"


def assert_error(reply: Reply, status: int, code: str) -> None:
    """The §6 error body, exactly, with the JSON headers."""
    assert reply.code == status, reply
    assert set(reply.json) == {"error"}, reply
    assert set(reply.json["error"]) == {"code", "message"}, reply
    assert reply.json["error"]["code"] == code, reply
    assert isinstance(reply.json["error"]["message"], str) and reply.json["error"]["message"]
    assert_json_headers(reply)


def assert_json_headers(reply: Reply) -> None:
    assert reply.header("content-type") == "application/json; charset=utf-8", reply
    assert reply.header("cache-control") == "no-store", reply


class Broker:
    """A RelayAPI over a memory store with a signing, byte-exact client."""

    def __init__(self, clock: Optional[Clock] = None, store=None, config=None, **broker: Any):
        from relay.store.memory import MemoryStore

        self.clock = clock if clock is not None else Clock()
        if self.clock.seconds() == 0:
            self.clock.advance(START)
        self.config = config if config is not None else make_config(**broker)
        self.store = store if store is not None else MemoryStore()
        self.assembly = assemble(self.config, self.store, self.clock, listen=False)
        self.api = self.assembly.api
        self.broker = self.api.broker
        self.agent = MemoryAgent(self.assembly.site, self.clock)
        self.secrets: Dict[str, str] = {}

    # -- raw requests ---------------------------------------------------------

    def send(self, method: str, path: str, raw: bytes = b"",
             headers: Optional[Dict[str, str]] = None, chunked: bool = False,
             chunks: Optional[List[bytes]] = None) -> Deferred:
        """Start a request; the Deferred fires with a :class:`Reply`."""
        h = Headers()
        for name, value in (headers or {}).items():
            h.addRawHeader(name, value)
        body = chunks if chunks is not None else ([raw] if raw else [])
        producer = BytesProducer(body, chunked) if (body or chunked) else None

        async def run() -> Reply:
            response = await self.agent.request(method.encode("ascii"), BASE + path.encode("utf-8"),
                                                h, producer)
            content = await readBody(response)
            return Reply(response.code, response.headers, content)

        return ensureDeferred(run())

    def signed_headers(self, agent: str, method: str, path: str, raw: bytes,
                       secret: Optional[str] = None, timestamp: Optional[int] = None
                       ) -> Dict[str, str]:
        ts = int(self.clock.seconds()) if timestamp is None else timestamp
        key = secret if secret is not None else self.secrets.get(agent, SECRET)
        return {
            "X-Relay-Agent": agent,
            "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(key, method, path, ts, raw),
            "Content-Type": "application/json",
        }

    def request(self, agent: Optional[str], method: str, path: str, body: Any = None,
                raw: Optional[bytes] = None, chunked: bool = False,
                headers: Optional[Dict[str, str]] = None, **sign_options: Any) -> Deferred:
        """A signed request (unsigned when ``agent`` is None)."""
        if raw is None:
            raw = b"" if body is None else json.dumps(body).encode("utf-8")
        all_headers = {} if agent is None else self.signed_headers(agent, method, path, raw,
                                                                   **sign_options)
        all_headers.update(headers or {})
        return self.send(method, path, raw, all_headers, chunked=chunked)

    def get(self, agent: Optional[str], path: str, **kw: Any) -> Deferred:
        return self.request(agent, "GET", path, **kw)

    def post(self, agent: Optional[str], path: str, body: Any = None, **kw: Any) -> Deferred:
        return self.request(agent, "POST", path, body, **kw)

    def flush(self) -> None:
        """Deliver what the server wrote after the request returned (long polls)."""
        self.agent.flush()

    def hang_up(self) -> None:
        """Every client with a request in flight goes away."""
        self.agent.hang_up()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.flush()

    # -- conveniences ---------------------------------------------------------

    async def register(self, *agents: str) -> None:
        for agent in agents:
            reply = await self.post(agent, "/register", {})
            assert reply.code == 200, reply

    async def message(self, sender: str, to: str, **fields: Any) -> str:
        """Send a message; returns its id."""
        reply = await self.post(sender, "/messages", dict(fields, to=to))
        assert reply.code == 201, reply
        return reply.json["id"]

    async def pull(self, agent: str, **body: Any) -> List[Dict[str, Any]]:
        reply = await self.post(agent, "/v1/pull", body)
        assert reply.code == 200, reply
        return reply.json["messages"]

    async def poll(self, agent: str, query: str = "") -> Tuple[List[Dict[str, Any]], Any]:
        reply = await self.get(agent, "/messages" + query)
        assert reply.code == 200, reply
        return reply.json["messages"], reply.json["cursor"]

    async def status(self, agent: str, *ids: str) -> List[Dict[str, Any]]:
        reply = await self.post(agent, "/v1/status", {"messageIds": list(ids)})
        assert reply.code == 200, reply
        return reply.json["messages"]


async def answered(broker: Broker, d: Deferred, seconds: float = 10.0) -> Reply:
    """``d``'s reply, flushing what the broker writes once the database answered."""
    deadline = time.monotonic() + seconds
    while not d.called and time.monotonic() < deadline:
        broker.flush()
        await deferLater(reactor, 0.01, lambda: None)
    return await d


# -- what the tests of the routes share ----------------------------------------------------


async def two_agents(**broker: Any) -> Broker:
    """A broker (``broker`` are its ``broker.*`` keys) with alpha and beta registered."""
    b = Broker(**broker)
    await b.register("alpha", "beta")
    return b


async def leased_one(b: Broker, **pull: Any) -> Dict[str, Any]:
    """A message from alpha, leased by beta's pull (``pull`` are its fields)."""
    msg_id = await b.message("alpha", "beta")
    (leased,) = await b.pull("beta", **pull)
    assert leased["id"] == msg_id
    return leased


async def lease(b: Broker, **fields: Any) -> Dict[str, Any]:
    """A message from alpha (``fields`` are its envelope's), leased by beta."""
    await b.message("alpha", "beta", **fields)
    (leased,) = await b.pull("beta", limit=1)
    return leased


async def ack(b: Broker, leased: Dict[str, Any], outcome: str, agent: str = "beta",
              **extra: Any) -> Reply:
    """``POST /v1/ack`` of ``leased`` with ``outcome`` (``extra`` are more fields)."""
    body = {"messageId": leased["id"], "leaseId": leased["leaseId"], "outcome": outcome}
    body.update(extra)
    return await b.post(agent, "/v1/ack", body)


def logged_store():
    """A memory store that notes the store operations requests make (``operations``)."""
    from relay.store.memory import MemoryStore

    class Logged(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.operations: list = []

        def find(self, *args, **kwargs):
            self.operations.append("find")
            return super().find(*args, **kwargs)

        def add(self, *args, **kwargs):
            self.operations.append("add")
            return super().add(*args, **kwargs)

        def settle(self, *args, **kwargs):
            self.operations.append("settle")
            return super().settle(*args, **kwargs)

    return Logged()


def sized_envelope(size: int) -> bytes:
    """A send to beta of exactly ``size`` bytes."""
    head = b'{"to":"beta","body":{"pad":"'
    tail = b'"}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


# -- through relay.testing's signed client -------------------------------------------------


async def registered(*agents: str, **broker: Any):
    """``make_api(**broker)`` with ``agents`` registered: ``(api, client, clock)``."""
    api, client, clock = make_api(**broker)
    for agent in agents:
        assert (await client.post(agent, "/register", {}))[0] == 200
    return api, client, clock


def refused(answer, status: int = 400, code: str = "bad_request") -> str:
    """The message of an error answer, after checking its status and uniform body."""
    got, body, _ = answer
    assert got == status, body
    assert set(body) == {"error"} and body["error"]["code"] == code
    return body["error"]["message"]
