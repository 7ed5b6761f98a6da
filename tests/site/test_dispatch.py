"""One dispatcher: every route of the main listener runs through Klein, so the
app's error handlers answer on every route, and a client that goes away cancels
whatever its route waits on, on every route alike."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from relay.broker import jsonapi
from relay.broker.loopback import connect, disconnect
from relay.testing import SECRET, START, build_site, make_config
from relay.wire import errors
from relay.wire.signing import sign

# route -> (the Broker method it calls, method, path, body)
ROUTES: Dict[str, Tuple[str, str, str, Any]] = {
    "register": ("register", "POST", "/register", {"agent": "alpha"}),
    "peers": ("peers_page", "GET", "/peers", None),
    "send": ("send", "POST", "/messages", {"to": "beta", "body": {}}),
    "poll": ("poll", "GET", "/messages?limit=1", None),
    "receipt": ("receipt", "POST", "/messages/m-1/ack", {}),
    "pull": ("pull", "POST", "/v1/pull", {"agent": "alpha"}),
    "ack": ("ack", "POST", "/v1/ack", {"messageId": "m", "leaseId": "l",
                                        "outcome": "completed"}),
    "status": ("status", "POST", "/v1/status", {"messageIds": ["m"]}),
    "recent": ("recent", "POST", "/v1/recent", {"agent": "alpha"}),
    "query": ("query", "POST", "/v1/messages/query", {"agent": "alpha"}),
    "renew": ("renew", "POST", "/v1/lease/renew", {"messageId": "m", "leaseId": "l"}),
    "requeue": ("requeue", "POST", "/v1/requeue", {"messageId": "m"}),
    "cancel": ("cancel", "POST", "/v1/cancel", {"messageId": "m"}),
    "thread": ("thread", "POST", "/v1/thread", {"agent": "alpha", "rootId": "m"}),
}


def request_bytes(method: str, target: str, value: Any) -> bytes:
    raw = b"" if value is None else json.dumps(value).encode()
    ts = int(START)
    return (b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: alpha\r\n"
            b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (method.encode(), target.encode(), ts,
               sign(SECRET, method, target, ts, raw).encode(), len(raw), raw))


def site_and_broker() -> Tuple[Any, Any, Clock]:
    clock = Clock()
    clock.advance(START)
    site = build_site(make_config(rateLimitLoopback=10**6), clock)
    return site, site.resource.api.broker, clock


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_the_apps_error_handlers_answer_on_every_route(route: str, monkeypatch) -> None:
    answered: List[str] = []

    def teapot(request, failure) -> bytes:
        answered.append(failure.type.__name__)
        return jsonapi.write_json(request, 418, {"error": {"code": "teapot", "message": "x"}})

    monkeypatch.setattr(jsonapi, "answer_failure", teapot)
    monkeypatch.setattr(jsonapi, "incident", teapot)
    site, broker, clock = site_and_broker()
    name, method, target, value = ROUTES[route]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise errors.wrong_state("refused")

    monkeypatch.setattr(broker, name, refuse)
    protocol, transport = connect(site)
    protocol.dataReceived(request_bytes(method, target, value))
    clock.advance(0)
    assert transport.take().startswith(b"HTTP/1.1 418 "), route
    assert answered == ["RelayError"]

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError()

    monkeypatch.setattr(broker, name, crash)
    protocol.dataReceived(request_bytes(method, target, value))
    clock.advance(0)
    assert transport.take().startswith(b"HTTP/1.1 418 "), route
    assert answered == ["RelayError", "ZeroDivisionError"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_client_that_goes_away_cancels_its_route(route: str, monkeypatch) -> None:
    site, broker, clock = site_and_broker()
    name, method, target, value = ROUTES[route]
    cancelled: List[str] = []
    monkeypatch.setattr(broker, name,
                        lambda *a, **kw: Deferred(lambda _: cancelled.append(route)))
    protocol, transport = connect(site)
    protocol.dataReceived(request_bytes(method, target, value))
    clock.advance(0)
    assert transport.take() == b"" and cancelled == []
    disconnect(protocol)
    assert cancelled == [route]


@pytest.mark.parametrize("method, target", [("get", "/peers"), ("post", "/messages"),
                                            ("Post", "/v1/pull"), ("get", "/")])
def test_a_method_not_in_upper_case_is_no_route(method: str, target: str) -> None:
    site, _, clock = site_and_broker()
    protocol, transport = connect(site)
    protocol.dataReceived(request_bytes(method, target, None))
    clock.advance(0)
    answer = transport.take()
    assert answer.startswith(b"HTTP/1.1 404 "), answer
    assert b'"no route %s %s"' % (method.encode(), target.encode()) in answer
