"""``relay.settings``, the documented import path of the connection settings: they are
:mod:`relay.client.settings`'."""

from relay.client.settings import Settings, UsageError, resolve_settings

__all__ = ["Settings", "UsageError", "resolve_settings"]
