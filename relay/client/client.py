"""A Twisted (treq) client for the dsh-agent-relay wire protocol v1.0 / v1.1, and
the delivery extensions v1.2 (EXTENSIONS.md) wherever the broker advertises them.

Every method returns a Deferred that fires with the broker's JSON answer (a dict)
or fails with :class:`relay.wire.errors.RelayError`. Transient failures (5xx, 408,
429, connection failures, timeouts) are retried per spec §5 with a 2/4/8 s
backoff measured on the injected ``clock``; a retried send keeps its message id,
so the broker's ``duplicate: true`` answer is an ordinary success.

The first signed request makes the ``GET /`` handshake when none has been made,
and its answer is kept: it says which extensions the broker has. A v1.2 feature
the broker does not advertise is never sent; the method that needs it fails with
code ``unsupported`` naming the capability, except :meth:`RelayClient.request`,
which falls back to what a v1.1 broker offers. A broker that advertises
``signedNonce`` gets a fresh ``X-Relay-Nonce`` on every request (§9).

https always verifies the broker's certificate, against the system trust store
or a given CA file, and presents a client certificate when one is configured
(:mod:`relay.client.trust`). A TLS failure (an untrusted or misnamed certificate,
a refused or missing client certificate) is never retried: it fails at once with
code ``tls_error``.

Message bodies are never logged: only methods, paths, statuses and attempts.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)
from urllib.parse import quote, urlsplit

import treq
from twisted.internet import defer
from twisted.internet.error import (
    ConnectError,
    ConnectionClosed,
    ConnectionRefusedError,
    DNSLookupError,
    TCPTimedOutError,
)
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.client import (
    PotentialDataLoss,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)

from relay.client.sse import RelayEvent, SSEParser, StreamError, reconnect_delay
from relay.client.trust import describe_tls_failure, make_http_client, tls_failure
from relay.wire.errors import RelayError
from relay.wire.protocol import (
    GROUP_PREFIX,
    KEEP_CARD,
    MAX_PRIORITY,
    PROTOCOL_VERSION,
    ROLE_PREFIX,
    is_loopback_host,
    notice_id,
)
from relay.wire.signing import auth_headers, new_nonce

RETRY_DELAYS_SECONDS: Tuple[float, ...] = (2.0, 4.0, 8.0)
DEFAULT_TIMEOUT_SECONDS = 15.0
# REACH §15: a question to a person offers 1..10 options
MAX_OPTIONS = 10
RETRYABLE_STATUSES = frozenset({408, 429})
# How much longer than the requested wait a long-poll request may take.
LONG_POLL_GRACE_SECONDS = 10.0
# The wait of a broker that advertises long polling without a maximum.
DEFAULT_LONG_POLL_SECONDS = 20.0
# request(): how long to wait for the answer unless told, how often to look for it
# when the broker cannot long-poll, and how long the answer's own lease lasts (short:
# an answer leased by a pull that was cut off comes back soon).
DEFAULT_REQUEST_TIMEOUT_SECONDS = 60.0
REPLY_POLL_SECONDS = 2.0
# Without failure notices, how many looks for the answer go by between two looks at
# the request's /v1/status (a failed request is then seen within 5 polls).
STATUS_EVERY_LOOKS = 5
REPLY_LEASE_SECONDS = 60
# How long past its timeout request() may take for a last answer to come back.
REQUEST_GRACE_SECONDS = 2.0
# The dashboard's page says it loads this script: what a client told the ops
# listener's address finds instead of the broker's JSON.
OPS_PAGE_MARK = b"/static/dashboard.js"
# The v1.1 fallback of request() reads this many of the newest replies per look.
FALLBACK_QUERY_LIMIT = 200
# The outcomes of a broker that lists none (v1.1).
V11_OUTCOMES = frozenset({"completed", "retry"})


class _TimedOut(Exception):
    """No complete answer arrived within the request timeout."""


class RequestTimeout(RelayError):
    """No answer to a request arrived in time (code ``request_timeout``).

    The request stays where it is: a late answer can still be awaited with
    :meth:`RelayClient.await_reply` and :attr:`request_id`.
    """

    def __init__(self, request_id: str, to: Optional[str], timeout: float) -> None:
        who = f" from {to}" if to else ""
        super().__init__(
            0, "request_timeout", f"no answer{who} to request {request_id} within {timeout:g} s"
        )
        self.request_id = request_id
        self.to = to
        self.timeout = timeout


class RequestFailed(RelayError):
    """A request failed or expired without an answer (code ``request_failed``).

    :attr:`event` is ``"failed"`` or ``"expired"`` and :attr:`error` the reason,
    from the broker's failure notice (EXTENSIONS.md §4, kept in :attr:`notice`)
    or, without one, from ``/v1/status``.
    """

    def __init__(
        self,
        request_id: str,
        to: Optional[str],
        event: str,
        error: str,
        notice: Optional[Dict[str, Any]] = None,
    ) -> None:
        who = f" to {to}" if to else ""
        super().__init__(0, "request_failed", f"request {request_id}{who} {event}: {error}")
        self.request_id = request_id
        self.to = to
        self.event = event
        self.error = error
        self.notice = notice


def unsupported(capability: str, what: str, spec: str = "EXTENSIONS.md v1.2") -> RelayError:
    """The error for a feature the broker does not advertise (code ``unsupported``)."""
    return RelayError(
        0,
        "unsupported",
        f"the broker lacks {capability} ({what}, {spec}); "
        "`relay handshake` lists what it offers",
    )


_TRANSIENT_FAILURES = (
    ConnectError,  # includes ConnectionRefusedError and TCPTimedOutError
    DNSLookupError,
    ConnectionClosed,
    ResponseFailed,  # includes ResponseNeverReceived
    RequestTransmissionFailed,
    _TimedOut,
)


def _is_cancellation(failure: BaseException) -> bool:
    """Whether ``failure`` is (or wraps) a cancellation by the caller."""
    if isinstance(failure, defer.CancelledError):
        return True
    reasons = getattr(failure, "reasons", None) or []
    return any(reason.check(defer.CancelledError) for reason in reasons)


def _is_retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUSES


def _encode_json(document: Any) -> bytes:
    """Compact UTF-8 JSON: the raw body that is both signed and sent."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _query(params: Sequence[Tuple[str, Any]]) -> str:
    """A query string in one canonical, fully percent-encoded form.

    The form is stable under URL normalisation, so the signed path is byte for
    byte the path on the wire.
    """
    parts = [f"{quote(key, safe='')}={quote(str(value), safe='')}" for key, value in params]
    return "?" + "&".join(parts) if parts else ""


def _error_from_answer(status: int, raw: bytes) -> RelayError:
    """The RelayError for a non-2xx answer, from the uniform body of spec §6."""
    try:
        document = json.loads(raw.decode("utf-8"))
        error = document["error"]
        return RelayError(status, str(error["code"]), str(error.get("message", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return RelayError(status, "http_error", f"HTTP {status} without a relay error body")


def long_poll_limit(info: Optional[Dict[str, Any]]) -> Optional[float]:
    """The longest wait the broker advertised in GET / (``capabilities.longPoll``).

    ``None`` when the broker does not advertise long polling; ``0`` is never
    returned. A bare ``true`` advertises long polling without a stated maximum,
    which is read as :data:`DEFAULT_LONG_POLL_SECONDS`.
    """
    if not isinstance(info, dict):
        return None
    capabilities = info.get("capabilities")
    if not isinstance(capabilities, dict):
        return None
    advertised = capabilities.get("longPoll")
    if advertised is True:
        return DEFAULT_LONG_POLL_SECONDS
    if isinstance(advertised, dict):
        maximum = advertised.get("maxWaitSeconds")
        if isinstance(maximum, (int, float)) and not isinstance(maximum, bool) and maximum > 0:
            return float(maximum)
        return DEFAULT_LONG_POLL_SECONDS
    return None


def capabilities_of(info: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``capabilities`` object of a ``GET /`` document (empty when absent)."""
    capabilities = info.get("capabilities") if isinstance(info, dict) else None
    return capabilities if isinstance(capabilities, dict) else {}


def advertises(info: Optional[Dict[str, Any]], capability: str) -> bool:
    """Whether ``GET /`` advertised ``capability`` (``true``, an object or a list)."""
    value = capabilities_of(info).get(capability)
    return value is True or (isinstance(value, (dict, list)) and value is not False)


def ack_outcomes(info: Optional[Dict[str, Any]]) -> FrozenSet[str]:
    """The ``/v1/ack`` outcomes the broker takes: ``capabilities.ackOutcomes`` or v1.1's."""
    listed = capabilities_of(info).get("ackOutcomes")
    if isinstance(listed, list):
        return frozenset(str(outcome) for outcome in listed) | V11_OUTCOMES
    return V11_OUTCOMES


def failure_notices(info: Optional[Dict[str, Any]]) -> bool:
    """Whether the broker stores a failure notice for each failed request (§4)."""
    dead_letters = capabilities_of(info).get("deadLetters")
    return isinstance(dead_letters, dict) and dead_letters.get("failureNotices") is True


def notice_of(message: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``relayNotice`` object of a message's body, or None. Any agent can write
    one: :func:`broker_notice` tells the broker's own failure notices."""
    body = message.get("body")
    notice = body.get("relayNotice") if isinstance(body, dict) else None
    return notice if isinstance(notice, dict) else None


def broker_notice(
    message: Mapping[str, Any], request_id: Optional[str] = None
) -> Optional[Dict[str, Any]]:
    """The ``relayNotice`` of a failure notice the broker stored (EXTENSIONS.md §4)
    for ``request_id`` (by default the request the message answers), or None.

    A notice is the broker's when its id is the one derived from the request's, in
    the id space no agent may send in; a ``relayNotice`` body under any other id
    is what some agent wrote, not the broker.
    """
    parent = request_id or message.get("parentId") or message.get("replyTo")
    if not isinstance(parent, str) or message.get("id") != notice_id(parent):
        return None
    return notice_of(message)


def answers_request(message: Mapping[str, Any], request_id: str, to: Optional[str]) -> bool:
    """Whether ``message`` is the answer to ``request_id``, sent to ``to``, or its
    failure notice: a reply from ``to`` itself, or the broker's notice. Anything
    else that names the request as its parent was written by someone else."""
    if broker_notice(message, request_id) is not None:
        return True
    return (to is not None and message.get("from") == to
            and request_id in (message.get("parentId"), message.get("replyTo")))


def question_body(question: str, options: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The body of a question to a person (REACH §15): ``{"question", "options"}``,
    ``options`` left out when None. ValueError unless ``question`` is a non-empty
    string and ``options`` 1 to :data:`MAX_OPTIONS` non-empty strings."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question must be a non-empty string")
    body: Dict[str, Any] = {"question": question}
    if options is not None:
        options = list(options)
        if not 1 <= len(options) <= MAX_OPTIONS:
            raise ValueError(f"give 1 to {MAX_OPTIONS} options, not {len(options)}")
        if not all(isinstance(option, str) and option.strip() for option in options):
            raise ValueError("every option must be a non-empty string")
        if len(set(options)) != len(options):
            raise ValueError("the options must differ from one another")
        body["options"] = options
    return body


def answer_of(reply: Mapping[str, Any]) -> Optional[str]:
    """The answer a person gave in ``reply`` (the envelope :meth:`RelayClient.ask`
    fires with): its body's ``answer`` when that is a string, else None."""
    body = reply.get("body")
    answer = body.get("answer") if isinstance(body, Mapping) else None
    return answer if isinstance(answer, str) else None


def _answer_or_failure(
    message: Dict[str, Any], request_id: str, to: Optional[str]
) -> Dict[str, Any]:
    """``message``, the answer to a request, unless it is its failure notice."""
    notice = broker_notice(message, request_id)
    if notice is None:
        return message
    event = str(notice.get("event") or "failed")
    raise RequestFailed(request_id, to or message.get("from"), event,
                        str(notice.get("error") or event), notice)


def _whole_seconds(seconds: float) -> int:
    """A wait in whole seconds, rounded up (a retry-after is never shortened)."""
    return max(0, int(math.ceil(seconds)))


class RelayClient:
    """One agent's authenticated connection to a relay broker.

    :param broker_url: ``http://`` or ``https://`` base URL of the broker.
    :param agent: this agent's name, sent as ``X-Relay-Agent``.
    :param secret: the HMAC secret shared with the broker.
    :param clock: the time source for timestamps, retry delays and timeouts.
    :param http: a treq-like client (``request(method, url, headers=, data=)``);
        by default a treq HTTPClient on ``reactor``. Tests pass
        :class:`relay.broker.loopback.MemoryHTTP`.
    :param reactor: the reactor for the default HTTP client (defaults to ``clock``).
    :param ca_file: a PEM CA bundle to trust for https instead of the system store.
    :param client_cert: a PEM client certificate presented when the broker asks
        for one (https); it may hold the key too.
    :param client_key: the PEM private key of ``client_cert``.
    :param cursor: the initial ``GET /messages`` cursor (a message id).
    :param retry_delays: backoff delays in seconds; one retry per entry.
    :param timeout: seconds before an unanswered request counts as failed.
    :param retry_refused_loopback: retry a connection refused by a loopback
        broker like any connection failure (the default). ``False`` fails at
        once: on this machine a refusal means no broker is listening, which
        a person at a prompt wants to hear now, not after 14 s.
    :param on_retry: called before each retry as ``on_retry(error, delay,
        retry, retries)``: the failure, the seconds until the next attempt,
        which retry this is (from 1) and how many there may be.
    :param info: the broker's ``GET /`` document when it is known already (for
        example from another client's handshake); the first signed request then
        makes no handshake of its own.
    :param registered_at: when this agent last registered, on ``clock``, if that
        is known (for example from an earlier run of the same command);
        :meth:`request` then makes no registration of its own.

    Every method may be called from the reactor thread only; each returns a
    Deferred (``await`` it in a coroutine, or hand it to
    ``twisted.internet.threads.blockingCallFromThread`` from another thread).
    Cancelling a Deferred stops the call, its retries and its waits.
    """

    log = Logger()

    def __init__(
        self,
        broker_url: str,
        agent: str,
        secret: str,
        *,
        clock: IReactorTime,
        http: Any = None,
        reactor: Any = None,
        ca_file: Optional[str] = None,
        client_cert: Optional[str] = None,
        client_key: Optional[str] = None,
        cursor: Optional[str] = None,
        retry_delays: Iterable[float] = RETRY_DELAYS_SECONDS,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retry_refused_loopback: bool = True,
        on_retry: Optional[Callable[[RelayError, float, int, int], None]] = None,
        info: Optional[Dict[str, Any]] = None,
        registered_at: Optional[float] = None,
    ) -> None:
        parts = urlsplit(broker_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RelayError(0, "bad_broker_url", f"not an http(s) URL: {broker_url!r}")
        if http is None and ":" in (parts.hostname or ""):
            # treq parses every URL with hyperlink, whose to_uri() IDNA-encodes an IPv6
            # literal and fails (python-hyper/hyperlink#188); no public treq API takes
            # the request target as bytes. Said here rather than at the first request.
            raise RelayError(0, "bad_broker_url",
                             f"{broker_url!r}: an IPv6 literal host cannot be reached "
                             "through treq; use a host name that resolves to it "
                             "(localhost, or one in /etc/hosts)")
        self.broker_url = broker_url.rstrip("/")
        self.agent = agent
        self._secret = secret
        self._clock = clock
        self.ca_file = ca_file
        self.client_cert = client_cert
        if http is None:
            http = make_http_client(
                reactor if reactor is not None else clock, ca_file, client_cert, client_key
            )
        self._http = http
        self.cursor = cursor
        self.retry_delays = tuple(retry_delays)
        self.timeout = timeout
        self.retry_refused_loopback = retry_refused_loopback
        self.on_retry = on_retry
        self._loopback = is_loopback_host(parts.hostname or "")
        self.info: Optional[Dict[str, Any]] = info
        self._handshaking = defer.DeferredLock()
        # When this agent last registered (on ``clock``); None until it did.
        self.registered_at = registered_at

    # -- what the broker offers -------------------------------------------

    @property
    def long_poll_seconds(self) -> Optional[float]:
        """The broker's advertised long-poll maximum, once :meth:`handshake` ran."""
        return long_poll_limit(self.info)

    @property
    def capabilities(self) -> Dict[str, Any]:
        """The ``capabilities`` of the last handshake (empty before one)."""
        return capabilities_of(self.info)

    @property
    def clock(self) -> IReactorTime:
        """What this client waits and times out on."""
        return self._clock

    def advertises(self, capability: str) -> bool:
        """Whether the last handshake advertised ``capability`` (e.g. ``"leaseRenew"``)."""
        return advertises(self.info, capability)

    @property
    def signs_nonce(self) -> bool:
        """Whether requests carry ``X-Relay-Nonce``: the broker advertises ``signedNonce``."""
        return self.advertises("signedNonce")

    async def _known(self) -> None:
        """Make the handshake, unless its answer is known already."""
        if self.info is None:
            await self._handshaking.run(self._handshake_unless_known)

    def _handshake_unless_known(self) -> defer.Deferred:
        if self.info is not None:
            return defer.succeed(self.info)
        return self.handshake()

    async def _require(
        self, capability: str, what: str, spec: str = "EXTENSIONS.md v1.2"
    ) -> None:
        await self._known()
        if not self.advertises(capability):
            raise unsupported(capability, what, spec)

    # -- transport --------------------------------------------------------

    def _wait_for(self, wait: Optional[float]) -> Optional[int]:
        """The wait to send: only when asked for and advertised, capped by the broker."""
        maximum = self.long_poll_seconds
        if wait is None or wait <= 0 or maximum is None:
            return None
        return max(1, int(min(wait, maximum)))

    def _run(
        self, coroutine_function: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> defer.Deferred:
        return defer.Deferred.fromCoroutine(coroutine_function(*args, **kwargs))

    async def _attempt(
        self, method: str, path: str, raw_body: bytes, signed: bool, timeout: float
    ) -> Tuple[int, bytes]:
        """One HTTP exchange; raises a transient failure or ``_TimedOut``.

        Each attempt is signed afresh: its own timestamp, and its own nonce when
        the broker advertises ``signedNonce``.
        """
        headers: Dict[str, List[str]] = {"Accept": ["application/json"]}
        if raw_body:
            headers["Content-Type"] = ["application/json; charset=utf-8"]
        if signed:
            stamped = auth_headers(
                self._secret,
                self.agent,
                method,
                path,
                int(self._clock.seconds()),
                raw_body,
                nonce=new_nonce() if self.signs_nonce else None,
            )
            for name, value in stamped.items():
                headers[name] = [value]

        async def exchange() -> Tuple[int, bytes]:
            response = await self._http.request(
                method,
                self.broker_url + path,
                headers=headers,
                data=raw_body if raw_body else None,
                allow_redirects=False,
            )
            return response.code, await treq.content(response)

        timed_out: List[bool] = []
        d = defer.Deferred.fromCoroutine(exchange())

        def expire() -> None:
            timed_out.append(True)
            d.cancel()

        timer = self._clock.callLater(timeout, expire)
        try:
            return await d
        except Exception as failure:
            if timed_out:
                raise _TimedOut() from None
            if _is_cancellation(failure):
                raise defer.CancelledError() from None
            raise
        finally:
            if timer.active():
                timer.cancel()

    async def _nonce_changed(self) -> bool:
        """Handshake again; whether the broker's ``signedNonce`` advertisement changed.

        A broker restarted with another configuration (or replaced by one of
        another version) may now want a nonce, or refuse one.
        """
        before = self.signs_nonce
        try:
            await self.handshake()
        except RelayError:
            return False
        return self.signs_nonce != before

    async def _request(
        self,
        method: str,
        path: str,
        document: Any = None,
        *,
        signed: bool = True,
        timeout: Optional[float] = None,
    ) -> Any:
        raw_body = b"" if document is None else _encode_json(document)
        if signed:
            await self._known()
        delays = list(self.retry_delays)
        attempt = 0
        handshaken_again = False
        while True:
            attempt += 1
            try:
                status, raw = await self._attempt(
                    method, path, raw_body, signed, timeout or self.timeout
                )
            except Exception as failure:
                tls_error = tls_failure(failure)
                if tls_error is not None:
                    # A certificate problem does not go away by itself: no retry.
                    raise RelayError(
                        0,
                        "tls_error",
                        describe_tls_failure(
                            tls_error, self.broker_url, self.ca_file, self.client_cert
                        ),
                    ) from None
                if not isinstance(failure, _TRANSIENT_FAILURES):
                    raise
                error = RelayError(0, "connection_error", _describe(failure, self.broker_url))
                if (
                    isinstance(failure, ConnectionRefusedError)
                    and self._loopback
                    and not self.retry_refused_loopback
                ) or _lasting(failure):
                    raise error from None
            else:
                if 200 <= status < 300:
                    return _decode_answer(status, raw, self.broker_url)
                error = _error_from_answer(status, raw)
                if status == 401 and signed and not handshaken_again:
                    handshaken_again = True
                    if await self._nonce_changed():
                        continue
                if not _is_retryable_status(status):
                    raise error
            if not delays:
                raise error
            delay = delays.pop(0)
            if self.on_retry is not None:
                self.on_retry(error, delay, attempt, len(self.retry_delays))
            self.log.info(
                "relay {method} {path} failed ({code}, attempt {attempt}); retrying in {delay}s",
                method=method,
                path=path,
                code=error.code,
                attempt=attempt,
                delay=delay,
            )
            await deferLater(self._clock, delay)

    # -- v1.0 -------------------------------------------------------------

    def handshake(self) -> defer.Deferred:
        """GET / (no auth): the broker's version document.

        Fails with ``RelayError(0, "protocol_mismatch", ...)`` unless the broker
        speaks protocol 1.0. ``capabilities`` and ``storage`` are optional. The
        answer is kept in :attr:`info`; the first signed request makes this
        handshake itself when none was made.
        """

        async def go() -> Dict[str, Any]:
            info = await self._request("GET", "/", signed=False)
            protocol = info.get("protocol") if isinstance(info, dict) else None
            if protocol != PROTOCOL_VERSION:
                raise RelayError(
                    0,
                    "protocol_mismatch",
                    f"broker speaks protocol {protocol!r}, this client speaks "
                    f"{PROTOCOL_VERSION!r}: upgrade the broker or this client",
                )
            self.info = info
            return info

        return self._run(go)

    def register(self, card: Any = KEEP_CARD) -> defer.Deferred:
        """POST /register: register this agent, or heartbeat it.

        :param card: a peer card to publish (v1.2 §8), a mapping with an optional
            ``description`` (text) and ``skills`` (a list of texts); ``None``
            removes the published card. By default the stored card is kept. A
            card needs ``peerCards``.
        """

        async def go() -> Dict[str, Any]:
            document: Dict[str, Any] = {"agent": self.agent}
            if card is not KEEP_CARD:
                await self._require("peerCards", "peer cards")
                document["card"] = None if card is None else dict(card)
            answer = await self._request("POST", "/register", document)
            self.registered_at = self._clock.seconds()
            return answer

        return self._run(go)

    def peers(
        self,
        *,
        after: Optional[str] = None,
        limit: Optional[int] = None,
        cards: Optional[bool] = None,
    ) -> defer.Deferred:
        """GET /peers: ``{"peers": [{"agent", "online", "lastSeen", "card"?}, ...]}``,
        with ``"next"`` (an agent name, for ``after``) when the broker stopped before
        the last peer. ``limit`` and ``cards=False`` (no cards) are the relay's
        additive parameters; none is sent unless given."""
        params: List[Tuple[str, Any]] = []
        if after is not None:
            params.append(("after", after))
        if limit is not None:
            params.append(("limit", int(limit)))
        if cards is not None:
            params.append(("cards", "true" if cards else "false"))
        return self._run(self._request, "GET", "/peers" + _query(params))

    def all_peers(self, *, cards: Optional[bool] = None) -> defer.Deferred:
        """Every peer, following ``next`` from page to page: ``{"peers": [...]}``, with
        the ``groups`` and ``roles`` of the last page when the broker lists them
        (REACH §13)."""

        async def go() -> Dict[str, Any]:
            listed: List[Dict[str, Any]] = []
            after: Optional[str] = None
            while True:
                answer = await self.peers(after=after, cards=cards)
                page = [p for p in answer.get("peers") or [] if isinstance(p, dict)]
                listed.extend(page)
                following = answer.get("next")
                if not isinstance(following, str) or not page or following == after:
                    teams = {key: answer[key] for key in ("groups", "roles")
                             if isinstance(answer.get(key), list)}
                    return {"peers": listed, **teams}
                after = following

        return self._run(go)

    def send(
        self,
        to: str,
        body: Optional[Dict[str, Any]] = None,
        *,
        message_id: Optional[str] = None,
        type: str = "message",
        kind: Optional[str] = None,
        reply_to: Optional[str] = None,
        root_id: Optional[str] = None,
        parent_id: Optional[str] = None,
        ack: bool = False,
        ttl_seconds: Optional[float] = None,
        delay_seconds: Optional[float] = None,
        priority: Optional[int] = None,
    ) -> defer.Deferred:
        """POST /messages: send one envelope; ``{"accepted", "id", "duplicate"}``.

        The id (``message_id`` or a fresh UUID) is fixed once, so every retry
        re-sends the same message and a duplicate answer is success. ``to`` may
        name a role, ``role:NAME``: one of its members takes the message
        (REACH §13, needs ``roles``).

        ``to`` may be a group, ``"group:NAME"`` (REACH §13, needs ``groups``): the
        broker stores a copy for each member but this agent, all or none, and
        the answer adds ``copies``, ``[{"to", "id"}, ...]``, each an ordinary
        message; a retry answers the same copies. :meth:`status` of the sent id
        lists them with their status.

        :param ttl_seconds: the message expires that long after it is stored
            (v1.2 §7, needs ``messageTtl``); rounded up to whole seconds.
        :param delay_seconds: the message is not delivered before that many
            seconds (needs ``delayedDelivery``); 0 or ``None`` sends no delay.
        :param priority: 0..9: a pull leases higher priorities first (REACH §14,
            needs ``priority``); 0 or ``None`` sends none. ValueError outside 0..9.
        """
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                     or not 0 <= priority <= MAX_PRIORITY):
            raise ValueError(f"priority must be an integer from 0 to {MAX_PRIORITY}")
        envelope: Dict[str, Any] = {
            "id": message_id or str(uuid.uuid4()),
            "from": self.agent,
            "to": to,
            "type": type,
            "body": {} if body is None else body,
            "replyTo": reply_to,
            "ack": ack,
        }
        if kind is not None:
            envelope["kind"] = kind
        if root_id is not None:
            envelope["rootId"] = root_id
        if parent_id is not None:
            envelope["parentId"] = parent_id

        async def go() -> Dict[str, Any]:
            if to.startswith(GROUP_PREFIX):
                await self._require("groups", "sending to a group", "REACH.md v1.3")
            if ttl_seconds is not None:
                await self._require("messageTtl", "per-message TTL")
                envelope["ttlSeconds"] = _whole_seconds(ttl_seconds)
            if delay_seconds:
                await self._require("delayedDelivery", "delayed delivery")
                envelope["delaySeconds"] = _whole_seconds(delay_seconds)
            if priority:
                await self._require("priority", "message priority", "REACH.md v1.3")
                envelope["priority"] = priority
            if to.startswith(ROLE_PREFIX):
                await self._require("roles", "a send to a role", "REACH.md v1.3")
            return await self._request("POST", "/messages", envelope)

        return self._run(go)

    def recv(self, limit: Optional[int] = None, wait: Optional[float] = None) -> defer.Deferred:
        """GET /messages after :attr:`cursor`: ``{"messages", "cursor"}``.

        The cursor advances when the broker returns one. ``wait`` long-polls
        only if the broker advertised ``capabilities.longPoll``.
        """

        async def go() -> Dict[str, Any]:
            await self._known()
            params: List[Tuple[str, Any]] = []
            if self.cursor:
                params.append(("since", self.cursor))
            if limit is not None:
                params.append(("limit", int(limit)))
            waited = self._wait_for(wait)
            if waited is not None:
                params.append(("wait", waited))
            answer = await self._request(
                "GET", "/messages" + _query(params), timeout=self._timeout_for(waited)
            )
            if not isinstance(answer, dict):
                raise RelayError(0, "bad_response", "GET /messages did not answer an object")
            answer.setdefault("messages", [])
            if answer.get("cursor"):
                self.cursor = answer["cursor"]
            return answer

        return self._run(go)

    def ack(
        self, message_id: str, status: str = "ok", error: Optional[str] = None
    ) -> defer.Deferred:
        """POST /messages/<id>/ack: the v1.0 receipt back to the sender.

        (The v1.1 lease acknowledgement is :meth:`ack_outcome`.)
        """
        document: Dict[str, Any] = {"status": status}
        if status == "error":
            document["error"] = error or "error"
        path = f"/messages/{quote(message_id, safe='')}/ack"
        return self._run(self._request, "POST", path, document)

    # -- v1.1 and the v1.2 lease operations ----------------------------------

    def pull(
        self,
        limit: Optional[int] = None,
        lease_seconds: Optional[int] = None,
        wait: Optional[float] = None,
        *,
        parent_id: Optional[str] = None,
        role: Optional[str] = None,
    ) -> defer.Deferred:
        """POST /v1/pull: lease queued messages; ``{"messages", "count"}``.

        Each returned envelope carries the ``leaseId`` that :meth:`ack_outcome`
        needs. ``wait`` long-polls only if the broker advertised it. The broker
        leases from this agent's inbox and the queues of its roles, higher
        priority first (REACH §13, §14).

        :param parent_id: lease only the messages whose ``parentId`` or
            ``replyTo`` is this id, the answers to one request (v1.2 §5,
            needs ``pullFilter``); other queued messages are left alone.
        :param role: lease only from the queue of this role (a name, without
            ``role:``), which this agent holds (needs ``roles``).
        """

        async def go() -> Dict[str, Any]:
            await self._known()
            document: Dict[str, Any] = {}
            if limit is not None:
                document["limit"] = int(limit)
            if lease_seconds is not None:
                document["leaseSeconds"] = int(lease_seconds)
            if parent_id is not None:
                await self._require("pullFilter", "pull by parent")
                document["parentId"] = parent_id
            if role is not None:
                await self._require("roles", "a pull from a role", "REACH.md v1.3")
                document["role"] = role
            waited = self._wait_for(wait)
            if waited is not None:
                document["waitSeconds"] = waited
            return await self._request(
                "POST", "/v1/pull", document, timeout=self._timeout_for(waited)
            )

        return self._run(go)

    def ack_outcome(
        self,
        message_id: str,
        lease_id: str,
        outcome: str,
        error: Optional[str] = None,
        *,
        retry_after: Optional[float] = None,
        reply: Optional[Mapping[str, Any]] = None,
    ) -> defer.Deferred:
        """POST /v1/ack: end a lease with ``outcome``.

        ``completed`` (done) and ``retry`` (queued again, one attempt more) are
        v1.1; ``release`` (queued again at no cost) and ``reject`` (failed at
        once) need them listed in ``capabilities.ackOutcomes``. Fires with
        ``{"ok", "status", "attempts"}``; 409 ``not_leased``/``lease_mismatch``
        when this lease is no longer current.

        :param retry_after: with ``retry`` or ``release``: seconds before the
            message may be delivered again (needs ``retryAfter``; rounded up).
        :param reply: with ``completed``: the reply stored in the same
            transaction (v1.2 §6, needs ``replyInAck``), a mapping with
            ``body`` and optionally ``kind`` (``"reply"``, the default, or
            ``"message"``), ``ack`` and ``id``. Without an ``id`` one is chosen
            here, before the first attempt, so that a retried ack is recognised
            as a duplicate; the answer then adds ``replyId`` and ``duplicate``.
        """
        document: Dict[str, Any] = {
            "messageId": message_id,
            "leaseId": lease_id,
            "outcome": outcome,
        }
        if error is not None:
            document["error"] = error
        fixed_reply: Optional[Dict[str, Any]] = None
        if reply is not None:
            fixed_reply = dict(reply)
            fixed_reply.setdefault("id", str(uuid.uuid4()))

        async def go() -> Dict[str, Any]:
            await self._known()
            if outcome not in ack_outcomes(self.info):
                raise unsupported(f'the "{outcome}" outcome', "ackOutcomes")
            if retry_after is not None:
                await self._require("retryAfter", f"{outcome} after a delay")
                document["retryAfterSeconds"] = _whole_seconds(retry_after)
            if fixed_reply is not None:
                await self._require("replyInAck", "the reply in the ack")
                document["reply"] = fixed_reply
            return await self._request("POST", "/v1/ack", document)

        return self._run(go)

    def complete(
        self, message_id: str, lease_id: str, reply: Optional[Mapping[str, Any]] = None
    ) -> defer.Deferred:
        """:meth:`ack_outcome` ``completed``, with the atomic ``reply`` when given."""
        return self.ack_outcome(message_id, lease_id, "completed", reply=reply)

    def retry(
        self,
        message_id: str,
        lease_id: str,
        error: Optional[str] = None,
        *,
        after: Optional[float] = None,
    ) -> defer.Deferred:
        """:meth:`ack_outcome` ``retry`` (one attempt more), not before ``after`` seconds."""
        return self.ack_outcome(message_id, lease_id, "retry", error, retry_after=after)

    def release(
        self, message_id: str, lease_id: str, *, after: Optional[float] = None
    ) -> defer.Deferred:
        """:meth:`ack_outcome` ``release``: give a message back without using an
        attempt (shutting down, not this worker's job), not before ``after`` seconds."""
        return self.ack_outcome(message_id, lease_id, "release", retry_after=after)

    def reject(
        self, message_id: str, lease_id: str, error: Optional[str] = None
    ) -> defer.Deferred:
        """:meth:`ack_outcome` ``reject``: a poison message fails at once with ``error``."""
        return self.ack_outcome(message_id, lease_id, "reject", error)

    def renew(
        self, message_id: str, lease_id: str, lease_seconds: Optional[float] = None
    ) -> defer.Deferred:
        """POST /v1/lease/renew: the lease now ends ``lease_seconds`` from now (the
        broker's ``leaseSeconds`` by default); ``{"ok", "leaseId", "leaseUntil"}``.

        Needs ``leaseRenew``. 409 ``not_leased`` when the lease has ended (its
        deadline passed, or the sender cancelled the message), 409
        ``lease_mismatch`` when another lease is current.
        """

        async def go() -> Dict[str, Any]:
            await self._require("leaseRenew", "lease renewal")
            document: Dict[str, Any] = {"messageId": message_id, "leaseId": lease_id}
            if lease_seconds is not None:
                document["leaseSeconds"] = max(1, _whole_seconds(lease_seconds))
            return await self._request("POST", "/v1/lease/renew", document)

        return self._run(go)

    def requeue(self, message_id: str) -> defer.Deferred:
        """POST /v1/requeue: put a failed message (a dead letter) back in the queue,
        with its attempts and deliveries at 0. Needs ``deadLetters``."""

        async def go() -> Dict[str, Any]:
            await self._require("deadLetters", "requeue")
            return await self._request("POST", "/v1/requeue", {"messageId": message_id})

        return self._run(go)

    def cancel(self, message_id: str, reason: Optional[str] = None) -> defer.Deferred:
        """POST /v1/cancel: withdraw a message this agent sent that is not done yet;
        it fails with ``reason``. Needs ``deadLetters``."""

        async def go() -> Dict[str, Any]:
            await self._require("deadLetters", "cancel")
            document: Dict[str, Any] = {"messageId": message_id}
            if reason is not None:
                document["reason"] = reason
            return await self._request("POST", "/v1/cancel", document)

        return self._run(go)

    def status(self, message_ids: Sequence[str]) -> defer.Deferred:
        """POST /v1/status: ``{"messages": [{id, status, attempts, ts, from, to, kind}]}``;
        a v1.2 broker adds ``deliveries`` and, when set, ``error``, ``notBefore``
        and ``expiresAt`` (epoch milliseconds). The id of a group send of this
        agent (REACH §13) is ``{id, via, copies: [{to, id, status}]}``."""
        return self._run(self._request, "POST", "/v1/status", {"messageIds": list(message_ids)})

    def recent(self, limit: Optional[int] = None) -> defer.Deferred:
        """POST /v1/recent: the most recent messages for this agent, any status."""
        document = {} if limit is None else {"limit": int(limit)}
        return self._run(self._request, "POST", "/v1/recent", document)

    def query(
        self,
        *,
        kind: Optional[str] = None,
        status: Optional[str] = None,
        from_: Optional[str] = None,
        to: Optional[str] = None,
        limit: Optional[int] = None,
        box: Optional[str] = None,
        root_id: Optional[str] = None,
        parent_id: Optional[str] = None,
    ) -> defer.Deferred:
        """POST /v1/messages/query: a read-only filtered search, newest first.

        ``box`` (``"inbox"``, the default, ``"sent"`` or ``"all"``), ``root_id``
        and ``parent_id`` are the conversation filters of v1.2 §5 and need
        ``threads``.
        """
        filters = {"kind": kind, "status": status, "from": from_, "to": to}
        document: Dict[str, Any] = {
            key: value for key, value in filters.items() if value is not None
        }
        if limit is not None:
            document["limit"] = int(limit)
        conversation = {"box": box, "rootId": root_id, "parentId": parent_id}
        wanted = {key: value for key, value in conversation.items() if value is not None}

        async def go() -> Dict[str, Any]:
            if wanted:
                await self._require("threads", "query by box, root or parent")
                document.update(wanted)
            return await self._request("POST", "/v1/messages/query", document)

        return self._run(go)

    def thread(
        self, root_id: str, since: Optional[str] = None, limit: Optional[int] = None
    ) -> defer.Deferred:
        """POST /v1/thread: the messages of one conversation that this agent sent or
        received, oldest first, after ``since``; ``{"messages", "count", "cursor"}``.
        Needs ``threads``."""

        async def go() -> Dict[str, Any]:
            await self._require("threads", "threads")
            document: Dict[str, Any] = {"rootId": root_id}
            if since is not None:
                document["since"] = since
            if limit is not None:
                document["limit"] = int(limit)
            return await self._request("POST", "/v1/thread", document)

        return self._run(go)

    # -- events (REACH §11) -------------------------------------------------

    def events(
        self,
        since: Optional[str] = None,
        *,
        on_state: Optional[Callable[[bool], None]] = None,
        on_wait: Optional[Callable[[RelayError, float], None]] = None,
    ) -> EventStream:
        """This agent's events (``GET /v1/events``), as an :class:`EventStream`: an
        async iterator of :class:`relay.client.sse.RelayEvent` that reconnects with backoff
        and resumes after the last event it read.

        :param since: the id of the last event seen earlier (an
            :attr:`EventStream.last_id`); None starts at the present.
        :param on_state: called with True each time the stream is open, with False
            each time it was lost (it reconnects by itself); not when it is closed.
        :param on_wait: called with the refusal and the seconds it waits when the
            broker refused the stream for a while (``403 locked`` after
            authentication failures: as long as the answer says, then it tries
            again).

        The first read makes the handshake when none was made and fails with code
        ``unsupported`` unless the broker advertises ``events``. A ``reset`` event
        (``since`` unknown or beyond the broker's retention) is given to the caller,
        who re-syncs by pulling. Reading fails, and the stream ends, on an answer
        that retrying cannot fix (a refused signature, a broker without the route).

        The stream starts opening at once: events that happen after this call are
        read even before the first ``async for`` step.
        """
        stream = EventStream(self, since, on_state=on_state, on_wait=on_wait)
        stream.open()
        return stream

    async def _open_events(self, since: Optional[str]) -> Any:
        """One signed ``GET /v1/events`` after ``since``: the 200 response, its body
        not read yet. Raises :class:`RelayError` (``connection_error`` when the
        broker could not be reached)."""
        path = "/v1/events" + _query([("since", since)] if since else [])
        headers: Dict[str, List[str]] = {"Accept": ["text/event-stream"]}
        stamped = auth_headers(
            self._secret, self.agent, "GET", path, int(self._clock.seconds()), b"",
            nonce=new_nonce() if self.signs_nonce else None,
        )
        for name, value in stamped.items():
            headers[name] = [value]
        d = self._http.request(
            "GET", self.broker_url + path, headers=headers, allow_redirects=False,
            unbuffered=True,
        )
        timed_out: List[bool] = []

        def expire() -> None:
            timed_out.append(True)
            d.cancel()

        timer = self._clock.callLater(self.timeout, expire)
        try:
            response = await d
        except Exception as failure:
            tls_error = tls_failure(failure)
            if tls_error is not None:
                raise RelayError(0, "tls_error", describe_tls_failure(
                    tls_error, self.broker_url, self.ca_file, self.client_cert)) from None
            if timed_out:
                raise RelayError(0, "connection_error",
                                 _describe(_TimedOut(), self.broker_url)) from None
            if _is_cancellation(failure):
                raise defer.CancelledError() from None
            if isinstance(failure, _TRANSIENT_FAILURES):
                code = "bad_answer" if _lasting(failure) else "connection_error"
                raise RelayError(0, code, _describe(failure, self.broker_url)) from None
            raise
        finally:
            if timer.active():
                timer.cancel()
        if response.code != 200:
            raise _error_from_answer(response.code, await treq.content(response))
        return response

    def _timeout_for(self, waited: Optional[int]) -> float:
        return self.timeout if waited is None else self.timeout + waited + LONG_POLL_GRACE_SECONDS

    # -- request / reply ------------------------------------------------------------

    def request(
        self,
        to: str,
        body: Optional[Dict[str, Any]] = None,
        timeout: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
        *,
        message_id: Optional[str] = None,
        root_id: Optional[str] = None,
        ttl_seconds: Optional[float] = None,
        poll_interval: float = REPLY_POLL_SECONDS,
    ) -> defer.Deferred:
        """Send ``body`` to ``to`` as a ``kind: "request"`` and wait for the answer.

        Fires with the answer's envelope, or fails with :class:`RequestFailed`
        (the request failed or expired: its failure notice, event and error) or
        :class:`RequestTimeout` (no answer within ``timeout`` seconds, which
        bounds the whole call, sending included). Other failures are the
        ``RelayError`` of the step that failed. This agent registers first (a
        reply can only reach a registered agent), unless it did already
        (:attr:`registered_at`).

        A broker with ``pullFilter`` is asked with long-poll pulls by parent
        (up to ``capabilities.longPoll.maxWaitSeconds`` each): they lease the
        answer alone, which is then acknowledged ``completed``; no other
        message is touched. A v1.1 broker is asked every ``poll_interval``
        seconds with read-only queries for the reply and ``/v1/status`` for a
        failure of the request (every fifth look): nothing is leased or
        acknowledged, so the answer stays queued in this agent's inbox.

        A group (``group:NAME``) is refused before anything is sent: each member
        answers its own copy, so :meth:`send` it as a request and
        :meth:`await_reply` each copy's id.
        """
        request_id = message_id or str(uuid.uuid4())

        async def go() -> Dict[str, Any]:
            if to.startswith(GROUP_PREFIX):
                raise RelayError(0, "bad_request", "a request to a group is answered per "
                                 "copy: send it, then wait for the answer to each copy")
            started = self._clock.seconds()
            if self.registered_at is None:
                await self.register()
            await self.send(
                to,
                body,
                message_id=request_id,
                kind="request",
                root_id=root_id,
                ttl_seconds=ttl_seconds,
            )
            return await self._await(request_id, to, started, timeout, poll_interval)

        return self._bounded(go, request_id, to, timeout)

    def ask(
        self,
        to: str,
        question: str,
        options: Optional[Sequence[str]] = None,
        timeout: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
        *,
        message_id: Optional[str] = None,
        ttl_seconds: Optional[float] = None,
    ) -> defer.Deferred:
        """Ask a person (an agent with ``human: true``, REACH §15) ``question``, with
        ``options`` as the answers they may pick, and wait for the answer as
        :meth:`request` does. Fires with the reply envelope: its body is
        ``{"answer": <the option picked, or the text the person wrote>}``
        (:func:`answer_of`). ValueError for a question or options the inbox page
        would not show as such."""
        body = question_body(question, options)
        return self.request(to, body, timeout, message_id=message_id, ttl_seconds=ttl_seconds)

    def await_reply(
        self,
        request_id: str,
        timeout: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
        *,
        to: Optional[str] = None,
        poll_interval: float = REPLY_POLL_SECONDS,
    ) -> defer.Deferred:
        """Wait up to ``timeout`` seconds for the answer to a request sent earlier,
        as :meth:`request` does (``to``, the agent asked, narrows the v1.1 query)."""

        async def go() -> Dict[str, Any]:
            started = self._clock.seconds()
            return await self._await(request_id, to, started, timeout, poll_interval)

        return self._bounded(go, request_id, to, timeout)

    def _bounded(
        self,
        coroutine_function: Callable[[], Awaitable[Dict[str, Any]]],
        request_id: str,
        to: Optional[str],
        timeout: float,
    ) -> defer.Deferred:
        """Run ``coroutine_function`` for at most ``timeout`` seconds (and a grace for
        the last answer); past that, cancel it and fail with :class:`RequestTimeout`."""

        async def go() -> Dict[str, Any]:
            inner = defer.Deferred.fromCoroutine(coroutine_function())
            expired: List[bool] = []

            def expire() -> None:
                expired.append(True)
                inner.cancel()

            timer = self._clock.callLater(timeout + REQUEST_GRACE_SECONDS, expire)
            try:
                return await inner
            except defer.CancelledError:
                if expired:
                    raise RequestTimeout(request_id, to, timeout) from None
                raise
            finally:
                if timer.active():
                    timer.cancel()

        return self._run(go)

    async def _await(
        self,
        request_id: str,
        to: Optional[str],
        started: float,
        timeout: float,
        poll_interval: float,
    ) -> Dict[str, Any]:
        await self._known()
        deadline = started + timeout
        by_parent = self.advertises("pullFilter")
        if not by_parent and not self.advertises("filteredQuery"):
            raise unsupported("pullFilter", "waiting for a reply; nor does it offer filteredQuery")
        if to is None:
            to = await self._recipient_of(request_id)
        # Without failure notices only /v1/status tells that the request failed.
        check_status = not (by_parent and failure_notices(self.info))
        looks = 0
        while True:
            looks += 1
            maximum = self.long_poll_seconds if by_parent else None
            remaining = deadline - self._clock.seconds()
            # Whole seconds, rounded down: a long poll never outlasts the deadline.
            wait = int(min(remaining, maximum)) if maximum and remaining >= 1 else 0
            if by_parent:
                answer, forged = await self._pull_answer(request_id, to, wait)
                if forged:
                    # Another agent's message names the request as its parent: it is
                    # given back, and from now on the answer is looked for read-only,
                    # so a pull by parent does not take that message again and again.
                    by_parent = False
                    wait = 0
            else:
                answer = await self._query_answer(request_id, to)
            if answer is not None:
                return answer
            # A short look (polling, or a long poll cut short) asks for the status
            # only every STATUS_EVERY_LOOKS looks: each costs a request of the
            # budget every local client shares.
            if check_status and (wait >= STATUS_EVERY_LOOKS * poll_interval
                                 or looks % STATUS_EVERY_LOOKS == 0
                                 or deadline - self._clock.seconds() <= poll_interval):
                await self._check_request(request_id, to)
            remaining = deadline - self._clock.seconds()
            if remaining <= 0:
                raise RequestTimeout(request_id, to, timeout)
            if not wait:
                await deferLater(self._clock, min(poll_interval, remaining))

    async def _recipient_of(self, request_id: str) -> Optional[str]:
        """The agent a request this agent sent went to, from ``/v1/status``; None when
        the broker no longer has it (then only the broker's notice answers it)."""
        for entry in _messages(await self.status([request_id])):
            if entry.get("id") == request_id and entry.get("from") == self.agent:
                recipient = entry.get("to")
                return recipient if isinstance(recipient, str) else None
        return None

    async def answerer(self, request_id: str, to: Optional[str]) -> Optional[str]:
        """Whose reply answers ``request_id``, sent to ``to``: ``to`` itself, or for a
        request to a role (``role:NAME``) the member that completed it, from
        ``/v1/status`` (REACH §13: the reply is stored with the completion, so a
        reply without it is not the answer); None while no member has."""
        if to is None or not to.startswith(ROLE_PREFIX):
            return to
        for entry in _messages(await self.status([request_id])):
            if entry.get("id") == request_id and entry.get("from") == self.agent:
                member = entry.get("completedBy")
                return member if isinstance(member, str) else None
        return None

    async def _pull_answer(
        self, request_id: str, to: Optional[str], wait: int
    ) -> Tuple[Optional[Dict[str, Any]], bool]:
        """One pull by parent (long-polling ``wait`` seconds): the answer, completed,
        and whether a message from another agent claimed to answer (it is released)."""
        document: Dict[str, Any] = {
            "limit": 1,
            "leaseSeconds": REPLY_LEASE_SECONDS,
            "parentId": request_id,
        }
        if wait:
            document["waitSeconds"] = wait
        answer = await self._request(
            "POST", "/v1/pull", document, timeout=self._timeout_for(wait or None)
        )
        forged = False
        messages = _messages(answer)
        if messages and to is not None and to.startswith(ROLE_PREFIX):
            to = await self.answerer(request_id, to)
        for message in messages:
            if not answers_request(message, request_id, to):
                forged = True
                await self._give_back_quietly(message)
                continue
            await self._complete_quietly(message)
            if message.get("type") == "ack":
                continue  # a v1.0 receipt of the request, not its answer
            return _answer_or_failure(message, request_id, to), forged
        return None, forged

    async def _query_answer(self, request_id: str, to: Optional[str]) -> Optional[Dict[str, Any]]:
        """One read-only look for the reply among the newest replies (v1.1; by parent
        where the broker can search by it)."""
        parent_id = request_id if self.advertises("threads") else None
        if to is not None and to.startswith(ROLE_PREFIX):
            to = await self.answerer(request_id, to)
        answer = await self.query(kind="reply", from_=to, limit=FALLBACK_QUERY_LIMIT,
                                  parent_id=parent_id)
        for message in _messages(answer):
            if answers_request(message, request_id, to) and message.get("type") != "ack":
                return _answer_or_failure(message, request_id, to)
        return None

    async def _give_back_quietly(self, message: Mapping[str, Any]) -> None:
        """Release a message a pull by parent leased that is not the answer: it stays
        in the inbox, queued, for whatever reads the inbox. A broker that cannot
        release gets it back when the lease lapses."""
        if "release" not in ack_outcomes(self.info):
            return
        try:
            await self.release(str(message.get("id")), str(message.get("leaseId") or ""))
        except RelayError as error:
            self.log.warn(
                "relay: message {id} names the request as its parent but is not its "
                "answer; giving it back failed ({code})",
                id=message.get("id"),
                code=error.code,
            )

    async def _complete_quietly(self, message: Mapping[str, Any]) -> None:
        """Acknowledge an answer leased by a pull by parent; a refusal is only logged
        (the answer was read: the lease lapses and nothing is lost)."""
        try:
            await self.complete(str(message.get("id")), str(message.get("leaseId") or ""))
        except RelayError as error:
            self.log.warn(
                "relay: the answer {id} was read but not acknowledged ({code})",
                id=message.get("id"),
                code=error.code,
            )

    async def _check_request(self, request_id: str, to: Optional[str]) -> None:
        """Raise :class:`RequestFailed` when ``/v1/status`` says the request failed or is gone."""
        answer = await self.status([request_id])
        for entry in _messages(answer):
            if entry.get("id") != request_id:
                continue
            state = entry.get("status")
            if state == "failed":
                error = entry.get("error") or f"failed after {entry.get('attempts')} attempts"
                raise RequestFailed(request_id, to, "failed", str(error))
            if state == "not_found":
                raise RequestFailed(
                    request_id, to, "expired", "the broker no longer has the request"
                )


# -- the event stream (REACH §11) ---------------------------------------------------


# A ``403 locked`` whose message names no wait is tried again after this long.
LOCKED_RETRY_SECONDS = 60.0
_LOCK_LEFT = re.compile(r"try again in (\d{1,6}) (min|s)\b")


def locked_seconds(error: RelayError) -> Optional[float]:
    """How long a ``403 locked`` answer says the lock holds, in seconds (None for
    any other error). The lock runs out by itself (``security.lockMinutes``); the
    answer names the time left in whole minutes or seconds, rounded up."""
    if error.status != 403 or error.code != "locked":
        return None
    found = _LOCK_LEFT.search(error.message)
    if found is None:
        return LOCKED_RETRY_SECONDS
    return float(int(found.group(1)) * (60 if found.group(2) == "min" else 1))


def _retryable_stream_error(error: RelayError) -> bool:
    """Whether a failed ``GET /v1/events`` may succeed later: the broker was not
    reached, or it was busy, overloaded or restarting."""
    if error.status == 0:
        return error.code == "connection_error"
    return _is_retryable_status(error.status)


class _EventBody(Protocol):
    """Hands the bytes of a stream's body to ``received`` as they come; ``done``
    fires when the body ends (the broker closed the stream) or fails when the
    connection was lost."""

    def __init__(self, received: Callable[[bytes], None], done: defer.Deferred) -> None:
        self.received = received
        self.done = done

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 (the interface's name)
        self.received(data)

    def connectionLost(self, reason: Any = None) -> None:  # noqa: N802
        if self.done.called:
            return
        if reason is None or reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(reason)

    def abort(self) -> None:
        """Close the connection (a stream gone quiet, or the reader stopped)."""
        if self.transport is not None:
            self.transport.stopProducing()


class EventStream:
    """One agent's events, read from ``GET /v1/events`` for as long as it is open.

    ``async for event in stream`` gives each :class:`relay.client.sse.RelayEvent` once, in
    order. A stream the broker ends, a lost connection or one silent for longer
    than twice the broker's keepalive interval is opened again after a delay (1,
    2, 4 ... at most 30 s while tries fail), resuming after the last event read
    (``since``), so nothing is lost or repeated while the broker keeps the
    events. An agent locked after authentication failures (``403 locked``) is
    tried again once the lock the answer names has run out (``on_wait`` is told).
    :attr:`last_id` is the id of the last event given to the caller: keep it to
    resume in a later run. :meth:`close` ends the iteration.
    """

    log = Logger()

    def __init__(
        self,
        client: RelayClient,
        since: Optional[str] = None,
        *,
        on_state: Optional[Callable[[bool], None]] = None,
        on_wait: Optional[Callable[[RelayError, float], None]] = None,
    ) -> None:
        self._client = client
        self._clock = client._clock
        self.last_id = since
        self.on_state = on_state
        self.on_wait = on_wait
        #: whether a stream is open now
        self.connected = False
        #: how many times a stream was opened
        self.connections = 0
        self._read_id = since  # the last id read off the wire (ahead of last_id)
        self._queue: List[RelayEvent] = []
        self._error: Optional[BaseException] = None
        self._waiter: Optional[defer.Deferred] = None
        self._loop: Optional[defer.Deferred] = None
        self._closed = False
        self._quiet_timer: Any = None

    def __aiter__(self) -> EventStream:
        return self

    def open(self) -> None:
        """Start reading (the first ``async for`` step does it too)."""
        if self._loop is None and not self._closed:
            self._loop = defer.Deferred.fromCoroutine(self._run())
            self._loop.addErrback(self._ended)

    async def __anext__(self) -> RelayEvent:
        self.open()
        while not self._queue:
            if self._error is not None:
                error, self._error = self._error, None
                self._closed = True
                raise error
            if self._closed:
                raise StopAsyncIteration
            self._waiter = defer.Deferred()
            await self._waiter
        event = self._queue.pop(0)
        self.last_id = event.id
        return event

    def close(self) -> None:
        """Stop reading: the connection is closed and the iteration ends."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.cancel()
        self._wake()

    async def aclose(self) -> None:
        """:meth:`close`, for ``contextlib.aclosing``."""
        self.close()

    # -- inside ----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.called:
            waiter.callback(None)

    def _ended(self, failure: Any) -> None:
        if not failure.check(defer.CancelledError):
            self._error = failure.value
        self._wake()

    def _state(self, connected: bool) -> None:
        if connected == self.connected:
            return
        self.connected = connected
        if self.on_state is not None and not self._closed:
            self.on_state(connected)

    def _quiet_seconds(self) -> float:
        events = self._client.capabilities.get("events")
        keepalive = events.get("keepaliveSeconds") if isinstance(events, dict) else None
        if not isinstance(keepalive, (int, float)) or isinstance(keepalive, bool) or keepalive <= 0:
            keepalive = 15
        return 2 * float(keepalive) + 5

    async def _run(self) -> None:
        await self._client._require("events", "the event stream", "REACH.md §11")
        failures = 0
        handshaken_again = False
        while not self._closed:
            locked = None
            try:
                response = await self._client._open_events(self._read_id)
            except RelayError as error:
                if error.status == 401 and not handshaken_again:
                    handshaken_again = True
                    if await self._client._nonce_changed():
                        continue
                locked = locked_seconds(error)
                if locked is None and not _retryable_stream_error(error):
                    raise
                self.log.info("relay event stream: {code}; reconnecting", code=error.code)
                if locked is not None and self.on_wait is not None and not self._closed:
                    self.on_wait(error, max(locked, reconnect_delay(failures)))
            else:
                failures = 0
                handshaken_again = False
                self.connections += 1
                self._state(True)
                try:
                    await self._read(response)
                except (StreamError, ResponseFailed, ConnectionClosed) as lost:
                    self.log.info("relay event stream lost ({what}); reconnecting",
                                  what=lost.__class__.__name__)
                finally:
                    self._state(False)
            delay = reconnect_delay(failures)
            if locked is not None:
                delay = max(delay, locked)
            failures += 1
            await deferLater(self._clock, delay)

    async def _read(self, response: Any) -> None:
        parser = SSEParser()
        done: defer.Deferred = defer.Deferred()
        body = _EventBody(lambda data: self._received(parser, data, body), done)
        quiet = self._quiet_seconds()
        self._quiet_timer = self._clock.callLater(quiet, body.abort)
        response.deliverBody(body)
        try:
            await done
        except defer.CancelledError:
            body.abort()
            raise
        finally:
            if self._quiet_timer.active():
                self._quiet_timer.cancel()

    def _received(self, parser: SSEParser, data: bytes, body: _EventBody) -> None:
        if self._quiet_timer is not None and self._quiet_timer.active():
            self._quiet_timer.reset(self._quiet_seconds())
        try:
            events = parser.feed(data)
        except StreamError:
            body.abort()
            return
        if not events:
            return
        self._read_id = events[-1].id
        self._queue.extend(events)
        self._wake()


def _messages(answer: Any) -> List[Dict[str, Any]]:
    """The message objects of an answer's ``messages`` list."""
    listed = answer.get("messages") if isinstance(answer, dict) else None
    return [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []


def _decode_answer(status: int, raw: bytes, broker_url: str = "") -> Any:
    if not raw.strip():
        return {}
    try:
        return json.loads(raw.decode("utf-8"))
    except ValueError:
        if OPS_PAGE_MARK in raw:
            raise RelayError(status, "ops_listener", _ops_listener_hint(broker_url)) from None
        raise RelayError(status, "bad_response", f"HTTP {status} answer is not JSON") from None


def _ops_listener_hint(broker_url: str) -> str:
    """What to say when ``broker_url`` answered with the dashboard's page."""
    parts = urlsplit(broker_url)
    guess = ""
    if parts.port is not None and parts.port > 1:
        netloc = parts.netloc.rsplit(":", 1)[0] + f":{parts.port - 1}"
        guess = f" (with conf/relay.yaml and relay init's config, {parts.scheme}://{netloc})"
    return (f"{broker_url} is the relay's ops listener (the dashboard), not the broker; "
            f"the broker is at the address of broker.listen{guess}")


def _lasting(failure: BaseException) -> bool:
    """Whether a transient-looking failure will not go away by retrying: a host name
    that does not resolve, or a server that does not speak HTTP (an answer that is
    no HTTP response, with the connection still open)."""
    if isinstance(failure, DNSLookupError):
        return True
    if not isinstance(failure, ResponseFailed) or isinstance(failure, ResponseNeverReceived):
        return False
    reasons = [getattr(reason, "value", reason) for reason in failure.reasons]
    return bool(reasons) and not any(
        isinstance(reason, (ConnectionClosed, OSError, defer.CancelledError, _TimedOut))
        for reason in reasons
    )


def _describe(failure: BaseException, broker_url: str) -> str:
    """A connection failure in words, with what the person may do about it."""
    if isinstance(failure, _TimedOut):
        return f"no answer from {broker_url} in time"
    if isinstance(failure, ResponseNeverReceived):
        hint = " (if the broker speaks TLS here, use https://)" if _is_http(broker_url) else ""
        return f"{broker_url} closed the connection without an answer{hint}"
    if isinstance(failure, ResponseFailed) and _lasting(failure):
        return (f"{broker_url} does not answer in HTTP: is it the relay broker's port? "
                "(broker.listen; 19121 with the shipped config)")
    if isinstance(failure, ResponseFailed):
        return f"connection to {broker_url} failed mid-request"
    if isinstance(failure, ConnectionRefusedError):
        return (
            f"cannot reach {broker_url}: connection refused; is the broker running "
            "(`make run` or `twistd -n relay`) and listening on that port?"
        )
    if isinstance(failure, DNSLookupError):
        return f"cannot reach {broker_url}: the host name does not resolve"
    if isinstance(failure, TCPTimedOutError):
        return f"cannot reach {broker_url}: connecting timed out"
    return f"cannot reach {broker_url}: {failure.__class__.__name__}"


def _is_http(broker_url: str) -> bool:
    return urlsplit(broker_url).scheme == "http"
