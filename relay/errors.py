"""Deprecated: ``relay.errors`` moved to :mod:`relay.wire.errors`.

The old path is kept for one release and warns when imported."""

import warnings

from relay.wire.errors import ConfigError, RelayError

__all__ = ["ConfigError", "RelayError"]

warnings.warn("relay.errors moved to relay.wire.errors: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
