"""Commands for a new broker: ``init`` writes its config, ``selfcheck`` proves it works."""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import uuid
from pathlib import Path
from typing import Any, Dict, List, Sequence

from relay.cli.command import Context, port_number
from relay.cli.commands.broker import selfcheck_agent_names
from relay.cli.output import Console
from relay.client.settings import UsageError
from relay.files.private import write_atomic
from relay.wire.errors import RelayError

# `relay init` writes its broker into a directory of its own, so that broker
# shares no config, secret, data or pid file with a checkout's `make run`.
DEFAULT_INIT_DIRECTORY = ".dsh-agent-relay"
DEFAULT_INIT_CONFIG = "relay.yaml"
DEFAULT_PORT = 19121
# The loopback budget (requests a minute) of the configs `relay init` writes and
# conf/relay.yaml: more than a dozen busy local agents send.
LOCAL_RATE_LIMIT = 60000
INIT_DESCRIPTION = f"""\
Write a broker config and a fresh 256-bit secret (both mode 0600) into a
directory of their own, by default ~/{DEFAULT_INIT_DIRECTORY}/: relay.yaml, relay.secret, and
data/ once the broker runs. The broker listens on loopback, its dashboard on the
next port. The secret is not printed; clients read the file
with --secret-file. Nothing is overwritten without --force."""


def init_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to write the config, whether to overwrite it, and the broker's port."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="the config file to write "
        f"(default ~/{DEFAULT_INIT_DIRECTORY}/{DEFAULT_INIT_CONFIG}); the secret goes beside it",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite an existing config and secret"
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        metavar="N",
        help=f"the loopback port the broker listens on (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--ops-port",
        type=port_number,
        metavar="N",
        help="the loopback port of the dashboard, /healthz and /metrics "
        "(default: the broker's port + 1)",
    )


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def init(ctx: Context) -> int:
    """Write a broker config and its secret file (mode 0600) in a directory of their own."""
    args, console = ctx.args, ctx.console
    if args.config:
        path = Path(args.config).expanduser().absolute()
    else:
        path = ctx.home / DEFAULT_INIT_DIRECTORY / DEFAULT_INIT_CONFIG
    secret_path = path.with_suffix(".secret")
    for existing in (path, secret_path):
        if existing.exists() and not args.force:
            raise UsageError(f"relay init: {existing} exists; pass --force to overwrite it")
    ops_port = args.ops_port
    if ops_port is None:
        ops_port = args.port + 1 if args.port < 65535 else args.port - 1
    if ops_port == args.port:
        raise UsageError("relay init: --ops-port must differ from --port")
    text = (
        "# dsh-agent-relay broker configuration, written by `relay init`.\n"
        "# Paths are relative to this file; docs/CONFIG.md describes every key.\n"
        "broker:\n"
        "  listen:\n"
        f"    - tcp:{args.port}:interface=127.0.0.1\n"
        "  # The dashboard, /healthz and /metrics (docs/OPERATIONS.md); `relay stats`.\n"
        "  opsListen:\n"
        f"    - tcp:{ops_port}:interface=127.0.0.1\n"
        f"  secretFile: {secret_path.name}\n"
        "  dataDir: data\n"
        "  # Every local client shares the loopback address's budget of requests a\n"
        "  # minute; the protocol's default of 600 stops a few busy agents within a\n"
        "  # minute. This is more than a dozen busy local agents send.\n"
        f"  rateLimitLoopback: {LOCAL_RATE_LIMIT}\n"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(secret_path, secrets.token_hex(32) + "\n")
        write_atomic(path, text)
    except OSError as error:
        raise RelayError(
            0, "io_error", f"cannot write {error.filename}: {error.strerror}"
        ) from None
    broker_url = f"http://127.0.0.1:{args.port}"
    dashboard_url = f"http://127.0.0.1:{ops_port}/"
    broker_flag = "" if args.port == DEFAULT_PORT else f"--broker {broker_url} "
    steps = [
        f"twistd -n relay --config {path}",
        f"relay {broker_flag}--secret-file {secret_path} selfcheck",
    ]
    busy = _port_in_use(args.port)
    ops_busy = _port_in_use(ops_port)
    console.emit(
        {
            "config": str(path),
            "secretFile": str(secret_path),
            "brokerUrl": broker_url,
            "dashboardUrl": dashboard_url,
            "portInUse": busy,
            "opsPortInUse": ops_busy,
            "nextSteps": steps,
        },
        lambda: _print_init(console, path, secret_path, broker_url, dashboard_url, steps, busy,
                            ops_busy),
    )
    return 0


def _print_init(
    console: Console,
    path: Path,
    secret_path: Path,
    broker_url: str,
    dashboard_url: str,
    steps: Sequence[str],
    busy: bool,
    ops_busy: bool,
) -> None:
    console.line(f"wrote {path} and a fresh secret in {secret_path} (both mode 0600)")
    if busy:
        console.warn(
            f"warning: something already listens on {broker_url} (a broker from `make run`?); "
            "stop it first, or run `relay init --force --port N` for another port"
        )
    if ops_busy and not busy:
        console.warn(
            f"warning: something already listens on {dashboard_url} (the dashboard's port); "
            "run `relay init --force --ops-port N` for another one"
        )
    console.line("next steps:")
    console.line(f"  1. start the broker:      {steps[0]}")
    console.line(f"  2. check the round trip:  {steps[1]}")
    console.line(f"     the dashboard:         {dashboard_url}")
    settings = json.dumps({"brokerUrl": broker_url, "secretFile": str(secret_path)})
    console.line(f"  3. save the settings:     put {settings}")
    console.line("     (and your \"agent\" name) in ~/.dsh-relay.json to drop the flags")


async def selfcheck(ctx: Context) -> int:
    """Round-trip a message over v1.0 and over v1.1 between two throwaway agents."""
    console = ctx.console
    tag = uuid.uuid4().hex[:8]
    alice_name, bob_name = selfcheck_agent_names(tag)
    alice, bob = ctx.new_client(alice_name), ctx.new_client(bob_name)
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
