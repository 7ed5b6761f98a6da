"""What every Klein app of the relay shares: reading a request body, writing JSON
answers, and answering every failure with the §6 body.

:func:`add_error_handling` registers one set of error handlers on an app (the
broker's API and the ops listener both call it): a :class:`RelayError` is its
own answer; a request no route matches is answered by the app object's
``unrouted(request)``; anything else is ``503 busy``, logged by incident id and
code location only, never with message content.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable, Optional
from urllib.parse import unquote_to_bytes

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from werkzeug.exceptions import MethodNotAllowed, NotFound
from werkzeug.routing import RequestRedirect

from relay.wire import errors, protocol
from relay.wire.errors import RelayError

log = Logger(namespace="relay.web")

JSON_TYPE = b"application/json; charset=utf-8"


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return protocol.compact_json(value).encode("utf-8")


def write_body(request, status: int, body: bytes) -> bytes:
    """Set the status and the JSON headers of ``request`` for the encoded ``body``;
    returns the body."""
    request.setResponseCode(status)
    headers = request.responseHeaders
    headers.setRawHeaders(b"content-type", [JSON_TYPE])
    headers.setRawHeaders(b"cache-control", [b"no-store"])
    headers.setRawHeaders(b"content-length", [b"%d" % len(body)])
    return body


def write_json(request, status: int, value: Any) -> bytes:
    """Set the status and JSON headers of ``request``; returns the encoded ``value``."""
    return write_body(request, status, encode_json(value))


def write_error(request, error: RelayError) -> bytes:
    """The §6 answer of ``error``."""
    return write_json(request, error.status, error.to_body())


def message_list(envelopes: Iterable[str], **fields: Any) -> bytes:
    """``{"messages": [...], **fields}`` from envelopes already encoded as JSON text."""
    tail = encode_json(fields)[1:] if fields else b"}"
    return b'{"messages":[' + ",".join(envelopes).encode("utf-8") + b"]" + (
        b"," + tail if fields else tail)


def read_body(request) -> bytes:
    """The request body; 400 ``bad_request`` when it is over 1 MiB (spec §1).

    :class:`relay.broker.site.RelayRequest` counts an oversized body without keeping it;
    under any other ``twisted.web`` request the buffered body is measured.
    """
    too_large = getattr(request, "body_too_large", None)
    content = request.content
    if too_large is None:
        too_large = content is not None and content.seek(0, 2) > protocol.MAX_BODY_BYTES
    if too_large:
        raise errors.bad_request(f"request body exceeds {protocol.MAX_BODY_BYTES} bytes")
    if content is None:
        return b""
    content.seek(0)
    return content.read()


def query_arg(request, name: bytes) -> Optional[str]:
    """The first value of the query parameter ``name``; 400 when it is not UTF-8."""
    values = request.args.get(name)
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise errors.bad_request(f"query parameter {name.decode()} is not valid UTF-8") from None


def utf8_path(path: bytes) -> bool:
    """Whether ``path`` is UTF-8 once percent-decoded (Klein refuses a request whose
    path is not with a plain-text body and a logged traceback)."""
    if b"%" in path or not path.isascii():
        try:
            unquote_to_bytes(path).decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def unreadable_url(request) -> Optional[RelayError]:
    """The §6 ``400`` for a request whose path (percent-decoded) or ``Host`` is not
    UTF-8, else None."""
    if not utf8_path(request.path):
        return errors.bad_request("the request URL is not valid UTF-8")
    try:
        request.getRequestHostname().decode("utf-8")
    except UnicodeDecodeError:
        return errors.bad_request("the request URL is not valid UTF-8")
    return None


def no_route(request) -> RelayError:
    """The §6 ``404`` for a request no route matches."""
    method = request.method.decode("latin-1")
    path = request.path.decode("utf-8", "replace")
    return errors.not_found(f"no route {method} {path}")


def incident(request, failure: Failure) -> bytes:
    """``503 busy`` for an unexpected failure, logged by incident id and the code
    locations it passed through, never with the request's content."""
    number = uuid.uuid4().hex[:12]
    frames = " < ".join(f"{f[0]}:{f[2]}" for f in reversed(failure.frames[-6:]))
    log.error("incident {incident}: {kind} in {frames}", incident=number,
              kind=failure.type.__name__, frames=frames)
    return write_error(request, errors.busy(f"internal broker error (incident {number})"))


def answer_failure(request, failure: Failure) -> Any:
    """The answer for ``failure`` of a route or of an error handler's own work: its
    §6 body for a RelayError (a Deferred of it while the error's ``pending`` work,
    such as counting a refusal in a table shared with other brokers, is not
    done), ``503`` for anything else."""
    if not failure.check(RelayError):
        return incident(request, failure)
    error = failure.value
    pending = getattr(error, "pending", None)
    if pending is not None:
        return pending.addBoth(lambda _: write_error(request, error))
    return write_error(request, error)


def add_error_handling(app: Klein) -> None:
    """Answer every failure of ``app``'s routes with the §6 body.

    The object ``app`` is bound to answers requests that match no route with
    ``unrouted(request)`` (bytes, or a Deferred of them).
    """

    @app.handle_errors(RelayError)
    def relay_error(api: Any, request, failure: Failure) -> Any:
        return answer_failure(request, failure)

    @app.handle_errors(NotFound, MethodNotAllowed, RequestRedirect)
    def unrouted(api: Any, request, failure: Failure) -> Any:
        # A redirect werkzeug would answer (a "//" in the path) is no route either:
        # the signature covers the path as sent.
        try:
            result = api.unrouted(request)
        except Exception:
            return answer_failure(request, Failure())
        if isinstance(result, Deferred):
            result.addErrback(lambda f: answer_failure(request, f))
        return result

    @app.handle_errors(Exception)
    def unexpected(api: Any, request, failure: Failure) -> bytes:
        return incident(request, failure)
