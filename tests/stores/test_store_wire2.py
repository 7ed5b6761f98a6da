"""The v2/v3 wire's messages in the one store (relay.testing.Wire2Contract) against
every backend."""

from relay.testing import Wire2Contract


class TestWire2Contract(Wire2Contract):
    pass
