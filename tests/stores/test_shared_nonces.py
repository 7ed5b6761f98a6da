"""Signed nonces shared by brokers on one store (EXTENSIONS.md §9, docs/SECURITY.md):
a request accepted by one broker is a replay on every other.

The authenticator and the routes run on a ``task.Clock`` with a stand-in for the
shared table; the PostgreSQL tests (``RELAY_TEST_POSTGRES_DSN``, tests/conftest.py)
run two brokers in process on one database, and the table's migration. Two real
``twistd -n relay`` processes are in tests/processes/test_postgres_scaleout.py.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from relay.rules.auth import Authenticator
from relay.testing import SECRET, START, make_config
from relay.wire import errors
from relay.wire.errors import RelayError
from relay.wire.signing import auth_headers
from tests.conftest import open_backend, reset_postgres
from tests.support.api import Broker, Reply, answered, assert_error

NONCE = "n0nce-0123456789_AB"


class Shared:
    """A stand-in for the table the brokers share: records each claim and answers
    it when the test says so."""

    def __init__(self) -> None:
        self.claims: List[Tuple[str, str, int]] = []
        self.addresses: List[Optional[str]] = []
        self.pending: List[Deferred] = []

    def claim_nonce(self, agent: str, nonce: str, timestamp: int,
                    address: Optional[str] = None) -> Deferred:
        self.claims.append((agent, nonce, timestamp))
        self.addresses.append(address)
        d: Deferred = Deferred()
        self.pending.append(d)
        return d

    def answer(self, first: bool) -> None:
        self.pending.pop(0).callback(first)

    def fail(self, error: Exception) -> None:
        self.pending.pop(0).errback(error)


def clock_at(now: float = START) -> Clock:
    c = Clock()
    c.advance(now)
    return c


def nonce_request(auth: Authenticator, agent: str = "alpha", nonce: str = NONCE):
    """The agent, or the Deferred of the shared claim: the HTTP layer's two steps."""
    ts = int(auth.clock.seconds())
    headers = auth_headers(SECRET, agent, "GET", "/peers", ts, b"", nonce)
    signed = auth.verify(b"GET", b"/peers", agent.encode(), str(ts).encode(),
                         headers["X-Relay-Signature"].encode(), b"", nonce.encode())
    assert signed == (agent, nonce, ts, "", "legacy", "seed")
    if auth.shares_nonces and signed.nonce is not None:
        return auth.claim(signed)
    return signed.agent


def refused(d: Deferred) -> RelayError:
    """The RelayError ``d`` failed with (already)."""
    failures: List[Any] = []
    d.addErrback(failures.append)
    (failure,) = failures
    assert isinstance(failure.value, RelayError), failure
    return failure.value


# -- the authenticator --------------------------------------------------------------------


def test_a_nonce_new_here_is_claimed_from_the_shared_table_before_it_is_accepted():
    heard: List[str] = []
    auth = Authenticator(clock_at(), SECRET, {}, lock_after_failures=2, on_failure=heard.append)
    shared = Shared()
    auth.nonces.share(shared)
    d = nonce_request(auth)
    assert isinstance(d, Deferred) and not d.called
    assert shared.claims == [("alpha", NONCE, int(START))]
    shared.answer(True)
    assert d.result == "alpha"
    # The same nonce again is refused from the local table, at once, unasked.
    with pytest.raises(RelayError) as info:
        nonce_request(auth)
    assert (info.value.status, info.value.code) == (401, "unauthenticated")
    assert "replayed" in info.value.message
    assert len(shared.claims) == 1, "a local replay costs no round trip"
    assert heard == ["replayed"]


def test_a_replay_found_by_the_shared_table_is_401_and_does_not_lock():
    heard: List[str] = []
    auth = Authenticator(clock_at(), SECRET, {}, lock_after_failures=2, on_failure=heard.append)
    shared = Shared()
    auth.nonces.share(shared)
    for i in range(4):  # twice the lockout's limit
        d = nonce_request(auth, nonce=f"{NONCE}{i}")
        shared.answer(False)  # another broker accepted it
        error = refused(d)
        assert (error.status, error.code) == (401, "unauthenticated")
        assert error.message == "replayed request (this nonce was used)"
    assert heard == ["replayed"] * 4
    assert auth.lockout.tracked() == (0, 0), "replays count toward no lockout"
    d = nonce_request(auth, nonce=NONCE + "fresh")
    shared.answer(True)
    assert d.result == "alpha"


def test_a_shared_table_that_cannot_tell_is_503_and_counts_nothing():
    heard: List[str] = []
    auth = Authenticator(clock_at(), SECRET, {}, on_failure=heard.append)
    shared = Shared()
    auth.nonces.share(shared)
    d = nonce_request(auth)
    shared.fail(errors.busy("the database is unavailable; try again"))
    error = refused(d)
    assert (error.status, error.code) == (503, "busy")
    assert heard == [] and auth.lockout.tracked() == (0, 0)


def test_requests_without_a_nonce_or_without_sharing_are_answered_at_once():
    auth = Authenticator(clock_at(), SECRET, {})
    assert not auth.shares_nonces
    assert nonce_request(auth) == "alpha", "not shared: no claim"
    shared = Shared()
    auth.nonces.share(shared)
    assert auth.shares_nonces
    ts = int(START)
    headers = auth_headers(SECRET, "alpha", "GET", "/peers", ts, b"")
    signed = auth.verify(b"GET", b"/peers", b"alpha", str(ts).encode(),
                         headers["X-Relay-Signature"].encode(), b"")
    assert signed == ("alpha", None, ts, "", "legacy", "seed")
    assert shared.claims == [], "no nonce, no claim"
    with pytest.raises(ValueError):
        auth.claim(signed)


def test_a_reload_keeps_claiming_from_the_shared_table():
    config = make_config()
    clock = clock_at()
    old = Authenticator.from_config(config, clock)
    shared = Shared()
    old.nonces.share(shared)
    new = Authenticator.from_config(config, clock, replacing=old)
    d = nonce_request(new)
    shared.answer(False)
    assert refused(d).code == "unauthenticated"


@pytest_twisted.ensureDeferred
async def test_stores_of_one_broker_share_no_nonces(tmp_path):
    """memory, sqlite and jsonl: the request path is the local table only."""
    from relay.broker.service import make_api

    for name in ("memory", "sqlite", "jsonl"):
        (tmp_path / name).mkdir()
        store = open_backend(name, tmp_path / name)
        try:
            api = make_api(make_config(storage=name), store, clock_at())
            assert api.auth.nonces.shared is None
            assert nonce_request(api.auth) == "alpha"
        finally:
            await store.close()


# -- the routes -----------------------------------------------------------------------------


def signed(broker: Broker, agent: str, method: str, path: str, body: Any = None,
           nonce: str = NONCE) -> Tuple[bytes, Dict[str, str]]:
    raw = b"" if body is None else json.dumps(body).encode("utf-8")
    headers = auth_headers(SECRET, agent, method, path, int(broker.clock.seconds()), raw, nonce)
    headers["Content-Type"] = "application/json"
    return raw, headers


def shared_broker() -> Tuple[Broker, Shared]:
    broker = Broker()
    shared = Shared()
    broker.api.auth.nonces.share(shared)
    return broker, shared


@pytest_twisted.ensureDeferred
async def test_the_route_runs_only_once_the_shared_table_accepted_the_nonce():
    broker, shared = shared_broker()
    await broker.register("beta")  # no nonce: answered as before
    raw, headers = signed(broker, "alpha", "POST", "/messages", {"to": "beta", "body": {}})
    d = broker.send("POST", "/messages", raw, headers)
    assert shared.claims and not d.called
    assert await broker.broker.store.recent("beta", 10, START, broker.broker.policy.rules) == []
    shared.answer(True)
    broker.flush()
    reply = await d
    assert reply.code == 201, reply
    assert len(await broker.broker.store.recent("beta", 10, START,
                                                broker.broker.policy.rules)) == 1


@pytest_twisted.ensureDeferred
async def test_a_replay_refused_by_the_shared_table_never_reaches_the_route():
    broker, shared = shared_broker()
    await broker.register("beta")
    raw, headers = signed(broker, "alpha", "POST", "/messages", {"to": "beta", "body": {}})
    d = broker.send("POST", "/messages", raw, headers)
    shared.answer(False)
    broker.flush()
    reply: Reply = await d
    assert_error(reply, 401, "unauthenticated")
    assert "replayed" in reply.json["error"]["message"]
    assert await broker.broker.store.recent("beta", 10, START, broker.broker.policy.rules) == []
    # A route with a parameter (Klein's way, not the fixed-route table) too.
    raw, headers = signed(broker, "beta", "POST", "/messages/m-1/ack", {}, nonce=NONCE + "ack")
    d = broker.send("POST", "/messages/m-1/ack", raw, headers)
    shared.answer(False)
    broker.flush()
    assert_error(await d, 401, "unauthenticated")


@pytest_twisted.ensureDeferred
async def test_an_unreachable_shared_table_is_503_busy():
    broker, shared = shared_broker()
    raw, headers = signed(broker, "beta", "POST", "/v1/pull", {"limit": 1})
    d = broker.send("POST", "/v1/pull", raw, headers)
    shared.fail(errors.busy("the database is unavailable; try again"))
    broker.flush()
    assert_error(await d, 503, "busy")


@pytest_twisted.ensureDeferred
async def test_no_route_waits_for_the_claim_a_replay_is_401_first():
    broker, shared = shared_broker()
    for first, status, code in ((True, 404, "not_found"), (False, 401, "unauthenticated")):
        for i, path in enumerate(("/nowhere", "//peers", "/v1/%70ull")):
            raw, headers = signed(broker, "alpha", "GET", path, nonce=f"{NONCE}{i}{first}")
            d = broker.send("GET", path, raw, headers)
            shared.answer(first)
            broker.flush()
            assert_error(await d, status, code)


# -- two brokers on one PostgreSQL database, in process ------------------------------------


def _rows(dsn: str, sql: str) -> List[Tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


@pytest_twisted.ensureDeferred
async def test_a_request_accepted_by_broker_a_is_refused_when_replayed_to_b(two_brokers):
    dsn, a, b = two_brokers
    assert a.api.auth.nonces.shared is a.store
    await answered(a, a.post("beta", "/register", {}))
    raw, captured = signed(a, "alpha", "POST", "/messages", {"to": "beta", "body": {"n": 1}})
    reply = await answered(a, a.send("POST", "/messages", raw, captured))
    assert reply.code == 201, reply
    for _ in range(6):  # more than lockAfterFailures (5): replays lock nobody
        reply = await answered(b, b.send("POST", "/messages", raw, captured))
        assert_error(reply, 401, "unauthenticated")
        assert "replayed" in reply.json["error"]["message"]
    assert_error(await answered(a, a.send("POST", "/messages", raw, captured)), 401,
                 "unauthenticated")
    raw_pull, pull = signed(b, "beta", "POST", "/v1/pull", {"limit": 5}, nonce=NONCE + "pull")
    reply = await answered(b, b.send("POST", "/v1/pull", raw_pull, pull))
    assert [m["body"] for m in reply.json["messages"]] == [{"n": 1}], "stored once"
    reply = await answered(a, a.send("POST", "/v1/pull", raw_pull, pull))
    assert_error(reply, 401, "unauthenticated")
    fresh = signed(b, "alpha", "POST", "/messages", {"to": "beta"}, nonce=NONCE + "fresh")
    assert (await answered(b, b.send("POST", "/messages", *fresh))).code == 201, "not locked"
    assert _rows(dsn, "SELECT count(*) FROM relay_nonces") == [(3,)]


@pytest_twisted.ensureDeferred
async def test_a_broker_that_cannot_reach_the_database_answers_503(two_brokers):
    from tests.support.processes import free_port

    dsn, a, b = two_brokers
    a.store.connections.conninfo = f"postgresql://relay@127.0.0.1:{free_port()}/relay"
    _rows(dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    raw, headers = signed(a, "alpha", "GET", "/peers")
    reply = await answered(a, a.send("GET", "/peers", raw, headers))
    assert_error(reply, 503, "busy")
    # Through B (reconnecting by itself) the nonce was never claimed: a retry
    # signed with it is accepted there, once.
    reply = await answered(b, b.send("GET", "/peers", raw, headers), seconds=15)
    assert reply.code == 200, reply


@pytest_twisted.ensureDeferred
async def test_the_expiry_sweep_forgets_the_nonces_past_the_window(two_brokers):

    dsn, a, _ = two_brokers
    now = int(time.time())
    assert await a.store.claim_nonce("alpha", "old-" + NONCE, now - 400) is True
    assert await a.store.claim_nonce("alpha", NONCE, now) is True
    assert await a.store.claim_nonce("alpha", NONCE, now) is False
    # A dead row not swept yet does not make a later use of its nonce a replay.
    assert await a.store.claim_nonce("alpha", "old-" + NONCE, now) is True
    assert await a.store.claim_nonce("alpha", "gone-" + NONCE, now - 400) is True
    await a.store.sweep_expired(now - 86400, now, a.broker.policy.rules)
    assert sorted(_rows(dsn, "SELECT nonce, expires FROM relay_nonces")) == [
        (NONCE, now + 300), ("old-" + NONCE, now + 300)]


@pytest.mark.postgres
def test_migration_5_adds_the_nonce_table(tmp_path):
    import psycopg

    from relay.store import postgres

    dsn = reset_postgres()
    with psycopg.connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn, target=4)
        assert conn.execute("SELECT to_regclass('relay_nonces')").fetchone() == (None,)
        assert postgres.migrate(conn, target=5) == 4
        assert conn.execute("SELECT max(version) FROM relay_schema").fetchone() == (5,)
        records = postgres.PostgresRecords(conn.cursor())
        with conn.transaction():
            assert postgres.nonce_claim(records, "alpha", NONCE, 1300, 1000) is True
        with conn.transaction():
            assert postgres.nonce_claim(records, "alpha", NONCE, 1300, 1000) is False
            assert postgres.nonce_claim(records, "beta", NONCE, 1300, 1000) is True
        with conn.transaction():
            assert postgres.nonce_forget(records, 1301) == 2
        persistence = conn.execute(
            "SELECT relpersistence FROM pg_class WHERE relname = 'relay_nonces'").fetchone()
        assert persistence == ("p",), "a logged table: it survives a crash and reaches replicas"
