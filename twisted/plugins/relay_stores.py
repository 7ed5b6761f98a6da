"""The built-in storage backends of the relay, as IStoreFactory plugins."""

from relay.store.plugins import jsonl, memory, postgres, sqlite

__all__ = ["memory", "sqlite", "jsonl", "postgres"]
