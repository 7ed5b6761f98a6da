"""Shared fixtures: a store per registered backend, a clock, a PostgreSQL database."""

from __future__ import annotations

import os
import subprocess
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from relay.store.plugins import store_factories
from relay.testing import START, make_config

# Brokers started by the tests (in-process and as real processes, which inherit the
# environment) skip the start-up warm-up: a test wants the broker at once. The
# warm-up has tests of its own that ask for it.
os.environ.setdefault("RELAY_WARMUP_SECONDS", "0")

# Every registered backend plugin runs the store contract.
BACKENDS = tuple(sorted(store_factories()))

POSTGRES_ENV = "RELAY_TEST_POSTGRES_DSN"
# Set by .ci/run: a PostgreSQL test that would skip fails instead.
POSTGRES_REQUIRED_ENV = "RELAY_TEST_POSTGRES_REQUIRED"
POSTGRES_SKIP = (
    f"PostgreSQL tests need {POSTGRES_ENV}, a libpq connection string of a server where "
    "they may create and drop a database, e.g. "
    f"{POSTGRES_ENV}=postgresql://postgres@127.0.0.1:5432/postgres"
)
_postgres = {}


def skip_postgres(reason: str) -> None:
    """Skip the calling PostgreSQL test, or fail it where they are required."""
    if os.environ.get(POSTGRES_REQUIRED_ENV):
        pytest.fail(f"{POSTGRES_REQUIRED_ENV} is set, but: {reason}", pytrace=False)
    pytest.skip(reason)


# -- markers -------------------------------------------------------------------------
# pyproject's markers say what a test needs beyond memory. A test that starts a process
# without ``process``, or reaches PostgreSQL without ``postgres``, fails with the marker
# to add: the fast lane (``make test-fast``, which deselects both) then never runs a
# test that is slow for a reason it does not show.
_current = {}


def pytest_collection_modifyitems(items) -> None:
    """A test run on the postgres backend (a ``"postgres"`` parameter) is marked postgres."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "postgres" in params.values() or "two_brokers" in item.fixturenames:
            item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    _current["item"] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item) -> None:
    _current.pop("item", None)


def require_marker(name: str, what: str) -> None:
    """Fail the running test unless it carries marker ``name``."""
    item = _current.get("item")
    if item is not None and item.get_closest_marker(name) is None:
        pytest.fail(f"{item.nodeid} {what}: mark it @pytest.mark.{name} "
                    f"(or pytestmark = pytest.mark.{name} for its module)", pytrace=False)


@contextmanager
def _unguarded() -> Iterator[None]:
    """Processes started inside are not the running test's own."""
    item = _current.pop("item", None)
    try:
        yield
    finally:
        if item is not None:
            _current["item"] = item


_popen_init = subprocess.Popen.__init__


def _marked_popen(self, *args, **kwargs) -> None:
    require_marker("process", "starts a process")
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _marked_popen


@pytest.fixture(autouse=True, scope="session")
def _processes_are_marked():
    """``reactor.spawnProcess`` needs the ``process`` marker too."""
    from twisted.internet import reactor

    spawn = reactor.spawnProcess

    def marked_spawn(*args, **kwargs):
        require_marker("process", "starts a process")
        return spawn(*args, **kwargs)

    reactor.spawnProcess = marked_spawn
    yield
    reactor.spawnProcess = spawn


def postgres_dsn() -> str:
    require_marker("postgres", "uses PostgreSQL")
    """The DSN of this run's own database, created on first use (dropped at exit);
    skips the calling test when ``RELAY_TEST_POSTGRES_DSN`` is not set."""
    admin = os.environ.get(POSTGRES_ENV)
    if not admin:
        skip_postgres(POSTGRES_SKIP)
    if "unusable" in _postgres:
        skip_postgres(_postgres["unusable"])
    if "dsn" not in _postgres:
        # psycopg's ctypes binding of libpq (PyPy) runs ldconfig to find the library:
        # a process of the import, not of the test.
        with _unguarded():
            try:
                import psycopg
            except ImportError:
                skip_postgres("the postgres extra is not installed: "
                              "pip install -e '.[test,postgres]'")
            from psycopg.conninfo import make_conninfo

            name = f"relay_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            try:
                conn = psycopg.connect(admin, autocommit=True)
            except TypeError as e:  # psycopg's ctypes libpq binding on PyPy 7.3.11
                _postgres["unusable"] = (f"psycopg cannot connect on this interpreter ({e}): "
                                         "the postgres backend runs on CPython")
                skip_postgres(_postgres["unusable"])
        with conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        _postgres.update(admin=admin, name=name, dsn=make_conninfo(admin, dbname=name))
    return _postgres["dsn"]


def reset_postgres() -> str:
    """This run's database, emptied (the next store migrates from scratch)."""
    dsn = postgres_dsn()
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return dsn


def pytest_sessionfinish(session, exitstatus) -> None:
    if "dsn" in _postgres:
        import psycopg

        with psycopg.connect(_postgres["admin"], autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{_postgres["name"]}" WITH (FORCE)')


def backend_options(name: str) -> dict:
    """The extra ``broker.*`` keys a backend needs in tests (its own section)."""
    if name == "postgres":
        return {"postgres": {"dsn": postgres_dsn(), "poolSize": 4}}
    return {}


def broker_storage(name: str) -> dict:
    """The ``broker.*`` keys of a real broker process on backend ``name``; a postgres
    broker gets a database with no relay tables."""
    if name == "postgres":
        reset_postgres()
    return dict(backend_options(name), storage=name)


def open_backend(name: str, data_dir: str, **broker):
    """Open backend ``name`` on ``data_dir`` (``broker`` are extra ``broker.*`` keys).

    Stores get the real reactor: they may schedule their group commits on it.
    Store methods take ``now`` explicitly, so tests still control time.
    """
    from twisted.internet import reactor

    from relay.store.plugins import open_configured_store

    options = dict(backend_options(name), **broker)
    config = make_config(storage=name, dataDir=str(data_dir), **options)
    return open_configured_store(config, reactor)


@pytest.fixture
def clock() -> Clock:
    c = Clock()
    c.advance(START)
    return c


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store(backend, tmp_path):
    if backend == "postgres":
        reset_postgres()
    s = open_backend(backend, tmp_path)
    yield s
    pytest_twisted.blockon(s.close())


@pytest.fixture
def two_brokers(tmp_path):
    """Two in-process brokers on one fresh PostgreSQL database: ``(dsn, a, b)``."""
    import pytest_twisted
    from twisted.internet import reactor as _reactor

    from tests.support.api import Broker as _Broker

    dsn = reset_postgres()
    stores = [open_backend("postgres", tmp_path / name) for name in ("a", "b")]
    brokers = [_Broker(clock=_reactor, store=store) for store in stores]
    yield dsn, brokers[0], brokers[1]
    for store in stores:
        pytest_twisted.blockon(store.close())
