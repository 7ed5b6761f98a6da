"""Checking, on an agent's own HTTP server, that a request is a webhook of the relay
(REACH §12) before acting on it.

The broker POSTs each of the agent's events to the agent's webhook URL, signed as
every relay request is (seed §3) but with **the agent's own secret**: over
``POST``, the URL's path and query, ``X-Relay-Timestamp`` and the raw body.
:func:`verify` checks exactly that, with the same clock-skew window the broker
applies to requests (300 s), in constant time, and returns the event.

Pure and framework-free (stdlib only): give it the method, the path with its
query, the headers and the raw body as your server received them.
"""

from __future__ import annotations

import json
from typing import Mapping, Optional

from relay.client.sse import RelayEvent
from relay.wire.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER
from relay.wire.signing import verify as verify_signature

AGENT_HEADER = "X-Relay-Agent"
EVENT_ID_HEADER = "X-Relay-Event-Id"
# The broker refuses requests whose timestamp is further from its clock (seed §3).
SKEW_SECONDS = 300


class WebhookRejected(Exception):
    """The request is no genuine webhook of the relay; :attr:`reason` says which check
    failed (it never holds the body). Answer it ``401`` (or ``400``) and do nothing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _header(headers: Mapping[str, str], name: str) -> Optional[str]:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def verify(
    secret: str,
    method: str,
    target: str,
    headers: Mapping[str, str],
    body: bytes,
    now: float,
    *,
    agent: Optional[str] = None,
    skew_seconds: float = SKEW_SECONDS,
) -> RelayEvent:
    """The event of a webhook request, once its signature, timestamp and shape check out.

    :param secret: the agent's own secret (the one its requests are signed with).
    :param method: the request's method (a webhook is a ``POST``).
    :param target: the path and query of the request as received, e.g.
        ``/hooks/relay?team=a`` (behind a proxy that rewrites paths: the path of
        the URL the agent registered).
    :param headers: the request's headers (any case).
    :param body: the raw body bytes, before any JSON parsing.
    :param now: the current time in epoch seconds.
    :param agent: the agent the webhook must be for (``X-Relay-Agent``), if given.
    :raises WebhookRejected: naming the check that failed.

    Deliveries are at least once: an event may come again (after a lost answer or a
    restart); skip an event id you handled already.
    """
    if method.upper() != "POST":
        raise WebhookRejected("a webhook is a POST")
    if agent is not None and _header(headers, AGENT_HEADER) != agent:
        raise WebhookRejected(f"{AGENT_HEADER} is not the expected agent")
    stamp = _header(headers, TIMESTAMP_HEADER)
    if stamp is None or not stamp.strip().isascii() or not stamp.strip().isdigit():
        raise WebhookRejected(f"{TIMESTAMP_HEADER} is missing or not epoch seconds")
    timestamp = int(stamp.strip())
    if abs(now - timestamp) > skew_seconds:
        raise WebhookRejected(
            f"{TIMESTAMP_HEADER} is more than {skew_seconds:g} s from this clock")
    signature = _header(headers, SIGNATURE_HEADER)
    if not signature or not verify_signature(secret, "POST", target, timestamp, body, signature):
        raise WebhookRejected(f"{SIGNATURE_HEADER} does not match (wrong secret, path or body)")
    try:
        document = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WebhookRejected("the body is not JSON") from None
    if (not isinstance(document, dict) or not isinstance(document.get("id"), str)
            or not isinstance(document.get("event"), str)
            or not isinstance(document.get("data"), dict)):
        raise WebhookRejected('the body is not {"id", "event", "data"}')
    if _header(headers, EVENT_ID_HEADER) not in (None, document["id"]):
        raise WebhookRejected(f"{EVENT_ID_HEADER} is not the body's id")
    return RelayEvent(document["id"], document["event"], document["data"])
