"""What the ``relay`` command keeps between runs: the ``recv``/``watch`` cursor and
the v1.0 receipts it has sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from relay.files import read_json, write_json_atomic

STATE_FILE = ".dsh-relay-state.json"
# Receipts are remembered past the broker's default message TTL (7 days): a
# message cannot be read again after it has expired.
RECEIPT_MEMORY_SECONDS = 8 * 24 * 60 * 60
MAX_RECEIPTS_REMEMBERED = 10_000
_RECEIPTS_KEY = "receiptsSent"


class CursorState:
    """The state of one broker and agent in ``~/.dsh-relay-state.json``.

    The cursor is kept in the reference CLI's format,
    ``{"<brokerUrl>|<agent>": {"since": id}}``; the ids of the messages whose
    v1.0 receipt was sent are kept under ``receiptsSent`` (``{"<brokerUrl>|<agent>":
    {id: epoch seconds}}``), which the reference CLI leaves alone. Every change
    is written at once, atomically, with mode 0600.
    """

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

    def _receipts(self, state: Dict[str, Any]) -> Dict[str, float]:
        table = state.get(_RECEIPTS_KEY)
        entry = table.get(self.key) if isinstance(table, dict) else None
        if not isinstance(entry, dict):
            return {}
        return {
            str(key): float(value)
            for key, value in entry.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }

    def receipt_sent(self, message_id: str) -> bool:
        """Whether the v1.0 receipt of ``message_id`` was sent already."""
        return message_id in self._receipts(self._load())

    def note_receipt(self, message_id: str, now: float) -> None:
        """Remember that the receipt of ``message_id`` was sent at ``now``.

        Entries older than :data:`RECEIPT_MEMORY_SECONDS` are dropped, and the
        oldest beyond :data:`MAX_RECEIPTS_REMEMBERED`.
        """
        state = self._load()
        receipts = self._receipts(state)
        receipts[message_id] = now
        kept = sorted(
            ((at, key) for key, at in receipts.items() if now - at < RECEIPT_MEMORY_SECONDS),
            reverse=True,
        )[:MAX_RECEIPTS_REMEMBERED]
        table = state.get(_RECEIPTS_KEY)
        if not isinstance(table, dict):
            table = state[_RECEIPTS_KEY] = {}
        table[self.key] = {key: at for at, key in sorted(kept)}
        write_json_atomic(self.path, state)
