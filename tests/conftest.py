"""Shared fixtures: a store per registered backend, a clock."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from relay.store.plugins import store_factories
from relay.testing import START, make_config

BACKENDS = ("memory", "sqlite", "jsonl")


def open_backend(name: str, data_dir: str, clock=None, **broker):
    """Open backend ``name`` on ``data_dir``; skips the test when it is not built."""
    factory = store_factories()[name]
    config = make_config(storage=name, dataDir=str(data_dir), **broker)
    try:
        return factory.open(config, clock if clock is not None else Clock())
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
def store(backend, tmp_path, clock):
    s = open_backend(backend, tmp_path, clock)
    yield s
    pytest_twisted.blockon(s.close())
