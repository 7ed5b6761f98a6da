"""The broker's site (relay/broker/site.py) on twisted.web: requests in pieces, pipelined
or trickled, large answers to slow readers, idle keep-alive connections, and the cap of
connections per address."""

from __future__ import annotations

import json
import re
from typing import List, Optional, Tuple

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from relay.broker.site import RelaySite
from relay.testing import SECRET, START, make_api
from relay.wire.signing import sign

PEER = IPv4Address("TCP", "127.0.0.1", 40000)
HOST = IPv4Address("TCP", "127.0.0.1", 19121)


def signed(method: str, path: str, body: Optional[dict] = None, agent: str = "alpha",
           extra: bytes = b"") -> bytes:
    raw = b"" if body is None else json.dumps(body).encode()
    signature = sign(SECRET, method, path, int(START), raw).encode()
    length = b"Content-Length: %d\r\n" % len(raw) if body is not None else b""
    return (b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: %s\r\n"
            b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n%s%s\r\n%s"
            % (method.encode(), path.encode(), agent.encode(), int(START), signature,
               length, extra, raw))


# -- the same answers either way ---------------------------------------------

def relay_site(timeout: float = 60.0) -> Tuple[RelaySite, Clock]:
    clock = Clock()
    clock.advance(START)
    api, _, _ = make_api(clock, rateLimitLoopback=10**9)
    api.broker.store.register("beta", START)
    clock.advance(0)
    return RelaySite(api.resource(), reactor=clock, timeout=timeout), clock


def exchange(requests: List[bytes], split: bool) -> List[bytes]:
    """Every request on one fresh keep-alive connection, each whole in one read or
    (``split``) in two: the answers with their Date and lease ids masked."""
    site, clock = relay_site()
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    answers = []
    for raw in requests:
        if split:
            channel.dataReceived(raw[:17])
            channel.dataReceived(raw[17:])
        else:
            channel.dataReceived(raw)
        clock.advance(0)
        answer = re.sub(rb"Date: [^\r]+", b"Date: -", transport.value())
        answers.append(re.sub(rb'"leaseId":"[^"]+"', b'"leaseId":"-"', answer))
        transport.clear()
    return answers


EXCHANGES = [
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    signed("POST", "/register", {"agent": "alpha"}),
    signed("POST", "/messages", {"id": "m-1", "to": "beta", "body": {"text": "hi"}}),
    signed("POST", "/messages", {"id": "m-1", "to": "beta", "body": {"text": "hi"}}),
    signed("POST", "/messages", {"id": "m-2", "to": "beta", "body": {"t": "\u00e9"}},
           extra=b"cookie: a=b\r\ncontent-type: application/json\r\n"),
    signed("GET", "/peers"),
    signed("GET", "/messages?limit=1", agent="beta"),
    signed("POST", "/v1/pull", {"agent": "beta", "limit": 1}, agent="beta"),
    signed("POST", "/v1/ack", {"messageId": "m-1", "leaseId": "nope", "outcome": "completed"},
           agent="beta"),
    signed("POST", "/messages", {"id": "m-3", "to": "beta"}, agent="nobody"),
    b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n\r\n{x}",
    b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /peers HTTP/1.1\r\nHost: evil.example\r\n\r\n",
    b"GET /%ff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    signed("POST", "/messages/gone%2D1/ack", {"status": "ok"}, agent="beta"),
    signed("POST", "/v1/%70ull", {"limit": 1}, agent="beta"),
    signed("DELETE", "/messages"),
    signed("GET", "/peers", extra=b"X-Relay-Agent: beta\r\n"),
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
]


def test_a_request_in_pieces_is_answered_as_one_arriving_whole() -> None:
    whole = exchange(EXCHANGES, split=False)
    split = exchange(EXCHANGES, split=True)
    for request, mine, theirs in zip(EXCHANGES, whole, split):
        assert mine == theirs, request
    assert whole[3].startswith(b"HTTP/1.1 201 Created\r\n")
    assert whole[-1].endswith(b"\r\n\r\n" + whole[0].split(b"\r\n\r\n", 1)[1])
    assert b"Connection: close" in whole[-1]


def test_pipelined_and_trickled_requests_are_answered_in_order() -> None:
    first = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    second = signed("GET", "/peers")
    site, clock = relay_site()
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    channel.dataReceived(first + second + first[:5])
    channel.dataReceived(first[5:])
    clock.advance(0)
    channel.dataReceived(second)  # whole again, after the pipelined ones
    clock.advance(0)
    answers = transport.value().split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200"] * 4
    assert b'"peers"' in answers[1] and b'"peers"' in answers[3]


# -- idle connections: one timestamp per channel, checked by the reaper -----------

def idle_site(timeout: float = 60.0) -> Tuple[RelaySite, Clock]:
    site, clock = relay_site(timeout)
    site.startFactory()
    return site, clock


def connect(site: RelaySite) -> Tuple[object, StringTransport]:
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    return channel, transport


def test_an_idle_keep_alive_connection_closes_after_the_idle_time() -> None:
    site, clock = idle_site(60.0)
    channel, transport = connect(site)
    clock.advance(30)
    channel.dataReceived(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 200")
    clock.pump([0.5] * 118)  # 59 s after the answer
    assert not transport.disconnecting, "each answer starts the idle time again"
    clock.pump([0.5] * 4)
    assert transport.disconnecting
    site.stopFactory()


def test_a_waiting_long_poll_is_not_idle() -> None:
    site, clock = idle_site(5.0)
    channel, transport = connect(site)
    channel.dataReceived(signed("POST", "/v1/pull", {"agent": "beta", "waitSeconds": 20},
                                agent="beta"))
    clock.pump([0.5] * 30)  # 15 s: the pull is still waiting, past the idle time
    assert transport.value() == b"" and not transport.disconnecting
    clock.pump([0.5] * 12)  # answered empty at 20 s; idle from then on
    assert transport.value().startswith(b"HTTP/1.1 200") and not transport.disconnecting
    clock.pump([0.5] * 12)
    assert transport.disconnecting
    site.stopFactory()


def test_twisteds_own_idle_timer_is_not_used() -> None:
    site, clock = idle_site(60.0)
    before = len(clock.getDelayedCalls())
    channel, _ = connect(site)
    for _ in range(3):
        channel.dataReceived(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert len(clock.getDelayedCalls()) == before, "no timer per connection or request"
    site.stopFactory()


# -- connections per address ---------------------------------------------------------------


def test_the_per_address_cap_counts_ipv6_per_64_and_not_loopback():
    from twisted.internet.task import Clock
    from twisted.web.resource import Resource

    site = RelaySite(Resource(), reactor=Clock(), max_connections=100, max_per_address=2)

    def connect(address):
        return site.buildProtocol(address)

    one = [connect(IPv6Address("TCP", f"2001:db8:1:2::{i}", 5000)) for i in (1, 2)]
    assert type(connect(IPv6Address("TCP", "2001:db8:1:2::3", 5000))).__name__ == "_Refused"
    assert type(connect(IPv6Address("TCP", "2001:db8:1:3::1", 5000))).__name__ != "_Refused"
    assert type(connect(IPv4Address("TCP", "192.0.2.1", 5000))).__name__ != "_Refused"
    assert type(connect(IPv4Address("TCP", "192.0.2.1", 5001))).__name__ != "_Refused"
    assert type(connect(IPv4Address("TCP", "192.0.2.1", 5002))).__name__ == "_Refused"
    for _ in range(5):
        assert type(connect(IPv4Address("TCP", "127.0.0.1", 5000))).__name__ != "_Refused"
    site.forget(one[0])
    assert type(connect(IPv6Address("TCP", "2001:db8:1:2::9", 5000))).__name__ != "_Refused"


def test_an_asterisk_target_but_options_is_the_uniform_400() -> None:
    """twisted.web answers ``GET *`` itself: 405 with no body, not the §6 body."""
    for method in (b"GET", b"POST", b"DELETE"):
        site, clock = relay_site()
        channel = site.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
        channel.makeConnection(transport)
        channel.dataReceived(method + b" * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        clock.advance(0)
        head, _, body = transport.value().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), transport.value()
        assert json.loads(body)["error"]["code"] == "bad_request"
        assert transport.disconnecting
    site, clock = relay_site()
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    channel.dataReceived(b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    clock.advance(0)
    assert transport.value().startswith(b"HTTP/1.1 200 OK\r\n")


def test_two_host_headers_are_the_uniform_400() -> None:
    """Whichever comes first: the Host rule must not read one name and a proxy the other."""
    for hosts in ((b"evil.example", b"127.0.0.1"), (b"127.0.0.1", b"127.0.0.1")):
        site, clock = relay_site()
        channel = site.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
        channel.makeConnection(transport)
        channel.dataReceived(b"GET / HTTP/1.1\r\nHost: %s\r\nHost: %s\r\n\r\n" % hosts)
        clock.advance(0)
        head, _, body = transport.value().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), transport.value()
        assert json.loads(body)["error"]["code"] == "bad_request"


# -- a client that shuts its sending side --------------------------------------------------


def test_a_client_that_shut_its_sending_side_gets_its_answer_then_the_close() -> None:
    """``shutdown(SHUT_WR)`` after the request (``nc -N``): an answer that comes later
    (a long poll here; any store write on SQLite) still goes out."""
    from twisted.internet.interfaces import IHalfCloseableProtocol

    site, clock = idle_site(60.0)
    connection, transport = connect(site)
    assert IHalfCloseableProtocol.providedBy(connection)
    connection.dataReceived(signed("POST", "/v1/pull", {"agent": "beta", "waitSeconds": 2},
                                   agent="beta"))
    connection.readConnectionLost()
    assert transport.value() == b"" and not transport.disconnecting
    clock.pump([0.5] * 5)
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"messages":[],"count":0}')
    assert transport.disconnecting
    site.stopFactory()


def test_a_half_close_with_no_whole_request_closes_at_once() -> None:
    site, clock = idle_site(60.0)
    for sent in (b"", b"POST /v1/pull HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
        connection, transport = connect(site)
        connection.dataReceived(sent)
        connection.readConnectionLost()
        assert transport.disconnecting and transport.value() == b""
    site.stopFactory()
