"""``relay.sse``, the documented import path of the events a client reads: they are
:mod:`relay.client.sse`'."""

from relay.client.sse import MESSAGE, RESET, STATUS, RelayEvent

__all__ = ["MESSAGE", "RESET", "STATUS", "RelayEvent"]
