"""Message content never reaches the log (spec §1), whatever the request does.

Every event published on the global log publisher during a scenario is
rendered every way an observer could render it (formatted text, the raw
event, any failure's traceback) and searched for a unique marker that was
only ever part of message bodies.
"""

from __future__ import annotations

import gc
import uuid
from typing import List

import pytest_twisted
from twisted.internet.defer import fail
from twisted.logger import LogEvent, capturedLogs, formatEvent

from relay.store.memory import MemoryStore
from relay.testing import new_message
from tests.support.api import Broker, assert_error


def rendered(events: List[LogEvent]) -> str:
    parts = []
    for event in events:
        parts.append(formatEvent(event))
        parts.append(repr(event))
        failure = event.get("log_failure")
        if failure is not None:
            parts.append(failure.getTraceback())
    return "\n".join(parts)


class FailingStore(MemoryStore):
    """A store that fails with the message content in the exception."""

    def add(self, message):
        raise RuntimeError(f"cannot store {message.body!r}")

    def pull(self, agent, limit, lease_seconds, now, rules):
        return fail(ValueError(f"pull broke near {self.records.by_id!r}"))


@pytest_twisted.ensureDeferred
async def test_message_content_never_reaches_the_log():
    marker = f"SECRET-MARKER-{uuid.uuid4().hex}"
    body = {"text": marker, "nested": {"k": [marker]}}
    with capturedLogs() as events:
        b = Broker()
        await b.register("alpha", "beta")
        await b.message("alpha", "beta", id="m1", body=body, ack=True, kind="request")
        await b.post("alpha", "/messages", {"id": "m1", "to": "beta", "body": body})
        await b.poll("beta", "?since=&limit=50")
        await b.post("beta", "/messages/m1/ack", {"status": "error", "error": marker})
        await b.message("alpha", "beta", id="m2", body=body)
        (m,) = await b.pull("beta", limit=1)
        await b.post("beta", "/v1/ack", {"messageId": m["id"], "leaseId": m["leaseId"],
                                         "outcome": "retry", "error": marker})
        await b.post("beta", "/v1/recent", {})
        await b.post("beta", "/v1/messages/query", {"kind": "request"})
        await b.post("alpha", "/v1/status", {"messageIds": ["m1", "m2"]})
        # errors of every kind, each carrying the marker in its body
        assert_error(await b.post("alpha", "/messages", {"to": "alpha", "body": body}),
                     400, "bad_request")
        assert_error(await b.post("alpha", "/messages", {"to": "nobody", "body": body}),
                     404, "no_such_agent")
        assert_error(await b.post("alpha", "/messages", raw=b'{"body": "' + marker.encode()),
                     400, "bad_request")
        assert_error(await b.post("alpha", "/messages", {"to": "beta", "body": body},
                                  secret="wrong"), 401, "unauthenticated")
        assert_error(await b.post("alpha", "/nope", {"body": body}), 404, "not_found")
        big = b'{"to":"beta","body":{"t":"' + marker.encode() * 40000 + b'"}}'
        assert_error(await b.post("alpha", "/messages", raw=big), 400, "bad_request")
        assert_error(await b.post("beta", "/v1/ack", {"messageId": "m2", "leaseId": marker,
                                                      "outcome": "completed"}),
                     409, "not_leased")
        # forced internal errors whose exceptions carry the content
        failing = Broker(store=FailingStore())
        await failing.register("alpha", "beta")
        assert_error(await failing.post("alpha", "/messages", {"to": "beta", "body": body}),
                     503, "busy")
        failing.store.records.insert(new_message("alpha", "beta", failing.clock.seconds(),
                                                 body=body))
        assert_error(await failing.post("beta", "/v1/pull", {}), 503, "busy")
        d = failing.post("beta", "/v1/pull", {"waitSeconds": 5})
        failing.advance(5)
        assert_error(d.result, 503, "busy")
        gc.collect()
    text = rendered(events)
    assert "incident" in text, "the forced 503s were logged (by incident id)"
    assert marker not in text


@pytest_twisted.ensureDeferred
async def test_503_body_carries_no_content():
    marker = f"SECRET-MARKER-{uuid.uuid4().hex}"
    b = Broker(store=FailingStore())
    await b.register("alpha", "beta")
    with capturedLogs() as events:
        reply = await b.post("alpha", "/messages", {"to": "beta", "body": {"t": marker}})
    assert_error(reply, 503, "busy")
    assert marker not in reply.raw.decode()
    incident = reply.json["error"]["message"].rsplit(" ", 1)[-1].rstrip(")")
    assert incident in rendered(events), "the response names the logged incident"


@pytest_twisted.ensureDeferred
async def test_a_lockout_is_logged_once_by_agent_name():
    b = Broker()
    with capturedLogs() as events:
        for _ in range(7):
            await b.post("mallory", "/register", {}, secret="wrong")
    locks = [formatEvent(e) for e in events if "locked" in formatEvent(e)]
    assert locks == ["agent mallory is locked for address 127.0.0.1 after repeated "
                     "authentication failures"]


@pytest_twisted.ensureDeferred
async def test_the_first_429_of_an_address_each_minute_is_logged_without_content():
    marker = f"SECRET-MARKER-{uuid.uuid4().hex}"
    b = Broker(rateLimitLoopback=3)
    await b.register("alpha")
    with capturedLogs() as events:
        for _ in range(6):
            reply = await b.post("alpha", "/messages", {"to": "alpha", "body": {"t": marker}})
        assert_error(reply, 429, "rate_limited")
        b.advance(60)  # the next minute: its first refusal is logged again
        for _ in range(6):
            reply = await b.post("alpha", "/messages", {"to": "alpha", "body": {"t": marker}})
    limited = [formatEvent(e) for e in events if "rate limit" in formatEvent(e)]
    assert limited == ["rate limit: requests from 127.0.0.1 refused over "
                       "broker.rateLimitLoopback (3 a minute); further refusals of this "
                       "address are not logged this minute"] * 2
    assert marker not in rendered(events)
