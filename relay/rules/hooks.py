"""Webhooks (REACH §12): the state the broker keeps per agent, and every decision
about delivering an agent's events to its URL — the allow-list, the backoff,
when an event is skipped and when the webhook is disabled, and the signed
request.

Pure: no reactor, no I/O; times are the ``now`` a caller passes. The delivery
loop (:mod:`relay.broker.webhooks`) applies these decisions; the store keeps the state
as JSON text (:meth:`HookState.to_json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Sequence, Tuple
from urllib.parse import quote, urlsplit

from relay.rules.events import Event, webhook_body
from relay.wire import errors
from relay.wire.signing import sign

MAX_URL_CHARS = 2048
MAX_BACKOFF_SECONDS = 300
TIMEOUT_SECONDS = 10

RETRY = "retry"
SKIP = "skip"
DISABLE = "disable"


@dataclass
class HookState:
    """One agent's webhook: the URL it registered (None when only the config names
    one), the last event acknowledged (or skipped), the tries of the next event, the
    failed tries in a row, and what the operator sees (epoch seconds)."""

    url: Optional[str] = None
    acked: int = 0
    tries: int = 0
    failures: int = 0
    disabled: bool = False
    failing_since: Optional[float] = None
    last_delivered: Optional[float] = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HookState:
        """The state stored as ``text``; unknown fields are ignored."""
        values = json.loads(text)
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def health(self) -> Dict[str, object]:
        """What the dashboard and ``relay stats`` show: never the URL."""
        return {"lastDelivered": self.last_delivered, "failingSince": self.failing_since,
                "disabled": self.disabled, "failures": self.failures}


def check_url(url: str, allow: Sequence[str]) -> None:
    """400 ``bad_request`` naming ``broker.webhookAllow`` unless ``url`` starts with one
    of its prefixes."""
    if not allowed(url, allow):
        raise errors.bad_request(
            "webhook.url must start with one of the prefixes of broker.webhookAllow")


def allowed(url: str, allow: Sequence[str]) -> bool:
    """True when ``url`` starts with a prefix of ``allow``."""
    return any(url.startswith(prefix) for prefix in allow)


def parse_webhook(body: Dict[str, object], keep: object) -> object:
    """The ``webhook`` of a register body: ``keep`` when absent, None to remove it,
    else its URL (an http or https URL of at most 2048 characters, ``url`` its
    only key)."""
    if "webhook" not in body:
        return keep
    hook = body["webhook"]
    if hook is None:
        return None
    if not isinstance(hook, dict):
        raise errors.bad_request("webhook must be an object or null")
    for key in hook:
        if key != "url":
            raise errors.bad_request(f"webhook.{key} is not a webhook field (url)")
    url = hook.get("url")
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS or not _sendable_url(url):
        raise errors.bad_request(
            f"webhook.url must be an http or https URL of at most {MAX_URL_CHARS} characters")
    if "@" in urlsplit(url).netloc:
        # Text before "@" is a user name and password: "http://127.0.0.1:@169.254.169.254/"
        # starts with the webhookAllow prefix "http://127.0.0.1:" yet names another host.
        raise errors.bad_request("webhook.url must not hold a user name or password (@)")
    return url


def _sendable_url(url: str) -> bool:
    """True for an http or https URL with a host and, when it names one, a port
    number (1..65535): one a request can be sent to."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        return False
    if port == 0:
        return False
    try:
        wire_url(url)
    except UnicodeError:  # a host name IDNA cannot encode
        return False
    return True


# What a request target keeps as it is (RFC 3986 unreserved, sub-delims, ":" "@"
# "/" and "%", so an escape already made is not escaped again); anything else,
# spaces, control and non-ASCII characters included, goes percent-encoded (UTF-8).
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?"


def wire_url(url: str) -> str:
    """``url`` as it goes on the wire: ASCII, its path and query percent-encoded
    where the URL left characters a request line cannot carry, a non-ASCII host
    name in IDNA, an empty path as ``/``, without the fragment. The webhook is
    POSTed to this URL and signed over its path and query, so the signature covers
    the request target the receiver sees. Already-encoded URLs are unchanged."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if not netloc.isascii():
        host = (parts.hostname or "").encode("idna").decode("ascii")
        netloc = host + (f":{parts.port}" if parts.port is not None else "")
    path = quote(parts.path or "/", safe=_PATH_SAFE)
    query = quote(parts.query, safe=_QUERY_SAFE)
    return f"{parts.scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def backoff(tries: int) -> float:
    """Seconds before the next try after ``tries`` failed ones: 1, 2, 4 … at most 300."""
    return float(min(2 ** max(0, tries - 1), MAX_BACKOFF_SECONDS))


def delivered(state: HookState, event_id: int, now: float) -> None:
    """The receiver acknowledged ``event_id``."""
    state.acked = event_id
    state.tries = 0
    state.failures = 0
    state.failing_since = None
    state.last_delivered = now


def failed(state: HookState, event_id: int, now: float, max_attempts: int,
           disable_after: int) -> Tuple[str, float]:
    """A try of ``event_id`` failed: ``(DISABLE, 0)`` after ``disable_after`` failed
    tries in a row, ``(SKIP, 0)`` (the event is passed over) after ``max_attempts``
    tries of it, else ``(RETRY, seconds to wait)``."""
    state.tries += 1
    state.failures += 1
    if state.failing_since is None:
        state.failing_since = now
    if state.failures >= disable_after:
        state.disabled = True
        state.tries = 0
        return DISABLE, 0.0
    if state.tries >= max_attempts:
        state.acked = event_id
        state.tries = 0
        return SKIP, 0.0
    return RETRY, backoff(state.tries)


def enabled(state: HookState, url: Optional[str]) -> None:
    """The agent registered ``url`` (None: removed its own): a disabled webhook is
    enabled again."""
    state.url = url
    state.disabled = False
    state.tries = 0
    state.failures = 0
    state.failing_since = None


def request(agent: str, secret: str, url: str, event: Event,
            timestamp: int) -> Tuple[bytes, Dict[bytes, bytes]]:
    """The body and headers of the POST of ``event`` to ``url``: signed as seed §3 with
    the agent's own secret over ``POST``, the path and query of :func:`wire_url`
    (what the request line carries), the timestamp and the body."""
    body = webhook_body(event)
    parts = urlsplit(wire_url(url))
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {
        b"Content-Type": b"application/json",
        b"X-Relay-Agent": agent.encode("utf-8"),
        b"X-Relay-Timestamp": str(timestamp).encode("ascii"),
        b"X-Relay-Event-Id": str(event.id).encode("ascii"),
        b"X-Relay-Signature": sign(secret, "POST", target, timestamp, body).encode("ascii"),
    }
    return body, headers
