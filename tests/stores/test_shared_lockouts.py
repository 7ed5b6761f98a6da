"""Lockouts shared by brokers on one store (docs/SECURITY.md, "Brute force and the
lockout"): a refused request is answered only once its failure is counted in the
shared table, so the refusal that locks an agent means every broker refuses it.

The routes run on a ``task.Clock`` with a stand-in for the shared table; the
PostgreSQL tests (``RELAY_TEST_POSTGRES_DSN``, tests/conftest.py) run two brokers
in process on one database.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import deferLater

from relay.testing import SECRET
from relay.wire.signing import auth_headers
from tests.support.api import Broker, answered, assert_error

NONCE = "n0nce-0123456789_AB"


class Counting:
    """A stand-in for the shared lockout table: each failure's count is done when
    the test says so."""

    def __init__(self) -> None:
        self.failures: List[Tuple[str, str]] = []
        self.pending: List[Deferred] = []

    def failed(self, agent: str, address: str) -> Deferred:
        self.failures.append((agent, address))
        d: Deferred = Deferred()
        self.pending.append(d)
        return d

    def succeeded(self, agent: str, address: str) -> None:
        pass

    def unlocked(self, agent: str) -> Deferred:
        return succeed(None)

    def count(self) -> None:
        self.pending.pop(0).callback(None)


def bad_headers(broker: Broker, agent: str, method: str, path: str,
                raw: bytes = b"") -> Dict[str, str]:
    return broker.signed_headers(agent, method, path, raw, secret="wrong-secret")


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/peers"),  # a route without parameters
    ("POST", "/messages/m-1/ack"),  # a route with one
    ("GET", "/nowhere"),  # no route: the refusal comes first
])
@pytest_twisted.ensureDeferred
async def test_a_refusal_is_answered_once_its_failure_is_counted(method, path):
    broker = Broker()
    counting = Counting()
    broker.api.auth.lockout.share(counting)
    d = broker.send(method, path, b"", bad_headers(broker, "alpha", method, path))
    broker.flush()
    assert counting.failures == [("alpha", "127.0.0.1")]
    assert not d.called, "answered before the failure was counted"
    counting.count()
    broker.flush()
    reply = await d
    assert_error(reply, 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_the_refusal_that_locks_waits_too_and_the_next_request_is_403():
    broker = Broker()
    counting = Counting()
    broker.api.auth.lockout.share(counting)
    for _ in range(5):
        d = broker.send("GET", "/peers", b"", bad_headers(broker, "alpha", "GET", "/peers"))
        assert not d.called
        counting.count()
        broker.flush()
        assert_error(await d, 401, "unauthenticated")
    reply = await broker.get("alpha", "/peers")
    assert_error(reply, 403, "locked")
    assert len(counting.pending) == 0, "a locked agent's requests count nothing"


class Claims:
    """A stand-in for the shared nonce table."""

    def __init__(self) -> None:
        self.pending: List[Tuple[Deferred, Optional[str]]] = []

    def claim_nonce(self, agent: str, nonce: str, timestamp: int,
                    address: Optional[str] = None) -> Deferred:
        d: Deferred = Deferred()
        self.pending.append((d, address))
        return d


@pytest_twisted.ensureDeferred
async def test_a_lock_that_arrives_during_the_claim_refuses_the_request():
    """Another broker's lock, heard while this broker claimed the nonce (or found by
    the claim itself), holds: 403, and the route does not run."""
    broker = Broker()
    claims = Claims()
    broker.api.auth.nonces.share(claims)
    raw, headers = signed(broker, "alpha", "GET", "/peers")
    d = broker.send("GET", "/peers", raw, headers)
    (claim, address), = claims.pending
    assert address == "127.0.0.1", "the claim names the address the lock is looked up for"
    broker.api.auth.lockout.lock("alpha", broker.clock.seconds() + 300, "127.0.0.1")
    claim.callback(True)
    broker.flush()
    reply = await d
    assert_error(reply, 403, "locked")
    assert "try again in 5 min" in reply.json["error"]["message"]


def signed(broker: Broker, agent: str, method: str, path: str, body: Any = None,
           nonce: str = NONCE) -> Tuple[bytes, Dict[str, str]]:
    raw = b"" if body is None else json.dumps(body).encode("utf-8")
    headers = auth_headers(SECRET, agent, method, path, int(broker.clock.seconds()), raw, nonce)
    headers["Content-Type"] = "application/json"
    return raw, headers


# -- two brokers on one PostgreSQL database, in process ------------------------------------


@pytest_twisted.ensureDeferred
async def test_after_the_fifth_401_through_a_broker_b_refuses_at_once(two_brokers):
    """Five bad signatures through A; the very next correct request through B,
    sent as soon as A's fifth 401 arrived, is 403 (it was 200 when A answered
    before counting)."""
    dsn, a, b = two_brokers
    await answered(a, a.post("victim", "/register", {}))
    for nonce in range(5):
        raw, headers = signed(a, "victim", "GET", "/peers", nonce=f"{NONCE}{nonce}")
        headers["X-Relay-Signature"] = "0" * 64
        assert_error(await answered(a, a.send("GET", "/peers", raw, headers)), 401,
                     "unauthenticated")
    raw, headers = signed(b, "victim", "GET", "/peers", nonce=NONCE + "good")
    reply = await answered(b, b.send("GET", "/peers", raw, headers))
    assert_error(reply, 403, "locked")
    raw, headers = signed(a, "victim", "GET", "/peers", nonce=NONCE + "on-a")
    assert_error(await answered(a, a.send("GET", "/peers", raw, headers)), 403, "locked")
    raw, headers = signed(b, "other", "GET", "/peers", nonce=NONCE + "other")
    assert (await answered(b, b.send("GET", "/peers", raw, headers))).code == 200


@pytest_twisted.ensureDeferred
async def test_without_a_nonce_b_applies_the_lock_it_is_notified_of(two_brokers):
    dsn, a, b = two_brokers
    for _ in range(5):
        reply = await answered(a, a.send("GET", "/peers", b"",
                                         bad_headers(a, "victim", "GET", "/peers")))
        assert_error(reply, 401, "unauthenticated")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reply = await answered(b, b.get("victim", "/peers"))
        if reply.code == 403:
            break
        await deferLater(reactor, 0.02, lambda: None)
    assert_error(reply, 403, "locked")


@pytest_twisted.ensureDeferred
async def test_a_lock_in_the_shared_table_holds_before_its_notification(two_brokers):
    """The claim of a request's nonce also reads the agent's lock: a lock another
    broker wrote holds on B before B hears of it (here: never)."""
    import psycopg

    dsn, a, b = two_brokers
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO relay_lockouts (agent, source, failures, locked_until, updated) "
                     "VALUES ('victim', '127.0.0.1', 0, %s, %s)", (time.time() + 240, time.time()))
    raw, headers = signed(b, "victim", "GET", "/peers", nonce=NONCE + "locked")
    reply = await answered(b, b.send("GET", "/peers", raw, headers))
    assert_error(reply, 403, "locked")
    assert "try again in 4 min" in reply.json["error"]["message"]
    assert (await answered(b, b.get("other", "/peers"))).code == 200
