"""REACH §11 events as every backend records them (relay.testing.EventContract)."""

from relay.testing import EventContract


class TestEventContract(EventContract):
    pass
