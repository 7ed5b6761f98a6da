"""Deprecated: ``relay.sse`` moved to :mod:`relay.client.sse`.

The old path is kept for one release and warns when imported."""

import warnings

from relay.client.sse import MESSAGE, RESET, STATUS, RelayEvent

__all__ = ["MESSAGE", "RESET", "STATUS", "RelayEvent"]

warnings.warn("relay.sse moved to relay.client.sse: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
