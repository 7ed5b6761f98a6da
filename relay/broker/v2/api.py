"""The HTTP face of the v2/v3 wire (PROTOCOL-V2 §5) as a Klein app.

:class:`relay.broker.api.ListenerFront` hands this app every request that carries
``X-Agent-Relay-Agent``, and ``GET /healthz`` (WIRE-V2 §1); every other request
goes to the seed wire's app untouched. A v2 request passes the same rails as a
seed-wire one (WIRE-V2 §2): the ``Host`` rule (before the dispatch), the
per-address rate limit, the body limit, the failure lockout and the content-free
logs. Routes only parse, call :class:`relay.broker.v2.operations.Wire2` and encode;
the values are read, coerced and clamped as the reference broker at 6d17ff4 reads
them, and every refusal is the uniform error body.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Collection, Dict, Optional, Union

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from relay.broker.jsonapi import add_error_handling, read_body, write_body, write_error, write_json
from relay.broker.v2.operations import Query, Send, Wire2
from relay.rules.auth import RateLimiter
from relay.wire import errors, protocol
from relay.wire.v2 import views
from relay.wire.v2.signing import SignedHeaders

MAX_PULL_LIMIT = 8
MIN_LEASE_SECONDS, MAX_LEASE_SECONDS = 15, 3600
MAX_STATUS_IDS = 100
DEFAULT_RECENT, MAX_RECENT = 20, 50
DEFAULT_QUERY, MAX_QUERY = 50, 100
DEFAULT_STUCK, MAX_STUCK = 50, 100


def signed(route: Callable) -> Callable:
    """Route decorator: rate-limit, verify the v2/v3 headers, and call the route with
    the agent and the parsed JSON object of the body."""
    endpoint = route.__name__

    @functools.wraps(route)
    def wrapper(self: V2API, request, *args: Any) -> Any:
        request.route = "v2_" + endpoint
        if not _routable(request):
            return self.unrouted(request)
        agent, body = self.authenticate(request)
        if agent.__class__ is str:
            return self._run(route, request, agent, body)
        return agent.addCallback(lambda name: self._run(route, request, name, body))

    return wrapper


class V2API:
    """The v2/v3 routes over a :class:`Wire2`."""

    app = Klein()
    add_error_handling(app)

    def __init__(self, wire: Wire2, auth: Any, rate_limiter: RateLimiter,
                 configured: Collection[str] = ()) -> None:
        self.wire = wire
        self.auth = auth
        self.rate_limiter = rate_limiter
        self.configured = sorted(configured)

    def resource(self) -> Resource:
        return self.app.resource()

    def configure(self, auth: Any, configured: Collection[str]) -> None:
        """Apply the settings a reload may change."""
        self.auth = auth
        self.configured = sorted(configured)

    # -- plumbing ------------------------------------------------------------------------

    def authenticate(self, request):
        """``(agent, body)``: the agent that signed ``request`` (a Deferred of it while a
        shared nonce or lockout is consulted) and the raw body. Every request counts
        toward its address's rate limit, a refused one included."""
        source = _peer_host(request)
        self.rate_limiter.hit(source)
        body = read_body(request)
        headers = request.requestHeaders
        signed = self.auth.verify_v2(request.method, request.uri,
                                     SignedHeaders.read(lambda name: _header(headers, name)),
                                     body, source)
        return signed.agent, body

    def _run(self, route: Callable, request, agent: str, body: bytes) -> Any:
        registering = self.wire.seen(agent)
        if registering is None:
            return route(self, request, agent, body)
        return registering.addCallback(lambda _: route(self, request, agent, body))

    def unrouted(self, request) -> Union[bytes, Deferred]:
        """401 for a request whose signature fails, else 404 ``not_found``."""
        request.route = "v2_unrouted"
        agent, _ = self.authenticate(request)
        method = request.method.decode("latin-1")
        path = request.path.decode("utf-8", "replace")
        error = errors.not_found(f"no v2 route {method} {path}")
        if agent.__class__ is str:
            return write_error(request, error)
        return agent.addCallback(lambda _: write_error(request, error))

    def _answer(self, d: Deferred, request) -> Deferred:
        d.addCallback(lambda document: write_json(request, 200, document))
        return d

    # -- routes --------------------------------------------------------------------------

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request) -> Any:
        request.route = "v2_healthz"
        if not _routable(request, head=True):
            return self.unrouted(request)
        if request.requestHeaders.getRawHeaders(b"x-agent-relay-agent") is None:
            self.rate_limiter.hit(_peer_host(request))
            read_body(request)
            return self._answer(self.wire.health(False), request)

        def public(failure) -> Deferred:
            # PROTOCOL-V2 §5: /healthz needs no auth, and the reference's clients read
            # any failure of it as "broker down". A signature that does not verify
            # (counted toward the lockout like any other) gets the unsigned answer.
            failure.trap(errors.RelayError)
            if failure.value.code not in _HEALTHZ_PUBLIC_ON:
                failure.raiseException()
            return self._answer(self.wire.health(False), request)

        def roster(name: str) -> Deferred:
            return self._run(lambda api, request, agent, body: api._answer(
                api.wire.health(True, api.configured), request), request, name, b"")

        try:
            agent, _ = self.authenticate(request)
        except errors.RelayError:
            return public(Failure())
        if agent.__class__ is str:
            return roster(agent)
        return agent.addCallbacks(roster, public)

    @app.route("/v1/messages", methods=["POST"])
    @signed
    def send(self, request, agent: str, raw: bytes) -> Deferred:
        d = self.wire.send(agent, parse_send(_object(raw), agent))
        d.addCallback(self._sent, request)
        return d

    def _sent(self, result, request) -> bytes:
        # encode_json({"message_id": ..., "created": ..., "protocol_version": 3}),
        # formatted directly: the hottest answer of the wire.
        message_id, created = result
        return write_body(request, 200, b'{"message_id":"%s","created":%s,'
                          b'"protocol_version":%d}' % (message_id.encode("ascii"),
                                                       b"true" if created else b"false",
                                                       views.PROTOCOL_VERSION))

    @app.route("/v1/pull", methods=["POST"])
    @signed
    def pull(self, request, agent: str, raw: bytes) -> Deferred:
        body = _object(raw)
        _check_agent(body, agent)
        limit = MAX_PULL_LIMIT
        if "limit" in body:
            limit = _clamp(_number(body["limit"], "limit must be an integer"),
                           1, MAX_PULL_LIMIT)
        lease: Optional[int] = None
        if "lease_seconds" in body:
            lease = _clamp(_number(body["lease_seconds"], "lease_seconds must be an integer"),
                           MIN_LEASE_SECONDS, MAX_LEASE_SECONDS)
        d = self.wire.pull(agent, limit, lease)
        d.addCallback(lambda views_: write_json(request, 200, {"messages": views_}))
        return d

    @app.route("/v1/ack", methods=["POST"])
    @signed
    def ack(self, request, agent: str, raw: bytes) -> Deferred:
        body = _object(raw)
        _check_agent(body, agent)
        message_id = _text(body.get("message_id"), "message_id").strip()
        outcome = _text(body.get("outcome"), "outcome").strip().lower()
        error = _text(body.get("error"), "error")[:views.MAX_ERROR_CHARS]
        token = _text(body.get("lease_token"), "lease_token").strip()
        if not message_id:
            raise errors.bad_request("message_id is required")
        return self._answer(self.wire.ack(agent, message_id, outcome, error or None, token),
                            request)

    @app.route("/v1/lease/renew", methods=["POST"])
    @signed
    def renew(self, request, agent: str, raw: bytes) -> Deferred:
        body = _object(raw)
        _check_agent(body, agent)
        message_id = _text(body.get("message_id"), "message_id").strip()
        token = _text(body.get("lease_token"), "lease_token").strip()
        if not message_id or not token:
            raise errors.bad_request("message_id and lease_token are required")
        seconds = _loose_number(body.get("lease_seconds"))
        if not seconds:
            seconds = self.wire.broker.policy.lease_seconds
        seconds = _clamp(seconds, MIN_LEASE_SECONDS, MAX_LEASE_SECONDS)
        return self._answer(self.wire.renew(agent, message_id, token, seconds), request)

    @app.route("/v1/status", methods=["POST"])
    @signed
    def status(self, request, agent: str, raw: bytes) -> Deferred:
        body = protocol.parse_json_body(raw)
        ids = body.get("message_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            raise errors.bad_request("message_ids array is required")
        _check_agent(body, agent)
        wanted = [text for text in (_loose_text(value) for value in ids) if text]
        d = self.wire.status(agent, wanted[:MAX_STATUS_IDS])
        d.addCallback(lambda entries: write_json(request, 200, {"messages": entries}))
        return d

    @app.route("/v1/recent", methods=["POST"])
    @signed
    def recent(self, request, agent: str, raw: bytes) -> Deferred:
        body = _object(raw)
        _check_agent(body, agent)
        limit = _loose_limit(body.get("limit"), DEFAULT_RECENT, MAX_RECENT)
        d = self.wire.recent(agent, limit)
        d.addCallback(lambda entries: write_json(request, 200, {"messages": entries}))
        return d

    @app.route("/v1/messages/query", methods=["POST"])
    @signed
    def query(self, request, agent: str, raw: bytes) -> Deferred:
        body = _object(raw)
        _check_agent(body, agent)
        since = None
        if "since" in body:
            since = _loose_number(body["since"])
            if since is None:
                raise errors.bad_request("since must be a number")
        limit = _loose_number(body.get("limit")) or DEFAULT_QUERY
        limit = _clamp(limit, 1, MAX_QUERY)

        def text(field: str, lower: bool = False) -> Optional[str]:
            value = _loose_text(body.get(field))
            if not value:
                return None
            return value.lower() if lower else value

        filters = Query(message_id=text("message_id"), root_id=text("root_id"),
                        origin=text("origin", True), target=text("target", True),
                        kind=text("kind", True), status=text("status", True),
                        topic=text("topic"), since=since)
        d = self.wire.query(agent, limit, filters)
        d.addCallback(lambda found: write_json(request, 200,
                                               {"agent": agent, "messages": found}))
        return d

    @app.route("/v1/admin/status", methods=["POST"])
    @signed
    def admin_status(self, request, agent: str, raw: bytes) -> Deferred:
        body = _object(raw)
        _check_agent(body, agent)
        limit = DEFAULT_STUCK
        number = _loose_number(body.get("limit")) if "limit" in body else None
        if number is not None:
            limit = _clamp(number, 1, MAX_STUCK)
        d = self.wire.stuck(agent, limit)
        d.addCallback(lambda found: write_json(request, 200,
                                               {"agent": agent, "messages": found}))
        return d

    @app.route("/v1/admin/requeue", methods=["POST"])
    @signed
    def admin_requeue(self, request, agent: str, raw: bytes) -> Deferred:
        message_id = _admin_id(raw)
        return self._answer(self.wire.requeue(agent, message_id), request)

    @app.route("/v1/admin/cancel", methods=["POST"])
    @signed
    def admin_cancel(self, request, agent: str, raw: bytes) -> Deferred:
        message_id = _admin_id(raw)
        return self._answer(self.wire.cancel(agent, message_id), request)


# -- reading values as the reference does ----------------------------------------------


def _object(raw: bytes) -> Dict[str, Any]:
    """The body as a JSON object; 400 otherwise."""
    try:
        body = protocol.parse_json_body(raw, empty_ok=False)
    except errors.RelayError:
        body = None
    if not isinstance(body, dict):
        raise errors.bad_request("body must be a JSON object")
    return body


def _check_agent(body: Dict[str, Any], agent: str) -> None:
    """403 when the body names an ``agent`` other than the one that signed."""
    if "agent" in body and _loose_text(body["agent"]).strip().lower() != agent:
        raise errors.forbidden("agent does not match authenticated identity")


def _loose_text(value: Any) -> str:
    """A value as the reference's ``String(value || '')`` reads it, for scalars; a
    list or object reads as "" (it names nothing)."""
    if value.__class__ is str:
        return value
    if value is None or value is False or value == "" or (
            isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return ""
    if isinstance(value, str):
        return value
    if value is True:
        return "true"
    if isinstance(value, (int, float)):
        return protocol.compact_json(value)
    return ""


def _text(value: Any, field: str) -> str:
    """A text field: a string, a number or absent; 400 for an object or a list."""
    if value.__class__ is str:
        return value
    if isinstance(value, (dict, list)):
        raise errors.bad_request(f"{field} must be a string")
    return _loose_text(value)


def _loose_number(value: Any) -> Optional[float]:
    """A value as the reference's ``Number(value)`` reads it; None when that is not a
    finite number."""
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return 0.0
        try:
            number = float(text)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _number(value: Any, message: str) -> float:
    number = _loose_number(value)
    if number is None:
        raise errors.bad_request(message)
    return number


def _clamp(value: float, low: int, high: int) -> int:
    return max(low, min(int(math.floor(value)), high))


def _loose_limit(value: Any, default: int, high: int) -> int:
    number = _loose_number(value)
    if number is None:
        return default
    return max(1, min(int(math.floor(number)) or default, high))


def _truncate(value: Any, field: str, limit: int) -> str:
    return _text(value, field)[:limit]


def _admin_id(raw: bytes) -> str:
    try:
        body = protocol.parse_json_body(raw)
    except errors.RelayError:
        body = None
    message_id = _loose_text(body.get("message_id")).strip() if isinstance(body, dict) else ""
    if not message_id:
        raise errors.bad_request("message_id is required")
    return message_id


def parse_send(body: Dict[str, Any], agent: str) -> Send:
    """The values of a ``POST /v1/messages`` body of ``agent``, read, checked and
    clamped in the reference's order: 400 for a bad ``allow_shared_write``, 403 for an
    ``origin`` that is not ``agent``, 400 for a bad kind, a missing or too long body,
    a missing idempotency key, or a target that is no agent name."""
    origin = _text(body.get("origin"), "origin").strip().lower()
    target = _text(body.get("target"), "target").strip().lower()
    kind = _text(body.get("kind"), "kind").strip().lower()
    text = _text(body.get("body"), "body").strip()
    shared = body.get("allow_shared_write", False)
    if not isinstance(shared, bool):
        raise errors.bad_request("allow_shared_write must be a boolean")
    if origin != agent:
        raise errors.forbidden("origin does not match authenticated agent")
    if kind not in ("request", "reply"):
        raise errors.bad_request("invalid message kind")
    key = _text(body.get("idempotency_key"), "idempotency_key").strip()
    key = key[:views.MAX_IDEMPOTENCY_KEY_CHARS]
    if not text or len(text) > views.MAX_BODY_CHARS or not key:
        raise errors.bad_request("message body or idempotency key is invalid")
    if not protocol.is_valid_agent_name(target):
        raise errors.bad_request("target must be an agent name")
    ttl = _loose_number(body.get("ttl_seconds")) or views.DEFAULT_TTL_SECONDS
    parent = _text(body.get("parent_id"), "parent_id").strip() or None
    root = _text(body.get("root_id"), "root_id") or None
    for value, field in ((parent, "parent_id"), (root, "root_id")):
        if value is not None:
            protocol.check_id(value, field)
    return Send(
        origin=origin,
        target=target,
        kind=kind,
        body=text,
        session_ref=_truncate(body.get("session_ref"), "session_ref",
                              views.MAX_SESSION_REF_CHARS),
        idempotency_key=key,
        parent_id=parent,
        root_id=root,
        execution_mode=(_text(body.get("execution_mode"), "execution_mode").strip().lower()
                        or "read"),
        allow_shared_write=shared,
        ttl_seconds=_clamp(ttl, views.TTL_MIN_SECONDS, views.TTL_MAX_SECONDS),
        context=_truncate(body.get("context"), "context", views.MAX_BODY_CHARS),
        topic=_truncate(body.get("topic"), "topic", views.MAX_TOPIC_CHARS),
    )


# The refusals of a signature that GET /healthz answers as if it were unsigned; a
# rate limit (429) or an oversized body (400) stays what it is.
_HEALTHZ_PUBLIC_ON = frozenset({"unauthenticated", "unknown_agent", "unknown_key", "locked"})


def _routable(request, head: bool = False) -> bool:
    """False for what werkzeug would match but no route is (as for the seed wire,
    :func:`relay.broker.api._routable`): a HEAD unless ``head``, a method not in upper case,
    a path starting with ``//``."""
    method = request.method
    return ((head or method != b"HEAD") and method.isupper()
            and not request.path.startswith(b"//"))


def _header(headers, name: bytes) -> Optional[bytes]:
    values = headers.getRawHeaders(name)
    return values[0].strip() if values else None


def _peer_host(request) -> str:
    address = request.getClientAddress()
    return getattr(address, "host", None) or "unix"
