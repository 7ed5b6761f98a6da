"""The contract suites relay.testing ships, against every registered backend: the store
contract, the delivery extensions v1.2, quotas and the agent cap, events (REACH §11),
group sends (§13), role queues and priorities (§13, §14), and the v2/v3 wire's messages.
A backend plugin that passes them is a backend."""

from relay.testing import (
    EventContract,
    ExtensionContract,
    GroupContract,
    QuotaContract,
    StoreContract,
    TeamContract,
    Wire2Contract,
)


class TestStoreContract(StoreContract):
    pass


class TestExtensionContract(ExtensionContract):
    pass


class TestQuotaContract(QuotaContract):
    pass


class TestEventContract(EventContract):
    pass


class TestGroupContract(GroupContract):
    pass


class TestTeamContract(TeamContract):
    pass


class TestWire2Contract(Wire2Contract):
    pass
