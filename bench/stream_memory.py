"""Bytes of Python memory one open event stream holds in the broker, by tracemalloc.

Load-independent (no sockets, no second process, no timing): builds the relay's
site on a backend as ``bench/inproc.py`` does, registers N agents, and opens one
``GET /v1/events`` per agent, each on its own HTTP channel over an in-memory
transport, the way a connection's bytes reach the broker. Prints the memory the
interpreter allocated for the N open streams (the channel, the request, the
stream's state; not the kernel's socket buffers nor the in-memory transports,
which are the bench's own), per stream, and where the most of it was allocated.

    .venv/bin/python bench/stream_memory.py [--streams 2000] [--backends memory,sqlite]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from typing import Any, List, Optional, Sequence

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

from inproc import connect  # noqa: E402
from twisted.internet.error import ConnectionDone  # noqa: E402
from twisted.internet.task import Clock  # noqa: E402
from twisted.python.failure import Failure  # noqa: E402

from relay.broker.assembly import assemble  # noqa: E402
from relay.store.plugins import open_configured_store  # noqa: E402
from relay.testing import SECRET, START, make_config  # noqa: E402
from relay.wire.signing import sign  # noqa: E402


def signed_get(path: str, agent: str, timestamp: int) -> bytes:
    """One raw signed HTTP ``GET`` of ``path`` as ``agent``."""
    signature = sign(SECRET, "GET", path, timestamp, b"").encode()
    return (b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Relay-Agent: %s\r\n"
            b"X-Relay-Timestamp: %d\r\nX-Relay-Signature: %s\r\n\r\n"
            % (path.encode(), agent.encode(), timestamp, signature))


def measure(backend: str, streams: int, top: int) -> None:
    clock = Clock()
    clock.advance(START)
    with tempfile.TemporaryDirectory() as data_dir:
        config = make_config(storage=backend, dataDir=data_dir, rateLimitLoopback=10**9,
                             maxStreams=streams + 10, maxConnections=streams + 100)
        store = open_configured_store(config, clock)
        agents = [f"agent-{i}" for i in range(streams)]
        for agent in agents:
            store.register(agent, clock.seconds())
        clock.advance(0)
        assembly = assemble(config, store, clock, listen=False)
        site = assembly.site
        requests = [signed_get("/v1/events", agent, int(START)) for agent in agents]
        # The transports are the bench's stand-in for sockets: made before counting.
        pairs: List[Any] = [connect(site) for _ in agents]
        gc.collect()
        tracemalloc.start(10)
        before = tracemalloc.take_snapshot()
        for (channel, transport), raw in zip(pairs, requests):
            channel.dataReceived(raw)
            clock.advance(0)
            transport.clear()
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        opened = assembly.broker.streams.total
        total = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        print(f"{backend:8s} {streams} streams open ({opened}): {total / streams:,.0f} bytes "
              "a stream (Python allocations)")
        for stat in after.compare_to(before, "lineno")[:top]:
            frame = stat.traceback[0]
            where = os.path.relpath(frame.filename) if "site-packages" not in frame.filename \
                else frame.filename.split("site-packages/")[1]
            print(f"    {stat.size_diff / streams:8,.0f} B  {where}:{frame.lineno}")
        streams_held = assembly.broker.streams
        written = [len(transport.value()) for _, transport in pairs]
        started = time.perf_counter()
        streams_held.keepalive()
        took = time.perf_counter() - started
        touched = sum(1 for (_, transport), was in zip(pairs, written)
                      if len(transport.value()) != was)
        print(f"    one keepalive tick writes to {touched} streams in {took * 1000:.1f} ms "
              "(wall clock: a rough figure on a busy machine)")
        for channel, _ in pairs:
            channel.connectionLost(Failure(ConnectionDone()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--backends", default="memory,sqlite")
    parser.add_argument("--top", type=int, default=12, help="allocation sites shown")
    args = parser.parse_args(argv)
    for backend in [b for b in args.backends.split(",") if b]:
        measure(backend, args.streams, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
