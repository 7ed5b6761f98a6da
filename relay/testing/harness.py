"""The in-memory broker of the tests: a configured API over a memory store, built
by the composition root, and a client that signs its requests (spec §3) and sends
them through the broker's own site in memory; the config, rules and messages the
contract suites start from."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

from twisted.internet.task import Clock

from relay.rules.config import Config, parse_config
from relay.rules.delivery import Message, Rules
from relay.wire.signing import sign

SECRET = "s3cret-for-the-tests"
START = 1_712_345_678.0


def make_config(base_dir: str = "/tmp", agents: Optional[Dict[str, Any]] = None,
                security: Optional[Dict[str, Any]] = None,
                groups: Optional[Dict[str, Any]] = None, roles: Optional[Dict[str, Any]] = None,
                **broker: Any) -> Config:
    """A validated Config: the shared secret :data:`SECRET`, memory storage, and ``broker``
    (and ``agents``, ``security``, ``groups``, ``roles`` sections when given)."""
    values = {"secret": SECRET, "storage": "memory"}
    values.update(broker)
    data: Dict[str, Any] = {"broker": values}
    if agents is not None:
        data["agents"] = agents
    if security is not None:
        data["security"] = security
    if groups is not None:
        data["groups"] = groups
    if roles is not None:
        data["roles"] = roles
    return parse_config(data, base_dir)


def make_rules(**changes: Any) -> Rules:
    """The delivery rules of a config that sets nothing (the config table's defaults),
    with ``changes``."""
    from relay.broker.operations import Policy

    return replace(Policy.from_config(make_config()).rules, **changes)


def new_message(sender: str, to: str, now: float, ttl_seconds: Optional[int] = None,
                delay_seconds: int = 0, **fields: Any) -> Message:
    """A message as the API would build it from a shorthand envelope."""
    envelope = {
        "id": fields.pop("id", None) or str(uuid.uuid4()),
        "from": sender,
        "to": to,
        "type": "message",
        "body": {"text": "hello"},
        "replyTo": None,
        "ack": False,
        "kind": "message",
        "rootId": None,
        "parentId": None,
    }
    envelope.update(fields)
    return Message.from_envelope(envelope, now, ttl_seconds, delay_seconds)


class SignedClient:
    """Signs requests per spec §3 and sends them to ``site`` in memory
    (:class:`relay.broker.loopback.MemoryHTTP`)."""

    def __init__(self, site, clock: Clock, secret: str = SECRET) -> None:
        from relay.broker.loopback import MemoryHTTP

        self.clock = clock
        self.secret = secret
        self.http = MemoryHTTP(site, clock)

    def headers(self, agent: str, method: str, path: str, raw: bytes,
                secret: Optional[str] = None, timestamp: Optional[int] = None) -> Dict[str, str]:
        ts = int(self.clock.seconds()) if timestamp is None else timestamp
        return {
            "X-Relay-Agent": agent,
            "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(secret or self.secret, method, path, ts, raw),
            "Content-Type": "application/json",
        }

    async def request(self, agent: Optional[str], method: str, path: str, body: Any = None,
                      raw: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None,
                      **sign_options: Any) -> Tuple[int, Any, Any]:
        """Send one request; returns ``(status, parsed JSON body, response)``."""
        if raw is None:
            raw = b"" if body is None else json.dumps(body).encode("utf-8")
        all_headers = {} if agent is None else self.headers(agent, method, path, raw,
                                                            **sign_options)
        all_headers.update(headers or {})
        response = await self.http.request(
            method, "http://127.0.0.1:19121" + path, data=raw or None, headers=all_headers
        )
        content = await response.content()
        return response.code, json.loads(content) if content else None, response

    async def get(self, agent: Optional[str], path: str, **kw: Any):
        return await self.request(agent, "GET", path, **kw)

    async def post(self, agent: Optional[str], path: str, body: Any = None, **kw: Any):
        return await self.request(agent, "POST", path, body, **kw)


def make_api(clock: Optional[Clock] = None, store=None, config: Optional[Config] = None,
             **broker: Any):
    """``(api, client, clock)``: a broker over a memory store as
    :func:`relay.broker.assembly.assemble` builds it (without listeners), and a signing
    client of its site.

    ``api.broker`` is the :class:`relay.broker.operations.Broker` behind it.
    """
    from relay.broker.assembly import assemble
    from relay.store.memory import MemoryStore

    clock = clock if clock is not None else Clock()
    if clock.seconds() == 0:
        clock.advance(START)
    config = config if config is not None else make_config(**broker)
    built = assemble(config, store if store is not None else MemoryStore(), clock, listen=False)
    return built.api, SignedClient(built.site, clock), clock


def build_site(config: Config, clock: Clock, store=None):
    """The broker's production site over ``store`` (a memory store when None), built
    by the composition root (:func:`relay.broker.assembly.assemble`) without listeners."""
    from relay.broker.assembly import assemble
    from relay.store.memory import MemoryStore

    store = store if store is not None else MemoryStore()
    return assemble(config, store, clock, listen=False).site
