"""The agent runtime: one agent that leases requests, runs a handler, replies and acks.

:class:`AgentService` handshakes once, heartbeats well within the broker's 90 s
TTL, leases messages with ``POST /v1/pull`` (long-polling when the broker
advertises it) and, for each request, calls a handler. A completed reply is
persisted in a per-agent :class:`relay.receipts.ReceiptStore` before it is
sent, so a request that is delivered again (lost ack, restart) gets the same
reply re-sent and is never handled twice (spec §5.1, "Receipts").

Only ids and events are logged, never message bodies.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any, Callable, Dict, Optional, Sequence, Set

from twisted.application.service import Service
from twisted.internet import defer, error, protocol
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from relay.client import RelayClient
from relay.errors import RelayError
from relay.polling import poll
from relay.receipts import ReceiptStore

HEARTBEAT_INTERVAL_SECONDS = 30.0  # the broker's TTL is 90 s
POLL_INTERVAL_SECONDS = 2.0
SHUTDOWN_GRACE_SECONDS = 30.0
RETRY_DELAY_SECONDS = 5.0
# Handshake failures that waiting will not fix: the runtime stops on these.
FATAL_HANDSHAKE_CODES = frozenset({"protocol_mismatch", "tls_error"})
EXEC_TIMEOUT_SECONDS = 300.0
MAX_ERROR_TEXT = 500

Message = Dict[str, Any]
Handler = Callable[[Message], Any]


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


class AgentService(Service):
    """Runs one agent against a broker until stopped.

    :param client: the agent's :class:`RelayClient`.
    :param handler: called with each request envelope; returns the reply (a
        dict body, a string for ``{"text": ...}``, or ``None``), a Deferred or a
        coroutine. Raising (or failing) re-queues the request with ``retry``.
    :param receipts: where completed replies are remembered.
    :param concurrency: how many requests may be handled at once.
    :param retry_delay: seconds a failed request stays leased before it is
        handed back with ``retry``, so a failing handler does not burn all the
        broker's attempts at once.
    :param on_receipt: called with each ``type: "ack"`` envelope (v1.0 receipts).
    :param on_reply: called with each ``kind: "reply"`` envelope (answers to
        this agent's own requests). Neither is run as a request.
    :param on_fatal: called with a RelayError the runtime cannot recover from
        (a protocol mismatch, or a TLS failure such as an untrusted broker
        certificate at the first handshake); the runtime stops working first.
    :param debug: log the traceback of each handler failure, not only its
        exception type and message.
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
        on_receipt: Optional[Callable[[Message], Any]] = None,
        on_reply: Optional[Callable[[Message], Any]] = None,
        on_fatal: Optional[Callable[[RelayError], Any]] = None,
        debug: bool = False,
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
        self.on_receipt = on_receipt
        self.on_reply = on_reply
        self.on_fatal = on_fatal
        self.debug = debug
        self._clock = clock
        self._stopping = False
        self._waiting: Optional[defer.Deferred] = None
        self._slot: Optional[defer.Deferred] = None
        self._inflight: Set[defer.Deferred] = set()
        self._leases: Dict[str, str] = {}
        self._heartbeat: Optional[LoopingCall] = None
        self._main: Optional[defer.Deferred] = None

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

        Requests whose handlers do not finish in time keep their lease, which
        lapses at the broker and makes them deliverable again.
        """
        super().stopService()
        self._stopping = True
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        if self._waiting is not None:
            self._waiting.cancel()
        pending = list(self._inflight)
        if not pending:
            return defer.succeed(None)
        done: defer.Deferred = defer.Deferred()

        def finish(_: Any = None) -> None:
            if not done.called:
                done.callback(None)

        # The handlers are not cancelled when the grace period ends: the
        # process just stops waiting for them.
        timer = self._clock.callLater(self.shutdown_grace, finish)
        defer.DeferredList(pending, consumeErrors=True).addBoth(finish)
        done.addBoth(lambda result: timer.cancel() if timer.active() else None)
        return done

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
        self.log.info(
            "agent {agent} running (long-poll: {wait})",
            agent=self.client.agent,
            wait=self.client.long_poll_seconds,
        )

    def _beat(self) -> defer.Deferred:
        d = self.client.register()
        d.addErrback(
            lambda failure: self.log.warn(
                "agent {agent}: heartbeat failed ({code})",
                agent=self.client.agent,
                code=getattr(failure.value, "code", failure.type.__name__),
            )
        )
        return d

    async def _lease_loop(self) -> None:
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
            # handling it: the newer lease is the one to acknowledge.
            if lease_id:
                self._leases[message_id] = str(lease_id)
            return
        self._leases[message_id] = str(lease_id or "")
        d = defer.Deferred.fromCoroutine(self._process(message))
        self._inflight.add(d)

        def finished(result: Any) -> None:
            self._inflight.discard(d)
            self._leases.pop(message_id, None)
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
        if receipt is None:
            try:
                result = await defer.maybeDeferred(self.handler, message)
            except Exception:
                failure = Failure()
                # The exception's own words (the handler author's), never the body.
                self.log.warn(
                    "agent {agent}: handler failed for {id}: {kind}: {reason}; "
                    "asking for a retry",
                    agent=self.client.agent,
                    id=message_id,
                    kind=failure.type.__name__,
                    reason=" ".join(_error_text(failure).split()),
                )
                if self.debug:
                    self.log.failure(
                        "agent {agent}: handler traceback for {id}",
                        failure,
                        agent=self.client.agent,
                        id=message_id,
                    )
                if not self._stopping and self.retry_delay > 0:
                    await deferLater(self._clock, self.retry_delay)
                await self._finish(message_id, "retry", _error_text(failure))
                return
            reply = {
                "id": str(uuid.uuid4()),
                "to": message.get("from"),
                "body": reply_body(result),
                "replyTo": message_id,
                "parentId": message_id,
                "rootId": message.get("rootId") or message_id,
            }
            receipt = self.receipts.put(message_id, reply)
        else:
            self.log.info(
                "agent {agent}: {id} already answered by {reply}; replaying the reply",
                agent=self.client.agent,
                id=message_id,
                reply=receipt["reply"].get("id"),
            )
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
            self.log.warn(
                "agent {agent}: reply {reply} to {id} not accepted ({code}: {message})",
                agent=self.client.agent,
                reply=reply["id"],
                id=message_id,
                code=failure.code,
                message=failure.message,
            )
            # As for a failed handler: hold the lease a while, so that a requester
            # that is not registered yet does not see its request fail at once.
            if not self._stopping and self.retry_delay > 0:
                await deferLater(self._clock, self.retry_delay)
            await self._finish(message_id, "retry", f"reply not accepted: {failure.code}")
            return
        await self._receipt(message, receipt)
        await self._finish(message_id, "completed")

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

    async def _finish(
        self, message_id: str, outcome: str, error_text: Optional[str] = None
    ) -> None:
        lease_id = self._leases.get(message_id) or ""
        try:
            answer = await self.client.ack_outcome(message_id, lease_id, outcome, error_text)
        except RelayError as failure:
            self.log.warn(
                "agent {agent}: ack {outcome} of {id} refused ({code})",
                agent=self.client.agent,
                outcome=outcome,
                id=message_id,
                code=failure.code,
            )
            return
        self.log.info(
            "agent {agent}: {id} acked {outcome} -> {status}",
            agent=self.client.agent,
            id=message_id,
            outcome=outcome,
            status=answer.get("status") if isinstance(answer, dict) else None,
        )


# -- the --exec handler ----------------------------------------------------------------


class ExecFailed(Exception):
    """The command exited non-zero, was killed, or ran out of time."""


class _Collect(protocol.ProcessProtocol):
    def __init__(self, stdin: bytes, done: defer.Deferred) -> None:
        self.stdin = stdin
        self.done = done
        self.stdout = bytearray()

    def connectionMade(self) -> None:
        self.transport.write(self.stdin)
        self.transport.closeStdin()

    def outReceived(self, data: bytes) -> None:
        self.stdout.extend(data)

    def errReceived(self, data: bytes) -> None:
        """Standard error is discarded: it may echo message content."""

    def processEnded(self, reason: Failure) -> None:
        if self.done.called:
            return
        if reason.check(error.ProcessDone):
            self.done.callback(bytes(self.stdout))
        elif reason.check(error.ProcessTerminated):
            value = reason.value
            if value.exitCode is not None:
                self.done.errback(ExecFailed(f"command exited with status {value.exitCode}"))
            else:
                self.done.errback(ExecFailed(f"command killed by signal {value.signal}"))
        else:
            self.done.errback(reason)


def exec_input(message: Message) -> bytes:
    """What an ``--exec`` command reads: the body's ``text``, else the JSON body."""
    body = message.get("body")
    if isinstance(body, dict) and isinstance(body.get("text"), str):
        return body["text"].encode("utf-8")
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


class ExecHandler:
    """A handler that runs a shell command per request.

    The command reads the request (see :func:`exec_input`) on stdin and writes
    the reply text on stdout (one trailing newline is dropped). A non-zero
    exit or exceeding ``timeout`` fails the request (``retry``). The
    environment adds ``RELAY_MESSAGE_ID``, ``RELAY_FROM``, ``RELAY_KIND`` and
    ``RELAY_ROOT_ID``.
    """

    def __init__(
        self,
        command: str,
        *,
        reactor: Any,
        timeout: float = EXEC_TIMEOUT_SECONDS,
        env: Optional[Dict[str, str]] = None,
    ) -> None:
        self.command = command
        self.timeout = timeout
        self._reactor = reactor
        self._env = dict(os.environ if env is None else env)

    def __call__(self, message: Message) -> defer.Deferred:
        done: defer.Deferred = defer.Deferred()
        env = dict(self._env)
        env.update(
            {
                "RELAY_MESSAGE_ID": str(message.get("id", "")),
                "RELAY_FROM": str(message.get("from", "")),
                "RELAY_KIND": str(message.get("kind") or "message"),
                "RELAY_ROOT_ID": str(message.get("rootId") or message.get("id", "")),
            }
        )
        collector = _Collect(exec_input(message), done)
        process = self._reactor.spawnProcess(
            collector, "/bin/sh", ["/bin/sh", "-c", self.command], env=env
        )

        def expire() -> None:
            if done.called:
                return
            with contextlib.suppress(error.ProcessExitedAlready):
                process.signalProcess("KILL")
            done.errback(ExecFailed(f"command timed out after {self.timeout:g}s"))

        timer = self._reactor.callLater(self.timeout, expire)

        def stop_timer(result: Any) -> Any:
            if timer.active():
                timer.cancel()
            return result

        done.addBoth(stop_timer)
        done.addCallback(_reply_text)
        return done


def _reply_text(stdout: bytes) -> str:
    text = stdout.decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\n") else text
