"""``relay mcp``: serve the relay as MCP tools on standard input and output."""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
from pathlib import Path

from relay.agent.runtime import card_of
from relay.cli.command import Context, card_arguments
from relay.client.settings import UsageError
from relay.files.private import write_atomic
from relay.mcp import install as install_text
from relay.mcp import unavailable
from relay.mcp.tools import RelayTools
from relay.wire.errors import RelayError

MCP_DESCRIPTION = """\
Run a Model Context Protocol server on standard input and output, for a coding
agent (Claude Code, Codex, Cursor, Gemini CLI, ...) to use the relay as tools:
relay_peers, relay_send, relay_request, relay_wait_reply, relay_inbox,
relay_reply, relay_done and more (docs/MCP.md). The server acts as the one
agent of --agent and --secret-file (or the DSH_RELAY_* variables); no tool can
act as another. It handshakes and registers at start (refusing a broker of
another protocol), heartbeats while the session lives, and releases the
messages the model still holds when the session ends. Where the broker has
events it follows the agent's event stream and tells the host of each message
that arrives (Claude Code's channels, experimental capability claude/channel;
--no-channel turns it off); the notice never holds a body. Needs the mcp extra
(Python 3.10 or later; README.md, "Installing").

--listen HOST:PORT serves the same tools over the MCP streamable HTTP transport
at http://HOST:PORT/mcp for a host elsewhere: every request must carry the
bearer token of --token-file; only loopback addresses unless --tls-cert and
--tls-key make it https.

`relay mcp install --for claude|codex` instead writes the coding agent's
MCP config to run this server as --agent: it prints the change and asks before
writing (--yes writes without asking). The config names --secret-file, never
the secret itself."""


def mcp_arguments(parser: argparse.ArgumentParser) -> None:
    """The peer card; ``install`` and its options."""
    parser.add_argument(
        "action", nargs="?", choices=["install"],
        help="install: write a coding agent's MCP config instead of serving")
    card_arguments(
        parser, "what this agent does, published in its peer card (relay_peers shows it)")
    parser.add_argument(
        "--for", dest="client", choices=["claude", "codex"],
        help="install: the coding agent (Claude Code or Codex) whose config to change")
    parser.add_argument(
        "--scope", choices=["user", "project"], default="user",
        help="install, Claude Code: ~/.claude.json (user, the default) or ./.mcp.json (project)")
    parser.add_argument("--yes", action="store_true", help="install: write without asking")
    parser.add_argument(
        "--listen", metavar="HOST:PORT",
        help="serve over streamable HTTP at http(s)://HOST:PORT/mcp instead of stdio "
             "(loopback only, unless --tls-cert and --tls-key)")
    parser.add_argument(
        "--token-file", metavar="PATH",
        help="--listen: a file holding the bearer token every HTTP request must carry")
    parser.add_argument("--tls-cert", metavar="PATH", help="--listen: PEM certificate (https)")
    parser.add_argument("--tls-key", metavar="PATH", help="--listen: PEM private key (https)")
    parser.add_argument(
        "--no-channel", action="store_true",
        help="do not follow the agent's events to notify the host (claude/channel)")


async def install(ctx: Context) -> int:
    """Show the change to a coding agent's MCP config that runs ``relay mcp``; write it
    once the person agrees (or with ``--yes``)."""
    args, console, settings = ctx.args, ctx.console, ctx.settings
    if args.client is None:
        raise UsageError("relay mcp install: pass --for claude or --for codex")
    if not settings.secret_file:
        raise UsageError(
            "relay mcp install: pass --secret-file PATH (or set DSH_RELAY_SECRET_FILE): the "
            "config names the secret's file, never the secret itself")
    secret_file = Path(settings.secret_file).expanduser().absolute()
    if secret_file.stat().st_mode & 0o077:
        console.warn(f"warning: other users can read {secret_file}; chmod 600 it")
    command = _relay_command()
    server = install_text.server_arguments(
        settings.broker_url, settings.agent or "", str(secret_file), args.description,
        args.skills)
    if args.client == "claude":
        path = (Path.cwd() / ".mcp.json" if args.scope == "project"
                else ctx.home / ".claude.json")
        change = install_text.claude_config
    else:
        codex_home = ctx.env.get("CODEX_HOME")
        path = (Path(codex_home) if codex_home else ctx.home / ".codex") / "config.toml"
        change = install_text.codex_config
    try:
        old = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        old = None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"relay mcp install: cannot read {path}: {error}") from None
    try:
        new = change(old, command, server)
    except ValueError as error:
        raise UsageError(f"relay mcp install: cannot change {path}: {error}") from None
    if new == old:
        console.line(f"{path} already runs relay mcp as {settings.agent}; nothing to change")
        return 0
    for line in difflib.unified_diff((old or "").splitlines(), new.splitlines(),
                                     fromfile=str(path) if old is not None else "/dev/null",
                                     tofile=str(path), lineterm=""):
        console.line(line)
    if not args.yes:
        console.warn(f"write {path}? [y/N] ")
        answer = ctx.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            console.warn("not written")
            return 1
    mode = path.stat().st_mode & 0o777 if old is not None else 0o600
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, new, mode)
    except OSError as error:
        raise RelayError(0, "io_error", f"cannot write {path}: {error.strerror}") from None
    console.line(f"wrote {path}; start a new {CLIENT_NAMES[args.client]} session to use it")
    return 0


CLIENT_NAMES = {"claude": "Claude Code", "codex": "Codex"}


def _relay_command() -> str:
    """The ``relay`` of this installation, by its full path when it has one (a coding
    agent does not start it from a shell with this PATH)."""
    beside = Path(sys.executable).parent / "relay"
    if beside.exists():
        return str(beside)
    found = shutil.which("relay")
    return found or "relay"


async def mcp(ctx: Context) -> int:
    """Serve MCP over stdio as the configured agent until the client ends the session
    (``install``: write a coding agent's config instead)."""
    if ctx.args.action == "install":
        return await install(ctx)
    problem = unavailable()
    if problem is not None:
        ctx.console.warn(f"error: {problem}")
        return 1
    from relay.mcp.http import HTTPListener
    from relay.mcp.server import serve

    console = ctx.console
    args = ctx.args

    def note(line: str) -> None:
        console.warn(f"relay mcp: {line}")

    listener = None
    if args.listen is not None:
        listener = HTTPListener(args.listen, args.token_file, args.tls_cert, args.tls_key)
        if listener.token_file_readable_by_others():
            console.warn(f"warning: other users can read {args.token_file}; chmod 600 it")
    elif args.token_file or args.tls_cert or args.tls_key:
        raise UsageError("relay mcp: --token-file, --tls-cert and --tls-key go with --listen")

    tools = RelayTools(
        ctx.client,
        ctx.clock,
        card=card_of(ctx.args.description, ctx.args.skills),
        note=note,
    )
    try:
        info = await tools.start()
    except BaseException:
        if listener is not None:
            listener.socket.close()
        raise
    where = "on stdio" if listener is None else f"at {listener.url}"
    note(
        f"agent {tools.agent} on {ctx.client.broker_url} ({info.get('broker', 'broker')} "
        f"{info.get('version', '?')}, protocol {info['protocol']}); serving MCP {where}"
    )
    await serve(ctx.clock, tools, channel=not args.no_channel, note=note, listen=listener)
    return 0
