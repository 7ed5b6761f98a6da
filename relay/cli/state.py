"""What the ``relay`` command keeps between runs: the ``recv``/``watch`` cursor and
the v1.0 receipts it has sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from relay.files.private import read_json, write_json_atomic

STATE_FILE = ".dsh-relay-state.json"
# Receipts are remembered past the broker's default message TTL (7 days): a
# message cannot be read again after it has expired.
RECEIPT_MEMORY_SECONDS = 8 * 24 * 60 * 60
MAX_RECEIPTS_REMEMBERED = 10_000
_RECEIPTS_KEY = "receiptsSent"


def load_state(path: Path) -> Dict[str, Any]:
    """The state file's document; empty when it is missing or unreadable."""
    try:
        loaded = read_json(path)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


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
        return load_state(self.path)

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


# How long a run of `relay` trusts what an earlier run learnt: the broker's
# GET / document and the agent's registration. Shorter than the broker's 90 s
# heartbeat window, so an agent whose registration is remembered still shows
# online; long enough that a busy script of `relay ask` calls makes neither
# request again for each call.
REMEMBER_SECONDS = 60.0
_HANDSHAKES_KEY = "handshakes"
_REGISTERED_KEY = "registered"
MAX_REMEMBERED = 100


class BrokerMemory:
    """What one run of ``relay`` leaves for the next, in ``~/.dsh-relay-state.json``:
    the broker's ``GET /`` document under ``handshakes`` (``{"<brokerUrl>": {"at",
    "info"}}``) and when an agent last registered under ``registered``
    (``{"<brokerUrl>|<agent>": epoch seconds}``). Each is used for
    :data:`REMEMBER_SECONDS`; every entry older than that is dropped at each save.
    """

    def __init__(self, path: Path, broker_url: str, agent: str) -> None:
        self.path = path
        self.url = broker_url.rstrip("/")
        self.key = f"{self.url}|{agent}"

    def _load(self) -> Dict[str, Any]:
        return load_state(self.path)

    def info(self, now: float) -> Optional[Dict[str, Any]]:
        """The broker's ``GET /`` document, when a run learnt it less than
        :data:`REMEMBER_SECONDS` before ``now``."""
        table = self._load().get(_HANDSHAKES_KEY)
        entry = table.get(self.url) if isinstance(table, dict) else None
        if not isinstance(entry, dict) or not _fresh(entry.get("at"), now):
            return None
        info = entry.get("info")
        return info if isinstance(info, dict) else None

    def registered_at(self, now: float) -> Optional[float]:
        """When the agent registered, if less than :data:`REMEMBER_SECONDS` before ``now``."""
        table = self._load().get(_REGISTERED_KEY)
        at = table.get(self.key) if isinstance(table, dict) else None
        return float(at) if _fresh(at, now) else None

    def save(self, now: float, info: Optional[Dict[str, Any]],
             registered_at: Optional[float]) -> None:
        """Remember ``info`` (learnt at ``now``) and ``registered_at``; forget stale entries."""
        state = self._load()
        handshakes = _fresh_entries(state.get(_HANDSHAKES_KEY), now,
                                    lambda entry: entry.get("at") if isinstance(entry, dict)
                                    else None)
        if info is not None:
            previous = handshakes.get(self.url)
            if not (isinstance(previous, dict) and previous.get("info") == info):
                handshakes[self.url] = {"at": now, "info": info}
        registered = _fresh_entries(state.get(_REGISTERED_KEY), now, lambda at: at)
        if registered_at is not None:
            registered[self.key] = registered_at
        if state.get(_HANDSHAKES_KEY) == handshakes and state.get(_REGISTERED_KEY) == registered:
            return
        state[_HANDSHAKES_KEY] = handshakes
        state[_REGISTERED_KEY] = registered
        write_json_atomic(self.path, state)


def _fresh(at: Any, now: float) -> bool:
    return (isinstance(at, (int, float)) and not isinstance(at, bool)
            and 0 <= now - at < REMEMBER_SECONDS)


def _fresh_entries(table: Any, now: float, when: Any) -> Dict[str, Any]:
    """The entries of ``table`` whose time (``when(entry)``) is fresh, the newest
    :data:`MAX_REMEMBERED`."""
    if not isinstance(table, dict):
        return {}
    fresh = [(when(entry), key, entry) for key, entry in table.items()
             if _fresh(when(entry), now)]
    fresh.sort(key=lambda item: item[0], reverse=True)
    return {key: entry for _, key, entry in fresh[:MAX_REMEMBERED]}
