"""Reading the broker's event stream (REACH §11) on the client side: the
``text/event-stream`` records as :class:`RelayEvent`, and the delays between
reconnections.

Pure: no reactor, no I/O. :class:`relay.client.client.EventStream` feeds the bytes it
reads to an :class:`SSEParser` and waits :func:`reconnect_delay` between tries.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, NamedTuple, Optional

MESSAGE = "message"
STATUS = "status"
RESET = "reset"

# The longest line a record may have; a longer one means the peer is no broker's stream.
MAX_LINE_BYTES = 1 << 20
# Seconds between reconnections after failed tries: 1, 2, 4 ... at most this.
MAX_RECONNECT_SECONDS = 30.0


class RelayEvent(NamedTuple):
    """One event of an agent's stream: its opaque ``id`` (what a client resumes
    after), its ``type`` (``message``, ``status``, ``reset``, or a type a later
    broker adds) and its ``data``. An event never holds a message body."""

    id: str
    type: str
    data: Dict[str, Any]


class StreamError(Exception):
    """The bytes are no event stream (a line beyond :data:`MAX_LINE_BYTES`)."""


class SSEParser:
    """Splits a ``text/event-stream`` into :class:`RelayEvent` records.

    Comment lines (``: keepalive``) and fields other than ``id``, ``event`` and
    ``data`` are ignored; a record without ``data`` is no event. ``data`` that is
    not a JSON object is given as ``{}`` (the type and id still count).
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._after_cr = False
        self._id: Optional[str] = None
        self._type: Optional[str] = None
        self._data: List[str] = []

    def feed(self, chunk: bytes) -> List[RelayEvent]:
        """The records ``chunk`` completes, in order. Raises :class:`StreamError`."""
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split between two chunks
        self._after_cr = False
        self._buffer += chunk
        out: List[RelayEvent] = []
        while True:
            lf, cr = self._buffer.find(b"\n"), self._buffer.find(b"\r")
            if lf == -1 and cr == -1:
                if len(self._buffer) > MAX_LINE_BYTES:
                    raise StreamError(f"an event stream line longer than {MAX_LINE_BYTES} bytes")
                return out
            end = lf if cr == -1 or (lf != -1 and lf < cr) else cr
            raw, rest = self._buffer[:end], self._buffer[end + 1:]
            if end == cr:
                if rest.startswith(b"\n"):
                    rest = rest[1:]
                elif not rest:
                    self._after_cr = True
            self._buffer = rest
            event = self._line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                out.append(event)

    def _line(self, line: str) -> Optional[RelayEvent]:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "id":
            self._id = value
        elif name == "event":
            self._type = value
        elif name == "data":
            self._data.append(value)
        return None

    def _dispatch(self) -> Optional[RelayEvent]:
        event_id, event_type, data = self._id, self._type, self._data
        self._id, self._type, self._data = None, None, []
        if not data or event_id is None:
            return None
        try:
            document = json.loads("\n".join(data))
        except ValueError:
            document = None
        return RelayEvent(event_id, event_type or MESSAGE,
                          document if isinstance(document, dict) else {})


def reconnect_delay(failures: int) -> float:
    """Seconds before the next try after ``failures`` tries in a row that got no
    stream (0 after a stream that ended: 1 s): 1, 2, 4 ... at most 30."""
    return float(min(2 ** max(0, failures), MAX_RECONNECT_SECONDS))
