"""The brokers the tests of the routes ask for by name: roles on two backends, and the
v2/v3 wire's harness on every backend or in memory."""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.conftest import open_backend
from tests.support.teams import ROLE_TEAM, ROLES, TeamBroker
from tests.support.v2 import V2Broker


@pytest.fixture(params=["memory", "sqlite"])
def role_broker(request, tmp_path):
    """A :class:`TeamBroker` with the roles of ``ROLES``, in memory and on SQLite."""
    store = None if request.param == "memory" else open_backend("sqlite", tmp_path)
    b = TeamBroker(store=store, agents=ROLE_TEAM, roles=ROLES)
    yield b
    if store is not None:
        pytest_twisted.blockon(store.close())


@pytest.fixture
def v2_broker(store):
    """The v2/v3 harness over the ``store`` of every backend."""
    b = V2Broker(store=store)
    yield b
    b.stop()


@pytest.fixture
def v2_brokers():
    """Makes v2/v3 harnesses in memory (keys: their ``broker.*`` config)."""
    def make(**kw):
        made.append(V2Broker(**kw))
        return made[-1]

    made = []
    yield make
    for b in made:
        b.stop()
