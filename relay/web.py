"""The broker's HTTP API (spec §4, §5.1) as a Klein app.

Routes only translate HTTP into broker calls: authenticate, parse, one call to
:class:`relay.broker.Broker`, encode. They hold no delivery rule. Every
failure is a :class:`relay.errors.RelayError` rendered in one place as the §6
body; anything unexpected becomes ``503 busy`` and is logged by incident id
only, never with message content.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import RequestRedirect

from relay import errors, protocol
from relay.auth import Authenticator, Bounded, RateLimiter
from relay.broker import Broker
from relay.errors import RelayError
from relay.http import canonical_name, first_header, names_this_machine, set_headers

log = Logger(namespace="relay.web")

MAX_HOSTS_REMEMBERED = 256

JSON_HEADERS = (
    (canonical_name(b"content-type"), b"application/json; charset=utf-8"),
    (canonical_name(b"cache-control"), b"no-store"),
)
_CONTENT_LENGTH = canonical_name(b"content-length")
_HOST = canonical_name(b"host")
_AGENT = canonical_name(b"x-relay-agent")
_TIMESTAMP = canonical_name(b"x-relay-timestamp")
_SIGNATURE = canonical_name(b"x-relay-signature")
_NONCE = canonical_name(b"x-relay-nonce")


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return protocol.compact_json(value).encode("utf-8")


def set_json_headers(request, status: int) -> None:
    """Set the status and the JSON headers of a response."""
    request.setResponseCode(status)
    set_headers(request.responseHeaders, JSON_HEADERS)


def write_json(request, status: int, value: Any) -> bytes:
    """Set the status and JSON headers of ``request``; returns the encoded body."""
    return write_body(request, status, encode_json(value))


def write_body(request, status: int, body: bytes) -> bytes:
    """Set the status and JSON headers of ``request`` for the encoded ``body``."""
    request.setResponseCode(status)
    set_headers(request.responseHeaders, JSON_HEADERS + ((_CONTENT_LENGTH, b"%d" % len(body)),))
    return body


def message_list(envelopes: List[str], **fields: Any) -> bytes:
    """``{"messages": [...], **fields}`` from envelopes already encoded as JSON text."""
    tail = encode_json(fields)[1:] if fields else b"}"
    return b'{"messages":[' + ",".join(envelopes).encode("utf-8") + b"]" + (
        b"," + tail if fields else tail)


def answer_error(request, error: RelayError) -> Union[bytes, Deferred]:
    """The §6 answer of ``error``: its body, or, when the error has ``pending`` (a
    refusal being counted where brokers share their lockouts), a Deferred of the
    body firing once that is done."""
    body = error.to_body()
    if error.pending is None:
        return write_json(request, error.status, body)
    return error.pending.addBoth(lambda _: write_json(request, error.status, body))


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
    """Route decorator: rate-limit, verify the §3 headers, pass the agent name.

    Behind brokers sharing their seen nonces, a request whose nonce is new to this
    broker runs once the shared table accepted the nonce (a replay is 401 first).
    """
    endpoint = route.__name__

    @functools.wraps(route)
    def wrapper(self: RelayAPI, request, *args, **kwargs):
        request.route = endpoint  # the route label of the HTTP metrics
        agent = self.authenticate(request)
        path = request.path
        if path.startswith(b"//") or (b"%" in path and not self.matches_as_sent(request,
                                                                                 endpoint)):
            # Paths match as sent (spec §1): "/v1/%70ull" is not "/v1/pull",
            # "/messages/<id>%2Fack" is not "/messages/<id>/ack", and "//peers" is
            # not "/peers" (Klein would drop the empty first segment).
            return _no_route_for(agent, request)
        if request.method == b"HEAD":
            # werkzeug answers HEAD with the GET route; here a HEAD would poll
            # (spending a once-delivery) and throw the page away.
            return _no_route_for(agent, request)
        if agent.__class__ is str:
            return route(self, request, agent, *args, **kwargs)
        # A Deferred: a nonce new to this broker, claimed from the store it shares.
        return agent.addCallback(_route_claimed, route, self, request, args, kwargs)

    return wrapper


def _route_claimed(agent: str, route: Callable, api: RelayAPI, request, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
    """Run ``route`` once the shared nonce table accepted the request's nonce."""
    return route(api, request, agent, *args, **kwargs)


def _no_route_for(agent: Union[str, Deferred], request) -> Deferred:
    """404 for an authenticated request; after a pending shared nonce claim, whose
    refusal of a replay (401) comes first."""
    if agent.__class__ is str:
        raise _no_route(request)

    def unroutable(_: str) -> None:
        raise _no_route(request)

    return agent.addCallback(unroutable)


class RelayAPI:
    """The HTTP face of a :class:`relay.broker.Broker`. ``resource()`` gives the
    root IResource."""

    app = Klein()

    def __init__(self, broker: Broker, auth: Authenticator, rate_limiter: RateLimiter,
                 allowed_hosts: Collection[str] = ()) -> None:
        self.broker = broker
        self.auth = auth
        self.rate_limiter = rate_limiter
        self.allowed_hosts = frozenset(allowed_hosts)
        self.info = encode_json(broker.info())
        self._bound_app = self.app  # Klein binds its app to this instance anew per access

    def resource(self):
        """The resource serving this API: Klein's, behind the checks of the URL's
        encoding and of the ``Host`` a loopback listener was reached by."""
        return _Front(self.app.resource(), self)

    def fixed_routes(self) -> Dict[Tuple[bytes, bytes], str]:
        """``(method, path) -> endpoint`` for every route without a parameter, for
        the methods it was declared with (``HEAD`` is left to Klein)."""
        table = {}
        for rule in self.app.url_map.iter_rules():
            if rule.arguments:
                continue
            for method in rule.methods or ():
                if method != "HEAD":
                    table[(method.encode("ascii"), rule.rule.encode("ascii"))] = rule.endpoint
        return table

    def serve(self, endpoint: str, request) -> Union[bytes, int]:
        """Run the route ``endpoint`` for ``request`` and answer as Klein does once a
        route has matched: a result or a failure through this API's error handlers,
        and, for a route that waits on more than the store (a long poll, which
        sets ``request.waits``), a pending answer cancelled when the client goes
        away, so its waiter is dropped. An answer ready at once is returned for
        twisted.web to write; otherwise ``NOT_DONE_YET``."""
        try:
            result = self._bound_app.execute_endpoint(endpoint, request)
        except Exception:
            result = fail()  # its answer may wait (a refusal being counted)
        if not isinstance(result, Deferred):
            return result
        ready: List[bytes] = []
        pending = False

        def settled(value: Any) -> None:
            if pending and (request.finished or getattr(request, "_disconnected", False)):
                if isinstance(value, Failure) and not value.check(CancelledError):
                    self.unexpected(request, value)  # logged by incident id; nobody to answer
                return
            answer = self._answer(value, request)
            if isinstance(answer, Deferred):
                answer.addCallback(deliver)
            else:
                deliver(answer)

        def deliver(body: bytes) -> None:
            if not pending:
                ready.append(body)
            elif not (request.finished or getattr(request, "_disconnected", False)):
                request.write(body)
                request.finish()

        result.addBoth(settled)
        if ready:
            return ready[0]
        pending = True
        if getattr(request, "waits", False):
            request.notifyFinish().addErrback(lambda _: result.cancel())
        return NOT_DONE_YET

    def _answer(self, value: Any, request) -> Union[bytes, Deferred]:
        """The body answering ``request`` for a route's result or failure (a Deferred
        of it for an error to be answered later: see :meth:`relay_error`)."""
        if not isinstance(value, Failure):
            return value
        if value.check(RelayError):
            return self.relay_error(request, value)
        return self.unexpected(request, value)

    # -- plumbing ------------------------------------------------------------

    def authenticate(self, request) -> Union[str, Deferred]:
        """The agent that signed ``request``; RelayError on any §3 failure. Every
        request counts toward its address's rate limit, a refused one included.
        A Deferred firing with the agent (or failing) while a nonce new to this
        broker is claimed from the store it shares with other brokers."""
        source = _peer_host(request)
        self.rate_limiter.hit(source)
        check_body_size(request)
        headers = request.requestHeaders
        auth = self.auth
        signed = auth.verify(
            request.method,
            request.uri,
            _header(headers, _AGENT),
            _header(headers, _TIMESTAMP),
            _header(headers, _SIGNATURE),
            raw_body(request),
            _header(headers, _NONCE),
            source,
        )
        if signed.nonce is not None and auth.shares_nonces:
            return auth.claim(signed)
        return signed.agent

    def matches_as_sent(self, request, endpoint: str) -> bool:
        """True when the path as sent, before percent-decoding, matches ``endpoint``'s
        route (a parameter may hold escapes; a fixed part may not)."""
        adapter = self.app.url_map.bind("relay")
        try:
            matched, _ = adapter.match(request.path.decode("ascii"),
                                       method=request.method.decode("ascii"))
        except (HTTPException, RequestRedirect, UnicodeDecodeError):
            return False
        return matched == endpoint

    @app.handle_errors(RelayError)
    def relay_error(self, request, failure: Failure) -> Union[bytes, Deferred]:
        """The §6 body of a RelayError; for one with ``pending`` (a refusal being
        counted in a table shared with other brokers), a Deferred of it, once the
        count is done."""
        return answer_error(request, failure.value)

    @app.handle_errors(NotFound, MethodNotAllowed, RequestRedirect)
    def no_route(self, request, failure: Failure) -> bytes:
        """401 for an unsigned request, else 404; a redirect werkzeug would answer (a
        ``//`` in the path) is no route either: the signature covers the path as sent."""
        try:
            agent = self.authenticate(request)
        except RelayError as error:
            return answer_error(request, error)
        if agent.__class__ is not str:  # a shared nonce claim: a replay is 401 first
            return _no_route_for(agent, request).addErrback(self._refusal, request)
        return write_json(request, 404, _no_route(request).to_body())

    def _refusal(self, failure: Failure, request) -> bytes:
        """The §6 body of a RelayError from an error handler's own Deferred (which
        Klein would hand to the next handler, not to :meth:`relay_error`)."""
        if failure.check(RelayError):
            return self.relay_error(request, failure)
        return self.unexpected(request, failure)

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
        request.route = "info"
        self.rate_limiter.hit(_peer_host(request))
        check_body_size(request)
        set_json_headers(request, 200)
        request.setHeader(b"content-length", b"%d" % len(self.info))
        return self.info

    @app.route("/register", methods=["POST"])
    @authenticated
    def register(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        d = self.broker.register(agent, protocol.parse_card(body))
        d.addCallback(lambda ts: write_json(request, 200, {"ok": True, "agent": agent, "ts": ts}))
        return d

    @app.route("/peers", methods=["GET"])
    @authenticated
    def peers(self, request, agent: str) -> Deferred:
        query = protocol.parse_peers_query(_query_arg(request, b"after"),
                                           _query_arg(request, b"limit"),
                                           _query_arg(request, b"cards"))
        d = self.broker.peers_page(*query)
        d.addCallback(lambda document: write_json(request, 200, document))
        return d

    # The hot routes (send, pull, ack) chain callbacks rather than use
    # inlineCallbacks: a generator per request is measurable at this rate.

    @app.route("/messages", methods=["POST"])
    @authenticated
    def send(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_body(raw_body(request))
        envelope = protocol.normalize_envelope(body, agent)
        ttl, delay = protocol.parse_send_options(body)
        d = self.broker.send(agent, envelope, ttl, delay)
        d.addCallback(self._sent, request, envelope["id"])
        return d

    def _sent(self, added: bool, request, message_id: str) -> bytes:
        # encode_json({"accepted": True, "id": message_id, "duplicate": not added}),
        # formatted directly: the hottest answer of all.
        body = b'{"accepted":true,"id":%s,"duplicate":%s}' % (
            encode_json(message_id), b"false" if added else b"true")
        return write_body(request, 201 if added else 200, body)

    @app.route("/messages", methods=["GET"])
    @authenticated
    def poll(self, request, agent: str) -> Deferred:
        since = protocol.optional_query_id(_query_arg(request, b"since"), "since")
        limit = protocol.clamp_limit(_query_arg(request, b"limit"))
        wait = protocol.parse_wait_seconds(_query_arg(request, b"wait"), "wait")
        request.waits = wait > 0
        d = self.broker.poll(agent, since, limit, wait)
        d.addCallback(
            lambda page: write_body(request, 200, message_list(page[0], cursor=page[1]))
        )
        return d

    @app.route("/messages/<path:message_id>/ack", methods=["POST"])
    @authenticated
    def receipt(self, request, agent: str, message_id: str) -> Deferred:
        protocol.check_id(message_id, "the message id")
        d = self.broker.receipt(agent, message_id, raw_body(request))
        d.addCallback(lambda receipt_id: write_json(request, 201,
                                                    {"accepted": True, "id": receipt_id}))
        return d

    # -- v1.1 ----------------------------------------------------------------

    @app.route("/v1/pull", methods=["POST"])
    @authenticated
    def pull(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        limit = protocol.clamp_limit(body.get("limit"))
        lease_seconds = protocol.parse_lease_seconds(body)
        wait = protocol.strict_int(body, "waitSeconds", 0, protocol.MAX_WAIT_SECONDS) or 0
        parent_id = protocol.optional_id(body, "parentId")
        request.waits = wait > 0
        d = self.broker.pull(agent, limit, lease_seconds, wait, parent_id)
        d.addCallback(self._listed, request)
        return d

    def _listed(self, envelopes: List[str], request) -> bytes:
        return write_body(request, 200, message_list(envelopes, count=len(envelopes)))

    @app.route("/v1/ack", methods=["POST"])
    @authenticated
    def ack(self, request, agent: str) -> Deferred:
        ack = protocol.parse_ack(protocol.parse_json_object(raw_body(request)))
        d = self.broker.ack(agent, ack)
        d.addCallback(self._ok, request)
        return d

    def _ok(self, result: Dict[str, Any], request) -> bytes:
        return write_json(request, 200, result)

    @app.route("/v1/status", methods=["POST"])
    @authenticated
    def status(self, request, agent: str) -> Deferred:
        ids = protocol.parse_status_ids(protocol.parse_json_object(raw_body(request)))
        d = self.broker.status(agent, ids)
        d.addCallback(lambda entries: write_json(request, 200, {"messages": entries}))
        return d

    @app.route("/v1/recent", methods=["POST"])
    @authenticated
    def recent(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        d = self.broker.recent(agent, protocol.clamp_limit(body.get("limit")))
        d.addCallback(self._listed, request)
        return d

    @app.route("/v1/messages/query", methods=["POST"])
    @authenticated
    def query(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        filters = protocol.parse_query_filters(body)
        d = self.broker.query(agent, protocol.clamp_limit(body.get("limit")), filters)
        d.addCallback(self._listed, request)
        return d

    # -- v1.2 (EXTENSIONS.md) ------------------------------------------------

    @app.route("/v1/lease/renew", methods=["POST"])
    @authenticated
    def renew(self, request, agent: str) -> Deferred:
        message_id, lease_id, seconds = protocol.parse_renew(
            protocol.parse_json_object(raw_body(request)))
        d = self.broker.renew(agent, message_id, lease_id, seconds)
        d.addCallback(self._ok, request)
        return d

    @app.route("/v1/requeue", methods=["POST"])
    @authenticated
    def requeue(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        d = self.broker.requeue(agent, protocol.required_id(body, "messageId"))
        d.addCallback(self._ok, request)
        return d

    @app.route("/v1/cancel", methods=["POST"])
    @authenticated
    def cancel(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        message_id = protocol.required_id(body, "messageId")
        d = self.broker.cancel(agent, message_id, protocol.parse_reason(body))
        d.addCallback(self._ok, request)
        return d

    @app.route("/v1/thread", methods=["POST"])
    @authenticated
    def thread(self, request, agent: str) -> Deferred:
        body = protocol.parse_json_object(raw_body(request))
        protocol.check_body_agent(body, agent)
        root_id = protocol.required_id(body, "rootId")
        since = protocol.optional_id(body, "since")
        d = self.broker.thread(agent, root_id, since, protocol.clamp_limit(body.get("limit")))
        d.addCallback(lambda page: write_body(
            request, 200, message_list(page[0], count=len(page[0]), cursor=page[1])))
        return d


class _Front(Resource):
    """In front of the Klein resource: a request that reached a loopback listener
    by another host's name (DNS rebinding from a web page) is ``403 forbidden``, and
    a URL that is not UTF-8 once percent-decoded is the §6 ``400`` (Klein refuses it
    too, but with a plain-text body and a logged traceback)."""

    isLeaf = True

    def __init__(self, klein_resource, api: RelayAPI) -> None:
        super().__init__()
        self.klein_resource = klein_resource
        self.api = api
        # Most requests name a route without parameters exactly: those go to their
        # route by one dict look-up instead of werkzeug binding and matching per
        # request (a third of a send's cost). A path with an escape, a "//", a
        # trailing slash or a parameter is not in the table and takes Klein's way.
        self.fixed = api.fixed_routes()
        # (listener address, Host header) -> True or the refusal: a broker is reached
        # by a handful of names, each judged once.
        self._hosts: Bounded = Bounded(MAX_HOSTS_REMEMBERED)

    def render(self, request):
        key = (getattr(request.getHost(), "host", None),
               first_header(request.requestHeaders, _HOST))
        verdict = self._hosts.get(key)
        if verdict is None:
            verdict = self._judge_host(request)
            self._hosts.put(key, verdict)
        if verdict is not True:
            return write_json(request, verdict.status, verdict.to_body())
        if not (request.uri.isascii() and b"%" not in request.uri):
            try:
                b"/".join(request.prepath + request.postpath).decode("utf-8")
            except UnicodeDecodeError:
                error = errors.bad_request("the request URL is not valid UTF-8")
                return write_json(request, 400, error.to_body())
        endpoint = self.fixed.get((request.method, request.path))
        if endpoint is not None:
            return self.api.serve(endpoint, request)
        return self.klein_resource.render(request)

    def _judge_host(self, request) -> Union[bool, RelayError]:
        """True when the listener and ``Host`` header of ``request`` may be served,
        else the refusal (the same for every request naming them)."""
        if not names_this_machine(request, self.api.allowed_hosts):
            return errors.forbidden("the Host header names neither this machine's loopback "
                                    "nor a host in broker.allowedHosts")
        try:
            request.getRequestHostname().decode("utf-8")
        except UnicodeDecodeError:
            return errors.bad_request("the request URL is not valid UTF-8")
        return True


def _no_route(request) -> RelayError:
    method = request.method.decode("latin-1")
    path = request.path.decode("utf-8", "replace")
    return errors.not_found(f"no route {method} {path}")


def _header(headers, name: bytes) -> Optional[bytes]:
    value = first_header(headers, name)
    return value.strip() if value is not None else None


def _peer_host(request) -> str:
    address = request.getClientAddress()
    return getattr(address, "host", None) or "unix"

