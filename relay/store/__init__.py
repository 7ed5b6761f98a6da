"""Message stores: one interface (:mod:`relay.store.interface`), several backends."""

from __future__ import annotations

import os

from relay.errors import ConfigError


def make_data_dir(data_dir: str) -> str:
    """``data_dir``, created if missing; ConfigError with the path and the reason if not."""
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError("broker.dataDir", f"cannot create {data_dir}: {e.strerror}") from None
    return data_dir
