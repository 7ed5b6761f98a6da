"""The agent runtime: one agent that leases requests, runs a handler, replies and acks.

:class:`AgentService` handshakes once, heartbeats well within the broker's 90 s
TTL (with its peer card, when it has one and the broker takes cards), leases
messages with ``POST /v1/pull`` and, for each request, calls a handler. Where
the broker advertises ``events`` (REACH §11) it pulls when its event stream says
a message became deliverable, and waits without a request in between; while
the stream is down, and on other brokers, it long-polls (or polls) instead.

On a broker with the delivery extensions v1.2 (EXTENSIONS.md) the lease of a
running handler is renewed every third of its length, so a handler may run for
hours on a short lease, and the reply is stored by the completing ack itself
(``replyInAck``): the request is answered exactly once without a receipts file.
On a v1.1 broker a completed reply is persisted in a per-agent
:class:`relay.agent.receipts.ReceiptStore` before it is sent, so a request that is
delivered again (lost ack, restart) gets the same reply re-sent and is never
handled twice (spec §5.1, "Receipts").

A handler ends its request otherwise than with a reply by raising
:class:`Retry`, :class:`Release` or :class:`Reject`; any other exception asks
for a retry after ``retry_delay``.

Only ids and events are logged, never message bodies.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from relay.agent.receipts import ReceiptStore
from relay.client.client import RelayClient, ack_outcomes
from relay.client.polling import MIN_HELD_SECONDS, poll
from relay.client.sse import MESSAGE as MESSAGE_EVENT
from relay.client.sse import RESET as RESET_EVENT
from relay.wire.errors import RelayError
from relay.wire.protocol import KEEP_CARD

HEARTBEAT_INTERVAL_SECONDS = 30.0  # the broker's TTL is 90 s
POLL_INTERVAL_SECONDS = 2.0
# With events, a pull at least this often even when no event came.
RESYNC_INTERVAL_SECONDS = 300.0
# With events, how long the first pull waits for the stream to open.
STREAM_OPEN_SECONDS = 5.0
SHUTDOWN_GRACE_SECONDS = 30.0
RETRY_DELAY_SECONDS = 5.0
# Handshake failures that waiting will not fix: the runtime stops on these.
FATAL_HANDSHAKE_CODES = frozenset({"protocol_mismatch", "tls_error", "ops_listener"})
MAX_ERROR_TEXT = 500
# A lease is renewed when a third of it has run (EXTENSIONS.md §1).
RENEW_FRACTION = 1 / 3
MIN_RENEW_INTERVAL_SECONDS = 1.0
# The lease asked for in renewals when the runtime cannot tell how long the
# broker's lease is (a pulled envelope without leaseUntil).
FALLBACK_LEASE_SECONDS = 60
# The answers to a renewal that mean the lease is gone.
LEASE_GONE = frozenset({404, 409})

Message = Dict[str, Any]
Handler = Callable[[Message], Any]


# -- what a handler may raise ----------------------------------------------------------


class HandlerOutcome(Exception):
    """Raised by a handler to end its request without a reply; see the subclasses."""

    def __init__(self, reason: str, after: Optional[float] = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after = after


class Retry(HandlerOutcome):
    """Try the request again later: ``retry`` (one attempt more; past the broker's
    ``maxAttempts`` the request fails), not before ``after`` seconds.

    ``reason`` is the error ``relay status`` shows. Without ``after`` the
    runtime's ``retry_delay`` applies, as for any other exception.
    """

    def __init__(self, reason: str = "retry", after: Optional[float] = None) -> None:
        super().__init__(reason, after)


class Release(HandlerOutcome):
    """Give the request back without using an attempt (``release``): not this
    worker's job, or not now; not before ``after`` seconds.

    A v1.1 broker has no ``release``: the runtime then leaves the lease to lapse,
    which hands the request back, at no cost, when the lease ends.
    """

    def __init__(self, after: Optional[float] = None, reason: str = "released") -> None:
        super().__init__(reason, after)


class Reject(HandlerOutcome):
    """The request can never succeed (a poison message): it fails at once
    (``reject``) with ``reason``, and its sender gets a failure notice.

    A v1.1 broker has no ``reject``: the runtime then acks ``retry``, and the
    request fails once its attempts are used up.
    """

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)


# -- the runtime ---------------------------------------------------------------------


def reply_body(result: Any) -> Dict[str, Any]:
    """A handler's return value as a reply body."""
    if isinstance(result, dict):
        return result
    if result is None:
        return {}
    if isinstance(result, bytes):
        result = result.decode("utf-8", errors="replace")
    if isinstance(result, str):
        return {"text": result}
    return {"result": result}


def _error_text(failure: Failure) -> str:
    text = failure.getErrorMessage() or failure.type.__name__
    return text[:MAX_ERROR_TEXT]


def card_of(description: Optional[str], skills: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The peer card (EXTENSIONS.md §8) of a description and skills; None when both
    are empty."""
    card: Dict[str, Any] = {}
    if description:
        card["description"] = description
    if skills:
        card["skills"] = list(skills)
    return card or None


class AgentService(Service):
    """Runs one agent against a broker until stopped.

    :param client: the agent's :class:`RelayClient`.
    :param handler: called with each request envelope; returns the reply (a
        dict body, a string for ``{"text": ...}``, or ``None``), a Deferred or a
        coroutine. Raising :class:`Retry`, :class:`Release` or :class:`Reject`
        ends the request that way; any other exception re-queues it with
        ``retry`` after ``retry_delay``.
    :param receipts: where completed replies are remembered (v1.1 brokers).
    :param concurrency: how many requests may be handled at once.
    :param lease_seconds: the lease asked for in pulls and renewals (default:
        the broker's).
    :param retry_delay: seconds before a failed request may be delivered again,
        so a failing handler does not burn all the broker's attempts at once
        (``retryAfterSeconds`` where advertised; on a v1.1 broker the lease is
        held that long before the ``retry``).
    :param card: this agent's peer card, ``{"description", "skills"}``, sent with
        every heartbeat when the broker advertises ``peerCards``.
    :param on_receipt: called with each ``type: "ack"`` envelope (v1.0 receipts).
    :param on_reply: called with each ``kind: "reply"`` envelope (answers to
        this agent's own requests, failure notices included). Neither is run as
        a request.
    :param on_fatal: called with a RelayError the runtime cannot recover from
        (a protocol mismatch, or a TLS failure such as an untrusted broker
        certificate at the first handshake); the runtime stops working first.
    :param debug: log the traceback of each handler failure, not only its
        exception type and message.
    :param use_events: where the broker advertises ``events`` (REACH §11), wait
        for an event between pulls instead of long-polling or polling (the
        default); False always polls.
    :param resync_interval: with events, pull at least this often even when no
        event came.
    """

    log = Logger()

    def __init__(
        self,
        client: RelayClient,
        handler: Handler,
        *,
        clock: IReactorTime,
        receipts: ReceiptStore,
        concurrency: int = 1,
        lease_seconds: Optional[int] = None,
        poll_interval: float = POLL_INTERVAL_SECONDS,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_SECONDS,
        shutdown_grace: float = SHUTDOWN_GRACE_SECONDS,
        retry_delay: float = RETRY_DELAY_SECONDS,
        card: Optional[Mapping[str, Any]] = None,
        on_receipt: Optional[Callable[[Message], Any]] = None,
        on_reply: Optional[Callable[[Message], Any]] = None,
        on_fatal: Optional[Callable[[RelayError], Any]] = None,
        debug: bool = False,
        use_events: bool = True,
        resync_interval: float = RESYNC_INTERVAL_SECONDS,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client = client
        self.handler = handler
        self.receipts = receipts
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.shutdown_grace = shutdown_grace
        self.retry_delay = retry_delay
        self.card = dict(card) if card is not None else None
        self.on_receipt = on_receipt
        self.on_reply = on_reply
        self.on_fatal = on_fatal
        self.debug = debug
        self.use_events = use_events
        self.resync_interval = resync_interval
        self._clock = clock
        self._stopping = False
        self._waiting: Optional[defer.Deferred] = None
        self._slot: Optional[defer.Deferred] = None
        self._inflight: Set[defer.Deferred] = set()
        # message id -> the lease to acknowledge it with (the newest one)
        self._leases: Dict[str, str] = {}
        # message id -> a lease that renewal found gone: never acknowledged
        self._lost: Dict[str, str] = {}
        self._renewals: Dict[str, LoopingCall] = {}
        # held leases waiting out a retry delay (v1.1); a stop cuts them short
        self._holds: Set[defer.Deferred] = set()
        self._heartbeat: Optional[LoopingCall] = None
        self._main: Optional[defer.Deferred] = None
        self._card_refused = False
        # woken by events: the stream, whether something happened since the last
        # pull began, and the wait an event ends
        self._events: Optional[Any] = None
        self._woken = False
        self._wake_up: Optional[defer.Deferred] = None
        # message events not yet matched by pulled messages; whether to pull until
        # a page is not full
        self._unpulled = 0
        self._drain = False

    # -- lifecycle --

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        self._main = defer.Deferred.fromCoroutine(self._run())
        self._main.addErrback(self._main_failed)

    def _main_failed(self, failure: Failure) -> None:
        if not failure.check(defer.CancelledError):
            self.log.failure("agent {agent}: runtime loop failed", failure, agent=self.client.agent)

    def stopService(self) -> defer.Deferred:
        """Stop leasing; wait up to the grace period for in-flight handlers.

        A request whose lease is held for a retry delay is handed back at once.

        The leases of handlers that do not finish in time are released at once
        where the broker has ``release`` (another worker may take them); on a
        v1.1 broker they lapse at the broker. Either way the late handlers'
        results are not acknowledged.
        """
        super().stopService()
        self._stopping = True
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        if self._waiting is not None:
            self._waiting.cancel()
        for hold in list(self._holds):
            hold.cancel()
        pending = list(self._inflight)
        if not pending:
            return defer.succeed(None)
        done: defer.Deferred = defer.Deferred()

        def finish(_: Any = None) -> None:
            if not done.called:
                done.callback(None)

        def grace_over() -> None:
            if not done.called:
                defer.ensureDeferred(self._give_up_unfinished()).addBoth(finish)

        # The handlers are not cancelled when the grace period ends: the
        # process just stops waiting for them.
        timer = self._clock.callLater(self.shutdown_grace, grace_over)
        defer.DeferredList(pending, consumeErrors=True).addBoth(finish)
        done.addBoth(lambda result: timer.cancel() if timer.active() else None)
        return done

    async def _give_up_unfinished(self) -> None:
        """Stop renewing the leases of unfinished handlers, and release them."""
        releasable = "release" in ack_outcomes(self.client.info)
        releases = []
        for message_id, lease_id in list(self._leases.items()):
            self._stop_renewing(message_id)
            self._lost[message_id] = lease_id
            if releasable and lease_id:
                d = self.client.release(message_id, lease_id)
                d.addErrback(lambda failure: None)
                releases.append(d)
        if releases:
            await defer.DeferredList(releases)
            self.log.info(
                "agent {agent}: released {count} unfinished requests",
                agent=self.client.agent,
                count=len(releases),
            )

    async def _pause(self, d: defer.Deferred) -> Any:
        """Wait for ``d``, letting :meth:`stopService` cancel the wait."""
        self._waiting = d
        try:
            return await d
        finally:
            self._waiting = None

    async def _sleep(self, seconds: float) -> None:
        await self._pause(deferLater(self._clock, seconds))

    async def _run(self) -> None:
        try:
            await self._start()
            await self._lease_loop()
        except defer.CancelledError:
            return

    async def _start(self) -> None:
        while not self._stopping:
            try:
                await self._pause(self.client.handshake())
                break
            except RelayError as failure:
                if failure.code in FATAL_HANDSHAKE_CODES:
                    self.log.critical(
                        "agent {agent}: {code}: {message}",
                        agent=self.client.agent,
                        code=failure.code,
                        message=failure.message,
                    )
                    self._stopping = True
                    if self.on_fatal is not None:
                        self.on_fatal(failure)
                    return
                self.log.warn(
                    "agent {agent}: handshake failed ({code}: {message}); retrying",
                    agent=self.client.agent,
                    code=failure.code,
                    message=failure.message,
                )
                await self._sleep(self.poll_interval)
        if self._stopping:
            return
        self._heartbeat = LoopingCall(self._beat)
        self._heartbeat.clock = self._clock
        self._heartbeat.start(self.heartbeat_interval, now=True)
        extensions = [
            name
            for name in ("leaseRenew", "replyInAck", "retryAfter", "peerCards", "signedNonce")
            if self.client.advertises(name)
        ]
        self.log.info(
            "agent {agent} running (long-poll: {wait}; v1.2: {extensions})",
            agent=self.client.agent,
            wait=self.client.long_poll_seconds,
            extensions=", ".join(extensions) or "none, receipts in use",
        )

    def _beat(self) -> defer.Deferred:
        card: Any = KEEP_CARD
        if self.card is not None:
            if self.client.advertises("peerCards"):
                card = self.card
            elif not self._card_refused:
                self._card_refused = True
                self.log.warn(
                    "agent {agent}: the broker lacks peerCards; the card is not published",
                    agent=self.client.agent,
                )
        d = self.client.register(card=card)
        d.addErrback(
            lambda failure: self.log.warn(
                "agent {agent}: heartbeat failed ({code})",
                agent=self.client.agent,
                code=getattr(failure.value, "code", failure.type.__name__),
            )
        )
        return d

    async def _lease_loop(self) -> None:
        if self.use_events and self.client.advertises("events"):
            await self._event_loop()
            return
        await poll(
            self._lease,
            self._dispatch_all,
            clock=self._clock,
            wait=self.client.long_poll_seconds,
            interval=self.poll_interval,
            running=lambda: not self._stopping,
            on_error=self._pull_failed,
            sleep=self._sleep,
        )

    # -- woken by events (REACH §11) --

    async def _event_loop(self) -> None:
        """Pull when an event says there is something to pull; while the stream is
        down, pull as :func:`poll` does.

        Leases are still taken by pull only: an event is a reason to pull, never a
        delivery. After a full page the loop pulls again while message events are
        unmatched by pulled messages; it drains the queue (pulls until a page is
        not full) when the stream opens or reopens, after a ``reset`` and every
        ``resync_interval`` seconds, since messages may have become deliverable
        without an event of this stream. An event that comes while a pull is under
        way makes another pull follow it, so none is missed.
        """
        stream = self.client.events(on_state=self._stream_state)
        self._events = stream
        self._drain = True
        reading = defer.Deferred.fromCoroutine(self._read_events(stream))
        reading.addErrback(self._events_failed)
        try:
            # The first pull waits for the stream (or for a moment): a long-poll
            # begun before it opened would be held for nothing.
            await self._wait_for_event(STREAM_OPEN_SECONDS)
            while not self._stopping:
                self._woken = False
                draining, self._drain = self._drain, False
                connected = stream.connected
                # Down (not yet open, lost, or given up): a long-poll as without events.
                wait = None if connected else self.client.long_poll_seconds
                asked = self.concurrency - len(self._inflight)
                started = self._clock.seconds()
                try:
                    messages = await self._lease(wait)
                except RelayError as failure:
                    self._pull_failed(failure)
                    self._drain = True
                    await self._sleep(self.poll_interval)
                    continue
                held = self._clock.seconds() - started
                self._unpulled = max(0, self._unpulled - len(messages))
                full = len(messages) >= asked
                if full and draining:
                    self._drain = True
                await self._dispatch_all(messages)
                if not (connected and stream.connected):
                    self._drain = True
                    if not messages and (not wait or held < MIN_HELD_SECONDS):
                        await self._sleep(self.poll_interval)
                    continue
                if self._woken or self._drain or (full and self._unpulled > 0):
                    continue
                await self._wait_for_event()
        finally:
            stream.close()
            self._events = None

    async def _read_events(self, stream: Any) -> None:
        async for event in stream:
            if event.type == MESSAGE_EVENT:
                self._unpulled += 1
                self._wake()
            elif event.type == RESET_EVENT:
                self.log.info("agent {agent}: events reset; pulling to re-sync",
                              agent=self.client.agent)
                self._drain = True
                self._wake()

    def _events_failed(self, failure: Failure) -> None:
        """The stream ended for good (a refused signature, a broker without it): the
        loop pulls as without events from now on."""
        self.log.warn(
            "agent {agent}: event stream ended ({code}); polling instead",
            agent=self.client.agent,
            code=getattr(failure.value, "code", failure.type.__name__),
        )
        self._wake()

    def _stream_state(self, connected: bool) -> None:
        if connected:
            self._drain = True
        else:
            self.log.info("agent {agent}: event stream lost; polling until it is back",
                          agent=self.client.agent)
        self._wake()

    def _resync(self) -> None:
        self._drain = True
        self._wake()

    def _wake(self) -> None:
        self._woken = True
        wake, self._wake_up = self._wake_up, None
        if wake is not None and not wake.called:
            wake.callback(None)

    async def _wait_for_event(self, seconds: Optional[float] = None) -> None:
        """Until something wakes the loop (at once if something did already)."""
        if self._woken:
            return
        self._wake_up = defer.Deferred()
        timer = self._clock.callLater(
            self.resync_interval if seconds is None else seconds, self._resync)
        try:
            await self._pause(self._wake_up)
        finally:
            if timer.active():
                timer.cancel()

    async def _lease(self, wait: Optional[float]) -> Sequence[Message]:
        answer = await self._pause(
            self.client.pull(
                limit=self.concurrency - len(self._inflight),
                lease_seconds=self.lease_seconds,
                wait=wait,
            )
        )
        return answer.get("messages") or [] if isinstance(answer, dict) else []

    def _pull_failed(self, failure: RelayError) -> None:
        self.log.warn(
            "agent {agent}: pull failed ({code}: {message})",
            agent=self.client.agent,
            code=failure.code,
            message=failure.message,
        )

    async def _dispatch_all(self, messages: Sequence[Message]) -> None:
        """Start handling ``messages``; return once a handler slot is free again."""
        for message in messages:
            self._dispatch(message)
        while len(self._inflight) >= self.concurrency:
            self._slot = defer.Deferred()
            await self._pause(self._slot)

    # -- one message --

    def _dispatch(self, message: Message) -> None:
        message_id = str(message.get("id"))
        lease_id = message.get("leaseId")
        if message_id in self._leases:
            # Our own lease lapsed and we got the message again while still
            # handling it: the newer lease is the one to acknowledge (and renew).
            if lease_id:
                self._leases[message_id] = str(lease_id)
            return
        self._leases[message_id] = str(lease_id or "")
        d = defer.Deferred.fromCoroutine(self._process(message))
        self._inflight.add(d)

        def finished(result: Any) -> None:
            self._inflight.discard(d)
            self._stop_renewing(message_id)
            self._leases.pop(message_id, None)
            self._lost.pop(message_id, None)
            if self._slot is not None and not self._slot.called:
                slot, self._slot = self._slot, None
                slot.callback(None)
            if isinstance(result, Failure):
                self.log.failure(
                    "agent {agent}: processing {id} failed",
                    result,
                    agent=self.client.agent,
                    id=message_id,
                )

        d.addBoth(finished)

    async def _process(self, message: Message) -> None:
        message_id = str(message.get("id"))
        if message.get("type") == "ack":
            await self._notify(self.on_receipt, message)
            await self._finish(message_id, "completed")
        elif message.get("kind") == "reply":
            await self._notify(self.on_reply, message)
            await self._receipt(message, None)
            await self._finish(message_id, "completed")
        else:
            await self._handle_request(message)

    async def _notify(self, callback: Optional[Callable[[Message], Any]], message: Message) -> None:
        if callback is None:
            return
        try:
            await defer.maybeDeferred(callback, message)
        except Exception:
            self.log.failure(
                "agent {agent}: callback failed for {id}",
                agent=self.client.agent,
                id=message.get("id"),
            )

    async def _handle_request(self, message: Message) -> None:
        message_id = str(message.get("id"))
        receipt = self.receipts.get(message_id)
        if receipt is not None:
            self.log.info(
                "agent {agent}: {id} already answered by {reply}; replaying the reply",
                agent=self.client.agent,
                id=message_id,
                reply=receipt["reply"].get("id"),
            )
            await self._send_reply(message, receipt)
            return
        outcome: Optional[HandlerOutcome] = None
        failure: Optional[Failure] = None
        self._keep_leased(message)
        try:
            result = await defer.maybeDeferred(self.handler, message)
        except HandlerOutcome as raised:
            outcome = raised
        except Exception:
            failure = Failure()
        finally:
            self._stop_renewing(message_id)
        if outcome is not None:
            await self._hand_back(message_id, outcome)
            return
        if failure is not None:
            await self._handler_failed(message_id, failure)
            return
        if self._lease_lost(message_id):
            return
        if self.client.advertises("replyInAck"):
            await self._complete_with_reply(message, reply_body(result))
            return
        reply = {
            "id": str(uuid.uuid4()),
            "to": message.get("from"),
            "body": reply_body(result),
            "replyTo": message_id,
            "parentId": message_id,
            "rootId": message.get("rootId") or message_id,
        }
        await self._send_reply(message, self.receipts.put(message_id, reply))

    async def _handler_failed(self, message_id: str, failure: Failure) -> None:
        # The exception's own words (the handler author's), never the body.
        self.log.warn(
            "agent {agent}: handler failed for {id}: {kind}: {reason}; asking for a retry",
            agent=self.client.agent,
            id=message_id,
            kind=failure.type.__name__,
            reason=" ".join(_error_text(failure).split()),
        )
        for line in getattr(failure.value, "error_output", ()):
            # The command's own words, marked as such: the relay never logs a body.
            self.log.warn(
                "agent {agent}: {id}: the command's error output: {line}",
                agent=self.client.agent,
                id=message_id,
                line=line,
            )
        if self.debug:
            self.log.failure(
                "agent {agent}: handler traceback for {id}",
                failure,
                agent=self.client.agent,
                id=message_id,
            )
        await self._retry(message_id, _error_text(failure), self.retry_delay)

    async def _complete_with_reply(self, message: Message, body: Dict[str, Any]) -> None:
        """The reply and the completion in one ack (EXTENSIONS.md §6): no receipt needed."""
        message_id = str(message.get("id"))
        reply = {"id": str(uuid.uuid4()), "body": body}
        try:
            answer = await self._ack(message_id, "completed", reply=reply)
        except RelayError as failure:
            if failure.status == 409 and failure.code in ("not_leased", "lease_mismatch"):
                self._ack_refused("completed", message_id, failure)
                return
            await self._reply_refused(message_id, reply["id"], failure)
            return
        await self._receipt(message, None)
        self._acked(message_id, "completed", answer)

    async def _send_reply(self, message: Message, receipt: Dict[str, Any]) -> None:
        """Send the reply of ``receipt``, then complete the request (v1.1)."""
        message_id = str(message.get("id"))
        reply = receipt["reply"]
        try:
            await self.client.send(
                str(reply["to"]),
                reply["body"],
                message_id=reply["id"],
                kind="reply",
                reply_to=reply["replyTo"],
                parent_id=reply["parentId"],
                root_id=reply["rootId"],
            )
        except RelayError as failure:
            await self._reply_refused(message_id, reply["id"], failure)
            return
        await self._receipt(message, receipt)
        await self._finish(message_id, "completed")

    async def _reply_refused(self, message_id: str, reply_id: str, failure: RelayError) -> None:
        self.log.warn(
            "agent {agent}: reply {reply} to {id} not accepted ({code}: {message})",
            agent=self.client.agent,
            reply=reply_id,
            id=message_id,
            code=failure.code,
            message=failure.message,
        )
        # As for a failed handler: not at once, so that a requester that is
        # not registered yet does not see its request fail at once.
        await self._retry(message_id, f"reply not accepted: {failure.code}", self.retry_delay)

    async def _hand_back(self, message_id: str, outcome: HandlerOutcome) -> None:
        """End a request the way the handler's :class:`HandlerOutcome` asks."""
        reason = outcome.reason[:MAX_ERROR_TEXT]
        # The handler author's words, like an exception's message; never the body.
        self.log.info(
            "agent {agent}: handler asked to {outcome} {id}: {reason}",
            agent=self.client.agent,
            outcome=type(outcome).__name__.lower(),
            id=message_id,
            reason=" ".join(reason.split()),
        )
        outcomes = ack_outcomes(self.client.info)
        if isinstance(outcome, Reject):
            if "reject" in outcomes:
                await self._finish(message_id, "reject", reason)
            else:
                self.log.warn(
                    "agent {agent}: the broker lacks reject; {id} is retried instead "
                    "(it fails once its attempts are used up)",
                    agent=self.client.agent,
                    id=message_id,
                )
                await self._finish(message_id, "retry", reason)
        elif isinstance(outcome, Release):
            if "release" in outcomes:
                await self._finish(
                    message_id, "release", retry_after=self._retry_after(outcome.after)
                )
            else:
                self.log.warn(
                    "agent {agent}: the broker lacks release; the lease of {id} is left "
                    "to lapse",
                    agent=self.client.agent,
                    id=message_id,
                )
        else:
            after = self.retry_delay if outcome.after is None else outcome.after
            await self._retry(message_id, reason, after)

    def _retry_after(self, after: Optional[float]) -> Optional[float]:
        return after if after and self.client.advertises("retryAfter") else None

    async def _retry(self, message_id: str, error_text: str, after: float) -> None:
        """``retry``, not before ``after`` seconds: with ``retryAfterSeconds`` where
        the broker has it, else by holding the lease that long first."""
        if after > 0 and self.client.advertises("retryAfter"):
            await self._finish(message_id, "retry", error_text, retry_after=after)
            return
        if after > 0 and not self._stopping:
            await self._hold(after)
        await self._finish(message_id, "retry", error_text)

    async def _hold(self, seconds: float) -> None:
        """Wait ``seconds``, or until the runtime stops."""
        d = deferLater(self._clock, seconds)
        self._holds.add(d)
        try:
            await d
        except defer.CancelledError:
            pass
        finally:
            self._holds.discard(d)

    # -- leases --

    def _keep_leased(self, message: Message) -> None:
        """Renew the lease of ``message`` every third of its length while it is handled."""
        if not self.client.advertises("leaseRenew"):
            return
        message_id = str(message.get("id"))
        length, asked = self._lease_length(message)
        renewal = LoopingCall(self._renew, message_id, asked)
        renewal.clock = self._clock
        self._renewals[message_id] = renewal
        interval = max(MIN_RENEW_INTERVAL_SECONDS, length * RENEW_FRACTION)
        renewal.start(interval, now=False).addErrback(
            lambda failure: self.log.failure(
                "agent {agent}: renewing {id} failed", failure, agent=self.client.agent,
                id=message_id,
            )
        )

    def _lease_length(self, message: Message) -> Tuple[float, Optional[int]]:
        """How long a lease of ``message`` lasts, and the ``leaseSeconds`` to renew with.

        The runtime's ``lease_seconds`` when set; otherwise the broker's own
        lease (renewed with the broker's default), measured from the envelope's
        ``leaseUntil`` against this clock.
        """
        if self.lease_seconds is not None:
            return float(self.lease_seconds), self.lease_seconds
        until = message.get("leaseUntil")
        if isinstance(until, (int, float)) and not isinstance(until, bool):
            left = until / 1000.0 - self._clock.seconds()
            if left > 0:
                return left, None
        return float(FALLBACK_LEASE_SECONDS), FALLBACK_LEASE_SECONDS

    def _stop_renewing(self, message_id: str) -> None:
        renewal = self._renewals.pop(message_id, None)
        if renewal is not None and renewal.running:
            renewal.stop()

    async def _renew(self, message_id: str, lease_seconds: Optional[int]) -> None:
        lease_id = self._leases.get(message_id)
        if not lease_id or self._lost.get(message_id) == lease_id:
            return
        try:
            await self.client.renew(message_id, lease_id, lease_seconds)
        except RelayError as failure:
            if failure.status in LEASE_GONE:
                self._lost[message_id] = lease_id
                self.log.warn(
                    "agent {agent}: the lease of {id} is gone ({code}); the handler's "
                    "result will not be acknowledged",
                    agent=self.client.agent,
                    id=message_id,
                    code=failure.code,
                )
            else:
                self.log.warn(
                    "agent {agent}: renewing the lease of {id} failed ({code}); "
                    "trying again later",
                    agent=self.client.agent,
                    id=message_id,
                    code=failure.code,
                )

    def _lease_lost(self, message_id: str) -> bool:
        lost = self._lost.get(message_id)
        if lost is None or lost != self._leases.get(message_id):
            return False
        self.log.warn(
            "agent {agent}: {id} not acknowledged: its lease is gone",
            agent=self.client.agent,
            id=message_id,
        )
        return True

    # -- acknowledgements --

    async def _receipt(self, message: Message, receipt: Optional[Dict[str, Any]]) -> None:
        """The v1.0 receipt for an ``ack: true`` message, sent at most once per receipt."""
        if not message.get("ack") or (receipt is not None and receipt.get("receiptSent")):
            return
        message_id = str(message.get("id"))
        try:
            await self.client.ack(message_id, "ok")
        except RelayError as failure:
            self.log.warn(
                "agent {agent}: receipt for {id} not sent ({code})",
                agent=self.client.agent,
                id=message_id,
                code=failure.code,
            )
            return
        if receipt is not None:
            self.receipts.mark(message_id, receiptSent=True)

    async def _ack(
        self,
        message_id: str,
        outcome: str,
        error_text: Optional[str] = None,
        **extensions: Any,
    ) -> Dict[str, Any]:
        lease_id = self._leases.get(message_id) or ""
        answer = await self.client.ack_outcome(
            message_id, lease_id, outcome, error_text, **extensions
        )
        return answer if isinstance(answer, dict) else {}

    async def _finish(
        self,
        message_id: str,
        outcome: str,
        error_text: Optional[str] = None,
        *,
        retry_after: Optional[float] = None,
    ) -> None:
        if self._lease_lost(message_id):
            return
        extensions = {} if retry_after is None else {"retry_after": retry_after}
        try:
            answer = await self._ack(message_id, outcome, error_text, **extensions)
        except RelayError as failure:
            self._ack_refused(outcome, message_id, failure)
            return
        self._acked(message_id, outcome, answer)

    def _ack_refused(self, outcome: str, message_id: str, failure: RelayError) -> None:
        self.log.warn(
            "agent {agent}: ack {outcome} of {id} refused ({code})",
            agent=self.client.agent,
            outcome=outcome,
            id=message_id,
            code=failure.code,
        )

    def _acked(self, message_id: str, outcome: str, answer: Dict[str, Any]) -> None:
        self.log.info(
            "agent {agent}: {id} acked {outcome} -> {status}",
            agent=self.client.agent,
            id=message_id,
            outcome=outcome,
            status=answer.get("status"),
        )
