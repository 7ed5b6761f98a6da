"""The ``recv``/``watch`` cursor, kept between runs of the ``relay`` command."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from relay.files import read_json, write_json_atomic

STATE_FILE = ".dsh-relay-state.json"


class CursorState:
    """The ``recv``/``watch`` cursor per broker and agent, in ``~/.dsh-relay-state.json``."""

    def __init__(self, path: Path, broker_url: str, agent: str) -> None:
        self.path = path
        self.key = f"{broker_url.rstrip('/')}|{agent}"

    def _load(self) -> Dict[str, Any]:
        try:
            loaded = read_json(self.path)
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def get(self) -> Optional[str]:
        """The saved cursor, if any."""
        entry = self._load().get(self.key)
        since = entry.get("since") if isinstance(entry, dict) else None
        return since if isinstance(since, str) and since else None

    def set(self, cursor: Optional[str]) -> None:
        """Save ``cursor``, or forget the saved one when it is ``None``."""
        state = self._load()
        if cursor:
            state[self.key] = {"since": cursor}
        else:
            state.pop(self.key, None)
        write_json_atomic(self.path, state)
