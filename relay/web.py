"""The broker's HTTP API (spec §4, §5.1) as a Klein app.

Routes only translate HTTP into store calls: parse, authenticate, call,
encode. Every failure is a :class:`relay.errors.RelayError` rendered in one
place as the §6 body; anything unexpected becomes ``503 busy`` and is logged
by incident id only, never with message content.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from typing import Any, Callable, Dict, Optional

from klein import Klein
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from werkzeug.exceptions import MethodNotAllowed, NotFound
from werkzeug.routing import RequestRedirect

from relay import __version__, errors, protocol
from relay.auth import Authenticator, RateLimiter
from relay.config import Config
from relay.delivery import Message
from relay.errors import RelayError
from relay.protocol import HEARTBEAT_TTL_SECONDS, MAX_WAIT_SECONDS
from relay.waiters import Waiters

log = Logger(namespace="relay.web")

JSON_HEADERS = (
    (b"content-type", b"application/json; charset=utf-8"),
    (b"cache-control", b"no-store"),
)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return _encode(value).encode("utf-8")


def set_json_headers(request, status: int) -> None:
    """Set the status and the JSON headers of a response."""
    request.setResponseCode(status)
    for name, header in JSON_HEADERS:
        request.setHeader(name, header)


def write_json(request, status: int, value: Any) -> bytes:
    """Set the status and JSON headers of ``request``; returns the encoded body."""
    set_json_headers(request, status)
    body = encode_json(value)
    request.setHeader(b"content-length", b"%d" % len(body))
    return body


def parse_json(raw: bytes) -> Any:
    """A request body as JSON (``{}`` when empty); lone surrogates are refused."""
    value = protocol.parse_json_body(raw)
    if _SURROGATE_ESCAPE.search(raw):
        try:
            encode_json(value)
        except UnicodeEncodeError:
            raise errors.bad_request("request body holds an invalid unicode escape") from None
    return value


def parse_object(raw: bytes) -> Dict[str, Any]:
    """A request body that must be a JSON object."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise errors.bad_request("body must be a JSON object")
    return value


def check_body_size(request) -> None:
    """400 ``bad_request`` when the request body is over 1 MiB (spec §1).

    :class:`relay.http.RelayRequest` counts without keeping; under any other
    ``twisted.web`` request (a plain Site, ``StubTreq``) the buffered body is measured.
    """
    too_large = getattr(request, "body_too_large", None)
    if too_large is None:
        content = request.content
        too_large = content is not None and content.seek(0, 2) > protocol.MAX_BODY_BYTES
    if too_large:
        raise errors.bad_request(f"request body exceeds {protocol.MAX_BODY_BYTES} bytes")


def raw_body(request) -> bytes:
    """The request body as received (the size was checked by :func:`check_body_size`)."""
    reader = getattr(request, "raw_body", None)
    if reader is not None:
        return reader()
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return content.read()


def _query_arg(request, name: bytes) -> Optional[str]:
    values = request.args.get(name)
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise errors.bad_request(f"query parameter {name.decode()} is not valid UTF-8") from None


def authenticated(route: Callable) -> Callable:
    """Route decorator: rate-limit, verify the §3 headers, pass the agent name."""

    @functools.wraps(route)
    def wrapper(self: RelayAPI, request, *args, **kwargs):
        agent = self.authenticate(request)
        path = request.path
        if (not kwargs and b"%" in path) or path.startswith(b"//"):
            # Paths match as sent (spec §1): "/v1/%70ull" is not "/v1/pull", and
            # "//peers" is not "/peers" (Klein would drop the empty first segment).
            raise _no_route(request)
        return route(self, request, agent, *args, **kwargs)

    return wrapper


class RelayAPI:
    """The HTTP API over one store. ``resource()`` gives the root IResource."""

    app = Klein()

    def __init__(
        self,
        store,
        config: Config,
        clock: IReactorTime,
        auth: Optional[Authenticator] = None,
        rate_limiter: Optional[RateLimiter] = None,
        waiters: Optional[Waiters] = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.auth = (
            auth if auth is not None else Authenticator.from_config(config, clock, _log_lock)
        )
        self.rate_limiter = (
            rate_limiter
            if rate_limiter is not None
            else RateLimiter(clock, config.rate_limit_loopback, config.rate_limit_remote)
        )
        self.waiters = waiters if waiters is not None else Waiters(clock)
        self.info = encode_json(
            {
                "protocol": protocol.PROTOCOL_VERSION,
                "broker": protocol.BROKER_NAME,
                "version": __version__,
                "capabilities": {
                    "leaseDelivery": True,
                    "requestReply": True,
                    "filteredQuery": True,
                    "sqlitePersistence": True,
                    "longPoll": {"maxWaitSeconds": MAX_WAIT_SECONDS},
                },
                "storage": store.name,
            }
        )

    def resource(self):
        """The resource serving this API: Klein's, behind a check of the URL's encoding."""
        return _UTF8URLs(self.app.resource())

    # -- plumbing ------------------------------------------------------------

    def authenticate(self, request) -> str:
        """The agent that signed ``request``; RelayError on any §3 failure."""
        check_body_size(request)
        self.rate_limiter.hit(_peer_host(request))
        headers = request.requestHeaders
        return self.auth.authenticate(
            request.method,
            request.uri,
            _header(headers, b"x-relay-agent"),
            _header(headers, b"x-relay-timestamp"),
            _header(headers, b"x-relay-signature"),
            raw_body(request),
        )

    @app.handle_errors(RelayError)
    def relay_error(self, request, failure: Failure) -> bytes:
        error = failure.value
        return write_json(request, error.status, error.to_body())

    @app.handle_errors(NotFound, MethodNotAllowed, RequestRedirect)
    def no_route(self, request, failure: Failure) -> bytes:
        """401 for an unsigned request, else 404; a redirect werkzeug would answer (a
        ``//`` in the path) is no route either: the signature covers the path as sent."""
        try:
            self.authenticate(request)
        except RelayError as error:
            return write_json(request, error.status, error.to_body())
        return write_json(request, 404, _no_route(request).to_body())

    @app.handle_errors(Exception)
    def unexpected(self, request, failure: Failure) -> bytes:
        incident = uuid.uuid4().hex[:12]
        frames = " < ".join(f"{f[0]}:{f[2]}" for f in reversed(failure.frames[-6:]))
        log.error(
            "incident {incident}: {kind} in {frames}",
            incident=incident,
            kind=failure.type.__name__,
            frames=frames,
        )
        error = errors.busy(f"internal broker error (incident {incident})")
        return write_json(request, 503, error.to_body())

    # -- v1.0 ----------------------------------------------------------------

    @app.route("/", methods=["GET"])
    def root(self, request) -> bytes:
        if request.path != b"/":
            return self.no_route(request, None)
        check_body_size(request)
        set_json_headers(request, 200)
        request.setHeader(b"content-length", b"%d" % len(self.info))
        return self.info

    @app.route("/register", methods=["POST"])
    @authenticated
    @inlineCallbacks
    def register(self, request, agent: str):
        body = parse_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        now = int(self.clock.seconds())
        yield self.store.register(agent, now)
        return write_json(request, 200, {"ok": True, "agent": agent, "ts": now})

    @app.route("/peers", methods=["GET"])
    @authenticated
    @inlineCallbacks
    def peers(self, request, agent: str):
        peers = yield self.store.peers()
        now = self.clock.seconds()
        return write_json(
            request,
            200,
            {
                "peers": [
                    {"agent": name, "online": now - seen < HEARTBEAT_TTL_SECONDS, "lastSeen": seen}
                    for name, seen in peers
                ]
            },
        )

    # The hot routes (send, pull, ack) chain callbacks rather than use
    # inlineCallbacks: a generator per request is measurable at this rate.

    @app.route("/messages", methods=["POST"])
    @authenticated
    def send(self, request, agent: str) -> Deferred:
        envelope = protocol.normalize_envelope(parse_json(raw_body(request)), agent)
        self.check_acl(agent, envelope["to"])
        registered = self.store.is_registered(envelope["to"])
        if isinstance(registered, Deferred):  # a store that answers asynchronously
            registered.addCallback(self._add_if_registered, request, envelope)
            return registered
        return self._add_if_registered(registered, request, envelope)

    def _add_if_registered(self, registered: bool, request, envelope) -> Deferred:
        if not registered:
            raise errors.no_such_agent(f"recipient {envelope['to']!r} has never registered")
        message = Message.from_envelope(envelope, self.clock.seconds())
        d = self.store.add(message)
        d.addCallback(self._added, request, message)
        return d

    def _added(self, added: bool, request, message: Message) -> bytes:
        if added:
            self.waiters.wake(message.to)
        return write_json(
            request,
            201 if added else 200,
            {"accepted": True, "id": message.id, "duplicate": not added},
        )

    @app.route("/messages", methods=["GET"])
    @authenticated
    def poll(self, request, agent: str) -> Deferred:
        since = _query_arg(request, b"since") or None
        limit = protocol.clamp_limit(_query_arg(request, b"limit"))
        wait = protocol.parse_wait_seconds(_query_arg(request, b"wait"), "wait")

        def attempt():
            return self.store.get_since(agent, since, limit, self.clock.seconds())

        def found(result) -> bool:
            return bool(result[0])

        d = self.waiters.wait_for(agent, attempt, found, wait, consume=False)
        d.addCallback(
            lambda result: write_json(
                request,
                200,
                {"messages": [m.envelope() for m in result[0]], "cursor": result[1]},
            )
        )
        return d

    @app.route("/messages/<path:message_id>/ack", methods=["POST"])
    @authenticated
    @inlineCallbacks
    def receipt(self, request, agent: str, message_id: str):
        target = yield self.store.find(message_id)
        if target is None:
            raise errors.no_such_message()
        if target.to != agent:
            raise errors.forbidden("only the recipient may acknowledge this message")
        envelope = protocol.ack_receipt(
            {"id": target.id, "from": target.sender}, agent, parse_json(raw_body(request))
        )
        self.check_acl(agent, envelope["to"])
        message = Message.from_envelope(envelope, self.clock.seconds())
        yield self.store.add(message)
        self.waiters.wake(message.to)
        return write_json(request, 201, {"accepted": True, "id": message.id})

    # -- v1.1 ----------------------------------------------------------------

    @app.route("/v1/pull", methods=["POST"])
    @authenticated
    def pull(self, request, agent: str) -> Deferred:
        body = parse_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        limit = protocol.clamp_limit(body.get("limit"))
        lease_seconds = protocol.parse_lease_seconds(body, self.config.lease_seconds)
        wait = protocol.parse_wait_seconds(body.get("waitSeconds"), "waitSeconds")

        def attempt():
            return self.store.pull(agent, limit, lease_seconds, self.clock.seconds())

        def leased(messages):
            # One pull leases its batch with one deadline.
            for lease_until in {m.lease_until for m in messages}:
                self.waiters.wake_at(agent, lease_until / 1000.0)
            return write_json(
                request,
                200,
                {
                    "messages": [m.envelope(with_lease=True) for m in messages],
                    "count": len(messages),
                },
            )

        d = self.waiters.wait_for(agent, attempt, bool, wait)
        d.addCallback(leased)
        return d

    @app.route("/v1/ack", methods=["POST"])
    @authenticated
    def ack(self, request, agent: str) -> Deferred:
        message_id, lease_id, outcome, error = protocol.parse_ack_outcome(
            parse_object(raw_body(request))
        )
        d = self.store.ack(
            message_id,
            agent,
            lease_id,
            outcome,
            error,
            self.clock.seconds(),
            self.config.max_attempts,
        )
        d.addCallback(self._settled, request, agent)
        return d

    def _settled(self, result: Dict[str, Any], request, agent: str) -> bytes:
        if result["status"] == protocol.QUEUED:
            self.waiters.wake(agent)
        return write_json(request, 200, result)

    @app.route("/v1/status", methods=["POST"])
    @authenticated
    @inlineCallbacks
    def status(self, request, agent: str):
        ids = protocol.parse_status_ids(parse_object(raw_body(request)))
        yield self.release_expired_leases()
        entries = yield self.store.status(ids, agent)
        return write_json(request, 200, {"messages": entries})

    @app.route("/v1/recent", methods=["POST"])
    @authenticated
    @inlineCallbacks
    def recent(self, request, agent: str):
        body = parse_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        yield self.release_expired_leases()
        messages = yield self.store.recent(agent, protocol.clamp_limit(body.get("limit")))
        return write_json(
            request, 200, {"messages": [m.envelope() for m in messages], "count": len(messages)}
        )

    @app.route("/v1/messages/query", methods=["POST"])
    @authenticated
    @inlineCallbacks
    def query(self, request, agent: str):
        body = parse_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        filters = protocol.parse_query_filters(body)
        yield self.release_expired_leases()
        messages = yield self.store.query(
            agent,
            protocol.clamp_limit(body.get("limit")),
            filters["kind"],
            filters["status"],
            filters["from"],
            filters["to"],
        )
        return write_json(
            request, 200, {"messages": [m.envelope() for m in messages], "count": len(messages)}
        )

    # -- rules -----------------------------------------------------------------

    def release_expired_leases(self) -> Deferred:
        """Requeue leases past their deadline before a read, so it reports them truthfully.

        The periodic sweep does the same; this keeps ``/v1/status``, ``/v1/recent``
        and ``/v1/messages/query`` exact between two sweeps (spec §5.1).
        """
        d = self.store.sweep_leases(self.clock.seconds())

        def woke(agents) -> None:
            for name in agents:
                self.waiters.wake(name)

        d.addCallback(woke)
        return d

    def check_acl(self, sender: str, recipient: str) -> None:
        """403 ``forbidden`` when ``sender``'s ``allowed_targets`` omit ``recipient``."""
        entry = self.config.agents.get(sender)
        targets = entry.allowed_targets if entry is not None else None
        if targets is not None and recipient not in targets:
            raise errors.forbidden(f"agent {sender!r} is not allowed to send to {recipient!r}")


class _UTF8URLs(Resource):
    """Answers a URL that is not UTF-8 once percent-decoded with the §6 ``400``.

    Klein refuses such a URL itself, but with a plain-text body and a logged
    traceback; every other request goes to the Klein resource unchanged.
    """

    isLeaf = True

    def __init__(self, klein_resource) -> None:
        super().__init__()
        self.klein_resource = klein_resource

    def render(self, request):
        try:
            request.getRequestHostname().decode("utf-8")
            if not (request.uri.isascii() and b"%" not in request.uri):
                b"/".join(request.prepath + request.postpath).decode("utf-8")
        except UnicodeDecodeError:
            error = errors.bad_request("the request URL is not valid UTF-8")
            return write_json(request, 400, error.to_body())
        return self.klein_resource.render(request)


def _no_route(request) -> RelayError:
    method = request.method.decode("latin-1")
    path = request.path.decode("utf-8", "replace")
    return errors.not_found(f"no route {method} {path}")


def _log_lock(agent: str) -> None:
    log.warn("agent {agent} is locked after repeated authentication failures", agent=agent)


def _header(headers, name: bytes) -> Optional[bytes]:
    values = headers.getRawHeaders(name)
    return values[0].strip() if values else None


def _peer_host(request) -> str:
    address = request.getClientAddress()
    return getattr(address, "host", None) or "unix"

