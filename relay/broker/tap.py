"""``twistd relay``: command-line options and the composition root of the broker."""

from __future__ import annotations

import sys
from typing import Any, Dict

from twisted.python import usage

from relay.files.pidfile import choose_pidfile
from relay.wire.errors import EXIT_CONFIG_ERROR, ConfigError

DEFAULT_CONFIG = "conf/relay.yaml"
# The pid file of a detached broker (none in the foreground; see relay.files.pidfile).
BROKER_PIDFILE = "relay.pid"


class Options(usage.Options):
    """Options of ``twistd relay``."""

    optParameters = [
        ["config", "c", DEFAULT_CONFIG, "Path of the YAML config file."],
        ["data-dir", "d", None, "Directory for stored data (overrides broker.dataDir)."],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["listen"] = []

    def opt_listen(self, description: str) -> None:
        """Twisted endpoint string to listen on (repeatable; overrides broker.listen)."""
        self["listen"].append(description)

    def postOptions(self) -> None:
        choose_pidfile(self, BROKER_PIDFILE)

    def overrides(self) -> Dict[str, Any]:
        """The ``broker.*`` values given on the command line."""
        out: Dict[str, Any] = {}
        if self["listen"]:
            out["listen"] = list(self["listen"])
        if self["data-dir"]:
            out["dataDir"] = self["data-dir"]
        return out


def fail(error: Exception) -> None:
    """Stop the start with one line on stderr and exit status 78 (EX_CONFIG)."""
    sys.stderr.write(f"relay: config error: {error}\n")
    raise SystemExit(EXIT_CONFIG_ERROR)


def makeService(options: Options, reactor=None):
    """Load the config, open the store, build the broker through the composition
    root (:func:`relay.broker.assembly.assemble`) and hand it to the service."""
    if reactor is None:
        from twisted.internet import reactor
    from relay.broker.assembly import assemble
    from relay.broker.service import RelayService
    from relay.rules.config import load_config
    from relay.store.plugins import open_configured_store, store_factories

    try:
        factories = store_factories()
        path, overrides = options["config"], options.overrides()
        config, created = load_config(path, overrides, factories)
        store = open_configured_store(config, reactor, factories)
        try:
            assembly = assemble(config, store, reactor)
        except BaseException:
            store.close()
            raise
        return RelayService(assembly, reactor, created=created,
                            reload_config=lambda: load_config(path, overrides, factories),
                            handle_signals=True)
    except ConfigError as error:
        fail(error)
