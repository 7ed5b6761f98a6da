"""twistd plugin ``relay-agent``: run one agent with a Python handler or a command.

    twistd -n relay-agent --agent NAME --handler package.module:callable
    twistd -n relay-agent --agent NAME --exec "COMMAND"

Connection settings are resolved as for the ``relay`` command (flags, then
environment, then ``~/.dsh-relay.json``), the https ones included: ``--ca-file``,
``--client-cert`` and ``--client-key``, whose files are checked before the
start. A ``--handler`` callable may carry ``on_receipt`` / ``on_reply``
attributes, which receive v1.0 receipts and replies to this agent's own
requests. ``--description`` and ``--skill`` (repeatable) make the agent's peer
card, published with every heartbeat where the broker takes cards. Handler
modules are imported from the working directory first, as with ``python -m``.
Any problem with the options stops the start with one line,
``relay-agent: error: ...``, and exit status 78 (EX_CONFIG).
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from twisted.application.service import IService
from twisted.logger import Logger
from twisted.python import usage

from relay.agent.exec_handler import EXEC_TIMEOUT_SECONDS, ExecHandler
from relay.agent.receipts import ReceiptStore
from relay.agent.runtime import (
    HEARTBEAT_INTERVAL_SECONDS,
    POLL_INTERVAL_SECONDS,
    SHUTDOWN_GRACE_SECONDS,
    AgentService,
    card_of,
)
from relay.client.settings import (
    ENV_AGENT,
    ENV_SECRET,
    ENV_SECRET_FILE,
    FLAG_KEYS,
    Settings,
    UsageError,
    resolve_settings,
)
from relay.client.trust import client_tls_policy
from relay.files.pidfile import choose_pidfile
from relay.wire.errors import EXIT_CONFIG_ERROR, RelayError
from relay.wire.protocol import MAX_CARD_DESCRIPTION_CHARS, MAX_CARD_SKILL_CHARS, MAX_CARD_SKILLS

_log = Logger(namespace="relay.agent")


def _positive(kind: Any) -> Any:
    def coerce(value: str) -> Any:
        number = kind(value)
        if number <= 0:
            raise ValueError(f"must be positive: {value}")
        return number

    coerce.coerceDoc = "Must be positive."  # type: ignore[attr-defined]
    return coerce


class StartError(usage.UsageError):
    """Options that cannot start an agent: printed as one line, exit status 78."""


def load_handler(spec: str, directory: Optional[str] = None) -> Any:
    """The callable named by ``module:callable`` (or ``module.callable``).

    The module is imported as ``python -m`` would: from ``directory`` (default:
    the working directory) first, then the installed packages. Every problem
    is a :class:`StartError` with one line: Python's own ``No module named
    ...``, or the module's own import error, or what is missing in it.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise StartError(f"--handler {spec!r}: expected MODULE:CALLABLE, e.g. myhandlers:answer")
    where = os.path.abspath(directory if directory is not None else os.getcwd())
    if where not in sys.path:
        sys.path.insert(0, where)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise StartError(
                f"cannot load handler {spec!r}: No module named {missing!r} "
                f"(looked in {where} and the installed packages)"
            ) from None
        raise StartError(
            f"cannot load handler {spec!r}: importing {module_name} failed: {error}"
        ) from None
    except Exception as error:
        raise StartError(
            f"cannot load handler {spec!r}: importing {module_name} failed: "
            f"{type(error).__name__}: {error}"
        ) from None
    handler: Any = module
    for part in attribute.split("."):
        try:
            handler = getattr(handler, part)
        except AttributeError:
            raise StartError(
                f"cannot load handler {spec!r}: module {module_name} has no {attribute!r}"
            ) from None
    if not callable(handler):
        raise StartError(f"cannot load handler {spec!r}: {attribute} is not callable")
    return handler


class Options(usage.Options):
    """Command-line options of ``twistd relay-agent``."""

    synopsis = "--agent NAME (--handler MODULE:CALLABLE | --exec COMMAND) [options]"

    optParameters = [
        ["agent", None, None, "This agent's name (or DSH_RELAY_AGENT)."],
        ["broker", None, None, "Broker URL (or DSH_RELAY_BROKER_URL)."],
        ["secret", None, None, "HMAC secret (or DSH_RELAY_SECRET)."],
        ["secret-file", None, None, "File holding the HMAC secret (or DSH_RELAY_SECRET_FILE)."],
        ["ca-file", None, None, "PEM CA bundle to trust for https (or DSH_RELAY_CA_FILE)."],
        [
            "client-cert",
            None,
            None,
            "PEM client certificate for https, may hold the key (or DSH_RELAY_CLIENT_CERT).",
        ],
        [
            "client-key",
            None,
            None,
            "PEM private key of --client-cert (or DSH_RELAY_CLIENT_KEY).",
        ],
        ["handler", None, None, "Python handler as module:callable."],
        ["exec", None, None, "Shell command run per request: request on stdin, reply on stdout."],
        [
            "exec-timeout",
            None,
            EXEC_TIMEOUT_SECONDS,
            "Seconds before --exec is killed.",
            _positive(float),
        ],
        ["concurrency", None, 1, "Requests handled at once.", _positive(int)],
        ["lease", None, None, "Lease length in seconds (broker default if unset).", _positive(int)],
        [
            "poll-interval",
            None,
            POLL_INTERVAL_SECONDS,
            "Seconds between polls when the broker has no long-poll.",
            _positive(float),
        ],
        [
            "heartbeat",
            None,
            HEARTBEAT_INTERVAL_SECONDS,
            "Seconds between heartbeats.",
            _positive(float),
        ],
        [
            "shutdown-grace",
            None,
            SHUTDOWN_GRACE_SECONDS,
            "Seconds to wait for in-flight requests on shutdown.",
            _positive(float),
        ],
        ["receipts-dir", None, None, "Directory of the receipts file (default: home)."],
        ["description", None, None, "What this agent does, for its peer card (`relay peers`)."],
    ]
    optFlags = [
        [
            "debug",
            None,
            "Log the traceback of each handler failure (message bodies are never logged).",
        ],
        [
            "no-events",
            None,
            "Poll (long-poll) for requests even where the broker offers events.",
        ],
    ]

    settings: Settings
    handler: Any = None

    def __init__(self) -> None:
        super().__init__()
        self["skills"] = []

    def opt_url(self, url: str) -> None:
        """Another name of --broker."""
        self["broker"] = url

    def opt_skill(self, skill: str) -> None:
        """A skill for this agent's peer card (repeatable)."""
        self["skills"].append(skill)

    def postOptions(self) -> None:
        """Check everything the agent needs; a problem stops the start with one line."""
        try:
            self.check()
        except StartError as error:
            sys.stderr.write(f"relay-agent: error: {error} (see `twistd relay-agent --help`)\n")
            raise SystemExit(EXIT_CONFIG_ERROR) from None
        choose_pidfile(self, f"relay-agent-{self.settings.agent}.pid")

    def check(self) -> None:
        """Resolve the settings and load the handler; :class:`StartError` on a problem."""
        flags = {key: self[key.replace("_", "-")] for key in FLAG_KEYS}
        try:
            self.settings = resolve_settings(flags, os.environ, Path.home())
        except UsageError as error:
            raise StartError(str(error)) from None
        settings = self.settings
        if settings.ca_file is not None or settings.client_cert is not None:
            try:
                client_tls_policy(settings.ca_file, settings.client_cert, settings.client_key)
            except RelayError as error:
                raise StartError(f"{error.code}: {error.message}") from None
        if not settings.agent:
            raise StartError(f"no agent name: pass --agent NAME or set {ENV_AGENT}")
        if not settings.secret:
            raise StartError(
                f"no secret: pass --secret-file PATH or --secret, or set {ENV_SECRET_FILE} "
                f"or {ENV_SECRET}"
            )
        if (self["handler"] is None) == (self["exec"] is None):
            raise StartError("give exactly one of --handler and --exec")
        if self["handler"] is not None:
            self.handler = load_handler(self["handler"])
        if self["heartbeat"] >= 90:
            raise StartError("--heartbeat must be well under the broker's 90 s TTL")
        description = self["description"]
        if description is not None and len(description) > MAX_CARD_DESCRIPTION_CHARS:
            raise StartError(
                f"--description: at most {MAX_CARD_DESCRIPTION_CHARS} characters "
                f"(this one has {len(description)})"
            )
        if len(self["skills"]) > MAX_CARD_SKILLS:
            raise StartError(f"--skill: at most {MAX_CARD_SKILLS} skills")
        for skill in self["skills"]:
            if not skill or len(skill) > MAX_CARD_SKILL_CHARS:
                raise StartError(f"--skill {skill!r}: 1 to {MAX_CARD_SKILL_CHARS} characters")


def _exit_failed() -> None:
    """End the process with status 1, after twistd has shut down cleanly."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _a_second_signal_stops_at_once(agent: str) -> None:
    """Once the agent is stopping (it may wait for handlers, and for a broker that is
    down), a second Ctrl-C or SIGTERM ends the process at once, by the signal's own
    action. Twisted's handler would only try to stop the stopping reactor again, and
    log the traceback of ReactorNotRunning."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    _log.info("agent {agent}: stopping; a second Ctrl-C or SIGTERM stops it at once",
              agent=agent)


def makeService(options: Options, reactor: Optional[Any] = None) -> IService:
    """The agent runtime described by ``options``."""
    if reactor is None:
        from twisted.internet import reactor  # type: ignore[no-redef]
    from relay.client.client import RelayClient

    settings = options.settings
    client = RelayClient(
        settings.broker_url,
        settings.agent or "",
        settings.secret or "",
        clock=reactor,
        reactor=reactor,
        ca_file=settings.ca_file,
        client_cert=settings.client_cert,
        client_key=settings.client_key,
    )
    if options["exec"] is not None:
        handler: Any = ExecHandler(
            options["exec"], reactor=reactor, timeout=options["exec-timeout"]
        )
    else:
        handler = options.handler
    home = Path(options["receipts-dir"]).expanduser() if options["receipts-dir"] else Path.home()
    receipts = ReceiptStore.for_agent(client.agent, home, reactor)
    reactor.addSystemEventTrigger("after", "shutdown", receipts.close)
    reactor.addSystemEventTrigger("before", "shutdown", _a_second_signal_stops_at_once,
                                  client.agent)

    def fatal(error: Exception) -> None:
        if reactor.running:
            # twistd exits 0 once the reactor stops; a supervisor must see a failure.
            atexit.register(_exit_failed)
            reactor.stop()

    return AgentService(
        client,
        handler,
        clock=reactor,
        receipts=receipts,
        concurrency=options["concurrency"],
        lease_seconds=options["lease"],
        poll_interval=options["poll-interval"],
        heartbeat_interval=options["heartbeat"],
        shutdown_grace=options["shutdown-grace"],
        card=card_of(options["description"], options["skills"]),
        on_receipt=getattr(handler, "on_receipt", None),
        on_reply=getattr(handler, "on_reply", None),
        on_fatal=fatal,
        debug=bool(options["debug"]),
        use_events=not options["no-events"],
    )
