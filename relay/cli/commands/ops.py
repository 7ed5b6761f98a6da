"""``relay stats``: the figures of the dashboard, in the terminal (``--json`` for scripts);
``relay unlock``: an operator clears an agent's authentication locks.

The ops listener is found from ``--ops URL``, then ``DSH_RELAY_OPS``, then the
first ``broker.opsListen`` endpoint of the broker config: ``--config``, else
``conf/relay.yaml`` in the working directory, else ``relay init``'s
``~/.dsh-agent-relay/relay.yaml``; without any of them, the default ops address
``http://127.0.0.1:19122``. Its token comes from ``--ops-token``,
``DSH_RELAY_OPS_TOKEN``, then the config's ``broker.opsToken`` or
``broker.opsTokenFile``. Reading the config creates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import yaml

from relay.cli.command import Context
from relay.cli.output import span, table
from relay.client.settings import UsageError
from relay.rules.endpoints import TLS_KINDS, endpoint_kind, endpoint_option, listen_interface
from relay.wire.errors import RelayError

ENV_OPS = "DSH_RELAY_OPS"
ENV_OPS_TOKEN = "DSH_RELAY_OPS_TOKEN"
DEFAULT_CONFIG = "conf/relay.yaml"
INIT_CONFIG = "~/.dsh-agent-relay/relay.yaml"
DEFAULT_OPS_URL = "http://127.0.0.1:19122"
TIMEOUT_SECONDS = 15.0


def stats_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the ops listener is and its token."""
    parser.add_argument("--ops", metavar="URL",
                        help=f"the ops listener (default: ${ENV_OPS}, else broker.opsListen "
                             "of --config)")
    parser.add_argument("--ops-token", metavar="TOKEN",
                        help=f"the ops token (default: ${ENV_OPS_TOKEN}, else the config's)")
    parser.add_argument("--config", metavar="PATH",
                        help=f"the broker config to read them from (default {DEFAULT_CONFIG}, "
                             f"else {INIT_CONFIG}, else the ops address {DEFAULT_OPS_URL})")
    parser.add_argument("--all", action="store_true",
                        help="list every agent, the offline ones and those of selfcheck runs")


def ops_url(description: str) -> str:
    """The URL of an ops endpoint string (``tcp:``, ``tcp6:``, ``ssl:``); a wildcard
    interface is reached on loopback."""
    interface = listen_interface(description)
    if interface is None:
        raise UsageError(f"cannot reach ops endpoint {description!r} over HTTP: pass --ops URL")
    port = endpoint_option(description, "port", 1) or ""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(interface, interface)
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if endpoint_kind(description) in TLS_KINDS else "http"
    return f"{scheme}://{host}:{port}"


def _from_config(path: str) -> Tuple[Optional[str], Optional[str]]:
    """``(url, token)`` from the config file at ``path``; the url is None when the
    config has no ops listener. A missing file is a UsageError saying so."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise UsageError(f"no such config file: {path}") from None
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    broker = data.get("broker") if isinstance(data, dict) else None
    if not isinstance(broker, dict):
        return None, None
    listen = broker.get("opsListen")
    if isinstance(listen, str):
        listen = [listen]
    url = ops_url(listen[0]) if isinstance(listen, list) and listen else None
    token = broker.get("opsToken")
    if isinstance(token, list):
        token = token[0] if token else None
    token_file = broker.get("opsTokenFile")
    if token is None and isinstance(token_file, str):
        file = Path(os.path.dirname(os.path.abspath(path))) / os.path.expanduser(token_file)
        try:
            lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
        except OSError as error:
            raise UsageError(f"cannot read the ops token file {file}: {error.strerror}") from None
        token = next((line for line in lines if line), None)
    return url, token if isinstance(token, str) else None


def _config_path(args: argparse.Namespace, home: Path) -> Optional[str]:
    """The config to read: ``--config``, else the first of conf/relay.yaml and relay
    init's that exists; None when neither does."""
    if args.config:
        return str(args.config)
    for candidate in (Path(DEFAULT_CONFIG), home / ".dsh-agent-relay" / "relay.yaml"):
        if candidate.is_file():
            return str(candidate)
    return None


def ops_target(args: argparse.Namespace, env: Mapping[str, str],
               home: Optional[Path] = None) -> Tuple[str, Optional[str]]:
    """The ops listener's URL and token, from flags, environment, then the config,
    then the default ops address."""
    url = args.ops or env.get(ENV_OPS) or None
    token = args.ops_token or env.get(ENV_OPS_TOKEN) or None
    if url is None or token is None:
        path = _config_path(args, Path.home() if home is None else home)
        if path is None:
            return (url or DEFAULT_OPS_URL).rstrip("/"), token
        config_url, config_token = _from_config(path)
        if url is None and config_url is None:
            raise UsageError(f"{path} has no broker.opsListen, so its broker has no ops "
                             "listener (docs/OPERATIONS.md); add one, or pass --ops URL")
        url = url or config_url
        token = token or config_token
    return (url or DEFAULT_OPS_URL).rstrip("/"), token


def _reason(failure: BaseException) -> str:
    """A connection failure in a few words."""
    from twisted.internet.error import ConnectionRefusedError, DNSLookupError

    if isinstance(failure, ConnectionRefusedError):
        return "connection refused"
    if isinstance(failure, DNSLookupError):
        return "the host name does not resolve"
    return str(failure) or failure.__class__.__name__


def _age(seconds: Optional[float]) -> str:
    """An age in the words of every readable output (``12 s``, ``3 min``)."""
    return "-" if seconds is None else span(seconds)


def _pairs(counts: Dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v) or "0"


def _worth_listing(agent: Mapping[str, Any]) -> bool:
    """Online, holding messages, streaming or with a webhook: an offline agent with
    nothing (the throwaway agents of selfcheck runs among them) is only counted."""
    held = sum(agent.get(key) or 0 for key in ("queued", "leased", "delayed", "failed"))
    return (bool(agent.get("online")) or held > 0 or bool(agent.get("streams"))
            or agent.get("webhook") is not None)


def _webhook(health: Optional[Mapping[str, Any]], now: Optional[float]) -> str:
    """A webhook's health in a word or two (never its URL): ``-`` for none."""
    if health is None:
        return "-"
    if health.get("disabled"):
        return "disabled"
    since = health.get("failingSince")
    if since is not None and now is not None:
        return f"failing {_age(now - since)}"
    delivered = health.get("lastDelivered")
    if delivered is not None and now is not None:
        return f"ok {_age(now - delivered)} ago"
    return "ok"


def print_overview(ctx: Context, overview: Dict[str, Any]) -> None:
    """The overview in the words of the dashboard; offline idle agents folded."""
    console = ctx.console
    show_all = bool(getattr(ctx.args, "all", False))
    b, t = overview["broker"], overview["totals"]
    health = "healthy" if b["healthy"] else f"UNHEALTHY: {b['health']}"
    console.line(f"broker {b['version']}, storage {b['storage']}, {health}, "
                 f"up {_age(b['uptimeSeconds'])}")
    console.line(f"agents online {t['agentsOnline']}  queued {t['queued']}  leased {t['leased']}"
                 f"  delayed {t['delayed']}  dead letters {t['failed']}"
                 f"  long polls waiting {t['pullWaiting']}")
    console.line(f"sent {t['sent']}  delivered {t['delivered']}  acked {_pairs(t['acked'])}"
                 f"  dead-lettered {_pairs(t['deadLettered'])}  expired {t['expired']}"
                 f"  lease expirations {t['leaseExpirations']}")
    console.line(f"refused: rate-limited (429) {t.get('rateLimited', 0)}  sends refused "
                 f"{_pairs(t['sendsRefused'])}  auth failures {_pairs(t['authFailures'])}"
                 f"  lockouts {t['lockouts']}")
    wires = t.get("requestsByWire")
    if wires:
        console.line(f"requests by wire: seed {wires.get('seed', 0)}  v2/v3 {wires.get('v2', 0)}")
    console.line(f"event streams {t.get('eventStreams', 0)}  events streamed "
                 f"{t.get('eventsStreamed', 0)}  webhook attempts {t.get('webhookAttempts', 0)}"
                 f"  failures {t.get('webhookFailures', 0)}  skips {t.get('webhookSkips', 0)}"
                 f"  disabled {t.get('webhooksDisabled', 0)}")
    if t.get("groupSends"):
        console.line(f"group sends {_pairs(t['groupSends'])}")
    if overview["throughput"]:
        last = overview["throughput"][-1]
        console.line(f"last interval: sent {last['sent']:.2f}/s  delivered "
                     f"{last['delivered']:.2f}/s  acked {last['acked']:.2f}/s  requests "
                     f"{last['requests']:.2f}/s  errors {last['errors']:.2f}/s")
    console.line()
    listed = [a for a in overview["agents"] if show_all or _worth_listing(a)]
    now = b.get("now")
    rows = [(a["agent"], "yes" if a["online"] else "no", a["queued"], a["leased"],
             a["delayed"], a["failed"], _age(a["oldestAgeSeconds"]), a.get("streams", 0),
             _webhook(a.get("webhook"), now))
            for a in listed]
    if rows:
        for line in table(rows, ("AGENT", "ONLINE", "QUEUED", "LEASED", "DELAYED", "FAILED",
                                 "OLDEST", "STREAMS", "WEBHOOK")):
            console.line(line)
    elif not overview["agents"]:
        console.line("no agents")
    folded = len(overview["agents"]) - len(listed)
    if folded:
        console.line(f"{folded} offline agent{'' if folded == 1 else 's'} with no messages "
                     "not shown (--all lists them)")
    pairs = overview["flow"]["pairs"][:10]
    if pairs:
        console.line()
        for line in table([(p["from"], p["to"], p["count"]) for p in pairs],
                          ("FROM", "TO", "MESSAGES (LAST MINUTES)")):
            console.line(line)


async def ops_request(ctx: Context, method: str, path: str,
                      body: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One JSON request to the ops listener (with its token); the answer's JSON
    object, or a RelayError that says what went wrong in one line."""
    import treq

    from relay.client.trust import make_http_client

    url, token = ops_target(ctx.args, ctx.env, ctx.home)
    http = ctx.http
    if http is None:
        settings = ctx.settings
        http = make_http_client(ctx.clock, settings.ca_file, settings.client_cert,
                                settings.client_key)
    headers = {"Accept": ["application/json"]}
    if token:
        headers["Authorization"] = [f"Bearer {token}"]
    data = None
    if body is not None:
        headers["Content-Type"] = ["application/json"]
        data = json.dumps(body).encode("utf-8")
    try:
        response = await http.request(method, url + path, headers=headers, data=data,
                                      timeout=TIMEOUT_SECONDS)
        raw = await treq.content(response)
    except Exception as failure:  # a connection or TLS failure, said in one line
        hint = ""
        if url == DEFAULT_OPS_URL and not (ctx.args.ops or ctx.env.get(ENV_OPS)
                                           or _config_path(ctx.args, ctx.home)):
            hint = (f" (the default address: there is no {DEFAULT_CONFIG} here and no "
                    f"{INIT_CONFIG}; pass --ops URL or --config PATH)")
        raise RelayError(0, "connection_error",
                         f"cannot reach the ops listener at {url}: {_reason(failure)}{hint}"
                         ) from None
    try:
        document = json.loads(raw)
    except ValueError:
        raise RelayError(response.code, "bad_answer",
                         f"the ops listener at {url} did not answer JSON") from None
    if response.code != 200:
        error = document.get("error", {}) if isinstance(document, dict) else {}
        raise RelayError(response.code, error.get("code", "error"), error.get("message", ""))
    return document


async def stats(ctx: Context) -> int:
    """GET /api/overview of the ops listener: the dashboard's figures."""
    document = await ops_request(ctx, "GET", "/api/overview")
    ctx.console.emit(document, lambda: print_overview(ctx, document))
    return 0


UNLOCK_DESCRIPTION = """\
Clear an agent's authentication locks and failure counts, from every address
and on every broker sharing the store, through the broker's ops listener (with
its token). A lock holds `security.lockMinutes` after repeated authentication
failures: find why they failed (a wrong or rotated secret, a clock off by more
than 300 s) before clearing it, or it comes back."""


def unlock_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent, and where the ops listener is."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("agent_name", metavar="AGENT", help="the locked agent")
    stats_arguments(parser)


async def unlock(ctx: Context) -> int:
    """POST /api/unlock of the ops listener."""
    agent = ctx.args.agent_name
    document = await ops_request(ctx, "POST", "/api/unlock", {"agent": agent})
    locks = document.get("unlocked", 0)

    def readable() -> None:
        if locks:
            ctx.console.line(f"{agent}: unlocked ({locks} lock{'s' if locks != 1 else ''} "
                             "cleared)")
        else:
            ctx.console.line(f"{agent}: was not locked (its failure counts are cleared)")

    ctx.console.emit(document, readable)
    return 0
