"""Message stores: one interface (:mod:`relay.store.interface`), several backends."""

from __future__ import annotations

import os
from typing import Any, Mapping

from relay.errors import ConfigError


def make_data_dir(data_dir: str) -> str:
    """``data_dir``, created if missing; ConfigError with the path and the reason if not."""
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError("broker.dataDir", f"cannot create {data_dir}: {e.strerror}") from None
    return data_dir


def sync_option(section: Mapping[str, Any], backend: str, default: str) -> str:
    """``broker.<backend>.sync`` (off, normal or full); ``broker.sync`` when absent."""
    from relay.config import SYNC_LEVELS, read_str

    sync = read_str(section, "sync", f"broker.{backend}", default).lower()
    if sync not in SYNC_LEVELS:
        raise ConfigError(f"broker.{backend}.sync", f"must be one of {', '.join(SYNC_LEVELS)}")
    return sync
