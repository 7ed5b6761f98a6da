"""The webhook delivery loop (REACH §12): each agent's recorded events POSTed to its
URL, in order, one request at a time per agent, at most ``webhookConcurrency`` in
flight in all.

Decisions (backoff, skip, disable, the allow-list, the signed request) are
:mod:`relay.rules.hooks`'; this service applies them on a clock. It reads the events
the store recorded (so delivery resumes after a restart from the last
acknowledged event) and keeps each agent's progress in the store. Logs name
agents and event ids only: never a URL, a body or a secret.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredSemaphore, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.ssl import optionsForClientTLS
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer

from relay.rules import hooks
from relay.rules.delivery import Changes
from relay.rules.events import ALL_AGENTS, RESET, Event, EventPage
from relay.rules.hooks import HookState
from relay.wire.protocol import compact_json

log = Logger(namespace="relay.webhooks")

# The delivery role is renewed this often, for this long (another broker takes it
# over once it ran out).
LEAD_SECONDS = 5.0
LEAD_HOLD_SECONDS = 15.0
# What the delivering broker writes of a state (the rest is the agent's register).
PROGRESS = ("acked", "tries", "failures", "disabled", "failing_since", "last_delivered")
# The most events of an agent read from the store at once, to be sent one by one.
READ_AHEAD = 32
# What a register writes: the URL, and a webhook enabled again.
REGISTERED = ("url", "disabled", "tries", "failures", "failing_since")

# (url, headers, body) -> Deferred firing with the response's status code
Poster = Callable[[str, Dict[bytes, bytes], bytes], Deferred]


@dataclass(frozen=True)
class HookSettings:
    """What the config says of webhooks (a reload may change all but ``concurrency``)."""

    allow: Tuple[str, ...]
    max_attempts: int
    disable_after: int
    concurrency: int
    # agent -> the operator's URL (wins over the agent's own)
    configured: Mapping[str, str]
    # agent -> the secret its requests (and so its webhooks) are signed with
    secrets: Mapping[str, str]

    @classmethod
    def from_config(cls, config: Any) -> HookSettings:
        return cls(
            allow=tuple(config.webhook_allow),
            max_attempts=config.webhook_max_attempts,
            disable_after=config.webhook_disable_after,
            concurrency=config.webhook_concurrency,
            configured={name: agent.webhook for name, agent in config.agents.items()
                        if agent.webhook is not None},
            secrets={name: agent.secret for name, agent in config.agents.items()
                     if agent.secret is not None},
        )


class _Discard(Protocol):
    """Reads a response body to its end and throws it away."""

    def __init__(self, done: Deferred) -> None:
        self.done = done

    def dataReceived(self, data: bytes) -> None:
        pass

    def connectionLost(self, reason: Any = None) -> None:
        if not self.done.called:
            self.done.callback(None)


@implementer(IBodyProducer)
class _Bytes:
    """A request body that is all there at once."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: Any) -> Deferred:
        consumer.write(self.body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def _passing(action: Callable[[], None]) -> Callable[[Any], Any]:
    """A callback and errback that runs ``action`` and passes its result on."""
    def run(result: Any) -> Any:
        action()
        return result
    return run


def _cancelled(failure: Any) -> bool:
    """True when a request failed because its deadline cancelled it."""
    return bool(failure.check(CancelledError)) or any(
        reason.check(CancelledError) for reason in getattr(failure.value, "reasons", ()))


@implementer(IStreamClientEndpoint)
class _Quiet:
    """An endpoint whose connections' factories do not log their start and stop (those
    lines would name the webhook's host and port)."""

    def __init__(self, endpoint: IStreamClientEndpoint) -> None:
        self.endpoint = endpoint

    def connect(self, factory: Any) -> Deferred:
        factory.noisy = False
        return self.endpoint.connect(factory)


@implementer(IAgentEndpointFactory)
class _QuietEndpoints:
    """Endpoints of webhook URLs: TCP, or TLS for https, each :class:`_Quiet`."""

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        endpoint = HostnameEndpoint(self.reactor, uri.host, uri.port,
                                    timeout=hooks.TIMEOUT_SECONDS)
        if uri.scheme == b"https":
            endpoint = wrapClientTLS(optionsForClientTLS(uri.host.decode("idna")), endpoint)
        return _Quiet(endpoint)


# An idle connection to a receiver is kept this long for the next event: below the
# shortest keep-alive timeout common servers use (5 s), so the receiver does not
# close it under a request about to go.
IDLE_CONNECTION_SECONDS = 4.0


def http_poster(reactor: Any, concurrency: int = 64,
                timeout: float = hooks.TIMEOUT_SECONDS) -> Poster:
    """POST with Twisted's Agent on ``reactor``: ``timeout`` (10 s) for the whole answer,
    its body read and discarded, redirects not followed, nothing of the URL logged.
    Connections are kept open between the requests of a busy receiver (at most
    ``concurrency`` per receiver, as many as requests may be in flight; each closed
    when idle for :data:`IDLE_CONNECTION_SECONDS`): a connection per event cost the
    broker more than the event itself."""
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = concurrency
    pool.cachedConnectionTimeout = IDLE_CONNECTION_SECONDS
    agent = Agent.usingEndpointFactory(reactor, _QuietEndpoints(reactor), pool)

    def once(target: bytes, headers: Dict[bytes, bytes], body: bytes) -> Deferred:
        d = agent.request(b"POST", target,
                          Headers({name: [value] for name, value in headers.items()}),
                          _Bytes(body))

        def answered(response: Any) -> Deferred:
            done: Deferred = Deferred()
            response.deliverBody(_Discard(done))
            return done.addCallback(lambda _: response.code)

        d.addCallback(answered)
        # One deadline for the status and the body (REACH §12: a 2xx within 10 s);
        # cancelling d cancels whichever of the two it waits for.
        deadline = reactor.callLater(timeout, d.cancel)
        return d.addBoth(_passing(lambda: deadline.cancel() if deadline.active() else None))

    def post(url: str, headers: Dict[bytes, bytes], body: bytes) -> Deferred:
        # A kept connection the receiver closed as the request went (an HTTP/1.0
        # server closes after each answer without saying so, another when idle) gets
        # no answer: the request goes once more, on a new connection, before it
        # counts as a failed try. (The receiver may see it twice: at least once.)
        # A receiver that did not answer in time is a failed try at once: the next
        # goes after the backoff, not straight away.
        # The URL goes to the Agent as the bytes that were signed (hooks.wire_url):
        # treq would parse it again with hyperlink, which cannot send to an IPv6
        # literal such as http://[::1]:PORT/ (a default webhookAllow prefix).
        # Agent follows no redirect.
        target = hooks.wire_url(url).encode("ascii")

        def again(failure: Any) -> Deferred:
            failure.trap(RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived)
            if _cancelled(failure):
                return failure
            return once(target, headers, body)

        return once(target, headers, body).addErrback(again)

    return post


class WebhookDelivery(Service):
    """Delivers every agent's events to its webhook; started and stopped with the broker."""

    def __init__(self, store: Any, clock: IReactorTime, post: Poster, settings: HookSettings,
                 shared_secret: str, counters: Any = None) -> None:
        self.store = store
        self.clock = clock
        self.post = post
        self.settings = settings
        self.shared_secret = shared_secret
        self.counters = counters
        self.states: Dict[str, HookState] = {}
        self.busy: Set[str] = set()
        # agents whose events changed while a read of them was under way: that read
        # may predate the change (its commit, on another broker), so they read again
        self.missed: Set[str] = set()
        self.timers: Dict[str, Any] = {}
        # agent -> (the position they follow, events read from the store and not
        # delivered yet, in order): valid while that position is the agent's acked
        self.ahead: Dict[str, Tuple[int, List[Event]]] = {}
        self.limit = DeferredSemaphore(settings.concurrency)
        self.loaded = False
        # Brokers sharing a store agree on one of them delivering every webhook (so
        # each event is POSTed once, in order, one at a time per agent): the role is
        # taken and renewed in the store, and another broker takes it over when it
        # is not renewed.
        self.token = uuid.uuid4().hex
        self.leading = False
        self._leader = LoopingCall(self._lead)
        self._leader.clock = clock
        store.subscribe(self.changed)

    # -- life -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.reload()  # every broker answers registers with the agent's webhook
        self._leader.start(LEAD_SECONDS, now=True)

    def _lead(self) -> Deferred:
        d = self.store.lead_webhooks(self.token, self.clock.seconds(), LEAD_HOLD_SECONDS)
        d.addCallbacks(self._led, lambda f: log.warn(
            "webhook delivery role not renewed: {kind}", kind=f.type.__name__))
        return d

    def _led(self, leading: bool) -> None:
        if not self.running:
            return
        was, self.leading = self.leading, leading
        if leading and not was:
            self.reload()
        elif was and not leading:
            log.info("another broker delivers the webhooks now")

    def reload(self) -> Deferred:
        """Read every webhook's state from the store again, then send what is due."""
        d = self.store.webhook_states()
        d.addCallback(self._loaded)
        d.addErrback(lambda f: log.error("webhook states could not be read: {kind}",
                                         kind=f.type.__name__))
        return d

    def _loaded(self, stored: Mapping[str, str]) -> None:
        self.states = {agent: HookState.from_json(text) for agent, text in stored.items()}
        self.loaded = True
        self.kick_all()

    def stopService(self) -> Optional[Deferred]:
        super().stopService()
        if self._leader.running:
            self._leader.stop()
        for call in self.timers.values():
            if call.active():
                call.cancel()
        self.timers.clear()
        if self.leading:  # hand the role over at once rather than when it runs out
            self.leading = False
            d = self.store.lead_webhooks(self.token, self.clock.seconds(), 0)
            d.addErrback(lambda _: None)
            return d
        return None

    def configure(self, settings: HookSettings, shared_secret: str) -> None:
        """Apply a reloaded config: a narrower allow-list stops deliveries outside it
        at once, a wider one resumes them."""
        self.settings = settings
        self.shared_secret = shared_secret
        self.kick_all()

    # -- what agents and operators see ----------------------------------------------------

    def url_of(self, agent: str) -> Optional[str]:
        """The URL ``agent``'s events go to (the config's, else its own)."""
        configured = self.settings.configured.get(agent)
        if configured is not None:
            return configured
        state = self.states.get(agent)
        return state.url if state is not None else None

    def shown(self, agent: str) -> Optional[Dict[str, Any]]:
        """The register answer's ``webhook`` for ``agent`` (its own answer only)."""
        url = self.url_of(agent)
        if url is None:
            return None
        state = self.states.get(agent)
        if state is not None and state.disabled:
            return {"url": url, "disabled": True}
        return {"url": url}

    def health(self) -> Dict[str, Dict[str, Any]]:
        """Per agent with a webhook: last delivered, failing since, disabled — no URL."""
        return {agent: state.health() for agent, state in sorted(self.states.items())
                if self.url_of(agent) is not None}

    def register(self, agent: str, url: Any, keep: Any) -> Deferred:
        """The webhook of a register body (``keep``: unchanged; None: removed; else a
        URL, checked against the allow-list, which also enables a disabled webhook),
        on whichever broker the agent registers. A new webhook starts at the present.
        Fires once the state is stored."""
        if url is keep:
            if agent in self.settings.configured and agent not in self.states:
                return self._merge(agent, {}, announce=True)
            return succeed(None)
        if url is not None:
            hooks.check_url(url, self.settings.allow)
        elif agent not in self.settings.configured:
            self.states.pop(agent, None)
            return self.store.put_webhook(agent, None)
        enable = HookState(url=url)
        fields = {key: getattr(enable, key) for key in REGISTERED}
        return self._merge(agent, fields, announce=True)

    def _merge(self, agent: str, fields: Dict[str, Any], announce: bool) -> Deferred:
        """Write ``fields`` of ``agent``'s state (a new state starts at the present)."""
        d = self.store.events(agent, None, 0)
        d.addCallback(lambda page: self.store.merge_webhook(agent, fields, {"acked": page.last},
                                                            announce))
        d.addCallback(self._merged, agent)
        return d

    def _merged(self, text: str, agent: str) -> None:
        """Take what a register stored; the progress kept here may be newer (the
        delivery may have gone on meanwhile) and is kept."""
        stored = HookState.from_json(text)
        state = self.states.get(agent)
        if state is None:
            self.states[agent] = stored
        else:
            for key in REGISTERED:
                setattr(state, key, getattr(stored, key))
        self.kick(agent)

    def _save(self, agent: str, announce: bool = False) -> Deferred:
        """Store the delivery progress of ``agent`` (its URL and an enabling register
        another broker stored meanwhile are kept); with ``announce``, the other
        brokers read it (a webhook disabled: their register answers say so)."""
        state = self.states.get(agent)
        if state is None:
            return succeed(None)
        fields = {key: getattr(state, key) for key in PROGRESS}
        d = self.store.merge_webhook(agent, fields, None, announce)

        def merged(text: str) -> None:
            fresh = HookState.from_json(text)
            if agent in self.states:
                self.states[agent] = fresh

        return d.addCallback(merged)

    # -- the loop -------------------------------------------------------------------------

    def changed(self, changes: Changes) -> None:
        """New events were recorded: the agents concerned send them; webhook settings
        changed (on another broker too): they are read again."""
        if changes.hooks:  # the deliverer sends by them, every broker shows them
            self.reload()
            return
        if ALL_AGENTS in changes.events:
            self.kick_all()
            return
        for agent in changes.events:
            if agent in self.states:
                self.kick(agent)

    def kick_all(self) -> None:
        for agent in list(self.states):
            self.kick(agent)

    def kick(self, agent: str) -> None:
        """Send ``agent``'s next event unless a request or a retry of it is under way."""
        if agent in self.busy:
            self.missed.add(agent)
            return
        if not self.running or not self.leading or not self.loaded or agent in self.timers:
            return
        self.busy.add(agent)
        self._next(agent)

    def _sendable(self, agent: str) -> Optional[str]:
        state = self.states.get(agent)
        url = self.url_of(agent)
        if state is None or url is None or state.disabled:
            return None
        if not hooks.allowed(url, self.settings.allow):
            return None  # outside the allow-list in force: nothing is sent
        return url

    def _next(self, agent: str) -> None:
        if not self.running or not self.leading or self._sendable(agent) is None:
            self.busy.discard(agent)
            self.ahead.pop(agent, None)
            return
        acked = self.states[agent].acked
        cached = self.ahead.pop(agent, None)
        if cached is not None:
            base, ahead = cached
            if ahead and ahead[0].id == acked and base < acked:  # the first went
                ahead.pop(0)
                base = acked
            if base == acked and ahead:  # what the store gave after acked, still
                self.ahead[agent] = (base, ahead)
                self._got(EventPage(ahead[:1], None, ahead[0].id), agent)
                return
        self.missed.discard(agent)
        d = self.store.events(agent, acked, READ_AHEAD)
        d.addCallbacks(self._got, self._unreadable, callbackArgs=(agent, acked),
                       errbackArgs=(agent,))

    def _unreadable(self, failure: Any, agent: str) -> None:
        log.warn("webhook of {agent}: its events could not be read ({kind})", agent=agent,
                 kind=failure.type.__name__)
        self._later(agent, hooks.backoff(1))

    def _got(self, page: EventPage, agent: str, read_after: Optional[int] = None) -> None:
        state = self.states.get(agent)
        if state is None:
            self.busy.discard(agent)
            return
        if read_after is not None and page.events:
            # the events after read_after, sent one by one without reading again
            self.ahead[agent] = (read_after, list(page.events))
        if page.reset is not None:
            # Past retention (the webhook failed or the broker was down that long):
            # the receiver is told with a reset, as a stream would be, and delivery
            # goes on from the present once it took it.
            log.warn("webhook of {agent}: events after {acked} are past retention and "
                     "skipped; a reset is sent", agent=agent, acked=state.acked)
            if self.counters is not None:
                self.counters.webhook_skipped()
            reset = Event(page.last, agent, RESET, compact_json({"reason": page.reset}),
                          self.clock.seconds())
            d = self.limit.run(self._send, agent, reset)
            d.addBoth(self._answered, agent, reset)
            return
        if not page.events:
            if agent in self.missed:
                self._next(agent)
                return
            self.busy.discard(agent)
            return
        event = page.events[0]
        d = self.limit.run(self._send, agent, event)
        d.addBoth(self._answered, agent, event)

    def _send(self, agent: str, event: Event) -> Deferred:
        url = self._sendable(agent)  # the allow-list at the time of sending
        if url is None:
            return succeed(None)
        secret = self.settings.secrets.get(agent, self.shared_secret)
        body, headers = hooks.request(agent, secret, url, event, int(self.clock.seconds()))
        if self.counters is not None:
            self.counters.webhook_attempted()
        return self.post(url, headers, body)

    def _answered(self, result: Any, agent: str, event: Event) -> None:
        state = self.states.get(agent)
        if state is None:
            self.busy.discard(agent)
            return
        if result is None:  # not sent: the URL left the allow-list or the webhook went
            self.busy.discard(agent)
            return
        now = self.clock.seconds()
        if isinstance(result, int) and 200 <= result < 300:
            hooks.delivered(state, event.id, now)
            self._save(agent).addBoth(lambda _: self._next(agent))
            return
        if self.counters is not None:
            self.counters.webhook_failed()
        self.ahead.pop(agent, None)  # a retry reads the store again (retention, restarts)
        action, delay = hooks.failed(state, event.id, now, self.settings.max_attempts,
                                     self.settings.disable_after)
        saved = self._save(agent, announce=action == hooks.DISABLE)
        if action == hooks.SKIP:
            log.warn("webhook of {agent}: event {event} skipped after {tries} tries",
                     agent=agent, event=event.id, tries=self.settings.max_attempts)
            if self.counters is not None:
                self.counters.webhook_skipped()
            saved.addBoth(lambda _: self._next(agent))
        elif action == hooks.DISABLE:
            log.warn("webhook of {agent} disabled after {count} failed tries in a row",
                     agent=agent, count=state.failures)
            if self.counters is not None:
                self.counters.webhook_disabled()
            self.busy.discard(agent)
        else:
            saved.addBoth(lambda _: self._later(agent, delay))

    def _later(self, agent: str, delay: float) -> None:
        self.busy.discard(agent)

        def due() -> None:
            self.timers.pop(agent, None)
            self.kick(agent)

        if self.running:
            self.timers[agent] = self.clock.callLater(delay, due)

    def pending(self) -> Sequence[str]:
        """Agents with a request or a retry under way (tests, the dashboard)."""
        return sorted(self.busy | set(self.timers))
