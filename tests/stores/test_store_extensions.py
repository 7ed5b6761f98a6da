"""The delivery extensions v1.2 (relay.testing.ExtensionContract) against every backend."""

from relay.testing import ExtensionContract


class TestExtensionContract(ExtensionContract):
    pass
