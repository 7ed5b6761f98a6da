"""Per-request CPU cost of the broker without sockets: a steadier figure than the suite.

Feeds signed requests straight into an HTTP channel over an in-memory
transport, for the bare Klein ceiling app and for the relay on each backend,
and prints microseconds per request. No network, no second process, so the
numbers move far less from run to run than the load-generator figures on a
shared machine; they do not include socket I/O. On sqlite every request gets
its own commit (the suite's concurrent clients share commits).

Scenarios: ``send`` (``POST /messages``, ~200-byte bodies), ``send-stream``
(the same while the recipient holds its event stream open, ``GET /v1/events``:
the difference is what writing each ``message`` event to a stream costs) and
``pull-ack`` (``POST /v1/pull`` of 10, then ``POST /v1/ack`` of each; the figure
is per request, eleven requests per batch, and the ceiling serves the same count).
``v2-send`` and ``v2-pull-ack`` are the same on the reference's v2/v3 wire
(WIRE-V2): a ``POST /v1/messages`` of the same text, signed v2 over its
canonical JSON; a pull of 8 (the most that wire leases at once) and an ack of
each with its ``lease_token``, nine requests per batch.

    .venv/bin/python bench/inproc.py [--requests 20000]
        [--scenario send|pull-ack|v2-send|v2-pull-ack]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any, List, Optional, Sequence

# This checkout's relay, whatever the venv has installed.
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import ceiling  # noqa: E402
from twisted.internet.address import IPv4Address  # noqa: E402
from twisted.internet.task import Clock  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402

from relay.broker.assembly import assemble  # noqa: E402
from relay.store.plugins import open_configured_store  # noqa: E402
from relay.testing import SECRET, START, make_config  # noqa: E402
from relay.wire.signing import sign  # noqa: E402
from relay.wire.v2.canonical import canonical_body  # noqa: E402
from relay.wire.v2.signing import sign as sign_v2  # noqa: E402

# Requests per batch of each pull-and-ack scenario: one pull, then an ack per message.
BATCH = {"pull-ack": 11, "v2-pull-ack": 9}

PEER = IPv4Address("TCP", "127.0.0.1", 40000)
HOST = IPv4Address("TCP", "127.0.0.1", 19121)


def signed_sends(count: int, timestamp: int) -> List[bytes]:
    """``count`` raw HTTP requests sending a ~200-byte body from alpha to beta."""
    out = []
    for _ in range(count):
        body = json.dumps({"id": uuid.uuid4().hex, "to": "beta",
                           "body": {"text": "x" * 150}}).encode()
        signature = sign(SECRET, "POST", "/messages", timestamp, body).encode()
        out.append(
            b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nX-Relay-Agent: alpha\r\n"
            b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (timestamp, signature, len(body), body)
        )
    return out


def signed(path: str, value: Any, timestamp: int, agent: str = "alpha") -> bytes:
    """One raw signed HTTP ``POST`` of the JSON ``value`` to ``path``."""
    body = json.dumps(value).encode()
    signature = sign(SECRET, "POST", path, timestamp, body).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nX-Relay-Agent: %s\r\n"
        b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n"
        b"Content-Length: %d\r\n\r\n%s"
        % (path.encode(), agent.encode(), timestamp, signature, len(body), body)
    )


def signed_v2(path: str, value: Any, timestamp: int, agent: str = "alpha") -> bytes:
    """One raw ``POST`` of ``value`` as canonical JSON to ``path``, signed v2."""
    body = canonical_body(value)
    signature = sign_v2(SECRET, agent, "POST", path, timestamp, body).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nX-Agent-Relay-Agent: %s\r\n"
        b"X-Agent-Relay-Timestamp: %d\r\nX-Agent-Relay-Signature: %s\r\n"
        b"Content-Length: %d\r\n\r\n%s"
        % (path.encode(), agent.encode(), timestamp, signature, len(body), body)
    )


def v2_sends(count: int, timestamp: int) -> List[bytes]:
    """``count`` v2 requests from alpha to beta with the text of :func:`signed_sends`."""
    return [signed_v2("/v1/messages", {
        "origin": "alpha", "target": "beta", "kind": "request", "body": "x" * 150,
        "idempotency_key": uuid.uuid4().hex, "execution_mode": "read", "session_ref": "alpha",
        "ttl_seconds": 3600}, timestamp) for _ in range(count)]


def connect(site: Any) -> Any:
    """A keep-alive channel of ``site`` over an in-memory transport."""
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    return channel, transport


def per_request_us(site: Any, clock: Clock, requests: List[bytes]) -> float:
    """Serve every request on one keep-alive channel; microseconds per request."""
    channel, transport = connect(site)
    started = time.perf_counter()
    for raw in requests:
        channel.dataReceived(raw)
        clock.advance(0)
        transport.clear()
    return (time.perf_counter() - started) / len(requests) * 1e6


def pull_ack_us(site: Any, clock: Clock, batches: int, timestamp: int) -> float:
    """Pull batches of 10 as beta and ack each message; microseconds per request.

    The acks are signed as the pull answers arrive, outside the timed part.
    """
    channel, transport = connect(site)
    elapsed = 0.0
    requests = 0
    pull = signed("/v1/pull", {"agent": "beta", "limit": 10}, timestamp, "beta")
    for _ in range(batches):
        started = time.perf_counter()
        channel.dataReceived(pull)
        clock.advance(0)
        elapsed += time.perf_counter() - started
        answer = json.loads(transport.value().split(b"\r\n\r\n", 1)[1])
        transport.clear()
        acks = [
            signed("/v1/ack", {"messageId": m["id"], "leaseId": m["leaseId"],
                               "outcome": "completed"}, timestamp, "beta")
            for m in answer["messages"]
        ]
        started = time.perf_counter()
        for raw in acks:
            channel.dataReceived(raw)
            clock.advance(0)
            if not transport.value().startswith(b"HTTP/1.1 200 "):
                raise SystemExit(f"ack refused: {transport.value()[:200]!r}")
            transport.clear()
        elapsed += time.perf_counter() - started
        requests += 1 + len(acks)
    return elapsed / requests * 1e6


def v2_pull_ack_us(site: Any, clock: Clock, batches: int, timestamp: int) -> float:
    """:func:`pull_ack_us` on the v2 wire: pulls of 8, acks with the lease token."""
    channel, transport = connect(site)
    elapsed = 0.0
    requests = 0
    pull = signed_v2("/v1/pull", {"agent": "beta", "limit": 8}, timestamp, "beta")
    for _ in range(batches):
        started = time.perf_counter()
        channel.dataReceived(pull)
        clock.advance(0)
        elapsed += time.perf_counter() - started
        answer = json.loads(transport.value().split(b"\r\n\r\n", 1)[1])
        transport.clear()
        acks = [
            signed_v2("/v1/ack", {"agent": "beta", "message_id": m["message_id"],
                                  "lease_token": m["lease_token"], "outcome": "completed"},
                      timestamp, "beta")
            for m in answer["messages"]
        ]
        started = time.perf_counter()
        for raw in acks:
            channel.dataReceived(raw)
            clock.advance(0)
            if not transport.value().startswith(b"HTTP/1.1 200 "):
                raise SystemExit(f"ack refused: {transport.value()[:200]!r}")
            transport.clear()
        elapsed += time.perf_counter() - started
        requests += 1 + len(acks)
    return elapsed / requests * 1e6


def baseline_v2_pull_ack(batches: int, timestamp: int) -> None:
    """What :func:`v2_pull_ack_us` does besides serving, for ``bench/instructions.py``."""
    for _ in range(batches * 8):
        signed_v2("/v1/ack", {"agent": "beta", "message_id": uuid.uuid4().hex,
                              "lease_token": uuid.uuid4().hex, "outcome": "completed"},
                  timestamp, "beta")


def open_stream(site: Any, clock: Clock, timestamp: int) -> Any:
    """beta's event stream, held open on its own channel; returns its transport."""
    signature = sign(SECRET, "GET", "/v1/events", timestamp, b"").encode()
    channel, transport = connect(site)
    channel.dataReceived(
        b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: beta\r\n"
        b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n\r\n" % (timestamp, signature))
    clock.advance(0)
    if not transport.value().startswith(b"HTTP/1.1 200 "):
        raise SystemExit(f"GET /v1/events refused: {transport.value()[:200]!r}")
    return transport


def baseline_pull_ack(batches: int, timestamp: int) -> None:
    """What :func:`pull_ack_us` does besides serving: sign as many acks (ids of the
    same length), for ``bench/instructions.py`` to subtract."""
    for _ in range(batches * 10):
        signed("/v1/ack", {"messageId": uuid.uuid4().hex, "leaseId": uuid.uuid4().hex,
                           "outcome": "completed"}, timestamp, "beta")


def relay_site(backend: str, clock: Clock, data_dir: str) -> Any:
    """The relay's site on ``backend`` with the recipient registered."""
    # Without the inbox quota, as the suite runs its brokers: past 10,000 queued
    # messages every send would be a refusal.
    config = make_config(storage=backend, dataDir=data_dir, rateLimitLoopback=10**9,
                         inboxMaxMessages=0, inboxMaxBytes=0)
    store = open_configured_store(config, clock)
    store.register("beta", clock.seconds())
    clock.advance(0)
    return assemble(config, store, clock, listen=False).site


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the per-request cost of the Klein ceiling and of each backend."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--backends", default="memory,sqlite,jsonl")
    parser.add_argument("--scenario", choices=["send", "send-stream", "pull-ack", "v2-send",
                                               "v2-pull-ack"],
                        default="send")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the Klein ceiling")
    parser.add_argument("--baseline", action="store_true",
                        help="prepare everything but serve none of the measured requests "
                             "(bench/instructions.py subtracts this run)")
    args = parser.parse_args(argv)
    clock = Clock()
    clock.advance(START)
    base = None
    if not args.no_ceiling:
        klein = ceiling.klein_site()
        klein.reactor = clock
        base = per_request_us(klein, clock, signed_sends(args.requests, int(START)))
        print(f"{'klein ceiling':14s} {base:7.1f} us/request")
    for backend in [b for b in args.backends.split(",") if b]:
        clock = Clock()
        clock.advance(START)
        with tempfile.TemporaryDirectory() as data_dir:
            site = relay_site(backend, clock, data_dir)
            v2 = args.scenario.startswith("v2-")
            sends = (v2_sends if v2 else signed_sends)(args.requests, int(START))
            batches = args.requests // BATCH.get(args.scenario, 11)
            if args.scenario in ("send", "send-stream", "v2-send"):
                if args.scenario == "send-stream":
                    stream = open_stream(site, clock, int(START))
                cost = 0.0 if args.baseline else per_request_us(site, clock, sends)
                if args.scenario == "send-stream" and not args.baseline:
                    received = stream.value().count(b"event: message")
                    if received != len(sends):
                        raise SystemExit(f"{received} events for {len(sends)} sends")
            elif v2:
                per_request_us(site, clock, sends[: batches * 8])
                if args.baseline:
                    baseline_v2_pull_ack(batches, int(START))
                    cost = 0.0
                else:
                    cost = v2_pull_ack_us(site, clock, batches, int(START))
            else:
                per_request_us(site, clock, sends[: batches * 10])
                if args.baseline:
                    baseline_pull_ack(batches, int(START))
                    cost = 0.0
                else:
                    cost = pull_ack_us(site, clock, batches, int(START))
        share = f"  ({base / cost:.0%} of the ceiling's rate)" if base and cost else ""
        print(f"{backend:14s} {cost:7.1f} us/request{share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
