"""Routing: a request naming a route without parameters exactly goes straight to it;
every other path takes Klein's matching, with the same answers as before."""

from __future__ import annotations

import pytest_twisted
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from relay.store.plugins import open_configured_store
from relay.testing import START, make_config
from tests.support.api import Broker, assert_error


def test_the_app_declares_every_route_and_no_other() -> None:
    table = {
        (method.encode(), rule.rule.encode()): rule.endpoint
        for rule in Broker().api.app.url_map.iter_rules()
        for method in rule.methods or () if method != "HEAD"
    }
    assert table == {
        (b"POST", b"/messages/<path:message_id>/ack"): "receipt",
        (b"GET", b"/"): "root",
        (b"POST", b"/register"): "register",
        (b"GET", b"/peers"): "peers",
        (b"POST", b"/messages"): "send",
        (b"GET", b"/messages"): "poll",
        (b"POST", b"/v1/pull"): "pull",
        (b"POST", b"/v1/ack"): "ack",
        (b"POST", b"/v1/status"): "status",
        (b"POST", b"/v1/recent"): "recent",
        (b"POST", b"/v1/messages/query"): "query",
        (b"POST", b"/v1/lease/renew"): "renew",
        (b"POST", b"/v1/requeue"): "requeue",
        (b"POST", b"/v1/cancel"): "cancel",
        (b"POST", b"/v1/thread"): "thread",
        (b"GET", b"/v1/events"): "events",
        (b"GET", b"/inbox"): "inbox_bare",
        (b"GET", b"/inbox/"): "inbox_page",
        (b"GET", b"/inbox/<path:name>"): "inbox_file",
    }


@pytest_twisted.ensureDeferred
async def test_paths_near_a_fixed_route_are_no_route() -> None:
    b = Broker()
    await b.register("alpha", "beta")
    for method, path in [("GET", "/peers/"), ("HEAD", "/peers"), ("GET", "/%70eers"),
                         ("GET", "//peers"), ("PUT", "/peers"), ("POST", "/v1/pull/")]:
        reply = await b.request("alpha", method, path)
        assert reply.code == 404, (method, path)
        if method != "HEAD":
            assert_error(reply, 404, "not_found")
    assert (await b.get("alpha", "/peers?x=1")).code == 200, "the query is not the path"


@pytest_twisted.ensureDeferred
async def test_a_long_poll_whose_client_went_away_is_no_incident() -> None:
    b = Broker()
    await b.register("alpha", "beta")
    with capturedLogs() as events:
        d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
        b.advance(1)
        assert b.broker.waiters.count("beta") == 1
        b.hang_up()
        d.addErrback(lambda failure: None)
        b.advance(30)
    assert b.broker.waiters.count("beta") == 0
    assert not [formatEvent(e) for e in events if "incident" in formatEvent(e)]


def test_a_write_whose_client_went_away_is_still_made_quietly(tmp_path) -> None:
    """An ack waiting for its commit when the client hangs up is committed all the same
    (nothing waits on the client, so nothing is cancelled) and logs no incident."""
    clock = Clock()
    clock.advance(START)
    store = open_configured_store(make_config(storage="sqlite", dataDir=str(tmp_path)), clock)
    b = Broker(clock=clock, store=store)

    def answered(d):
        b.advance(0)
        return d.result

    for agent in ("alpha", "beta"):
        assert answered(b.post(agent, "/register", {})).code == 200
    msg_id = answered(b.post("alpha", "/messages", {"to": "beta"})).json["id"]
    (leased,) = answered(b.post("beta", "/v1/pull", {})).json["messages"]
    with capturedLogs() as events:
        d = b.post("beta", "/v1/ack", {"messageId": msg_id, "leaseId": leased["leaseId"],
                                       "outcome": "completed"})
        assert not d.called  # held until the turn's commit
        b.hang_up()
        d.addErrback(lambda failure: None)
        b.advance(0)
    (entry,) = answered(b.post("alpha", "/v1/status", {"messageIds": [msg_id]})).json["messages"]
    assert entry["status"] == "done"
    assert not [formatEvent(e) for e in events if "incident" in formatEvent(e)]
    store.close()


@pytest_twisted.ensureDeferred
async def test_an_answer_that_comes_later_is_written_once() -> None:
    b = Broker()
    await b.register("alpha", "beta")
    d = b.post("beta", "/v1/pull", {"waitSeconds": 20})
    b.advance(1)
    assert not d.called
    msg_id = await b.message("alpha", "beta")
    b.flush()
    reply = d.result
    assert reply.code == 200
    assert [m["id"] for m in reply.json["messages"]] == [msg_id]
    assert reply.header("content-type") == "application/json; charset=utf-8"
