"""The ops listener (``broker.opsListen``): health, metrics, the dashboard and its JSON API.

A Klein app of its own, served by a second site: the main listener serves none
of this. Every route but ``GET /healthz`` asks for the ops token when one is
configured (``Authorization: Bearer TOKEN``, or HTTP Basic with the token as the
password, which is how a browser sends it); ``/healthz`` answers anyone its
verdict and reason, and the rest (version, storage, free disk) only to a request
that could read the dashboard. Without a token (a loopback-only
listener) a request must name a loopback host in ``Host``, so a web page
cannot reach the dashboard through DNS rebinding. Requests that change
something are JSON ``POST``s, and a browser's ``Origin`` must be the
listener's own: another site's page cannot send them.

Message bodies never appear here: the views of messages carry ids, names,
counts and errors only.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hmac
from importlib import resources
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from klein import Klein
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.resource import Resource

from relay import __version__
from relay.broker.counters import Counters
from relay.broker.jsonapi import (
    add_error_handling,
    no_route,
    read_body,
    unreadable_url,
    write_error,
    write_json,
)
from relay.broker.operations import Broker
from relay.broker.ops import metrics
from relay.broker.site import host_name
from relay.rules.auth import EVERY_ADDRESS, Lockout
from relay.rules.delivery import Message
from relay.wire import errors, protocol
from relay.wire.protocol import FAILED, LEASED, is_loopback_host

log = Logger(namespace="relay.ops")

REALM = b'realm="relay ops"'
DEFAULT_LIST = 50
MAX_LIST = 200
MAX_AGENTS = 1000
STATIC_FILES = {
    "dashboard.js": b"text/javascript; charset=utf-8",
    "dashboard.css": b"text/css; charset=utf-8",
}
# The page loads nothing from elsewhere and runs no inline script.
PAGE_HEADERS = (
    (b"content-security-policy",
     b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
)


def _static(name: str) -> bytes:
    return resources.files("relay.broker.ops").joinpath("static", name).read_bytes()


def _presented_token(header: Optional[bytes]) -> Optional[bytes]:
    """The token of an ``Authorization`` header: Bearer, or the password of Basic."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        return value.strip()
    if scheme == b"basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        return decoded.partition(b":")[2]
    return None


def guarded(route: Callable) -> Callable:
    """Route decorator: the ops token (when one is set), or a loopback ``Host``."""

    @functools.wraps(route)
    def wrapper(self: OpsAPI, request, *args, **kwargs):
        self.check_access(request)
        return route(self, request, *args, **kwargs)

    return wrapper


def _limit(request) -> int:
    values = request.args.get(b"limit")
    raw = values[0].decode("ascii", "replace") if values else None
    return max(1, min(MAX_LIST, protocol.clamp_limit(raw, DEFAULT_LIST)))


def message_view(message: Message, now: float) -> Dict[str, Any]:
    """What the ops views show of a message: never its body."""
    view: Dict[str, Any] = {
        "id": message.id,
        "from": message.sender,
        "to": message.to,
        "kind": message.kind,
        "ts": message.ts,
        "status": message.status,
        "attempts": message.attempts,
        "deliveries": message.deliveries,
        "error": message.error,
        "reason": message.dead_reason,
    }
    if message.status == LEASED and message.lease_until is not None:
        view["leaseUntil"] = message.lease_until
        view["secondsLeft"] = round(message.lease_until / 1000.0 - now, 3)
    return view


def _add_cards(rows: List[Dict[str, Any]], peers: List[Dict[str, Any]]) -> int:
    """Give each row its agent's card (None without one) while the cards hold at most
    :data:`relay.wire.protocol.PEERS_BUDGET_BYTES`; the rest get None. How many were left out."""
    cards = {peer["agent"]: peer.get("card") for peer in peers}
    size = omitted = 0
    for row in rows:
        card = cards.get(row["agent"])
        if card is not None:
            size += len(protocol.compact_json(card))
            if size > protocol.PEERS_BUDGET_BYTES:
                card = None
                omitted += 1
        row["card"] = card
    return omitted


def answered_with(counters: Counters, status: int) -> int:
    """How many requests of the main listener were answered ``status`` (429: over
    ``rateLimitLoopback`` or ``rateLimitRemote``)."""
    return sum(codes.get(status, 0) for codes in counters.http.values())


class OpsAPI:
    """The ops listener's routes over one broker and its counters, and the
    authentication ``lockout`` (its locks listed and cleared) when given."""

    app = Klein()
    add_error_handling(app)

    def __init__(self, broker: Broker, clock: IReactorTime, tokens: Sequence[str] = (),
                 started: Optional[float] = None, extra_collectors: Iterable = (),
                 lockout: Optional[Lockout] = None) -> None:
        self.broker = broker
        self.clock = clock
        self.lockout = lockout
        self.tokens = tuple(tokens)
        self.started = clock.seconds() if started is None else started
        self.extra_collectors = tuple(extra_collectors)
        self.stopping = False
        self._page = _static("index.html")
        self._files = {name: _static(name) for name in STATIC_FILES}

    def configure(self, tokens: Sequence[str]) -> None:
        """Apply the ops tokens of a reloaded config."""
        self.tokens = tuple(tokens)

    @property
    def counters(self) -> Counters:
        return self.broker.counters

    def resource(self) -> Resource:
        """The resource serving the ops listener: Klein's, behind :class:`OpsFront`."""
        return OpsFront(self.app.resource())

    # -- access ----------------------------------------------------------------------

    def has_access(self, request) -> bool:
        """Whether ``request`` carries a valid token (when tokens are set), or names a
        loopback ``Host`` (when none is)."""
        if not self.tokens:
            host = request.getHeader(b"host")
            return host is None or is_loopback_host(host_name(host))
        presented = _presented_token(request.getHeader(b"authorization"))
        if presented is not None:
            for token in self.tokens:
                if hmac.compare_digest(presented, token.encode("utf-8")):
                    return True
        return False

    def check_access(self, request) -> None:
        """RelayError 401 without a valid token (when tokens are set), 403 for a
        non-loopback ``Host`` (when none is)."""
        if self.has_access(request):
            return
        if not self.tokens:
            raise errors.forbidden("this ops listener has no token: use a loopback host name")
        request.responseHeaders.addRawHeader(b"www-authenticate", b"Basic " + REALM)
        request.responseHeaders.addRawHeader(b"www-authenticate", b"Bearer " + REALM)
        raise errors.unauthenticated("the ops token is required")

    def check_post(self, request) -> Dict[str, Any]:
        """The JSON object of a state-changing request from this listener's own page."""
        body = read_body(request)
        content_type = (request.getHeader(b"content-type") or b"").split(b";")[0].strip()
        if content_type.lower() != b"application/json":
            raise errors.bad_request("content-type must be application/json")
        origin = request.getHeader(b"origin")
        host = request.getHeader(b"host")
        if origin is not None and (host is None or origin.split(b"://", 1)[-1] != host):
            raise errors.forbidden("cross-origin requests are refused")
        return protocol.parse_json_object(body)

    # -- errors ------------------------------------------------------------------------

    def unrouted(self, request) -> bytes:
        """401 or 403 where access is refused, else 404."""
        self.check_access(request)
        return write_error(request, no_route(request))

    # -- health and metrics ------------------------------------------------------------

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request) -> Deferred:
        """200 while the store accepts writes, else 503 with the reason. The version,
        the storage and the free disk space only with access (the token, or a
        loopback ``Host`` on a listener without one). Never lists agents."""
        d = self.health()
        detailed = self.has_access(request)

        def answer(reason: Optional[str]) -> bytes:
            document: Dict[str, Any] = {"ok": reason is None}
            if detailed:
                document.update(storage=self.broker.storage(), version=__version__,
                                diskFreeBytes=self.broker.disk_free())
            if reason is not None:
                document["reason"] = reason
            return write_json(request, 200 if reason is None else 503, document)

        d.addCallback(answer)
        return d

    def health(self) -> Deferred:
        """Fires with why the broker is unhealthy (its store refuses writes, it is
        stopping, its disk is nearly full), or None: one verdict for ``/healthz``,
        the dashboard and ``relay stats``."""

        def verdict(reason: Optional[str]) -> Optional[str]:
            if reason is None and self.stopping:
                reason = "the broker is stopping"
            return reason if reason is not None else self.broker.disk_low()

        return self.broker.health().addCallback(verdict)

    @app.route("/metrics", methods=["GET"])
    @guarded
    @inlineCallbacks
    def metrics(self, request):
        depths = yield self.broker.queue_depths()
        peers = yield self.broker.peers()
        roles = yield self.broker.role_queues()
        scrape = metrics.Scrape(
            now=self.clock.seconds(),
            depths=depths,
            pull_waiting=self.broker.waiting(),
            agents_online=sum(1 for peer in peers if peer["online"]),
            version=__version__,
            storage=self.broker.storage(),
            agents_registered=len(peers),
            disk_free_bytes=self.broker.disk_free(),
            event_streams=sum(self.broker.event_streams().values()),
            roles=roles,
        )
        body = metrics.render(self.counters, scrape, self.extra_collectors)
        request.setHeader(b"content-type", metrics.CONTENT_TYPE.encode("ascii"))
        request.setHeader(b"cache-control", b"no-store")
        return body

    # -- the dashboard -----------------------------------------------------------------

    @app.route("/", methods=["GET"])
    @guarded
    def page(self, request) -> bytes:
        if request.path != b"/":
            return self.unrouted(request)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        for name, value in PAGE_HEADERS:
            request.setHeader(name, value)
        return self._page

    @app.route("/static/<name>", methods=["GET"])
    @guarded
    def static(self, request, name: str) -> bytes:
        content_type = STATIC_FILES.get(name)
        if content_type is None:
            raise errors.not_found(f"no static file {name!r}")
        request.setHeader(b"content-type", content_type)
        for header, value in PAGE_HEADERS:
            request.setHeader(header, value)
        return self._files[name]

    # -- the JSON API ------------------------------------------------------------------

    @app.route("/api/overview", methods=["GET"])
    @guarded
    def overview(self, request) -> Deferred:
        """Agents with their queues, the totals, throughput and flow (``relay stats``);
        with ``?cards=true``, their peer cards too (about 4 MiB of them at most)."""
        values = request.args.get(b"cards")
        cards = values[0].decode("latin-1") if values else None
        if cards not in (None, "true", "false", "1", "0"):
            raise errors.bad_request('cards must be "true" or "false"')
        d = self.overview_document(cards in ("true", "1"))
        d.addCallback(lambda document: write_json(request, 200, document))
        return d

    @inlineCallbacks
    def overview_document(self, cards: bool = False):
        """The overview; each agent's ``card`` only with ``cards``, and only while the
        cards listed hold at most :data:`relay.wire.protocol.PEERS_BUDGET_BYTES` (the
        number left out is ``cardsOmitted``)."""
        broker, counters = self.broker, self.counters
        health = yield self.health()
        depths = yield broker.queue_depths()
        peers = yield broker.peers()
        now = self.clock.seconds()
        by_agent = {depth.agent: depth for depth in depths}
        agents: Dict[str, Dict[str, Any]] = {}
        for peer in peers:
            agents[peer["agent"]] = {"agent": peer["agent"], "registered": True,
                                     "online": peer["online"], "lastSeen": peer["lastSeen"]}
        for agent in by_agent:
            agents.setdefault(agent, {"agent": agent, "registered": False, "online": False,
                                      "lastSeen": None})
        roles = yield broker.role_queues()
        limits = broker.limits()
        inbox_max = limits["inboxMaxMessages"]
        streams = broker.event_streams()
        webhooks = broker.webhook_health()
        for agent in set(streams) | set(webhooks):
            agents.setdefault(agent, {"agent": agent, "registered": False, "online": False,
                                      "lastSeen": None})
        rows: List[Dict[str, Any]] = []
        for name, row in agents.items():
            row["selfcheck"] = protocol.is_selfcheck_agent(name)
            row["streams"] = streams.get(name, 0)
            row["webhook"] = webhooks.get(name)  # health only: never the URL
            depth = by_agent.get(name)
            for state in metrics.QUEUE_STATES:
                row[state] = getattr(depth, state) if depth is not None else 0
            pending = row["queued"] + row["leased"] + row["delayed"]
            row["inboxFull"] = bool(inbox_max and pending >= inbox_max)
            oldest = depth.oldest_queued if depth is not None else None
            row["oldestAgeSeconds"] = None if oldest is None else round(max(0.0, now - oldest), 3)
            rows.append(row)
        # Online agents first, then those with messages, busiest first: what an
        # operator looks for; a fleet's offline past comes last.
        rows.sort(key=lambda r: (not r["online"],
                                 -(r["queued"] + r["leased"] + r["delayed"] + r["failed"]),
                                 r["agent"]))
        listed = rows[:MAX_AGENTS]
        omitted = _add_cards(listed, peers) if cards else 0
        document = {
            "broker": {
                "version": __version__,
                "storage": broker.storage(),
                "now": now,
                "startedAt": self.started,
                "uptimeSeconds": round(now - self.started, 3),
                "healthy": health is None,
                "health": health,
            },
            "limits": dict(limits, agentsRegistered=len(peers)),
            "agents": listed,
            "roles": roles,
            "agentsListed": len(listed),
            "agentsTotal": len(rows),
            "totals": {
                "sent": counters.sent,
                "delivered": counters.delivered,
                "acked": dict(counters.acked),
                "deadLettered": dict(counters.dead_lettered),
                "expired": counters.expired,
                "leaseExpirations": counters.lease_expirations,
                "authFailures": dict(counters.auth_failures),
                "lockouts": counters.lockouts,
                "sendsRefused": dict(counters.refused),
                "rateLimited": answered_with(counters, 429),
                "requestsByWire": counters.requests_by_wire(),
                "pullWaiting": broker.waiting(),
                "agentsOnline": sum(1 for peer in peers if peer["online"]),
                "queued": sum(d.queued for d in depths),
                "leased": sum(d.leased for d in depths),
                "delayed": sum(d.delayed for d in depths),
                "failed": sum(d.failed for d in depths),
                "eventStreams": sum(streams.values()),
                "eventsStreamed": counters.events_sent,
                "webhookAttempts": counters.webhook_attempts,
                "webhookFailures": counters.webhook_failures,
                "webhookSkips": counters.webhook_skips,
                "webhooksDisabled": counters.webhooks_disabled,
                "groupSends": dict(counters.group_sends),
            },
            "throughput": counters.throughput(),
            "flow": counters.recent_flow(),
        }
        if cards:
            document["cardsOmitted"] = omitted
        return document

    def _listing(self, request, status: str, key: str) -> Deferred:
        d = self.broker.messages_in(status, _limit(request))
        now = self.clock.seconds()
        d.addCallback(lambda found: write_json(
            request, 200, {key: [message_view(m, now) for m in found]}))
        return d

    @app.route("/api/leases", methods=["GET"])
    @guarded
    def leases(self, request) -> Deferred:
        """Leases in flight, newest first, with the time each has left."""
        return self._listing(request, LEASED, "leases")

    @app.route("/api/dead-letters", methods=["GET"])
    @guarded
    def dead_letters(self, request) -> Deferred:
        """Failed messages (the dead letters), newest first."""
        return self._listing(request, FAILED, "deadLetters")

    @app.route("/api/requeue", methods=["POST"])
    @guarded
    def requeue(self, request) -> Deferred:
        """Put a dead letter back in its recipient's queue, as the operator
        (``/v1/requeue`` without the sender-or-recipient rule)."""
        message_id = protocol.required_id(self.check_post(request), "messageId")
        d = self.broker.requeue(None, message_id)
        d.addCallback(lambda result: self._done(request, "requeued", message_id, result))
        return d

    @app.route("/api/cancel", methods=["POST"])
    @guarded
    def cancel(self, request) -> Deferred:
        """Withdraw a queued or leased message, as the operator (``/v1/cancel``
        without the sender rule): it becomes a dead letter."""
        body = self.check_post(request)
        message_id = protocol.required_id(body, "messageId")
        reason = protocol.parse_reason(body) or "cancelled by the operator"
        d = self.broker.cancel(None, message_id, reason)
        d.addCallback(lambda result: self._done(request, "cancelled", message_id, result))
        return d

    def _done(self, request, action: str, message_id: str, result: Dict[str, Any]) -> bytes:
        log.info("operator {action} message {id}", action=action,
                 id=protocol.loggable(message_id))
        return write_json(request, 200, result)

    # -- authentication lockouts -------------------------------------------------------

    def _lockout(self) -> Lockout:
        if self.lockout is None:
            raise errors.not_found("this ops listener has no lockouts to show")
        return self.lockout

    @app.route("/api/locks", methods=["GET"])
    @guarded
    def locks(self, request) -> bytes:
        """The authentication locks in force: the agent, the address it is locked
        for (null: every address) and the seconds left, the longest first."""
        found = self.lockout.locks() if self.lockout is not None else []
        locks = sorted(found, key=lambda lock: (-lock[2], lock[0], lock[1]))
        return write_json(request, 200, {"locks": [
            {"agent": agent, "address": None if address == EVERY_ADDRESS else address,
             "secondsLeft": round(left, 3)}
            for agent, address, left in locks[:MAX_LIST]]})

    @app.route("/api/unlock", methods=["POST"])
    @guarded
    def unlock(self, request) -> Deferred:
        """Clear an agent's authentication locks and failure counts, from every
        address (and on every broker sharing the store); answered once done."""
        agent = self.check_post(request).get("agent")
        if not isinstance(agent, str) or not protocol.is_valid_agent_name(agent):
            raise errors.bad_request("agent must be an agent name")
        live, shared = self._lockout().unlock(agent)

        def done(_: Any) -> bytes:
            log.info("operator unlocked agent {agent} ({locks} locks)", agent=agent, locks=live)
            return write_json(request, 200, {"agent": agent, "unlocked": live})

        return (shared if shared is not None else succeed(None)).addCallback(done)


class OpsFront(Resource):
    """The root resource of the ops listener, in front of Klein's: a URL or ``Host``
    that is not UTF-8 is the §6 ``400`` (Klein answers it in plain text and logs a
    traceback)."""

    isLeaf = True

    def __init__(self, klein_resource: Resource) -> None:
        super().__init__()
        self.klein_resource = klein_resource

    def render(self, request) -> Any:
        problem = unreadable_url(request)
        if problem is not None:
            return write_error(request, problem)
        return self.klein_resource.render(request)
