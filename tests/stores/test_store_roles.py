"""REACH §13 role queues and §14 priorities on every backend (relay.testing.TeamContract)."""

from relay.testing import TeamContract


class TestTeamContract(TeamContract):
    pass
