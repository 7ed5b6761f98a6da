"""The store contract (relay.testing.StoreContract) against every backend."""

from relay.testing import StoreContract


class TestStoreContract(StoreContract):
    pass
