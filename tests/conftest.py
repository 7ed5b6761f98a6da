"""Shared fixtures: a store per registered backend, a clock."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from relay.store.plugins import store_factories
from relay.testing import START, make_config

# Every registered backend plugin runs the store contract.
BACKENDS = tuple(sorted(store_factories()))


def open_backend(name: str, data_dir: str, **broker):
    """Open backend ``name`` on ``data_dir`` (``broker`` are extra ``broker.*`` keys).

    Stores get the real reactor: they may schedule their group commits on it.
    Store methods take ``now`` explicitly, so tests still control time.
    """
    from twisted.internet import reactor

    from relay.store.plugins import open_configured_store

    config = make_config(storage=name, dataDir=str(data_dir), **broker)
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
    s = open_backend(backend, tmp_path)
    yield s
    pytest_twisted.blockon(s.close())
