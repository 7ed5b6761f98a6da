"""The built-in store factories and the lookup by name.

A factory imports its backend module only when asked to open a store, so a
backend's optional driver matters only when that backend is chosen.
"""

from __future__ import annotations

import importlib
from typing import Dict

from twisted.plugin import IPlugin, getPlugins
from zope.interface import implementer

from relay.errors import ConfigError
from relay.store.interface import IStoreFactory


@implementer(IPlugin, IStoreFactory)
class ModuleStoreFactory:
    """A store factory whose backend module has an ``open_store(config, clock)``."""

    def __init__(self, name: str, module: str, description: str) -> None:
        self.name = name
        self.module = module
        self.description = description

    def open(self, config, clock):
        return importlib.import_module(self.module).open_store(config, clock)

    def __repr__(self) -> str:
        return f"<store factory {self.name!r} ({self.module})>"


memory = ModuleStoreFactory("memory", "relay.store.memory", "in memory; lost on restart")
sqlite = ModuleStoreFactory("sqlite", "relay.store.sqlite", "SQLite database dataDir/relay.db")
jsonl = ModuleStoreFactory("jsonl", "relay.store.jsonl", "append-only log dataDir/messages.jsonl")


def store_factories() -> Dict[str, IStoreFactory]:
    """Every store factory plugin, by name."""
    import twisted.plugins

    return {f.name: f for f in getPlugins(IStoreFactory, twisted.plugins)}


def find_store_factory(name: str) -> IStoreFactory:
    """The factory called ``name``, or a ConfigError listing the names available."""
    factories = store_factories()
    try:
        return factories[name]
    except KeyError:
        known = ", ".join(sorted(factories))
        raise ConfigError(
            "broker.storage", f"unknown backend {name!r} (available: {known})"
        ) from None
