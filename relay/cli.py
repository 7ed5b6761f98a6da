"""The ``relay`` command: talk to a dsh-agent-relay broker from a shell.

Settings come from flags (before or after the subcommand), then the
environment (``DSH_RELAY_BROKER_URL``, ``DSH_RELAY_AGENT``, ``DSH_RELAY_SECRET``,
``DSH_RELAY_SECRET_FILE``, ``DSH_RELAY_CA_FILE``, ``DSH_RELAY_CLIENT_CERT``,
``DSH_RELAY_CLIENT_KEY``), then ``~/.dsh-relay.json`` (``brokerUrl``, ``agent``,
``secret``, ``secretFile``, ``caFile``, ``clientCert``, ``clientKey``).

Exit status: 0 on success, 1 on a broker or network error, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from twisted.internet import defer

from relay.client import (
    DEFAULT_BROKER_URL,
    ENV_CA_FILE,
    ENV_CLIENT_CERT,
    ENV_CLIENT_KEY,
    RETRY_DELAYS_SECONDS,
    RelayClient,
)
from relay.errors import RelayError
from relay.files import read_json, write_atomic, write_json_atomic
from relay.polling import drain, poll

SETTINGS_FILE = ".dsh-relay.json"
STATE_FILE = ".dsh-relay-state.json"
DEFAULT_WATCH_INTERVAL_SECONDS = 2.0
WATCH_HEARTBEAT_SECONDS = 60.0
# A recv drain stops after this many pages even if the broker keeps answering.
MAX_DRAIN_PAGES = 1000
DEFAULT_INIT_CONFIG = "relay.yaml"

ENV_BROKER = "DSH_RELAY_BROKER_URL"
ENV_AGENT = "DSH_RELAY_AGENT"
ENV_SECRET = "DSH_RELAY_SECRET"
ENV_SECRET_FILE = "DSH_RELAY_SECRET_FILE"


class UsageError(Exception):
    """The command line or the settings cannot be used (exit status 2)."""


# -- settings ------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Where and as whom to talk to the broker."""

    broker_url: str
    agent: Optional[str]
    secret: Optional[str]
    ca_file: Optional[str] = None
    client_cert: Optional[str] = None
    client_key: Optional[str] = None


# Settings taken level by level: flag key, environment variable, settings-file key.
_SETTING_SOURCES: Tuple[Tuple[str, str, str], ...] = (
    ("broker", ENV_BROKER, "brokerUrl"),
    ("agent", ENV_AGENT, "agent"),
    ("secret", ENV_SECRET, "secret"),
    ("secret_file", ENV_SECRET_FILE, "secretFile"),
    ("ca_file", ENV_CA_FILE, "caFile"),
    ("client_cert", ENV_CLIENT_CERT, "clientCert"),
    ("client_key", ENV_CLIENT_KEY, "clientKey"),
)
FLAG_KEYS: Tuple[str, ...] = tuple(flag for flag, _, _ in _SETTING_SOURCES)


def _read_secret_file(path: str) -> str:
    try:
        secret = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except OSError as error:
        raise UsageError(f"cannot read secret file {path}: {error.strerror}") from None
    if not secret:
        raise UsageError(f"secret file {path} is empty")
    return secret


def resolve_settings(
    flags: Mapping[str, Optional[str]], env: Mapping[str, str], home: Path
) -> Settings:
    """Settings from flags, then environment, then ``~/.dsh-relay.json``, then defaults.

    ``flags`` may hold the keys of :data:`FLAG_KEYS` (``broker``, ``agent``,
    ``secret``, ``secret_file``, ``ca_file``, ``client_cert``, ``client_key``).
    At each level a secret beats a secret file. A client key without a client
    certificate is a usage error.
    """
    path = home / SETTINGS_FILE
    stored: Dict[str, Any] = {}
    if path.exists():
        try:
            loaded = read_json(path)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read {path}: {error}") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"{path} must hold a JSON object")
        stored = loaded

    def text(value: Any) -> Optional[str]:
        return value if isinstance(value, str) and value else None

    levels: List[Dict[str, Optional[str]]] = [
        {key: text(flags.get(key)) for key in FLAG_KEYS},
        {key: text(env.get(variable)) for key, variable, _ in _SETTING_SOURCES},
        {key: text(stored.get(name)) for key, _, name in _SETTING_SOURCES},
    ]

    def first(key: str) -> Optional[str]:
        for level in levels:
            if level[key]:
                return level[key]
        return None

    secret: Optional[str] = None
    for level in levels:
        if level["secret"]:
            secret = level["secret"]
            break
        if level["secret_file"]:
            secret = _read_secret_file(level["secret_file"] or "")
            break
    client_cert, client_key = first("client_cert"), first("client_key")
    if client_key and not client_cert:
        raise UsageError(
            f"a client key ({client_key}) was given without a client certificate: "
            f"pass --client-cert or set {ENV_CLIENT_CERT}"
        )
    return Settings(
        broker_url=first("broker") or DEFAULT_BROKER_URL,
        agent=first("agent"),
        secret=secret,
        ca_file=first("ca_file"),
        client_cert=client_cert,
        client_key=client_key,
    )


# -- argument parsing ------------------------------------------------------------


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return number


def _retries(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not 0 <= number <= len(RETRY_DELAYS_SECONDS):
        raise argparse.ArgumentTypeError(f"must be 0 to {len(RETRY_DELAYS_SECONDS)}: {value}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return number


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, keeping its usage line."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.format_usage().strip()}\n{self.prog}: error: {message}")

    def exit(self, status: int = 0, message: Optional[str] = None) -> Any:  # type: ignore[override]
        raise _Exit(status, message or "")


class _Exit(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _global_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = common.add_argument_group("connection and output")
    group.add_argument("--broker", metavar="URL", help=f"broker URL (default {DEFAULT_BROKER_URL})")
    group.add_argument("--agent", metavar="NAME", help="this agent's name")
    group.add_argument("--secret", metavar="SECRET", help="the HMAC secret")
    group.add_argument("--secret-file", metavar="PATH", help="a file holding the HMAC secret")
    group.add_argument(
        "--ca-file", metavar="PATH", help="PEM CA bundle to trust for https (default: system)"
    )
    group.add_argument(
        "--client-cert",
        metavar="PATH",
        help="PEM client certificate for https brokers that ask for one (may hold the key)",
    )
    group.add_argument("--client-key", metavar="PATH", help="PEM private key of --client-cert")
    group.add_argument(
        "--retries",
        type=_retries,
        metavar="N",
        help="retries of a transient failure, 0-3 (default 3: after 2, 4 and 8 s)",
    )
    group.add_argument("--json", action="store_true", help="print one JSON document")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The ``relay`` argument parser (global flags accepted on every subcommand)."""
    common = _global_flags()
    parser = _Parser(
        prog="relay",
        description="Talk to a dsh-agent-relay broker (wire protocol 1.0).",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, parents=[common])

    add("handshake", "check the broker's protocol version and capabilities")
    add("register", "register this agent (heartbeat)")
    add("peers", "list registered agents")

    send = add("send", "send a text message")
    send.add_argument("target", metavar="TARGET")
    send.add_argument("content", metavar="CONTENT")
    send.add_argument("--ack", action="store_true", help="ask the receiver for a receipt")
    send.add_argument("--kind", choices=["message", "request", "reply"])
    send.add_argument("--reply-to", metavar="ID", help="the id this message answers")
    send.add_argument("--root-id", metavar="ID", help="the first message of the conversation")
    send.add_argument("--id", dest="message_id", metavar="ID", help="a message id (idempotency)")

    recv = add("recv", "fetch new messages (drains the inbox unless --once)")
    recv.add_argument("--limit", type=_positive_int, default=50)
    recv.add_argument("--once", action="store_true", help="fetch one page only")
    recv.add_argument("--reset", action="store_true", help="forget the saved cursor first")

    watch = add("watch", "print new messages as they arrive, until interrupted")
    watch.add_argument("--interval", type=_positive_float, default=DEFAULT_WATCH_INTERVAL_SECONDS)
    watch.add_argument("--count", type=_positive_int, help="stop after N messages")

    pull = add("pull", "lease queued messages (v1.1)")
    pull.add_argument("--limit", type=_positive_int)
    pull.add_argument("--lease", type=_positive_int, metavar="SECONDS")

    ack = add("ack", "finish or re-queue a leased message (v1.1)")
    ack.add_argument("message_id", metavar="ID")
    ack.add_argument("lease_id", metavar="LEASE_ID")
    ack.add_argument("outcome", choices=["completed", "retry"])
    ack.add_argument("--error", metavar="TEXT")

    status = add("status", "delivery status of messages (v1.1)")
    status.add_argument("message_ids", metavar="ID", nargs="+")

    recent = add("recent", "most recent messages for this agent (v1.1)")
    recent.add_argument("--limit", type=_positive_int)

    query = add("query", "search messages (v1.1)")
    query.add_argument("--kind")
    query.add_argument("--status")
    query.add_argument("--from", dest="from_")
    query.add_argument("--to")
    query.add_argument("--limit", type=_positive_int)

    init = add("init", "write a broker config with a fresh secret")
    init.add_argument("--config", metavar="PATH", default=DEFAULT_INIT_CONFIG)
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.add_argument("--port", type=_positive_int, default=19121)

    add("selfcheck", "round-trip messages between two throwaway agents (v1.0 and v1.1)")
    return parser


NO_AGENT_COMMANDS = frozenset({"handshake", "init"})


@dataclass
class Invocation:
    """A parsed command line with its resolved settings."""

    command: str
    args: argparse.Namespace
    settings: Settings
    json: bool
    usage: str


def parse(argv: Sequence[str], env: Mapping[str, str], home: Path) -> Invocation:
    """Parse ``argv``; raise :class:`UsageError` on a usage problem."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    flags = {key: getattr(args, key, None) for key in FLAG_KEYS}
    settings = resolve_settings(flags, env, home)
    command = args.command
    usage = sub_usage(parser, command)
    if command not in NO_AGENT_COMMANDS | {"selfcheck"} and not settings.agent:
        raise UsageError(
            f"{usage}\nrelay {command}: error: no agent name: pass --agent NAME or set {ENV_AGENT}"
        )
    if command not in NO_AGENT_COMMANDS and not settings.secret:
        raise UsageError(
            f"{usage}\nrelay {command}: error: no secret: pass --secret, "
            f"--secret-file, or set {ENV_SECRET} (see `relay init`)"
        )
    return Invocation(command, args, settings, bool(getattr(args, "json", False)), usage)


def sub_usage(parser: argparse.ArgumentParser, command: str) -> str:
    """The usage line of one subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command].format_usage().strip()
    return parser.format_usage().strip()


# -- output ----------------------------------------------------------------------


class Console:
    """Writes readable text, or exactly one JSON document with ``--json``."""

    def __init__(self, out: TextIO, err: TextIO, as_json: bool) -> None:
        self.out = out
        self.err = err
        self.as_json = as_json

    def line(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def document(self, value: Any) -> None:
        self.line(json.dumps(value, ensure_ascii=False, sort_keys=True))

    def emit(self, value: Any, readable: Callable[[], None]) -> None:
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


# -- cursor state ------------------------------------------------------------------


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
        entry = self._load().get(self.key)
        since = entry.get("since") if isinstance(entry, dict) else None
        return since if isinstance(since, str) and since else None

    def set(self, cursor: Optional[str]) -> None:
        state = self._load()
        if cursor:
            state[self.key] = {"since": cursor}
        else:
            state.pop(self.key, None)
        write_json_atomic(self.path, state)


# -- commands --------------------------------------------------------------------


async def _receipts(client: RelayClient, console: Console, messages: Sequence[Mapping]) -> None:
    """Send the v1.0 receipt for every message that asked for one (best effort)."""
    for message in messages:
        if message.get("ack") and message.get("type", "message") == "message":
            try:
                await client.ack(str(message["id"]), "ok")
            except RelayError as error:
                console.warn(f"warning: no receipt sent for {message.get('id')}: {error.code}")


async def cmd_handshake(client: RelayClient, inv: Invocation, console: Console) -> int:
    info = await client.handshake()

    def readable() -> None:
        console.line(
            f"{info.get('broker', 'broker')} {info.get('version', '?')} at {client.broker_url}: "
            f"protocol {info['protocol']}"
        )
        if info.get("storage"):
            console.line(f"storage: {info['storage']}")
        capabilities = info.get("capabilities")
        if isinstance(capabilities, dict) and capabilities:
            enabled = ", ".join(
                name if value is True else f"{name}={json.dumps(value)}"
                for name, value in sorted(capabilities.items())
                if value
            )
            console.line(f"capabilities: {enabled or 'none'}")

    console.emit(info, readable)
    return 0


async def cmd_register(client: RelayClient, inv: Invocation, console: Console) -> int:
    answer = await client.register()
    console.emit(answer, lambda: console.line(f"registered {answer.get('agent', client.agent)}"))
    return 0


async def cmd_peers(client: RelayClient, inv: Invocation, console: Console) -> int:
    answer = await client.peers()
    peers = answer.get("peers") or []

    def readable() -> None:
        if not peers:
            console.line("no registered agents")
            return
        rows = [
            (peer.get("agent"), "yes" if peer.get("online") else "no", peer.get("lastSeen"))
            for peer in peers
        ]
        for line in table(rows, ("AGENT", "ONLINE", "LAST SEEN")):
            console.line(line)

    console.emit(answer, readable)
    return 0


async def cmd_send(client: RelayClient, inv: Invocation, console: Console) -> int:
    args = inv.args
    reply_to = args.reply_to
    answer = await client.send(
        args.target,
        {"text": args.content},
        message_id=args.message_id,
        kind=args.kind,
        reply_to=reply_to,
        parent_id=reply_to if args.kind == "reply" else None,
        root_id=args.root_id,
        ack=args.ack,
    )

    def readable() -> None:
        note = " (already accepted earlier)" if answer.get("duplicate") else ""
        console.line(f"sent {answer.get('id')} to {args.target}{note}")

    console.emit(answer, readable)
    return 0


async def cmd_recv(client: RelayClient, inv: Invocation, console: Console, home: Path) -> int:
    args = inv.args
    state = CursorState(home / STATE_FILE, client.broker_url, client.agent)
    if args.reset:
        state.set(None)
    client.cursor = state.get()

    async def page() -> Sequence[Dict[str, Any]]:
        answer = await client.recv(limit=args.limit)
        return answer.get("messages") or []

    received = await drain(page, 1 if args.once else MAX_DRAIN_PAGES)
    await _receipts(client, console, received)
    state.set(client.cursor)
    console.emit(
        {"count": len(received), "messages": received, "cursor": client.cursor},
        lambda: print_messages(console, received, "no new messages"),
    )
    return 0


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


async def cmd_watch(
    client: RelayClient, inv: Invocation, console: Console, home: Path, clock: Any
) -> int:
    args = inv.args
    state = CursorState(home / STATE_FILE, client.broker_url, client.agent)
    client.cursor = state.get()
    try:
        await client.handshake()
    except RelayError as error:
        if error.code == "protocol_mismatch":
            raise
        console.warn(f"warning: handshake failed ({error.code}); polling every {args.interval}s")
    await client.register()
    last_heartbeat = clock.seconds()
    wait = client.long_poll_seconds
    if not inv.json:
        mode = f"long-poll up to {wait:g}s" if wait else f"every {args.interval:g}s"
        console.warn(f"watching {client.agent} at {client.broker_url} ({mode}); Ctrl+C to stop")
    shown = 0

    async def fetch(wait: Optional[float]) -> Sequence[Dict[str, Any]]:
        nonlocal last_heartbeat
        now = clock.seconds()
        if now - last_heartbeat >= WATCH_HEARTBEAT_SECONDS:
            await client.register()
            last_heartbeat = now
        answer = await client.recv(limit=50, wait=wait)
        return answer.get("messages") or []

    async def show(messages: Sequence[Dict[str, Any]]) -> None:
        nonlocal shown
        for message in messages[: None if args.count is None else args.count - shown]:
            if inv.json:
                console.document(message)
            else:
                console.line(watch_line(message))
            shown += 1
        await _receipts(client, console, messages)
        state.set(client.cursor)

    await poll(
        fetch,
        show,
        clock=clock,
        wait=wait,
        interval=args.interval,
        running=lambda: args.count is None or shown < args.count,
        on_error=lambda error: console.warn(f"warning: {error.code}: {error.message}"),
    )
    return 0


async def cmd_pull(client: RelayClient, inv: Invocation, console: Console) -> int:
    answer = await client.pull(limit=inv.args.limit, lease_seconds=inv.args.lease)
    messages = answer.get("messages") or []
    console.emit(answer, lambda: print_messages(console, messages, "nothing to lease"))
    return 0


async def cmd_ack(client: RelayClient, inv: Invocation, console: Console) -> int:
    args = inv.args
    answer = await client.ack_outcome(args.message_id, args.lease_id, args.outcome, args.error)
    console.emit(
        answer,
        lambda: console.line(
            f"{args.message_id}: {answer.get('status')} (attempts {answer.get('attempts')})"
        ),
    )
    return 0


async def cmd_status(client: RelayClient, inv: Invocation, console: Console) -> int:
    answer = await client.status(inv.args.message_ids)
    messages = answer.get("messages") or []

    def readable() -> None:
        if not messages:
            console.line("no such messages")
            return
        rows = [
            tuple(m.get(key) for key in ("id", "status", "attempts", "from", "to", "kind", "ts"))
            for m in messages
        ]
        for line in table(rows, ("ID", "STATUS", "ATTEMPTS", "FROM", "TO", "KIND", "TS")):
            console.line(line)

    console.emit(answer, readable)
    return 0


async def cmd_recent(client: RelayClient, inv: Invocation, console: Console) -> int:
    answer = await client.recent(limit=inv.args.limit)
    messages = answer.get("messages") or []
    console.emit(answer, lambda: print_messages(console, messages, "no messages"))
    return 0


async def cmd_query(client: RelayClient, inv: Invocation, console: Console) -> int:
    args = inv.args
    answer = await client.query(
        kind=args.kind, status=args.status, from_=args.from_, to=args.to, limit=args.limit
    )
    messages = answer.get("messages") or []
    console.emit(answer, lambda: print_messages(console, messages, "no matching messages"))
    return 0


def cmd_init(inv: Invocation, console: Console) -> int:
    """Write a broker config with a fresh secret (mode 0600)."""
    args = inv.args
    path = Path(args.config).expanduser()
    secret = secrets.token_hex(32)
    text = (
        "# dsh-agent-relay broker configuration, written by `relay init`.\n"
        "# Keep this file private: the secret authenticates every agent.\n"
        "broker:\n"
        "  host: 127.0.0.1\n"
        f"  port: {args.port}\n"
        f"  secret: {secret}\n"
    )
    if path.exists() and not args.force:
        raise UsageError(f"relay init: {path} exists; pass --force to overwrite it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as error:
        raise RelayError(0, "io_error", f"cannot write {path}: {error.strerror}") from None
    broker_url = f"http://127.0.0.1:{args.port}"
    steps = [
        f"twistd -n relay --config {path}",
        f"export {ENV_BROKER}={broker_url} {ENV_SECRET}={secret}",
        "relay selfcheck",
    ]
    console.emit(
        {"config": str(path), "brokerUrl": broker_url, "secret": secret, "nextSteps": steps},
        lambda: _print_init(console, path, steps),
    )
    return 0


def _print_init(console: Console, path: Path, steps: Sequence[str]) -> None:
    console.line(f"wrote {path} (mode 0600) with a fresh secret")
    console.line("next steps:")
    console.line(f"  1. start the broker:        {steps[0]}")
    console.line(f"  2. point clients at it:     {steps[1]}")
    console.line("     (or save brokerUrl/agent/secret in ~/.dsh-relay.json)")
    console.line(f"  3. check the round trip:    {steps[2]}")


async def cmd_selfcheck(
    inv: Invocation, console: Console, make_client: Callable[[str], RelayClient]
) -> int:
    """Round-trip a message over v1.0 and over v1.1 between two throwaway agents."""
    tag = uuid.uuid4().hex[:8]
    alice = make_client(f"selfcheck-{tag}-a")
    bob = make_client(f"selfcheck-{tag}-b")
    report: List[Dict[str, Any]] = []
    context: Dict[str, Any] = {}

    async def handshake() -> str:
        info = await alice.handshake()
        return f"broker {info.get('broker', '?')} {info.get('version', '?')}, protocol 1.0"

    async def register() -> str:
        await alice.register()
        await bob.register()
        return f"registered {alice.agent} and {bob.agent}"

    async def v10_send() -> str:
        answer = await alice.send(bob.agent, {"text": "selfcheck v1.0"}, ack=True)
        context["v10"] = answer["id"]
        return f"sent {answer['id']}"

    async def v10_recv() -> str:
        answer = await bob.recv()
        ids = [m.get("id") for m in answer.get("messages") or []]
        _check(context["v10"] in ids, f"{context['v10']} not in {bob.agent}'s inbox")
        await bob.ack(context["v10"], "ok")
        return f"{bob.agent} received it and sent a receipt"

    async def v10_receipt() -> str:
        answer = await alice.recv()
        receipts = [
            m
            for m in answer.get("messages") or []
            if m.get("type") == "ack" and m.get("replyTo") == context["v10"]
        ]
        _check(bool(receipts), "no receipt came back to the sender")
        return f"{alice.agent} got the receipt"

    async def v11_request() -> str:
        answer = await alice.send(bob.agent, {"text": "selfcheck v1.1"}, kind="request")
        context["request"] = answer["id"]
        return f"sent request {answer['id']}"

    async def v11_pull_reply_ack() -> str:
        answer = await bob.pull(limit=50)
        leased = {m.get("id"): m for m in answer.get("messages") or []}
        _check(context["request"] in leased, "the request was not leased to the recipient")
        request = leased[context["request"]]
        _check(bool(request.get("leaseId")), "the leased envelope carries no leaseId")
        reply = await bob.send(
            alice.agent,
            {"text": "selfcheck reply"},
            kind="reply",
            reply_to=request["id"],
            parent_id=request["id"],
            root_id=request.get("rootId") or request["id"],
        )
        context["reply"] = reply["id"]
        for message in leased.values():
            outcome = await bob.ack_outcome(
                str(message["id"]), str(message["leaseId"]), "completed"
            )
            if message["id"] == request["id"]:
                _check(outcome.get("status") == "done", f"ack gave status {outcome.get('status')}")
        return "leased, replied and acked completed"

    async def v11_status() -> str:
        answer = await alice.status([context["request"]])
        statuses = {m.get("id"): m.get("status") for m in answer.get("messages") or []}
        _check(statuses.get(context["request"]) == "done", f"status is {statuses}")
        return "the request is done"

    async def v11_reply() -> str:
        answer = await alice.pull(limit=50)
        replies = [m for m in answer.get("messages") or [] if m.get("id") == context["reply"]]
        for message in answer.get("messages") or []:
            await alice.ack_outcome(str(message["id"]), str(message["leaseId"]), "completed")
        _check(bool(replies), "the reply did not reach the requester")
        _check(replies[0].get("parentId") == context["request"], "the reply lost its parentId")
        return f"{alice.agent} got the reply"

    steps = [
        ("handshake", handshake),
        ("register", register),
        ("v1.0 send", v10_send),
        ("v1.0 recv + receipt", v10_recv),
        ("v1.0 receipt delivered", v10_receipt),
        ("v1.1 request", v11_request),
        ("v1.1 pull, reply, ack", v11_pull_reply_ack),
        ("v1.1 status", v11_status),
        ("v1.1 reply delivered", v11_reply),
    ]
    failed = False
    for name, step in steps:
        if failed:
            report.append({"check": name, "ok": None, "detail": "skipped"})
            continue
        try:
            detail = await step()
        except (RelayError, _CheckFailed, KeyError, TypeError) as error:
            failed = True
            text = f"{error.code}: {error.message}" if isinstance(error, RelayError) else str(error)
            report.append({"check": name, "ok": False, "detail": text})
        else:
            report.append({"check": name, "ok": True, "detail": detail})

    def readable() -> None:
        for entry in report:
            mark = {True: "ok  ", False: "FAIL", None: "skip"}[entry["ok"]]
            console.line(f"{mark} {entry['check']}: {entry['detail']}")
        console.line("selfcheck failed" if failed else "selfcheck passed")

    console.emit({"ok": not failed, "checks": report}, readable)
    return 1 if failed else 0


class _CheckFailed(Exception):
    pass


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise _CheckFailed(message)


# -- entry points ----------------------------------------------------------------


async def run(
    reactor: Any,
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    home: Optional[Path] = None,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
    http: Any = None,
) -> int:
    """Run one ``relay`` command line on ``reactor``; the exit status.

    ``http`` replaces the HTTP client (tests pass ``StubTreq``).
    """
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        inv = parse(argv, env, home)
    except UsageError as error:
        err.write(f"{error}\n")
        return 2
    except _Exit as done:
        (out if done.status == 0 else err).write(done.message)
        return done.status
    console = Console(out, err, inv.json)
    settings = inv.settings

    retries = getattr(inv.args, "retries", len(RETRY_DELAYS_SECONDS))

    def make_client(agent: str) -> RelayClient:
        return RelayClient(
            settings.broker_url,
            agent,
            settings.secret or "",
            clock=reactor,
            reactor=reactor,
            http=http,
            ca_file=settings.ca_file,
            client_cert=settings.client_cert,
            client_key=settings.client_key,
            retry_delays=RETRY_DELAYS_SECONDS[:retries],
        )

    try:
        if inv.command == "init":
            return cmd_init(inv, console)
        if inv.command == "selfcheck":
            return await cmd_selfcheck(inv, console, make_client)
        client = make_client(settings.agent or "")
        if inv.command == "recv":
            return await cmd_recv(client, inv, console, home)
        if inv.command == "watch":
            return await cmd_watch(client, inv, console, home, reactor)
        return await COMMANDS[inv.command](client, inv, console)
    except UsageError as error:
        err.write(f"{error}\n")
        return 2
    except RelayError as error:
        if inv.json:
            console.document({"error": {"status": error.status, **error.to_body()["error"]}})
        err.write(f"error: {error.code}: {error.message}\n")
        return 1


COMMANDS: Dict[str, Callable[[RelayClient, Invocation, Console], Any]] = {
    "handshake": cmd_handshake,
    "register": cmd_register,
    "peers": cmd_peers,
    "send": cmd_send,
    "pull": cmd_pull,
    "ack": cmd_ack,
    "status": cmd_status,
    "recent": cmd_recent,
    "query": cmd_query,
}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``relay`` console script."""
    from twisted.internet.task import react

    arguments: Tuple[str, ...] = tuple(sys.argv[1:] if argv is None else argv)

    def start(reactor: Any) -> defer.Deferred:
        def finish(status: int) -> None:
            if status:
                raise SystemExit(status)

        return defer.Deferred.fromCoroutine(run(reactor, arguments)).addCallback(finish)

    react(start)


if __name__ == "__main__":
    main()
