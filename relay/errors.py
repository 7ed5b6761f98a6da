"""``relay.errors``, the documented import path of the relay's error types: they are
:mod:`relay.wire.errors`'."""

from relay.wire.errors import ConfigError, RelayError

__all__ = ["ConfigError", "RelayError"]
