"""How the ``relay`` command prints: readable text, or JSON with ``--json``.

Readable output never passes a control character through: anything a sender
or a broker put in a message, a name or an error could otherwise move the
cursor, recolour or retitle the terminal, or hide text. Such characters are
shown escaped (``\\x1b``, ``\\u202e``). Times are shown as ages ("12 s ago");
``--json`` prints the broker's values unchanged.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO

from relay.wire.protocol import iso_seconds, notice_id

# Characters that a terminal may act on, or that reorder or break the text
# around them: C0, DEL and C1 controls, the bidirectional embeddings,
# overrides and isolates, and the Unicode line and paragraph separators.
_BIDI_CONTROLS = (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029)
_ESCAPES: Dict[int, str] = {
    code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    for code in (*range(0x00, 0x20), *range(0x7F, 0xA0), *_BIDI_CONTROLS)
}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
# A body's own lines are shown as lines; every other control character is escaped.
_LINE_BREAK = re.compile(r"\r?\n")


def printable(text: str) -> str:
    """``text`` with every control character escaped, safe to write to a terminal."""
    return text.translate(_ESCAPES)


def _parse_time(value: Any) -> Optional[float]:
    """Epoch seconds from an ISO-8601 string, epoch seconds or epoch milliseconds."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        # The protocol's epoch numbers are seconds (lastSeen) or milliseconds
        # (leaseUntil); milliseconds are past 1e11 for any date after 1973.
        return value / 1000.0 if value > 1e11 else float(value)
    if isinstance(value, str) and value:
        return iso_seconds(value)
    return None


def span(seconds: float) -> str:
    """A duration as a person reads it: ``12 s``, ``3 min``, ``2 h``, ``5 d``."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min"
    if whole < 86400:
        return f"{whole // 3600} h"
    return f"{whole // 86400} d"


def age(value: Any, now: float) -> Optional[str]:
    """A time as a person reads it next to ``now``: ``12 s ago``, ``in 3 min``.

    ``value`` is an ISO-8601 string, epoch seconds or epoch milliseconds;
    ``None`` when it is none of these.
    """
    when = _parse_time(value)
    if when is None:
        return None
    delta = now - when
    if -1 < delta < 1:
        return "just now"
    return f"{span(delta)} ago" if delta > 0 else f"in {span(-delta)}"


class Console:
    """Writes readable text, or exactly one JSON document with ``--json``.

    :param now: the current time in epoch seconds, for the ages of readable output.
    """

    def __init__(
        self, out: TextIO, err: TextIO, as_json: bool, now: Callable[[], float]
    ) -> None:
        self.out = out
        self.err = err
        self.as_json = as_json
        self.now = now

    def line(self, text: str = "") -> None:
        """One line of standard output, control characters escaped."""
        self.out.write(printable(text) + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        """One line of standard error, control characters escaped."""
        self.err.write(printable(text) + "\n")
        self.err.flush()

    def document(self, value: Any) -> None:
        """``value`` as one line of JSON (JSON escapes control characters itself)."""
        self.out.write(json.dumps(value, ensure_ascii=False, sort_keys=True) + "\n")
        self.out.flush()

    def emit(self, value: Any, readable: Callable[[], None]) -> None:
        """``value`` as JSON with ``--json``, else whatever ``readable()`` prints."""
        if self.as_json:
            self.document(value)
        else:
            readable()

    def age(self, value: Any) -> str:
        """``value`` (a protocol time) as an age, or as given when it is not a time."""
        shown = age(value, self.now())
        return shown if shown is not None else ("" if value is None else str(value))


def body_text(body: Any) -> str:
    """A message body as the text a person wants to read."""
    if isinstance(body, dict) and isinstance(body.get("text"), str) and len(body) == 1:
        return body["text"]
    return json.dumps(body, ensure_ascii=False, sort_keys=True)


def message_block(message: Mapping[str, Any], now: float) -> List[str]:
    """One message as a few readable lines (the caller escapes them)."""
    head = f"{message.get('id')}  {message.get('from')} -> {message.get('to')}"
    if message.get("ts"):
        head += f"  {age(message.get('ts'), now) or message.get('ts')}"
    facts = []
    for label, key in (
        ("type", "type"),
        ("kind", "kind"),
        ("status", "status"),
        ("attempts", "attempts"),
        ("deliveries", "deliveries"),
        ("lease", "leaseId"),
        ("replyTo", "replyTo"),
        ("root", "rootId"),
        ("parent", "parentId"),
        ("error", "error"),
    ):
        value = message.get(key)
        if value not in (None, "", False):
            facts.append(f"{label} {value}")
    for label, key in (("due", "notBefore"), ("expires", "expiresAt")):
        if message.get(key):
            facts.append(f"{label} {age(message.get(key), now) or message.get(key)}")
    if message.get("ack"):
        facts.append("receipt requested")
    lines = [head]
    if facts:
        lines.append("  " + " | ".join(facts))
    notice = _notice(message)
    if notice is not None:
        lines.append("  " + notice)
    elif "body" in message:
        lines.extend("  " + line for line in _LINE_BREAK.split(body_text(message.get("body"))))
    return lines


def _notice(message: Mapping[str, Any]) -> Optional[str]:
    """A failure notice of the broker (EXTENSIONS.md §4) in words, or None. Only the
    broker's own counts (its id derived from the request's); a ``relayNotice`` an
    agent wrote under another id is shown as the body it is."""
    parent = message.get("parentId") or message.get("replyTo")
    if not isinstance(parent, str) or message.get("id") != notice_id(parent):
        return None
    body = message.get("body")
    notice = body.get("relayNotice") if isinstance(body, dict) else None
    if not isinstance(notice, dict):
        return None
    return (
        f"[notice] request {notice.get('messageId')} {notice.get('event')}: "
        f"{notice.get('error')} (attempts {notice.get('attempts')}, "
        f"deliveries {notice.get('deliveries')})"
    )


def print_messages(console: Console, messages: Sequence[Mapping[str, Any]], empty: str) -> None:
    """``messages`` as blocks separated by a blank line, or ``empty`` when there are none."""
    if not messages:
        console.line(empty)
        return
    now = console.now()
    for index, message in enumerate(messages):
        if index:
            console.line()
        for line in message_block(message, now):
            console.line(line)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> List[str]:
    """Rows as left-aligned columns under ``headers``, control characters escaped."""
    cells = [list(headers)] + [
        ["" if value is None else printable(str(value)) for value in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells
    ]


def one_line(value: Any) -> str:
    """``value`` as text with its whitespace runs (newlines included) made one space."""
    return " ".join(str(value).split())


def watch_line(message: Mapping[str, Any], now: float) -> str:
    """One message as one line (ids and a client's ``ts`` may hold newlines too)."""
    if message.get("type") == "ack":
        body = message.get("body") if isinstance(message.get("body"), dict) else {}
        status = one_line(body.get("status", "ok"))
        return (f"[receipt] {one_line(message.get('from'))} {status} for "
                f"{one_line(message.get('replyTo'))}")
    kind = message.get("kind")
    tag = f" ({one_line(kind)})" if kind and kind != "message" else ""
    text = one_line(_notice(message) or body_text(message.get("body")))
    when = age(message.get("ts"), now) or one_line(message.get("ts", ""))
    return (
        f"{when} {one_line(message.get('from'))}{tag} "
        f"[{one_line(message.get('id'))}]: {text}"
    ).strip()
