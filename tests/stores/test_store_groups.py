"""REACH §13 group sends as every backend stores them (relay.testing.GroupContract)."""

from relay.testing import GroupContract


class TestGroupContract(GroupContract):
    pass
