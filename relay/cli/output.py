"""How the ``relay`` command prints: readable text, or JSON with ``--json``."""

from __future__ import annotations

import json
from typing import Any, Callable, List, Mapping, Sequence, TextIO


class Console:
    """Writes readable text, or exactly one JSON document with ``--json``."""

    def __init__(self, out: TextIO, err: TextIO, as_json: bool) -> None:
        self.out = out
        self.err = err
        self.as_json = as_json

    def line(self, text: str = "") -> None:
        """One line of standard output."""
        self.out.write(text + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        """One line of standard error."""
        self.err.write(text + "\n")
        self.err.flush()

    def document(self, value: Any) -> None:
        """``value`` as one line of JSON."""
        self.line(json.dumps(value, ensure_ascii=False, sort_keys=True))

    def emit(self, value: Any, readable: Callable[[], None]) -> None:
        """``value`` as JSON with ``--json``, else whatever ``readable()`` prints."""
        if self.as_json:
            self.document(value)
        else:
            readable()


def body_text(body: Any) -> str:
    """A message body as the text a person wants to read."""
    if isinstance(body, dict) and isinstance(body.get("text"), str) and len(body) == 1:
        return body["text"]
    return json.dumps(body, ensure_ascii=False, sort_keys=True)


def message_block(message: Mapping[str, Any]) -> List[str]:
    """One message as a few readable lines."""
    head = f"{message.get('id')}  {message.get('from')} -> {message.get('to')}"
    if message.get("ts"):
        head += f"  {message.get('ts')}"
    facts = []
    for label, key in (
        ("type", "type"),
        ("kind", "kind"),
        ("status", "status"),
        ("attempts", "attempts"),
        ("lease", "leaseId"),
        ("replyTo", "replyTo"),
        ("root", "rootId"),
        ("parent", "parentId"),
    ):
        value = message.get(key)
        if value not in (None, "", False):
            facts.append(f"{label} {value}")
    if message.get("ack"):
        facts.append("receipt requested")
    lines = [head]
    if facts:
        lines.append("  " + " | ".join(facts))
    if "body" in message:
        lines.extend("  " + line for line in body_text(message.get("body")).splitlines() or [""])
    return lines


def print_messages(console: Console, messages: Sequence[Mapping[str, Any]], empty: str) -> None:
    """``messages`` as blocks separated by a blank line, or ``empty`` when there are none."""
    if not messages:
        console.line(empty)
        return
    for index, message in enumerate(messages):
        if index:
            console.line()
        for line in message_block(message):
            console.line(line)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> List[str]:
    """Rows as left-aligned columns under ``headers``."""
    cells = [list(headers)] + [
        ["" if value is None else str(value) for value in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells
    ]


def _one_line(value: Any) -> str:
    """``value`` as text with its whitespace runs (newlines included) made one space."""
    return " ".join(str(value).split())


def watch_line(message: Mapping[str, Any]) -> str:
    """One message as one line (ids and a client's ``ts`` may hold newlines too)."""
    if message.get("type") == "ack":
        body = message.get("body") if isinstance(message.get("body"), dict) else {}
        status = _one_line(body.get("status", "ok"))
        return (f"[receipt] {message.get('from')} {status} for "
                f"{_one_line(message.get('replyTo'))}")
    kind = message.get("kind")
    tag = f" ({kind})" if kind and kind != "message" else ""
    text = _one_line(body_text(message.get("body")))
    return (
        f"{_one_line(message.get('ts', ''))} {message.get('from')}{tag} "
        f"[{_one_line(message.get('id'))}]: {text}"
    ).strip()
