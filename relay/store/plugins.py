"""The built-in store factories, the lookup by name, and opening the configured store.

A factory imports its backend module only when asked to validate options or open
a store, so a backend's optional driver matters only when that backend is used.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Mapping, Optional

from twisted.plugin import IPlugin, getPlugins
from zope.interface import implementer

from relay.store.interface import IStoreFactory
from relay.wire.errors import ConfigError


@implementer(IPlugin, IStoreFactory)
class ModuleStoreFactory:
    """A store factory whose backend module has ``parse_options(section, config)`` and
    ``open_store(config, options, reactor)``."""

    def __init__(self, name: str, module: str, description: str) -> None:
        self.name = name
        self.module = module
        self.description = description

    def parse_options(self, section: Mapping[str, Any], config) -> Any:
        return importlib.import_module(self.module).parse_options(section, config)

    def open(self, config, options, reactor):
        return importlib.import_module(self.module).open_store(config, options, reactor)

    def __repr__(self) -> str:
        return f"<store factory {self.name!r} ({self.module})>"


memory = ModuleStoreFactory("memory", "relay.store.memory", "in memory; lost on restart")
sqlite = ModuleStoreFactory("sqlite", "relay.store.sqlite", "SQLite database dataDir/relay.db")
jsonl = ModuleStoreFactory("jsonl", "relay.store.jsonl", "append-only log dataDir/messages.jsonl")
postgres = ModuleStoreFactory("postgres", "relay.store.postgres",
                              "PostgreSQL database broker.postgres.dsn, shared by several brokers")


def store_factories() -> Dict[str, IStoreFactory]:
    """Every store factory plugin, by name."""
    import twisted.plugins

    return {f.name: f for f in getPlugins(IStoreFactory, twisted.plugins)}


def find_store_factory(name: str,
                       factories: Optional[Mapping[str, IStoreFactory]] = None) -> IStoreFactory:
    """The factory called ``name``, or a ConfigError listing the names available."""
    if factories is None:
        factories = store_factories()
    try:
        return factories[name]
    except KeyError:
        known = ", ".join(sorted(factories))
        raise ConfigError(
            "broker.storage", f"unknown backend {name!r} (available: {known})"
        ) from None


def open_configured_store(config, reactor,
                          factories: Optional[Mapping[str, IStoreFactory]] = None):
    """Open the store ``config`` names on ``reactor`` (see :meth:`IStoreFactory.open`),
    after every backend section in the config (``broker.<backend>``) was validated by
    its factory; ConfigError otherwise."""
    if factories is None:
        factories = store_factories()
    factory = find_store_factory(config.storage_backend, factories)
    options = {
        name: factories[name].parse_options(section, config)
        for name, section in config.backend_sections.items()
    }
    if factory.name not in options:
        options[factory.name] = factory.parse_options({}, config)
    return factory.open(config, options[factory.name], reactor)
