"""Every route's answers through the production site, against a recording.

Each case is raw HTTP bytes fed to a connection of the broker's real site (its
request class, its channel, its front resource, the Klein app), over an in-memory
transport with time on a ``task.Clock``. The answers (status line, headers
without ``Date``, body with generated ids replaced by their order of appearance)
are compared with ``tests/site/recordings/site_answers.json``, recorded from the broker
before its HTTP layer was rebuilt on public Twisted: a change of dispatch, of
parser or of writer that changes what a client sees fails here.

``RELAY_RECORD_SITE_ANSWERS=1`` writes the recording instead of comparing (only
for a deliberate change of the wire, which then shows in the diff).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from relay.testing import SECRET, START, build_site, make_config
from relay.wire.signing import sign

RECORDING = os.path.join(os.path.dirname(__file__), "recordings", "site_answers.json")
RECORD = os.environ.get("RELAY_RECORD_SITE_ANSWERS") == "1"

PEER = IPv4Address("TCP", "127.0.0.1", 40000)
HOST = IPv4Address("TCP", "127.0.0.1", 19121)
TS = int(START)
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
                   rb"|\b[0-9a-f]{32}\b|incident [0-9a-f]{12}")


def signed(method: str, target: str, body: Any = None, agent: str = "alpha",
           raw: Optional[bytes] = None, secret: str = SECRET, extra: bytes = b"",
           host: bytes = b"127.0.0.1:19121", version: bytes = b"HTTP/1.1",
           nonce: Optional[str] = None) -> bytes:
    """One raw request, signed per §3 over ``target`` as sent."""
    if raw is None:
        raw = b"" if body is None else json.dumps(body).encode()
    signature = sign(secret, method.upper(), target, TS, raw, agent if nonce else None,
                     nonce).encode()
    if nonce:
        extra += b"X-Relay-Nonce: %s\r\n" % nonce.encode()
    head = (b"%s %s %s\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"X-Relay-Agent: %s\r\nX-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n%s"
            % (method.encode(), target.encode("latin-1"), version, host, agent.encode(), TS,
               signature, extra))
    if raw or method in ("POST", "post"):
        head += b"Content-Length: %d\r\n" % len(raw)
    return head + b"\r\n" + raw


def plain(method: str, target: str, body: bytes = b"", extra: bytes = b"") -> bytes:
    """One raw unsigned request."""
    head = b"%s %s HTTP/1.1\r\nHost: 127.0.0.1:19121\r\n%s" % (
        method.encode(), target.encode("latin-1"), extra)
    if body or method == "POST":
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


def _message(mid: str, to: str = "beta", **more: Any) -> Dict[str, Any]:
    return dict({"id": mid, "to": to, "body": {"text": "hello"}}, **more)


# Requests that need an answer of an earlier one (a lease id) are functions of the
# answers so far.
Case = Tuple[str, Any]

CASES: List[Case] = [
    ("info", plain("GET", "/")),
    ("info with a query", plain("GET", "/?x=1")),
    ("info by POST", plain("POST", "/")),
    ("info HEAD", plain("HEAD", "/")),
    ("register alpha", signed("POST", "/register", {"agent": "alpha", "role": "sender"})),
    ("register beta", signed("POST", "/register", {"agent": "beta", "capabilities": ["x"]},
                             agent="beta")),
    ("register as another", signed("POST", "/register", {"agent": "beta"})),
    ("register unsigned", plain("POST", "/register", b'{"agent":"alpha"}')),
    ("register bad signature", signed("POST", "/register", {"agent": "alpha"},
                                      secret="wrong-secret")),
    ("register not JSON", signed("POST", "/register", raw=b"{not json")),
    ("peers", signed("GET", "/peers")),
    ("peers unsigned", plain("GET", "/peers")),
    ("peers trailing slash", signed("GET", "/peers/")),
    ("peers double slash", signed("GET", "//peers")),
    ("peers escaped", signed("GET", "/p%65ers")),
    ("peers HEAD", signed("HEAD", "/peers")),
    ("peers POST", signed("POST", "/peers", {})),
    ("peers lower-case method", signed("get", "/peers")),
    ("send", signed("POST", "/messages", _message("m-1"))),
    ("send again", signed("POST", "/messages", _message("m-1"))),
    ("send two", signed("POST", "/messages", _message("m-2", replyTo="m-1"))),
    ("send three", signed("POST", "/messages", _message("m-3"))),
    ("send no to", signed("POST", "/messages", {"id": "m-x", "body": {}})),
    ("send array", signed("POST", "/messages", raw=b"[1,2]")),
    ("send unknown recipient", signed("POST", "/messages", _message("m-y", to="nobody"))),
    ("send bad ttl", signed("POST", "/messages", _message("m-z", ttlSeconds="x"))),
    ("send NaN", signed("POST", "/messages", raw=b'{"id":"a","to":"beta","body":NaN}')),
    ("send duplicate keys", signed("POST", "/messages",
                                   raw=b'{"id":"a","id":"b","to":"beta","body":{}}')),
    ("send deep", signed("POST", "/messages", raw=b'{"to":"beta","body":' + b"[" * 200
                         + b"]" * 200 + b"}")),
    ("send too large", signed("POST", "/messages",
                              raw=b'{"to":"beta","body":"' + b"x" * (1024 * 1024) + b'"}')),
    ("send chunked", lambda _: (
        b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1:19121\r\nTransfer-Encoding: chunked\r\n"
        b"X-Relay-Agent: alpha\r\nX-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n\r\n"
        b"%x\r\n%s\r\n0\r\n\r\n" % (TS, sign(SECRET, "POST", "/messages", TS,
                                             json.dumps(_message("m-c")).encode()).encode(),
                                    len(json.dumps(_message("m-c"))),
                                    json.dumps(_message("m-c")).encode()))),
    ("send with nonce", signed("POST", "/messages", _message("m-n"),
                               nonce="abcdefghijklmnop0123")),
    ("send with the nonce again", signed("POST", "/messages", _message("m-n2"),
                                         nonce="abcdefghijklmnop0123")),
    ("send bad nonce", signed("POST", "/messages", _message("m-b"),
                              extra=b"X-Relay-Nonce: short\r\n")),
    ("send old timestamp", lambda _: signed("POST", "/messages", _message("m-o")).replace(
        b"X-Relay-Timestamp: %d" % TS, b"X-Relay-Timestamp: %d" % (TS - 1000))),
    ("send HTTP/1.0", signed("POST", "/messages", _message("m-h"), version=b"HTTP/1.0")),
    ("poll", signed("GET", "/messages?since=&limit=2", agent="beta")),
    ("poll bad limit", signed("GET", "/messages?limit=abc", agent="beta")),
    ("poll bad wait", signed("GET", "/messages?wait=-1", agent="beta")),
    ("poll not UTF-8 query", signed("GET", "/messages?since=%ff", agent="beta")),
    ("receipt", signed("POST", "/messages/m-1/ack", {"ok": True}, agent="beta")),
    ("receipt escaped id", signed("POST", "/messages/m%2D1/ack", {}, agent="beta")),
    ("receipt escaped slash", signed("POST", "/messages/m-1%2Fack", {}, agent="beta")),
    ("receipt unknown", signed("POST", "/messages/nope/ack", {}, agent="beta")),
    ("pull", signed("POST", "/v1/pull", {"agent": "beta", "limit": 2}, agent="beta")),
    ("pull bad limit", signed("POST", "/v1/pull", {"agent": "beta", "limit": "x"},
                              agent="beta")),
    ("pull bad lease", signed("POST", "/v1/pull", {"agent": "beta", "leaseSeconds": 0},
                              agent="beta")),
    ("pull other agent", signed("POST", "/v1/pull", {"agent": "alpha"}, agent="beta")),
    ("ack", lambda answers: signed("POST", "/v1/ack", {
        "messageId": answers["pull"]["messages"][0]["id"],
        "leaseId": answers["pull"]["messages"][0]["leaseId"],
        "outcome": "completed"}, agent="beta")),
    ("ack again", lambda answers: signed("POST", "/v1/ack", {
        "messageId": answers["pull"]["messages"][0]["id"],
        "leaseId": answers["pull"]["messages"][0]["leaseId"],
        "outcome": "completed"}, agent="beta")),
    ("ack with reply", lambda answers: signed("POST", "/v1/ack", {
        "messageId": answers["pull"]["messages"][1]["id"],
        "leaseId": answers["pull"]["messages"][1]["leaseId"],
        "outcome": "completed", "reply": {"id": "r-1", "body": {"text": "done"}}},
        agent="beta")),
    ("ack wrong lease", signed("POST", "/v1/ack", {"messageId": "m-3", "leaseId": "nope",
                                                   "outcome": "completed"}, agent="beta")),
    ("ack bad outcome", signed("POST", "/v1/ack", {"messageId": "m-3", "leaseId": "x",
                                                   "outcome": "maybe"}, agent="beta")),
    ("status", signed("POST", "/v1/status", {"messageIds": ["m-1", "m-2", "m-3", "nope"]})),
    ("status bad ids", signed("POST", "/v1/status", {"messageIds": "m-1"})),
    ("recent", signed("POST", "/v1/recent", {"agent": "beta", "limit": 5}, agent="beta")),
    ("query", signed("POST", "/v1/messages/query", {"agent": "beta", "from": "alpha"},
                     agent="beta")),
    ("query bad filter", signed("POST", "/v1/messages/query", {"agent": "beta",
                                                                "status": "weird"},
                                agent="beta")),
    ("send four", signed("POST", "/messages", _message("m-4"))),
    ("pull the third", signed("POST", "/v1/pull", {"agent": "beta", "limit": 10,
                                                    "leaseSeconds": 60}, agent="beta")),
    ("renew", lambda answers: signed("POST", "/v1/lease/renew", {
        "messageId": answers["pull the third"]["messages"][0]["id"],
        "leaseId": answers["pull the third"]["messages"][0]["leaseId"],
        "leaseSeconds": 120}, agent="beta")),
    ("renew unknown", signed("POST", "/v1/lease/renew", {"messageId": "nope",
                                                          "leaseId": "x"}, agent="beta")),
    ("requeue leased", signed("POST", "/v1/requeue", {"messageId": "m-3"})),
    ("cancel", signed("POST", "/v1/cancel", {"messageId": "m-3", "reason": "no longer"})),
    ("cancel again", signed("POST", "/v1/cancel", {"messageId": "m-3"})),
    ("cancel missing id", signed("POST", "/v1/cancel", {})),
    ("requeue cancelled", signed("POST", "/v1/requeue", {"messageId": "m-3"})),
    ("thread", signed("POST", "/v1/thread", {"agent": "alpha", "rootId": "m-2"})),
    ("thread missing root", signed("POST", "/v1/thread", {"agent": "alpha"})),
    ("unknown route", signed("GET", "/v2/nothing")),
    ("unknown route unsigned", plain("GET", "/v2/nothing")),
    ("not UTF-8 path", signed("GET", "/p%ffers")),
    ("foreign host", signed("GET", "/peers", host=b"evil.example")),
    ("localhost host", signed("GET", "/peers", host=b"localhost:19121")),
    ("wrong method on a route", signed("PUT", "/v1/pull", {})),
    ("malformed request line", b"GARBAGE\r\n\r\n"),
    ("malformed header", b"GET / HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n"),
    ("two lengths", b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                    b"Content-Length: 3\r\n\r\n{}"),
    ("TLS on a plain port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"),
]


def _normalise(data: bytes, seen: Dict[bytes, bytes]) -> str:
    def name(match: re.Match[bytes]) -> bytes:
        value = match.group(0)
        if value.startswith(b"incident "):
            return b"incident <incident>"
        if value not in seen:
            seen[value] = b"<id-%d>" % (len(seen) + 1)
        return seen[value]

    return _UUID.sub(name, data).decode("utf-8", "replace")


def _split(raw: bytes, seen: Dict[bytes, bytes]) -> List[Dict[str, Any]]:
    """The answers on one connection, each as status line, sorted headers and body."""
    answers = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = []
        length = 0
        for line in lines[1:]:
            key, _, value = line.partition(b":")
            key, value = key.strip().lower(), value.strip()
            if key == b"content-length":
                length = int(value)
            if key == b"server":  # twisted.web names its version
                value = re.sub(rb"TwistedWeb/[0-9.a-z]+", b"TwistedWeb/<version>", value)
            if key != b"date":
                headers.append(f"{key.decode()}: {_normalise(value, seen)}")
        body, raw = rest[:length], rest[length:]
        answers.append({"status": lines[0].decode(), "headers": sorted(headers),
                        "body": _normalise(body, seen)})
    return answers


def serve_cases() -> Dict[str, List[Dict[str, Any]]]:
    """Each case on its own connection of one production site; its answers."""
    clock = Clock()
    clock.advance(START)
    config = make_config(rateLimitLoopback=10**6, messageTtlDays=1)
    site = build_site(config, clock)
    seen: Dict[bytes, bytes] = {}
    parsed: Dict[str, Any] = {}
    out: Dict[str, List[Dict[str, Any]]] = {}
    for name, request in CASES:
        raw = request(parsed) if callable(request) else request
        channel = site.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
        channel.makeConnection(transport)
        channel.dataReceived(raw)
        clock.advance(0)
        value = transport.value()
        channel.connectionLost(None)
        out[name] = _split(value, seen)
        if value and b"\r\n\r\n" in value:
            body = value.partition(b"\r\n\r\n")[2]
            try:
                parsed[name] = json.loads(body)
            except ValueError:
                parsed[name] = None
    return out


def test_every_route_answers_as_recorded() -> None:
    answers = serve_cases()
    if RECORD:
        os.makedirs(os.path.dirname(RECORDING), exist_ok=True)
        with open(RECORDING, "w", encoding="utf-8") as f:
            json.dump(answers, f, indent=1, sort_keys=True)
            f.write("\n")
        pytest.skip("recorded")
    with open(RECORDING, encoding="utf-8") as f:
        recorded = json.load(f)
    assert set(answers) == set(recorded)
    for name in recorded:
        assert answers[name] == recorded[name], name
