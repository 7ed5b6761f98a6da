"""A v2/v3 client for the tests, written from the reference's PROTOCOL-V2 (§3-§5).

It serializes each body as canonical JSON, signs those bytes with the v2 scheme (or
v3 with a key id) through :mod:`relay.wire.v2`, and sends those bytes, as the
reference's own clients do. It speaks through a treq ``HTTPClient``: over
``treq.testing.RequestTraversalAgent`` in memory (time from a ``task.Clock``), or
over the reactor's TCP to a real broker process.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

import treq
from treq.client import HTTPClient
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers

from relay.wire.v2.canonical import canonical_body
from relay.wire.v2.signing import signed_headers


def _fresh_connections() -> HTTPClient:
    """A client that opens a connection per request, as the reference's clients do (and
    so none is left pointing at a broker process that was restarted)."""
    from twisted.internet import reactor

    return HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))


class V2Reply:
    """One answer: status and parsed JSON."""

    def __init__(self, code: int, raw: bytes) -> None:
        self.code = code
        self.raw = raw
        self.json: Any = json.loads(raw) if raw else None

    @property
    def error_code(self) -> Optional[str]:
        if isinstance(self.json, dict) and isinstance(self.json.get("error"), dict):
            return self.json["error"].get("code")
        return None

    def __repr__(self) -> str:
        return f"<V2Reply {self.code} {self.raw[:300]!r}>"


class V2Client:
    """One agent on the v2/v3 wire. ``key_id`` makes it sign with v3."""

    def __init__(self, base_url: str, agent: str, secret: str, key_id: Optional[str] = None,
                 http: Optional[HTTPClient] = None,
                 now: Callable[[], float] = time.time) -> None:
        self.base_url = base_url.rstrip("/")
        self.agent = agent
        self.secret = secret
        self.key_id = key_id
        self.http = http if http is not None else _fresh_connections()
        self.now = now

    # -- raw -------------------------------------------------------------------------

    async def request(self, method: str, path: str, payload: Any = None,
                      raw: Optional[bytes] = None, signed: bool = True,
                      headers: Optional[Dict[str, str]] = None,
                      secret: Optional[str] = None, timestamp: Optional[int] = None
                      ) -> V2Reply:
        """Send ``payload`` as canonical JSON (or ``raw`` as given), signed unless
        ``signed`` is False."""
        if raw is None:
            raw = b"" if payload is None else canonical_body(payload)
        all_headers: Dict[str, str] = {"Content-Type": "application/json"} if raw else {}
        if signed:
            all_headers.update(signed_headers(
                secret if secret is not None else self.secret, self.agent, method, path, raw,
                timestamp=int(self.now()) if timestamp is None else timestamp,
                key_id=self.key_id))
        all_headers.update(headers or {})
        h = Headers()
        for name, value in all_headers.items():
            h.addRawHeader(name, value)
        response = await self.http.request(method, self.base_url + path, headers=h,
                                           data=raw or None)
        content = await treq.content(response)
        return V2Reply(response.code, content)

    async def ok(self, method: str, path: str, payload: Any = None) -> Any:
        reply = await self.request(method, path, payload)
        assert reply.code == 200, reply
        return reply.json

    def _key(self) -> str:
        return f"{self.agent}:{uuid.uuid4().hex}"

    # -- the surface of the reference's RelayClientV2 ------------------------------

    async def health(self, signed: bool = False) -> V2Reply:
        return await self.request("GET", "/healthz", signed=signed)

    def request_payload(self, target: str, body: str, **fields: Any) -> Dict[str, Any]:
        payload = {"origin": self.agent, "target": target, "kind": "request", "body": body,
                   "idempotency_key": fields.pop("idempotency_key", None) or self._key(),
                   "execution_mode": fields.pop("execution_mode", "read"),
                   "session_ref": fields.pop("session_ref", self.agent), "ttl_seconds": 3600}
        payload.update(fields)
        return payload

    async def send_request(self, target: str, body: str, **fields: Any) -> V2Reply:
        return await self.request("POST", "/v1/messages",
                                  self.request_payload(target, body, **fields))

    async def send_reply(self, parent_id: str, target: str, body: str, **fields: Any
                         ) -> V2Reply:
        payload = {"origin": self.agent, "target": target, "kind": "reply", "body": body,
                   "parent_id": parent_id,
                   "idempotency_key": fields.pop("idempotency_key", None) or self._key()}
        payload.update(fields)
        return await self.request("POST", "/v1/messages", payload)

    async def pull(self, **fields: Any) -> List[Dict[str, Any]]:
        return (await self.ok("POST", "/v1/pull", dict({"agent": self.agent}, **fields))
                )["messages"]

    async def ack(self, message_id: str, outcome: str = "completed", **fields: Any) -> V2Reply:
        return await self.request("POST", "/v1/ack", dict(
            {"agent": self.agent, "message_id": message_id, "outcome": outcome}, **fields))

    async def renew(self, message_id: str, lease_token: str, **fields: Any) -> V2Reply:
        return await self.request("POST", "/v1/lease/renew", dict(
            {"agent": self.agent, "message_id": message_id, "lease_token": lease_token},
            **fields))

    async def status(self, *message_ids: str) -> List[Dict[str, Any]]:
        return (await self.ok("POST", "/v1/status", {"agent": self.agent,
                                                     "message_ids": list(message_ids)})
                )["messages"]

    async def recent(self, **fields: Any) -> List[Dict[str, Any]]:
        return (await self.ok("POST", "/v1/recent", dict({"agent": self.agent}, **fields))
                )["messages"]

    async def query(self, **filters: Any) -> List[Dict[str, Any]]:
        return (await self.ok("POST", "/v1/messages/query",
                              dict({"agent": self.agent}, **filters)))["messages"]

    async def requeue(self, message_id: str) -> V2Reply:
        return await self.request("POST", "/v1/admin/requeue", {"message_id": message_id})

    async def cancel(self, message_id: str) -> V2Reply:
        return await self.request("POST", "/v1/admin/cancel", {"message_id": message_id})

    async def admin_status(self, **fields: Any) -> List[Dict[str, Any]]:
        return (await self.ok("POST", "/v1/admin/status", dict({"agent": self.agent},
                                                                **fields)))["messages"]
