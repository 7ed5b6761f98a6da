"""Deprecated: ``relay.settings`` moved to :mod:`relay.client.settings`.

The old path is kept for one release and warns when imported."""

import warnings

from relay.client.settings import Settings, UsageError, resolve_settings

__all__ = ["Settings", "UsageError", "resolve_settings"]

warnings.warn("relay.settings moved to relay.client.settings: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
