"""A Twisted (treq) client for the dsh-agent-relay wire protocol v1.0 / v1.1.

Every method returns a Deferred that fires with the broker's JSON answer (a dict)
or fails with :class:`relay.errors.RelayError`. Transient failures (5xx, 408,
429, connection failures, timeouts) are retried per spec §5 with a 2/4/8 s
backoff measured on the injected ``clock``; a retried send keeps its message id,
so the broker's ``duplicate: true`` answer is an ordinary success.

https always verifies the broker's certificate, against the system trust store
or a given CA file, and presents a client certificate when one is configured. A
TLS failure (an untrusted or misnamed certificate, a refused or missing client
certificate) is never retried: it fails at once with code ``tls_error``.

Message bodies are never logged: only methods, paths, statuses and attempts.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Optional, Sequence, Tuple
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
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from relay import pem
from relay.errors import RelayError
from relay.protocol import PROTOCOL_VERSION, is_loopback_host
from relay.settings import ENV_CA_FILE, ENV_CLIENT_CERT
from relay.signing import auth_headers

RETRY_DELAYS_SECONDS: Tuple[float, ...] = (2.0, 4.0, 8.0)
DEFAULT_TIMEOUT_SECONDS = 15.0
RETRYABLE_STATUSES = frozenset({408, 429})
# How much longer than the requested wait a long-poll request may take.
LONG_POLL_GRACE_SECONDS = 10.0
# The wait of a broker that advertises long polling without a maximum.
DEFAULT_LONG_POLL_SECONDS = 20.0


class _TimedOut(Exception):
    """No complete answer arrived within the request timeout."""


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



# -- TLS ------------------------------------------------------------------------

# TLS alerts from a broker that refused this client's certificate (or its absence).
_CLIENT_CERTIFICATE_ALERTS = (
    "certificate required",
    "unknown ca",
    "bad certificate",
    "certificate unknown",
    "certificate expired",
    "certificate revoked",
    "unsupported certificate",
    "access denied",
)


# What OpenSSL says when the other side answered a ClientHello in plain text.
_PLAIN_HTTP_REASONS = (
    "wrong version number",
    "packet length too long",
    "http request",
    "unknown protocol",
    "record layer failure",
)


def _bad_file(code: str, what: str, path: str, problem: pem.PEMError) -> RelayError:
    """The RelayError for ``problem`` with the file ``path``.

    ``what`` names the file (``CA file``, ``client key``) for a read failure or a
    certificate problem.
    """
    if isinstance(problem, pem.Unreadable):
        text = f"cannot read {what} {path}: {problem.reason}"
    elif isinstance(problem, pem.NoCertificate):
        text = f"no PEM certificate found in {what} {path}"
    elif isinstance(problem, pem.MalformedCertificate):
        text = f"malformed certificate in {what} {path}: {problem}"
    elif isinstance(problem, pem.NoPrivateKey):
        text = f"no PEM private key found in {path}"
    elif isinstance(problem, pem.EncryptedKey):
        text = f"the private key in {path} is encrypted; the client needs it unencrypted"
    else:
        text = f"malformed private key in {path}: {problem}"
    return RelayError(0, code, text)


def load_trust_root(ca_file: str) -> Any:
    """A trust root holding every certificate of the PEM bundle ``ca_file``.

    An unreadable file, or one without a well-formed PEM certificate, is a
    ``RelayError(0, "bad_ca_file", ...)`` naming the path.
    """
    try:
        return pem.trust_root(pem.certificates(pem.read(os.path.expanduser(ca_file))))
    except pem.PEMError as problem:
        raise _bad_file("bad_ca_file", "CA file", ca_file, problem) from None


def load_client_certificate(
    cert_file: str, key_file: Optional[str] = None
) -> Tuple[Any, List[Any]]:
    """This client's certificate and key, and the intermediates to send after it.

    ``cert_file`` holds the PEM certificate, then any intermediate certificates;
    the unencrypted PEM key is in ``key_file``, or in ``cert_file`` itself when
    ``key_file`` is ``None``. Returns a Twisted ``PrivateCertificate`` and a list
    of pyOpenSSL ``X509`` intermediates. Every problem is a
    ``RelayError(0, "bad_client_cert", ...)`` naming the path.
    """
    from OpenSSL import crypto
    from twisted.internet.ssl import Certificate, KeyPair, PrivateCertificate

    code = "bad_client_cert"
    try:
        cert_data = pem.read(os.path.expanduser(cert_file))
        chain = pem.certificates(cert_data)
    except pem.PEMError as problem:
        raise _bad_file(code, "client certificate", cert_file, problem) from None
    if key_file is None:
        key_path = cert_file
        try:
            key = pem.private_key(cert_data)
        except pem.NoPrivateKey:
            raise RelayError(
                0, code, f"no PEM private key found in {cert_file}; give the key with --client-key"
            ) from None
        except pem.PEMError as problem:
            raise _bad_file(code, "client certificate", cert_file, problem) from None
    else:
        key_path = key_file
        try:
            key = pem.private_key(pem.read(os.path.expanduser(key_file)))
        except pem.PEMError as problem:
            raise _bad_file(code, "client key", key_file, problem) from None
    if not pem.matches(chain[0], key):
        raise RelayError(
            0, code, f"the client certificate {cert_file} does not match the key in {key_path}"
        )
    certificate = PrivateCertificate.fromCertificateAndKeyPair(
        Certificate(crypto.X509.from_cryptography(chain[0])),
        KeyPair(crypto.PKey.from_cryptography_key(key)),
    )
    return certificate, [crypto.X509.from_cryptography(c) for c in chain[1:]]


@implementer(IPolicyForHTTPS)
class ClientTLSPolicy:
    """How https connections to the broker verify it, and prove who this client is.

    The broker's certificate must chain to ``trust_root`` (a CA bundle, or the
    system trust store) and name the host of the URL; there is no mode without
    verification. ``client_certificate`` is presented when the broker asks.
    """

    def __init__(
        self,
        trust_root: Any,
        client_certificate: Any = None,
        extra_chain: Sequence[Any] = (),
    ) -> None:
        self.trust_root = trust_root
        self.client_certificate = client_certificate
        self.extra_chain = list(extra_chain)

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        """The connection creator for ``hostname:port``: verify it, maybe present ours."""
        from twisted.internet.ssl import optionsForClientTLS

        extra = {"extraCertChain": self.extra_chain} if self.extra_chain else None
        return optionsForClientTLS(
            hostname.decode("ascii"),
            trustRoot=self.trust_root,
            clientCertificate=self.client_certificate,
            extraCertificateOptions=extra,
        )


def client_tls_policy(
    ca_file: Optional[str] = None,
    client_cert: Optional[str] = None,
    client_key: Optional[str] = None,
) -> ClientTLSPolicy:
    """The https policy: trust ``ca_file`` (else the system store), present ``client_cert``.

    Reads and checks every file now, so a bad path fails before any connection
    with a RelayError naming it (``bad_ca_file`` or ``bad_client_cert``).
    """
    from twisted.internet.ssl import platformTrust

    if client_key is not None and client_cert is None:
        raise RelayError(
            0, "bad_client_cert", f"a client key ({client_key}) needs a client certificate"
        )
    trust_root = load_trust_root(ca_file) if ca_file is not None else platformTrust()
    certificate: Any = None
    chain: List[Any] = []
    if client_cert is not None:
        certificate, chain = load_client_certificate(client_cert, client_key)
    return ClientTLSPolicy(trust_root, certificate, chain)


def make_http_client(
    reactor: Any,
    ca_file: Optional[str] = None,
    client_cert: Optional[str] = None,
    client_key: Optional[str] = None,
) -> Any:
    """A treq HTTPClient whose https connections always verify the broker.

    :param ca_file: a PEM CA bundle to trust instead of the system trust store.
    :param client_cert: a PEM client certificate (optionally followed by its
        intermediates, and holding the key when ``client_key`` is not given).
    :param client_key: the PEM private key of ``client_cert``.
    :raises RelayError: ``bad_ca_file`` / ``bad_client_cert`` naming the path.
    """
    from treq.client import HTTPClient
    from twisted.web.client import Agent, HTTPConnectionPool

    policy = client_tls_policy(ca_file, client_cert, client_key)
    pool = HTTPConnectionPool(reactor, persistent=True)
    return HTTPClient(Agent(reactor, contextFactory=policy, pool=pool))


def tls_failure(failure: BaseException) -> Optional[BaseException]:
    """The TLS error (OpenSSL's or a host name mismatch) inside a connection failure."""
    from OpenSSL import SSL
    from service_identity import VerificationError

    pending: List[BaseException] = [failure]
    while pending:
        current = pending.pop()
        if isinstance(current, (SSL.Error, VerificationError)):
            return current
        for reason in getattr(current, "reasons", None) or []:
            value = getattr(reason, "value", None)
            if isinstance(value, BaseException):
                pending.append(value)
    return None


def _openssl_reasons(error: BaseException) -> str:
    """OpenSSL's reason strings, e.g. ``certificate verify failed``."""
    reasons = []
    details = error.args[0] if error.args and isinstance(error.args[0], list) else []
    for entry in details:
        if isinstance(entry, tuple) and entry and entry[-1]:
            reasons.append(str(entry[-1]))
    return "; ".join(reasons) or str(error) or error.__class__.__name__


def describe_tls_failure(
    error: BaseException,
    broker_url: str,
    ca_file: Optional[str] = None,
    client_cert: Optional[str] = None,
) -> str:
    """What went wrong in the TLS handshake with ``broker_url``, and what to do about it."""
    from service_identity import VerificationError

    where = f"TLS handshake with {broker_url} failed"
    if isinstance(error, VerificationError):
        host = urlsplit(broker_url).hostname
        return (
            f"{where}: the broker's certificate is not valid for {host!r} ({error}); "
            "connect with a name or address listed in its subjectAltName, or reissue it"
        )
    reason = _openssl_reasons(error)
    if "certificate verify failed" in reason:
        if ca_file is not None:
            return (
                f"{where}: the broker's certificate does not verify against the CA file "
                f"{ca_file} ({reason}); --ca-file must hold the CA that signed it"
            )
        return (
            f"{where}: the broker's certificate does not verify against the system trust "
            f"store ({reason}); pass --ca-file (or set {ENV_CA_FILE}) with the CA that signed it"
        )
    if any(alert in reason for alert in _CLIENT_CERTIFICATE_ALERTS):
        if client_cert is None:
            return (
                f"{where}: the broker requires a client certificate and none was given "
                f"({reason}); pass --client-cert and --client-key (or set {ENV_CLIENT_CERT})"
            )
        return (
            f"{where}: the broker refused the client certificate {client_cert} ({reason}); "
            "it must be signed by the CA in the broker's tlsClientCA"
        )
    if any(sign in reason for sign in _PLAIN_HTTP_REASONS):
        plain = urlsplit(broker_url)._replace(scheme="http").geturl()
        return (
            f"{where}: the broker speaks plain HTTP here, not TLS ({reason}); "
            f"is this the https port? For plain HTTP use {plain}"
        )
    hint = "check that the URL is the broker's https port"
    if client_cert is None:
        hint += "; if the broker requires client certificates, pass --client-cert"
    return f"{where} ({reason}); {hint}"


class RelayClient:
    """One agent's authenticated connection to a relay broker.

    :param broker_url: ``http://`` or ``https://`` base URL of the broker.
    :param agent: this agent's name, sent as ``X-Relay-Agent``.
    :param secret: the HMAC secret shared with the broker.
    :param clock: the time source for timestamps, retry delays and timeouts.
    :param http: a treq-like client (``request(method, url, headers=, data=)``);
        by default a treq HTTPClient on ``reactor``. Tests pass ``StubTreq``.
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
    ) -> None:
        parts = urlsplit(broker_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RelayError(0, "bad_broker_url", f"not an http(s) URL: {broker_url!r}")
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
        self.info: Optional[Dict[str, Any]] = None

    # -- transport --------------------------------------------------------

    @property
    def long_poll_seconds(self) -> Optional[float]:
        """The broker's advertised long-poll maximum, once :meth:`handshake` ran."""
        return long_poll_limit(self.info)

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
        """One HTTP exchange; raises a transient failure or ``_TimedOut``."""
        headers: Dict[str, List[str]] = {"Accept": ["application/json"]}
        if raw_body:
            headers["Content-Type"] = ["application/json; charset=utf-8"]
        if signed:
            stamped = auth_headers(
                self._secret, self.agent, method, path, int(self._clock.seconds()), raw_body
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
        delays = list(self.retry_delays)
        attempt = 0
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
                ):
                    raise error from None
            else:
                if 200 <= status < 300:
                    return _decode_answer(status, raw)
                error = _error_from_answer(status, raw)
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
        answer is kept in :attr:`info`.
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

    def register(self) -> defer.Deferred:
        """POST /register: register this agent, or heartbeat it."""
        return self._run(self._request, "POST", "/register", {"agent": self.agent})

    def peers(self) -> defer.Deferred:
        """GET /peers: ``{"peers": [{"agent", "online", "lastSeen"}, ...]}``."""
        return self._run(self._request, "GET", "/peers")

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
    ) -> defer.Deferred:
        """POST /messages: send one envelope; ``{"accepted", "id", "duplicate"}``.

        The id (``message_id`` or a fresh UUID) is fixed once, so every retry
        re-sends the same message and a duplicate answer is success.
        """
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
        return self._run(self._request, "POST", "/messages", envelope)

    def recv(self, limit: Optional[int] = None, wait: Optional[float] = None) -> defer.Deferred:
        """GET /messages after :attr:`cursor`: ``{"messages", "cursor"}``.

        The cursor advances when the broker returns one. ``wait`` long-polls
        only if the broker advertised ``capabilities.longPoll``.
        """

        async def go() -> Dict[str, Any]:
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
        """POST /messages/<id>/ack: the v1.0 receipt back to the sender."""
        document: Dict[str, Any] = {"status": status}
        if status == "error":
            document["error"] = error or "error"
        path = f"/messages/{quote(message_id, safe='')}/ack"
        return self._run(self._request, "POST", path, document)

    # -- v1.1 -------------------------------------------------------------

    def pull(
        self,
        limit: Optional[int] = None,
        lease_seconds: Optional[int] = None,
        wait: Optional[float] = None,
    ) -> defer.Deferred:
        """POST /v1/pull: lease queued messages; ``{"messages", "count"}``.

        Each returned envelope carries the ``leaseId`` that :meth:`ack_outcome`
        needs. ``wait`` long-polls only if the broker advertised it.
        """
        document: Dict[str, Any] = {}
        if limit is not None:
            document["limit"] = int(limit)
        if lease_seconds is not None:
            document["leaseSeconds"] = int(lease_seconds)
        waited = self._wait_for(wait)
        if waited is not None:
            document["waitSeconds"] = waited
        return self._run(
            self._request, "POST", "/v1/pull", document, timeout=self._timeout_for(waited)
        )

    def ack_outcome(
        self, message_id: str, lease_id: str, outcome: str, error: Optional[str] = None
    ) -> defer.Deferred:
        """POST /v1/ack: finish (``completed``) or re-queue (``retry``) a lease.

        ``{"ok", "status", "attempts"}``; 409 ``not_leased``/``lease_mismatch``
        when this lease is no longer current.
        """
        document: Dict[str, Any] = {
            "messageId": message_id,
            "leaseId": lease_id,
            "outcome": outcome,
        }
        if error is not None:
            document["error"] = error
        return self._run(self._request, "POST", "/v1/ack", document)

    def status(self, message_ids: Sequence[str]) -> defer.Deferred:
        """POST /v1/status: ``{"messages": [{id, status, attempts, ts, from, to, kind}]}``."""
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
    ) -> defer.Deferred:
        """POST /v1/messages/query: a read-only filtered search."""
        filters = {"kind": kind, "status": status, "from": from_, "to": to}
        document: Dict[str, Any] = {
            key: value for key, value in filters.items() if value is not None
        }
        if limit is not None:
            document["limit"] = int(limit)
        return self._run(self._request, "POST", "/v1/messages/query", document)

    def _timeout_for(self, waited: Optional[int]) -> float:
        return self.timeout if waited is None else self.timeout + waited + LONG_POLL_GRACE_SECONDS


def _decode_answer(status: int, raw: bytes) -> Any:
    if not raw.strip():
        return {}
    try:
        return json.loads(raw.decode("utf-8"))
    except ValueError:
        raise RelayError(status, "bad_response", f"HTTP {status} answer is not JSON") from None


def _describe(failure: BaseException, broker_url: str) -> str:
    """A connection failure in words, with what the person may do about it."""
    if isinstance(failure, _TimedOut):
        return f"no answer from {broker_url} in time"
    if isinstance(failure, ResponseNeverReceived):
        hint = " (if the broker speaks TLS here, use https://)" if _is_http(broker_url) else ""
        return f"{broker_url} closed the connection without an answer{hint}"
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
