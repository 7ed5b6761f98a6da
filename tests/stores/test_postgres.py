"""The PostgreSQL backend beyond the store contract: options, the driver, migrations,
the sequence lock, optimistic saves, notifications between two stores, and the
shared lockout counters. Needs ``RELAY_TEST_POSTGRES_DSN`` (tests/conftest.py);
the option and payload tests run without it.
"""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import deferLater

from relay.rules import delivery
from relay.rules.auth import Lockout
from relay.store import postgres
from relay.store.plugins import open_configured_store
from relay.testing import RULES, START, Recorder, make_config, make_rules, new_message
from relay.wire.errors import ConfigError
from relay.wire.protocol import LEASED
from tests.conftest import open_backend, postgres_dsn, reset_postgres

# -- options (no driver, no server) ----------------------------------------------------


def parse(section):
    return postgres.parse_options(section, make_config(storage="postgres"))


def test_options_defaults_and_keys():
    options = parse({"dsn": "postgresql://relay@db/relay"})
    assert options == postgres.PostgresOptions(dsn="postgresql://relay@db/relay", pool_size=10,
                                               listen_dsn=None)
    options = parse({"dsn": "host=db", "poolSize": 32, "listenDsn": "host=primary"})
    assert (options.pool_size, options.listen_dsn) == (32, "host=primary")


@pytest.mark.parametrize("section,key,reason", [
    ({}, "broker.postgres.dsn", "is required with broker.storage: postgres"),
    ({"dsn": ""}, "broker.postgres.dsn", "must be a non-empty string"),
    ({"dsn": "x", "poolSize": 0}, "broker.postgres.poolSize", "must be from 1 to 200"),
    ({"dsn": "x", "poolSize": "8"}, "broker.postgres.poolSize", "must be an integer"),
    ({"dsn": "x", "listenDsn": 5}, "broker.postgres.listenDsn", "must be a non-empty string"),
    ({"dsn": "x", "dataDir": "/x"}, "broker.postgres.dataDir", "unknown key"),
])
def test_bad_options_name_the_key(section, key, reason):
    with pytest.raises(ConfigError) as info:
        parse(section)
    assert info.value.key == key and info.value.reason.startswith(reason)


def test_section_of_an_unused_backend_needs_no_dsn():
    config = make_config(storage="memory", postgres={"poolSize": 4})
    assert postgres.parse_options({"poolSize": 4}, config).pool_size == 4


def test_a_missing_driver_stops_the_start_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # what an absent package imports as
    config = make_config(storage="postgres", postgres={"dsn": "host=db"})
    with pytest.raises(ConfigError) as info:
        open_configured_store(config, reactor)
    assert str(info.value) == (
        "broker.storage: postgres needs the psycopg driver, which is not installed: "
        "pip install 'psycopg[binary]>=3.2' in the broker's environment"
    )


def test_a_reactor_without_threads_is_refused_before_connecting():
    """The store runs its operations in worker threads that land through the reactor it
    is given; it takes no other reactor."""
    from twisted.internet.task import Clock

    config = make_config(storage="postgres", postgres={"dsn": "host=db"})
    with pytest.raises(TypeError, match="IReactorThreads"):
        open_configured_store(config, Clock())


@pytest.mark.postgres
def test_an_unreachable_server_stops_the_start_with_one_line(tmp_path):
    postgres_dsn()  # the driver is there, or the test skips as every postgres test does
    from tests.support.processes import free_port

    dsn = f"postgresql://relay@127.0.0.1:{free_port()}/relay"
    config = make_config(storage="postgres", postgres={"dsn": dsn})
    with pytest.raises(ConfigError) as info:
        open_configured_store(config, reactor)
    assert info.value.key == "broker.postgres.dsn"
    assert info.value.reason.startswith("cannot connect: ")
    assert "\n" not in str(info.value)


@pytest.mark.postgres
def test_an_unreachable_listen_dsn_stops_the_start_too(tmp_path):
    """Else the broker would start and never hear the other brokers' writes."""
    dsn = reset_postgres()
    from tests.support.processes import free_port

    listen = f"postgresql://relay@127.0.0.1:{free_port()}/relay"
    config = make_config(storage="postgres", postgres={"dsn": dsn, "listenDsn": listen})
    with pytest.raises(ConfigError) as info:
        open_configured_store(config, reactor)
    assert info.value.key == "broker.postgres.listenDsn"
    assert info.value.reason.startswith("cannot connect: ")
    assert "\n" not in str(info.value)


# -- notification payloads (pure) -------------------------------------------------------


def test_notification_round_trip_and_overflow():
    records = postgres.PostgresRecords(cursor=None)
    assert records.notification("me") is None
    records.changes.ready.update({"beta", "alpha"})
    records.changes.due.add((START + 60, "gamma"))
    token, changes, everything, rest = postgres.heard(records.notification("me"))
    assert (token, everything, rest) == ("me", False, {})
    assert changes.ready == {"alpha", "beta"} and changes.due == {(START + 60, "gamma")}
    records.changes.ready.update(f"agent-{i:05d}" for i in range(2000))
    payload = records.notification("me")
    assert len(payload) <= postgres.NOTIFY_BYTES
    token, changes, everything, _ = postgres.heard(payload)
    assert everything and not changes


@pytest.mark.parametrize("payload", ["", "[1]", '{"r": [1, "a"], "d": [[1], ["x", "a"]]}'])
def test_malformed_notifications_mean_nothing(payload):
    _, changes, everything, _ = postgres.heard(payload)
    assert changes.ready <= {"a"} and not changes.due and not everything


# -- against the server -------------------------------------------------------------------


@pytest.fixture
def dsn():
    return reset_postgres()


def connect(dsn, autocommit=False):
    import psycopg

    return psycopg.connect(dsn, autocommit=autocommit)


@pytest.mark.postgres
def test_several_brokers_migrating_at_once_migrate_once(dsn):
    errors = []
    barrier = threading.Barrier(4)

    def start() -> None:
        try:
            with connect(dsn, autocommit=True) as conn:
                barrier.wait(5)
                postgres.migrate(conn)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    with connect(dsn) as conn:
        rows = conn.execute("SELECT version FROM relay_schema ORDER BY 1").fetchall()
    assert rows == [(v,) for v in range(1, postgres.SCHEMA_VERSION + 1)]


@pytest.mark.postgres
def test_numbered_migrations_run_in_order_once(dsn):
    def script(version):
        if version == 1:
            return postgres.migration_script(1)
        return f"CREATE TABLE relay_extra_{version} (x integer)"

    with connect(dsn, autocommit=True) as conn:
        assert postgres.migrate(conn, target=1, script=script) == 0
        assert postgres.migrate(conn, target=3, script=script) == 1
        assert postgres.migrate(conn, target=3, script=script) == 3
        versions = [r[0] for r in conn.execute("SELECT version FROM relay_schema ORDER BY 1")]
        assert versions == [1, 2, 3]
        conn.execute("SELECT * FROM relay_extra_2, relay_extra_3")
        with pytest.raises(ConfigError) as info:
            postgres.migrate(conn, target=2, script=script)
    assert "newer than this broker's 2" in info.value.reason


def _records(conn):
    return postgres.PostgresRecords(conn.cursor())


@pytest.mark.postgres
def test_migration_4_counts_the_pending_messages_already_stored(dsn):
    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn, target=3)
        for i, (to, status, body) in enumerate([
                ("beta", "queued", '{"t":"é"}'), ("beta", "leased", "{}"),
                ("beta", "done", '{"big":"xxxxxxxx"}'), ("gamma", "failed", "{}"),
                ("gamma", "queued", '{"t":"😀"}')]):
            conn.execute(
                "INSERT INTO relay_messages (id, sender, recipient, ts, type, body, ack, kind,"
                " status, attempts, created) VALUES (%s, 'alpha', %s, 't', 'message', %s,"
                " false, 'message', %s, 0, 0)", (f"m{i}", to, body, status))
        assert postgres.migrate(conn, target=4) == 3
        records = _records(conn)
        assert records.usage("beta") == (2, len('{"t":"é"}'.encode()) + 2)
        assert records.usage("gamma") == (1, len('{"t":""}') + 4)
        assert records.usage("nobody") == (0, 0)


@pytest.mark.postgres
def test_migration_8_counts_the_envelope_strings_of_the_pending_messages(dsn):
    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn, target=7)
        for i, (to, status, parent) in enumerate([
                ("beta", "queued", "é" * 300), ("beta", "done", "x" * 900),
                ("beta", "leased", None)]):
            conn.execute(
                "INSERT INTO relay_messages (id, sender, recipient, ts, type, body, ack, kind,"
                " status, attempts, created, parent_id, root_id) VALUES (%s, 'alpha', %s, 't',"
                " 'message', '{}', false, 'message', %s, 0, 0, %s, %s)",
                (f"m{i}", to, status, parent, parent))
        assert postgres.migrate(conn) == 7
        envelope = len("m0" "alpha" "beta") + 2 * 600 + 2
        assert _records(conn).usage("beta") == (2, envelope + len("m2" "alpha" "beta") + 2)


@pytest.mark.postgres
def test_migration_13_keeps_every_message_without_a_completion_time(dsn):
    """Messages stored under migration 12 read the same after 13, with no completion
    time; the expiry sweep then keeps a v2/v3 one past its TTL and removes a seed-wire
    one, and reads none of them again."""
    from relay.store import records as ops
    from relay.wire.protocol import EXPIRED
    from relay.wire.v2 import views

    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn, target=12)
        for i, (status, v2) in enumerate([("queued", None), ("queued", "v2"), ("done", "v2"),
                                          ("failed", None), ("leased", "v2")]):
            conn.execute(
                "INSERT INTO relay_messages (id, sender, recipient, ts, type, body, ack, kind,"
                " status, attempts, created, expires_at, v2) VALUES (%s, 'alpha', 'beta', 't',"
                " 'message', '{}', false, 'request', %s, 0, %s, %s, %s)",
                (f"m{i}", status, START, START + 60,
                 views.v2_meta("read", "", False) if v2 else None))
        assert postgres.migrate(conn) == 12
        with conn.transaction():
            records = _records(conn)
            found = [records.get(f"m{i}") for i in range(5)]
            assert [m.status for m in found] == ["queued", "queued", "done", "failed", "leased"]
            assert all(m.completed_at is None and m.expires_at == START + 60 for m in found)
            assert ops.expire(records, START - 1, START + 61, RULES, 100) == (4, 4)
            kept = {f"m{i}": records.get(f"m{i}") for i in range(5)}
            assert {k: m.status for k, m in kept.items() if m is not None} == {
                "m1": EXPIRED, "m2": "done", "m4": EXPIRED}
            assert ops.expire(records, START - 1, START + 62, RULES, 100) == (0, 0)


@pytest.mark.postgres
def test_the_usage_of_a_new_message_counts_its_envelope_strings(dsn):
    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn)
        records = _records(conn)
        message = new_message("alpha", "beta", START, id="i" * 256, body={},
                              rootId="é" * 256, replyTo="r")
        records.insert(message)
        assert records.usage("beta") == (1, message.stored_bytes())
        assert message.stored_bytes() == 256 + 512 + 1 + len("alpha" "beta" "{}")


@pytest.mark.postgres
def test_a_senders_dead_letters_are_read_from_the_failed_rows(dsn):
    """A query of the sent box for ``failed`` does not walk the sender's sent box: the
    plan reads the partial index of its failed rows (``relay dead``, box all, finds
    them too)."""
    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn)
        conn.execute(
            "INSERT INTO relay_messages (id, sender, recipient, ts, type, body, ack, kind,"
            " status, attempts, created) SELECT 'm' || i, 'alpha', 'beta', 't', 'message',"
            " '{}', false, 'request', CASE WHEN i % 1000 = 0 THEN 'failed' ELSE 'done' END,"
            " 0, 0 FROM generate_series(1, 5000) AS i")
        # the rest of the fleet's dead letters, and the last two to alpha
        conn.execute(
            "INSERT INTO relay_messages (id, sender, recipient, ts, type, body, ack, kind,"
            " status, attempts, created) SELECT 'f' || i, 'gamma-' || (i % 50),"
            " CASE WHEN i > 4998 THEN 'alpha' ELSE 'beta' END, 't', 'message', '{}',"
            " false, 'request', 'failed', 0, 0 FROM generate_series(1, 5000) AS i")
        conn.execute("ANALYZE relay_messages")
        records = _records(conn)
        sent = ["m5000", "m4000", "m3000", "m2000", "m1000"]
        for box, newest in (("sent", sent), ("all", ["f5000", "f4999"] + sent)):
            filters = {"status": "failed", "box": box}
            found = records.listing("alpha", box, 10, filters, START)
            assert [m.id for m in found] == newest
        # a status no message has is still a filter, bound as given
        assert records.listing("alpha", "sent", 10, {"status": "lost"}, START) == []
        filters = {"status": "failed", "box": "sent"}
        params = {name: filters.get(name) for name, _ in postgres.FILTERS}
        params.update(agent="alpha", limit=10, now=START)
        plan = generic_plan(conn, postgres.listing_statement("sent", filters), params)
        assert "relay_messages_sent_failed" in plan and "Sort" not in plan, plan


def generic_plan(conn, sql, params):
    """The plan of ``sql`` (``%(name)s`` placeholders) without its parameters' values:
    the plan psycopg's prepared statements (from their sixth run) may settle on."""
    from psycopg import sql as sql_text

    names = []

    def number(match):
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    conn.execute("PREPARE generic AS " + re.sub(r"%\((\w+)\)s", number, sql))
    try:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        arguments = sql_text.SQL(", ").join(sql_text.Literal(params[name]) for name in names)
        rows = conn.execute(sql_text.SQL("EXPLAIN EXECUTE generic({})").format(arguments))
        return "\n".join(row[0] for row in rows)
    finally:
        conn.execute("RESET plan_cache_mode")
        conn.execute("DEALLOCATE generic")


@pytest.mark.postgres
def test_a_recipients_numbers_commit_in_order(dsn):
    """The second sender to an agent takes its number only after the first commits."""
    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn)
    first, second = connect(dsn), connect(dsn)
    try:
        assert _records(first).insert(new_message("a", "beta", START, id="first"))
        done = threading.Event()
        seqs = {}

        def insert_second() -> None:
            message = new_message("b", "beta", START, id="second")
            assert _records(second).insert(message)
            seqs["second"] = message.seq
            second.commit()
            done.set()

        t = threading.Thread(target=insert_second)
        t.start()
        assert not done.wait(0.3), "the second insert waits for the first transaction"
        # Another recipient is not held up.
        other = connect(dsn)
        assert _records(other).insert(new_message("a", "gamma", START, id="other"))
        other.commit()
        other.close()
        first.commit()
        assert done.wait(5)
        t.join(5)
        first_seq = first.execute("SELECT seq FROM relay_messages WHERE id = 'first'").fetchone()
        assert seqs["second"] > first_seq[0]
    finally:
        first.close()
        second.close()


@pytest.mark.postgres
def test_a_save_that_lost_a_race_conflicts(dsn):
    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn)
        _records(conn).insert(new_message("a", "beta", START, id="m"))
    one, two = connect(dsn), connect(dsn)
    try:
        mine, theirs = _records(one), _records(two)
        a, b = mine.get("m"), theirs.get("m")
        before = a.state()
        a.error, b.error = "mine", "theirs"
        mine.save([a], [before])
        one.commit()
        with pytest.raises(postgres.Conflict):
            theirs.save([b], [before])
        two.rollback()
        assert _records(two).get("m").error == "mine"
    finally:
        one.close()
        two.close()


@pytest.mark.postgres
def test_a_reply_another_broker_stored_after_the_duplicate_rule_read_runs_the_ack_again(dsn):
    """Two brokers settle the same ack with a reply at once: the one whose rule read
    no reply, and whose insert then met the other's committed one, is run again and
    answered as the duplicate it is, not 409."""
    from relay.store import records as ops

    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn)
        _records(conn).insert(new_message("alpha", "beta", START, id="q", kind="request"))
        (leased,) = ops.pull(_records(conn), "beta", 1, 60, START, RULES)
    transition = delivery.ack("beta", leased.lease_id, "completed", None, RULES,
                              reply={"id": "r1", "body": {}, "ack": False, "kind": "reply"})
    one, two = connect(dsn), connect(dsn)
    try:
        def overtaken(message, stored, now):
            assert stored is None
            first = ops.settle(_records(one), "q", transition, now, RULES)
            one.commit()  # the other broker's ack commits between the read and the insert
            assert first["duplicate"] is False
            return transition.decide(message, stored, now)

        with pytest.raises(ops.Raced):
            ops.settle(_records(two), "q", delivery.WithStored("r1", overtaken), START, RULES)
        two.rollback()
        again = ops.settle(_records(two), "q", transition, START, RULES)
        assert again == {"ok": True, "status": "done", "attempts": 0, "replyId": "r1",
                         "duplicate": True}
    finally:
        one.close()
        two.close()


@pytest.mark.postgres
def test_an_operation_that_raced_is_run_again_in_a_new_transaction(dsn):
    from relay.store import records as ops

    with connect(dsn, autocommit=True) as conn:
        postgres.migrate(conn)
    connections = postgres.Connections(postgres.conninfo_with_defaults(dsn), 1, "token")
    tries = []

    def operation(records):
        tries.append(1)
        if len(tries) == 1:
            raise ops.Raced("r1")
        return "answered"

    try:
        assert connections.interact(None, operation, ()).result == "answered"
        assert len(tries) == 2
    finally:
        connections.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_a_claim_gives_the_lease_of_delivery_lease(tmp_path, dsn):
    store = open_backend("postgres", tmp_path)
    try:
        sent = new_message("alpha", "beta", START, id="m")
        assert await store.add(sent, RULES)
        queued = await store.find("m", START)
        (claimed,) = await store.pull("beta", 5, 30, START, RULES)
        expected = queued.copy()
        delivery.lease(expected, 30, START)
        expected.lease_id = claimed.lease_id
        assert claimed.state() == expected.state()
        assert claimed.status == LEASED and len(claimed.lease_id) == 32
    finally:
        await store.close()


async def _heard(recorder: Recorder, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if recorder.heard:
            return recorder.take()
        d = Deferred()
        reactor.callLater(0.01, d.callback, None)
        await d
    return recorder.take()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_changes_of_one_store_reach_the_other(tmp_path, dsn):
    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        heard, mine = Recorder(), Recorder()
        b.subscribe(heard)
        a.subscribe(mine)
        await a.register("beta", START)
        assert await b.is_registered("beta") is True
        assert await a.add(new_message("alpha", "beta", START, id="x"), RULES)
        assert await _heard(heard) == ({"beta"}, set())
        assert mine.take() == ({"beta"}, set())  # its own, at once
        (m,) = await b.pull("beta", 1, 60, START, RULES)
        assert await _heard(mine) == (set(), {(START + 60, "beta")}), "a deadline set on B"
        heard.take()
        await b.add(new_message("alpha", "gamma", START, id="y"), RULES)
        assert await _heard(mine) == ({"gamma"}, set())
        assert heard.take() == ({"gamma"}, set())
        (m,) = await a.pull("gamma", 1, 60, START, RULES)
        assert await _heard(heard) == (set(), {(START + 60, "gamma")})
    finally:
        await a.close()
        await b.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_the_inbox_quota_holds_exactly_across_brokers(tmp_path, dsn):
    from twisted.internet.defer import DeferredList

    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        rules = make_rules(inbox_max_messages=25)
        sends = [store.add(new_message("alpha", "beta", START, id=f"q{i}-{n}"), rules)
                 for i in range(20) for n, store in enumerate((a, b))]
        results = await DeferredList(sends, consumeErrors=True)
        stored = [r for ok, r in results if ok and r is True]
        refused = [r.value.code for ok, r in results if not ok]
        assert (len(stored), refused) == (25, ["inbox_full"] * 15)
        assert len(await a.recent("beta", 100, START, RULES)) == 25
        forgotten = await b.forget_peers(START + 1)
        assert forgotten == []
    finally:
        await a.close()
        await b.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_forgetting_on_one_broker_reaches_the_others_cache(tmp_path, dsn):
    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        await a.register("idle", START)
        assert await b.is_registered("idle") is True
        assert await a.forget_peers(START + 1) == ["idle"]
        for _ in range(100):
            if await maybeDeferred(b.is_registered, "idle") is False:
                break
            await deferLater(reactor, 0.02, lambda: None)
        assert await maybeDeferred(b.is_registered, "idle") is False
    finally:
        await a.close()
        await b.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_lockout_counts_are_shared(tmp_path, dsn):
    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        lockout_a = Lockout(reactor, after=3, seconds=300)
        lockout_b = Lockout(reactor, after=3, seconds=300)
        lockout_a.share(a.share_lockouts(lockout_a))
        lockout_b.share(b.share_lockouts(lockout_b))
        await _settle()
        await lockout_a.failed("x", "10.0.0.1").shared
        await lockout_b.failed("x", "10.0.0.1").shared
        await _settle()
        # the third failure from one address, counted on two brokers: A knows of the
        # lock once the count is done
        await lockout_a.failed("x", "10.0.0.1").shared
        assert lockout_a.is_locked("x", "10.0.0.1")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not lockout_b.is_locked("x", "10.0.0.1"):
            await _settle(0.02)
        assert lockout_b.is_locked("x", "10.0.0.1")
        assert not lockout_a.is_locked("x", "10.0.0.2") and not lockout_b.is_locked("x", "::1")
        # a success on one broker resets the count the other one started
        await lockout_a.failed("y", "10.0.0.1").shared
        await lockout_a.failed("y", "10.0.0.1").shared
        await _settle()
        lockout_b.succeeded("y", "10.0.0.1")
        await _settle()
        lockout_a.clear("y", "10.0.0.1")
        await lockout_b.failed("y", "10.0.0.1").shared
        assert not lockout_a.is_locked("y", "10.0.0.1")
        assert not lockout_b.is_locked("y", "10.0.0.1")
    finally:
        await a.close()
        await b.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_failures_from_three_addresses_through_two_brokers_lock_the_agent(tmp_path, dsn):
    """The shared count follows Lockout's rules: five failures from three addresses,
    spread over two brokers that each saw fewer, lock the agent on both; an
    operator's unlock on one clears it on both."""
    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        lockout_a = Lockout(reactor, after=5, seconds=300)
        lockout_b = Lockout(reactor, after=5, seconds=300)
        lockout_a.share(a.share_lockouts(lockout_a))
        lockout_b.share(b.share_lockouts(lockout_b))
        await _settle()
        for lockout, address in ((lockout_a, "10.0.0.1"), (lockout_b, "10.0.0.2"),
                                 (lockout_a, "10.0.0.1"), (lockout_b, "10.0.0.2")):
            await lockout.failed("x", address).shared
        assert not lockout_a.is_locked("x", "10.9.9.9")
        counted = lockout_a.failed("x", "2001:db8::1")
        assert counted.locked is None, "A saw three failures: no lock of its own"
        await counted.shared
        assert lockout_a.is_locked("x", "10.9.9.9"), "the shared count locked x everywhere"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not lockout_b.is_locked("x", "10.9.9.9"):
            await _settle(0.02)
        assert lockout_b.is_locked("x", "10.9.9.9")
        live, cleared = lockout_b.unlock("x")
        assert live == 1
        await cleared
        assert not lockout_b.is_locked("x", "10.9.9.9")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and lockout_a.is_locked("x", "10.9.9.9"):
            await _settle(0.02)
        assert not lockout_a.is_locked("x", "10.9.9.9")
        assert _rows(dsn, "SELECT count(*) FROM relay_lockouts WHERE agent = 'x'") == [(0,)]
    finally:
        await a.close()
        await b.close()


def _rows(dsn: str, sql: str) -> list:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


async def _settle(seconds: float = 0.3) -> None:
    d = Deferred()
    reactor.callLater(seconds, d.callback, None)
    await d


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_racing_sweeps_leave_one_failure_notice_per_request(tmp_path, dsn):
    """Both brokers sweep the same lapsed leases and the same expired requests at
    once, several times over: each request that failed has exactly one notice."""
    from twisted.internet.defer import gatherResults

    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        rules = make_rules(max_deliveries=1)
        lapsing = [f"lapse-{i}" for i in range(30)]
        expiring = [f"expire-{i}" for i in range(30)]
        for n, mid in enumerate(lapsing + expiring):
            store = (a, b)[n % 2]
            ttl = 60 if mid.startswith("expire") else None
            assert await store.add(new_message("alpha", "beta", START, ttl_seconds=ttl,
                                               id=mid, kind="request"), rules)
        leased = await a.pull("beta", 30, 10, START, rules)
        assert sorted(m.id for m in leased) == sorted(lapsing)
        later = START + 120
        sweeps = []
        for _ in range(4):
            for store in (a, b):
                sweeps.append(store.sweep_leases(later, rules))
                sweeps.append(store.sweep_expired(START - 86400, later, rules))
        await gatherResults(sweeps, consumeErrors=True)
        notices = await b.recent("alpha", 500, later, rules)
        about = sorted(m.reply_to for m in notices)
        assert about == sorted(lapsing + expiring), "one notice per failed request"
        assert all(m.kind == "reply" for m in notices)
    finally:
        await a.close()
        await b.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_after_a_reconnect_the_deadlines_set_meanwhile_are_learnt(tmp_path, dsn):
    """B was not listening when A leased a message and stored a delayed one: once
    its LISTEN connection is back, B learns both deadlines, not only who has work."""
    a = open_backend("postgres", tmp_path / "a")
    b = None
    try:
        now = time.time()
        assert await a.add(new_message("alpha", "beta", now, id="held"), RULES)
        assert await a.add(new_message("alpha", "gamma", now, id="later", delay_seconds=60),
                           RULES)
        (leased,) = await a.pull("beta", 1, 30, now, RULES)
        b = open_backend("postgres", tmp_path / "b")
        heard = Recorder()
        b.subscribe(heard)
        b._listening(False)  # as after a reconnect
        deadline = time.monotonic() + 5
        due = set()
        while time.monotonic() < deadline and len(due) < 2:
            await _settle(0.05)
            due |= heard.take()[1]
        assert {agent for _, agent in due} == {"beta", "gamma"}
        when = dict((agent, at) for at, agent in due)
        assert when["beta"] == pytest.approx(leased.lease_until / 1000.0)
        assert when["gamma"] == pytest.approx(now + 60, abs=1)
    finally:
        await a.close()
        if b is not None:
            await b.close()


@pytest_twisted.ensureDeferred
@pytest.mark.postgres
async def test_a_lock_decided_on_one_brokers_own_count_holds_on_the_others(tmp_path, dsn):
    """A success through B reset the shared count while A's failures were on their
    way to the database (its notice not yet heard by A); A still locks on its own
    count, and that lock reaches B."""
    a = open_backend("postgres", tmp_path / "a")
    b = open_backend("postgres", tmp_path / "b")
    try:
        lockout_a = Lockout(reactor, after=3, seconds=300)
        lockout_b = Lockout(reactor, after=3, seconds=300)
        lockout_a.share(a.share_lockouts(lockout_a))
        lockout_b.share(b.share_lockouts(lockout_b))
        await _settle()
        await lockout_a.failed("x", "10.0.0.1").shared
        await lockout_a.failed("x", "10.0.0.1").shared
        await _settle()
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:  # B's reset, before A hears it
            conn.execute("DELETE FROM relay_lockouts WHERE agent = 'x'")
        counted = lockout_a.failed("x", "10.0.0.1")
        assert counted.locked == "10.0.0.1", "A's own third failure locks it"
        await counted.shared
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not lockout_b.is_locked("x", "10.0.0.1"):
            await _settle(0.02)
        assert lockout_b.is_locked("x", "10.0.0.1")
        lockout_c = Lockout(reactor, after=3, seconds=300)
        c = open_backend("postgres", tmp_path / "c")
        try:
            lockout_c.share(c.share_lockouts(lockout_c))
            await _settle()
            assert lockout_c.is_locked("x", "10.0.0.1"), "a broker started later loads the lock"
            assert not lockout_c.is_locked("x", "10.0.0.2")
        finally:
            await c.close()
    finally:
        await a.close()
        await b.close()
