"""The broker's HTTP API (spec §4, §5.1) as a Klein app.

Klein dispatches every request of the main listener. In front of its resource,
:class:`ListenerFront` refuses a request that reached a loopback listener by
another host's name (DNS rebinding) and hands Klein the path as sent, so that
routes match the path before percent-decoding (spec §1: ``/v1/%70ull`` is not
``/v1/pull``); a route parameter is decoded by its route.

Routes only translate HTTP into broker calls: authenticate, parse, one call to
:class:`relay.broker.operations.Broker`, encode. They hold no delivery rule. Every failure
is answered by the error handling :func:`relay.broker.jsonapi.add_error_handling`
registers, shared with the ops listener.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union
from urllib.parse import unquote_to_bytes

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource

from relay.broker import inbox
from relay.broker.jsonapi import (
    add_error_handling,
    encode_json,
    message_list,
    no_route,
    query_arg,
    read_body,
    utf8_path,
    write_body,
    write_error,
    write_json,
)
from relay.broker.operations import Broker
from relay.broker.site import names_this_machine
from relay.broker.v2.api import V2API
from relay.broker.v2.operations import ModeACL, Wire2
from relay.rules import events
from relay.rules.auth import Authenticator, Bounded, RateLimiter
from relay.rules.hooks import parse_webhook
from relay.wire import errors, protocol
from relay.wire.errors import RelayError

MAX_HOSTS_REMEMBERED = 256


def authenticated(route: Callable) -> Callable:
    """Route decorator: rate-limit, verify the §3 headers, and call the route with the
    agent name and the request body.

    Behind brokers sharing their seen nonces, a request whose nonce is new to this
    broker runs once the shared table accepted the nonce (a replay is 401 first).
    """
    endpoint = route.__name__

    @functools.wraps(route)
    def wrapper(self: RelayAPI, request, *args, **kwargs):
        request.route = endpoint  # the route label of the HTTP metrics
        if not _routable(request):
            return self.unrouted(request)
        agent, body = self.authenticate(request)
        if agent.__class__ is str:
            return route(self, request, agent, body, *args, **kwargs)
        # A Deferred: a nonce new to this broker, claimed from the store it shares.
        return agent.addCallback(lambda name: route(self, request, name, body, *args, **kwargs))

    return wrapper


def _routable(request, head: bool = False) -> bool:
    """False for what werkzeug would match but no route of the relay's is: a HEAD
    unless ``head`` (werkzeug answers it with the GET route: a HEAD of a signed
    route would poll, spending a once-delivery, and throw the page away), a
    method not in upper case (methods are case-sensitive, RFC 9110 §9.1;
    werkzeug upper-cases them), and a path starting with ``//`` (which werkzeug
    matches as ``/``)."""
    method = request.method
    return ((head or method != b"HEAD") and method.isupper()
            and not request.path.startswith(b"//"))


def _path_parameter(value: str) -> str:
    """A route parameter as matched (the path as sent), percent-decoded."""
    try:
        return unquote_to_bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise errors.bad_request("the request URL is not valid UTF-8") from None


class RelayAPI:
    """The HTTP face of a :class:`relay.broker.operations.Broker`. ``resource()`` gives the
    root IResource of a listener."""

    app = Klein()
    add_error_handling(app)

    def __init__(self, broker: Broker, auth: Authenticator, rate_limiter: RateLimiter,
                 allowed_hosts: Collection[str] = (), acl: Optional[ModeACL] = None,
                 configured: Collection[str] = ()) -> None:
        self.broker = broker
        self.auth = auth
        self.rate_limiter = rate_limiter
        self.allowed_hosts = frozenset(allowed_hosts)
        self.info = encode_json(broker.info())
        # The v2/v3 wire (WIRE-V2), on the same broker, rails and listener.
        self.v2 = V2API(Wire2(broker, acl if acl is not None else ModeACL({})), auth,
                        rate_limiter, configured)
        self.inbox_files = inbox.load()

    def resource(self) -> Resource:
        """The resource serving this API: Klein's, behind :class:`ListenerFront`."""
        return ListenerFront(self.app.resource(), self)

    def configure(self, auth: Authenticator, allowed_hosts: Collection[str],
                  acl: Optional[ModeACL] = None, configured: Collection[str] = ()) -> None:
        """Apply the settings a reload may change."""
        self.auth = auth
        self.allowed_hosts = frozenset(allowed_hosts)
        self.v2.configure(auth, configured)
        if acl is not None:
            self.v2.wire.configure(acl)

    def refresh_info(self) -> None:
        """Encode the ``GET /`` document again: after a reload its capabilities show
        the settings in force (``maxDeliveries``, ``messageTtl``, ``requireNonce``,
        ``eventRetentionSeconds``, ``webhookMaxAttempts``)."""
        self.info = encode_json(self.broker.info())

    # -- plumbing ------------------------------------------------------------

    def authenticate(self, request) -> Tuple[Union[str, Deferred], bytes]:
        """The agent that signed ``request`` and the request body; RelayError on any
        §3 failure or an oversized body. Every request counts toward its address's
        rate limit, a refused one included.

        Verification is synchronous; behind brokers sharing their nonces, a nonce
        new to this broker is then claimed from the shared table, and the agent is
        a Deferred of the name (failing with the 401 of a replay).
        """
        source = _peer_host(request)
        self.rate_limiter.hit(source)
        body = read_body(request)
        headers = request.requestHeaders
        auth = self.auth
        signed = auth.verify(
            request.method,
            request.uri,
            _header(headers, b"x-relay-agent"),
            _header(headers, b"x-relay-timestamp"),
            _header(headers, b"x-relay-signature"),
            body,
            _header(headers, b"x-relay-nonce"),
            source,
        )
        if signed.nonce is not None and auth.shares_nonces:
            return auth.claim(signed), body
        return signed.agent, body

    def unrouted(self, request) -> Union[bytes, Deferred]:
        """The answer to a request no route matches: 401 for an unsigned request
        (after a pending shared nonce claim, whose refusal of a replay comes
        first), else 404."""
        agent, _ = self.authenticate(request)
        if agent.__class__ is str:
            return write_error(request, no_route(request))
        return agent.addCallback(lambda _: write_error(request, no_route(request)))

    # -- v1.0 ----------------------------------------------------------------

    @app.route("/", methods=["GET"])
    def root(self, request) -> bytes:
        if request.path != b"/" or not _routable(request, head=True):
            return self.unrouted(request)
        self._public(request, "info")
        return write_body(request, 200, self.info)

    @app.route("/register", methods=["POST"])
    @authenticated
    def register(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        protocol.check_body_agent(body, agent)
        d = self.broker.register(agent, protocol.parse_card(body),
                                 parse_webhook(body, protocol.KEEP_CARD))
        d.addCallback(self._registered, request, agent)
        return d

    def _registered(self, answer: Tuple[int, Any], request, agent: str) -> bytes:
        ts, webhook = answer
        document: Dict[str, Any] = {"ok": True, "agent": agent, "ts": ts}
        if webhook is not None:
            document["webhook"] = webhook  # the agent's own answer only (REACH §12)
        return write_json(request, 200, document)

    @app.route("/peers", methods=["GET"])
    @authenticated
    def peers(self, request, agent: str, body: bytes) -> Deferred:
        query = protocol.parse_peers_query(query_arg(request, b"after"),
                                           query_arg(request, b"limit"),
                                           query_arg(request, b"cards"))
        d = self.broker.peers_page(*query)
        d.addCallback(lambda document: write_json(request, 200, document))
        return d

    # The hot routes (send, pull, ack) chain callbacks rather than use
    # inlineCallbacks: a generator per request is measurable at this rate.

    @app.route("/messages", methods=["POST"])
    @authenticated
    def send(self, request, agent: str, body: bytes) -> Deferred:
        fields = protocol.parse_json_body(body)
        envelope = protocol.normalize_envelope(fields, agent)
        ttl, delay = protocol.parse_send_options(fields)
        priority = protocol.parse_priority(fields)
        if envelope["to"].startswith(protocol.GROUP_PREFIX):
            d = self.broker.send_group(agent, envelope, ttl, delay, priority)
            d.addCallback(self._group_sent, request, envelope["id"])
            return d
        d = self.broker.send(agent, envelope, ttl, delay, priority)
        d.addCallback(self._sent, request, envelope["id"])
        return d

    def _group_sent(self, result, request, sent_id: str) -> bytes:
        stored, copies = result
        return write_json(request, 201 if stored else 200, {
            "accepted": True, "id": sent_id, "duplicate": not stored,
            "copies": [{"to": to, "id": copy_id} for to, copy_id in copies]})

    def _sent(self, added: bool, request, message_id: str) -> bytes:
        # encode_json({"accepted": True, "id": message_id, "duplicate": not added}),
        # formatted directly: the hottest answer of all.
        body = b'{"accepted":true,"id":%s,"duplicate":%s}' % (
            encode_json(message_id), b"false" if added else b"true")
        return write_body(request, 201 if added else 200, body)

    @app.route("/messages", methods=["GET"])
    @authenticated
    def poll(self, request, agent: str, body: bytes) -> Deferred:
        since = protocol.optional_query_id(query_arg(request, b"since"), "since")
        limit = protocol.clamp_limit(query_arg(request, b"limit"))
        wait = protocol.parse_wait_seconds(query_arg(request, b"wait"), "wait")
        d = self.broker.poll(agent, since, limit, wait)
        d.addCallback(
            lambda page: write_body(request, 200, message_list(page[0], cursor=page[1]))
        )
        return d

    @app.route("/messages/<path:message_id>/ack", methods=["POST"])
    @authenticated
    def receipt(self, request, agent: str, body: bytes, message_id: str) -> Deferred:
        message_id = _path_parameter(message_id)
        protocol.check_id(message_id, "the message id")
        d = self.broker.receipt(agent, message_id, body)
        d.addCallback(lambda receipt_id: write_json(request, 201,
                                                    {"accepted": True, "id": receipt_id}))
        return d

    # -- v1.1 ----------------------------------------------------------------

    @app.route("/v1/pull", methods=["POST"])
    @authenticated
    def pull(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        protocol.check_body_agent(body, agent)
        limit = protocol.clamp_limit(body.get("limit"))
        lease_seconds = protocol.parse_lease_seconds(body)
        wait = protocol.strict_int(body, "waitSeconds", 0, protocol.MAX_WAIT_SECONDS) or 0
        parent_id = protocol.optional_id(body, "parentId")
        role = protocol.parse_role(body)
        d = self.broker.pull(agent, limit, lease_seconds, wait, parent_id, role)
        d.addCallback(self._listed, request)
        return d

    def _listed(self, envelopes: List[str], request) -> bytes:
        return write_body(request, 200, message_list(envelopes, count=len(envelopes)))

    @app.route("/v1/ack", methods=["POST"])
    @authenticated
    def ack(self, request, agent: str, body: bytes) -> Deferred:
        ack = protocol.parse_ack(protocol.parse_json_object(body))
        d = self.broker.ack(agent, ack)
        d.addCallback(self._ok, request)
        return d

    def _ok(self, result: Dict[str, Any], request) -> bytes:
        return write_json(request, 200, result)

    @app.route("/v1/status", methods=["POST"])
    @authenticated
    def status(self, request, agent: str, body: bytes) -> Deferred:
        ids = protocol.parse_status_ids(protocol.parse_json_object(body))
        d = self.broker.status(agent, ids)
        d.addCallback(lambda entries: write_json(request, 200, {"messages": entries}))
        return d

    @app.route("/v1/recent", methods=["POST"])
    @authenticated
    def recent(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        protocol.check_body_agent(body, agent)
        d = self.broker.recent(agent, protocol.clamp_limit(body.get("limit")))
        d.addCallback(self._listed, request)
        return d

    @app.route("/v1/messages/query", methods=["POST"])
    @authenticated
    def query(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        protocol.check_body_agent(body, agent)
        filters = protocol.parse_query_filters(body)
        d = self.broker.query(agent, protocol.clamp_limit(body.get("limit")), filters)
        d.addCallback(self._listed, request)
        return d

    # -- v1.2 (EXTENSIONS.md) ------------------------------------------------

    @app.route("/v1/lease/renew", methods=["POST"])
    @authenticated
    def renew(self, request, agent: str, body: bytes) -> Deferred:
        message_id, lease_id, seconds = protocol.parse_renew(
            protocol.parse_json_object(body))
        d = self.broker.renew(agent, message_id, lease_id, seconds)
        d.addCallback(self._ok, request)
        return d

    @app.route("/v1/requeue", methods=["POST"])
    @authenticated
    def requeue(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        d = self.broker.requeue(agent, protocol.required_id(body, "messageId"))
        d.addCallback(self._ok, request)
        return d

    @app.route("/v1/cancel", methods=["POST"])
    @authenticated
    def cancel(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        message_id = protocol.required_id(body, "messageId")
        d = self.broker.cancel(agent, message_id, protocol.parse_reason(body))
        d.addCallback(self._ok, request)
        return d

    @app.route("/v1/thread", methods=["POST"])
    @authenticated
    def thread(self, request, agent: str, body: bytes) -> Deferred:
        body = protocol.parse_json_object(body)
        protocol.check_body_agent(body, agent)
        root_id = protocol.required_id(body, "rootId")
        since = protocol.optional_id(body, "since")
        d = self.broker.thread(agent, root_id, since, protocol.clamp_limit(body.get("limit")))
        d.addCallback(lambda page: write_body(
            request, 200, message_list(page[0], count=len(page[0]), cursor=page[1])))
        return d


    # -- v1.3 (REACH.md) ------------------------------------------------------

    @app.route("/v1/events", methods=["GET"])
    @authenticated
    def events(self, request, agent: str, body: bytes) -> Deferred:
        since = query_arg(request, b"since")
        if since is None:
            header = _header(request.requestHeaders, b"last-event-id")
            since = header.decode("latin-1") if header is not None else None
        return self.broker.streams.open(agent, request, events.parse_event_id(since))


    # -- the human inbox page (REACH §15): static, public, under the Host rule ---

    @app.route("/inbox", methods=["GET"])
    def inbox_bare(self, request) -> bytes:
        if not _routable(request, head=True):
            return self.unrouted(request)
        self._public(request, "inbox")
        request.setResponseCode(301)
        request.setHeader(b"location", protocol.INBOX_PATH.encode("ascii"))
        request.setHeader(b"content-length", b"0")
        return b""

    @app.route("/inbox/", methods=["GET"])
    def inbox_page(self, request) -> bytes:
        return self.inbox_file(request, "")

    @app.route("/inbox/<path:name>", methods=["GET"])
    def inbox_file(self, request, name: str) -> bytes:
        if not _routable(request, head=True):
            return self.unrouted(request)
        self._public(request, "inbox")
        return inbox.serve(request, self.inbox_files, name)

    def _public(self, request, route: str) -> None:
        """What an unsigned route does first: its metrics label, the rate limit of
        its address, and the body check (over 1 MiB is 400)."""
        request.route = route
        self.rate_limiter.hit(_peer_host(request))
        read_body(request)


class ListenerFront(Resource):
    """The root resource of a listener, in front of Klein's: a request that reached
    a loopback listener by another host's name (DNS rebinding from a web page) is
    ``403 forbidden``, a URL that is not UTF-8 once percent-decoded is the §6
    ``400`` (Klein refuses it too, but with a plain-text body and a logged
    traceback), and Klein matches the path as sent, before percent-decoding."""

    isLeaf = True

    def __init__(self, klein_resource: Resource, api: RelayAPI) -> None:
        super().__init__()
        self.klein_resource = klein_resource
        self.api = api
        self.v2_resource = api.v2.resource()
        # (listener address, Host header) -> True or the refusal: a broker is reached
        # by a handful of names, each judged once.
        self._hosts: Bounded = Bounded(MAX_HOSTS_REMEMBERED)

    def render(self, request) -> Any:
        key = (getattr(request.getHost(), "host", None), request.getHeader(b"host"))
        verdict = self._hosts.get(key)
        if verdict is None:
            verdict = self._judge_host(request)
            self._hosts.put(key, verdict)
        if verdict is not True:
            return write_error(request, verdict)
        path = request.path
        if b"%" in path or not path.isascii():
            if not utf8_path(path):
                return write_error(request, errors.bad_request(
                    "the request URL is not valid UTF-8"))
            # twisted.web decoded each segment; the routes match them as sent.
            request.postpath = path[1:].split(b"/")
        # WIRE-V2 §1: a request naming a v2 agent speaks v2, and so does an unsigned
        # GET /healthz (§2); every other request is the seed wire's, as before.
        headers = request.requestHeaders
        if headers.hasHeader(b"x-agent-relay-agent") or (
                path == b"/healthz" and not headers.hasHeader(b"x-relay-agent")):
            return self.v2_resource.render(request)
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


def _header(headers, name: bytes) -> Union[bytes, None]:
    values = headers.getRawHeaders(name)
    return values[0].strip() if values else None


def _peer_host(request) -> str:
    address = request.getClientAddress()
    return getattr(address, "host", None) or "unix"
