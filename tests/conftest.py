"""Shared fixtures: a store per registered backend, a clock."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from relay.store.plugins import store_factories
from relay.testing import START, make_config

BACKENDS = ("memory", "sqlite", "jsonl")


def open_backend(name: str, data_dir: str, **broker):
    """Open backend ``name`` on ``data_dir``; skips the test when it is not built.

    Stores get the real reactor: they may schedule their group commits on it.
    Store methods take ``now`` explicitly, so tests still control time.
    """
    from twisted.internet import reactor

    factory = store_factories()[name]
    config = make_config(storage=name, dataDir=str(data_dir), **broker)
    try:
        return factory.open(config, reactor)
    except ModuleNotFoundError as e:
        if e.name == factory.module:
            pytest.skip(f"backend {name} is not available")
        raise


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
