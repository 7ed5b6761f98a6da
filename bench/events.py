"""Events at scale (REACH §11, §12): many open event streams on one broker, and one
webhook receiver taking a steady flow of events.

``streams``: N agents (default 10,000) each hold one open ``GET /v1/events`` on one
broker (sqlite unless ``--storage``); senders send ``--rate`` messages per second
(open loop) to random agents among them. Figures: send → ``message`` event latency
(from just before the send request to the event read off the stream: p50/p90/p99/
max), events lost, the broker's RSS with no stream open and with all of them open,
and memory per stream ((RSS with streams − RSS without) / N).

``webhooks``: K agents (default 200) each register a webhook on one local receiver
(an asyncio HTTP server of this process); senders send ``--rate`` messages per second
(default 1,000) to random agents among them. Figures: send → receipt latency of the
``message`` event POSTed to the receiver, events lost, duplicates.

The broker is started as an operator would (``twistd -n relay --config <temp>``,
``bench/servers.py``) with its connection and stream caps set for N, or pass
``--url`` and ``--secret`` for a running broker. Every request is signed as the seed
wire says (``bench/loadgen.py``); the streams are plain asyncio protocols (a few
hundred bytes each here), so one process holds ten thousand of them. Both this
process and the broker raise their open-files limit toward the hard limit (which
must be above N + 200).

    .venv/bin/python bench/events.py streams --streams 10000 --rate 500 --duration 60
    .venv/bin/python bench/events.py webhooks --agents 200 --rate 1000 --duration 60

Each prints one JSON line, then the figures against the issue's targets (streams:
p99 < 50 ms, RSS < 500 MB, < 20 KB a stream; webhooks: p99 < 100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from array import array
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers  # noqa: E402
from loadgen import AsyncConn, Target, make_body, request_bytes, run_id  # noqa: E402

JsonDict = Dict[str, Any]


class BenchError(Exception):
    """The broker refused what the benchmark needs (the message says what)."""

TARGETS = {"streams": {"p99Ms": 50.0, "rssMB": 500.0, "perStreamKB": 20.0},
           "webhooks": {"p99Ms": 100.0}}


def raise_open_files() -> int:
    """Raise this process's soft open-files limit to its hard limit; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def percentiles(values: Sequence[float]) -> JsonDict:
    """p50/p90/p99/max in milliseconds of latencies in seconds."""
    if not values:
        return {"p50Ms": None, "p90Ms": None, "p99Ms": None, "maxMs": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

    return {"p50Ms": at(0.50), "p90Ms": at(0.90), "p99Ms": at(0.99),
            "maxMs": round(ordered[-1] * 1000, 2)}


class Sent:
    """Send times by message id, and the latencies of the ones seen arriving."""

    def __init__(self) -> None:
        self.at: Dict[str, float] = {}
        self.latencies = array("d")
        self.seen: set = set()
        self.duplicates = 0
        self.late = 0

    def arrived(self, message_id: Any) -> None:
        started = self.at.get(message_id)
        if started is None:
            return
        if message_id in self.seen:
            self.duplicates += 1
            return
        self.seen.add(message_id)
        self.latencies.append(time.time() - started)


# -- the event streams --------------------------------------------------------------------


class StreamReader(asyncio.Protocol):
    """One open ``GET /v1/events``: its chunked body parsed into SSE records; the id
    of each ``message`` event is handed to ``sent``."""

    __slots__ = ("request", "sent", "buf", "body", "chunk", "crlf", "status", "opened",
                 "lost", "transport")

    def __init__(self, request: bytes, sent: Sent, opened: asyncio.Future) -> None:
        self.request = request
        self.sent = sent
        self.buf = b""
        self.body = b""
        self.chunk = -1  # bytes left of the current chunk (-1: a size line is next)
        self.crlf = 0  # bytes left of the CRLF ending the current chunk
        self.status = 0
        self.opened = opened
        self.lost = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)
        self.request = b""

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.lost = True
        if not self.opened.done():
            self.opened.set_result(False)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.status:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self.buf[9:12])
            self.buf = self.buf[end + 4:]
            if not self.opened.done():
                self.opened.set_result(self.status == 200)
            if self.status != 200:
                self.transport.close()
                return
        self._unchunk()
        while True:
            end = self.body.find(b"\n\n")
            if end < 0:
                return
            record, self.body = self.body[:end], self.body[end + 2:]
            if b"event: message\n" in record:
                data = record[record.index(b"data: ") + 6:]
                self.sent.arrived(json.loads(data).get("id"))

    def _unchunk(self) -> None:
        buf = self.buf
        while buf:
            if self.chunk < 0:  # a chunk's size line
                line = buf.find(b"\r\n")
                if line < 0:
                    break
                self.chunk = int(buf[:line].split(b";")[0], 16)
                self.crlf = 2
                buf = buf[line + 2:]
            elif self.chunk > 0:
                take = buf[:self.chunk]
                self.body += take
                self.chunk -= len(take)
                buf = buf[len(take):]
            else:  # the CRLF after a chunk's data
                eaten = min(self.crlf, len(buf))
                buf = buf[eaten:]
                self.crlf -= eaten
                if not self.crlf:
                    self.chunk = -1
        self.buf = buf


async def register_all(target: Target, agents: Sequence[str], parallel: int = 16,
                       webhook: Optional[str] = None) -> None:
    """``POST /register`` each agent (with its webhook URL under ``webhook``/agent)."""
    queue = list(agents)

    async def worker() -> None:
        conn = AsyncConn(target)
        try:
            while queue:
                agent = queue.pop()
                body: JsonDict = {"agent": agent}
                if webhook is not None:
                    body["webhook"] = {"url": f"{webhook}/{agent}"}
                status, answer = await conn.request(
                    "POST", "/register", json.dumps(body).encode(), agent)
                if status != 200:
                    raise BenchError(f"POST /register for {agent}: {status} {answer[:200]!r}")
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(parallel)))


async def open_streams(target: Target, agents: Sequence[str], sent: Sent,
                       parallel: int = 64) -> List[StreamReader]:
    """One open event stream per agent, ``parallel`` being opened at a time."""
    loop = asyncio.get_running_loop()
    host = f"{target.host}:{target.port}".encode()
    key = target.secret.encode()
    gate = asyncio.Semaphore(parallel)
    readers: List[StreamReader] = []

    async def one(agent: str) -> None:
        async with gate:
            opened = loop.create_future()
            reader = StreamReader(request_bytes("GET", "/v1/events", b"", agent, key, host),
                                  sent, opened)
            await loop.create_connection(lambda: reader, target.host, target.port)
            if not await asyncio.wait_for(opened, 60):
                raise BenchError(f"GET /v1/events for {agent} answered {reader.status}")
            readers.append(reader)

    await asyncio.gather(*(one(agent) for agent in agents))
    return readers


async def send_at_rate(target: Target, senders: Sequence[str], recipients: Sequence[str],
                       rate: float, seconds: float, sent: Sent) -> JsonDict:
    """Open-loop sends: ``rate`` per second in all, spread over the senders (one
    connection each), each to a random recipient. Returns the send counts."""
    per_sender = rate / len(senders)
    interval = 1.0 / per_sender
    start = time.time() + 0.5
    stop = start + seconds
    counts = {"sent": 0, "refused": 0, "senderLate": 0}

    async def sender(agent: str, phase: float) -> None:
        conn = AsyncConn(target)
        rng = random.Random()
        due = start + phase
        try:
            while due < stop:
                delay = due - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -interval:
                    counts["senderLate"] += 1
                envelope = make_body(rng.choice(recipients))
                body = json.dumps(envelope, separators=(",", ":")).encode()
                sent.at[envelope["id"]] = time.time()
                status, _ = await conn.request("POST", "/messages", body, agent)
                if status in (200, 201):
                    counts["sent"] += 1
                else:
                    counts["refused"] += 1
                    sent.at.pop(envelope["id"], None)
                due += interval
        finally:
            conn.close()

    await asyncio.gather(*(sender(agent, i * interval / len(senders))
                           for i, agent in enumerate(senders)))
    return counts


async def settle(sent: Sent, wait: float) -> None:
    """Wait until every sent message arrived, at most ``wait`` seconds."""
    deadline = time.time() + wait
    while len(sent.seen) < len(sent.at) and time.time() < deadline:
        await asyncio.sleep(0.1)


def per_message(cpu: Optional[float], messages: int) -> Optional[float]:
    """The broker's CPU microseconds per message sent (its send and its event)."""
    if cpu is None or not messages:
        return None
    return round(cpu / messages * 1e6, 1)


def rss_mb(pid: Optional[int]) -> Optional[float]:
    if pid is None:
        return None
    rss = servers.read_status(pid).get("VmRSS")
    return None if rss is None else round(rss, 1)


async def streams_scenario(target: Target, pid: Optional[int], args: argparse.Namespace
                           ) -> JsonDict:
    prefix = run_id()
    agents = [f"ev{prefix}-{i}" for i in range(args.streams)]
    senders = [f"ev{prefix}-sender-{i}" for i in range(args.senders)]
    began = time.time()
    await register_all(target, agents + senders)
    registered = time.time() - began
    await asyncio.sleep(args.settle)
    without = rss_mb(pid)
    sent = Sent()
    began = time.time()
    readers = await open_streams(target, agents, sent)
    opening = time.time() - began
    await asyncio.sleep(args.settle)
    with_streams = rss_mb(pid)
    cpu0 = time.process_time()
    broker0 = servers.cpu_seconds(pid) if pid else 0.0
    counts = await send_at_rate(target, senders, agents, args.rate, args.duration, sent)
    await settle(sent, args.grace)
    broker_cpu = servers.cpu_seconds(pid) - broker0 if pid else None
    cpu = time.process_time() - cpu0
    after = rss_mb(pid)
    lost_streams = sum(1 for r in readers if r.lost)
    for reader in readers:
        reader.transport.close()
    out: JsonDict = {
        "scenario": "streams", "streams": args.streams, "rate": args.rate,
        "seconds": args.duration, "registerSeconds": round(registered, 1),
        "openSeconds": round(opening, 1), **counts,
        "delivered": len(sent.seen), "lost": len(sent.at) - len(sent.seen),
        "duplicates": sent.duplicates, "streamsClosedByBroker": lost_streams,
        **percentiles(sent.latencies),
        "rssWithoutStreamsMB": without, "rssWithStreamsMB": with_streams,
        "rssAfterMB": after,
        "brokerCpuUsPerMessage": per_message(broker_cpu, counts["sent"]),
        "loadgenCpuBusy": round(cpu / (args.duration + 0.5), 3),
    }
    if without is not None and with_streams is not None:
        out["perStreamKB"] = round((with_streams - without) * 1024 / args.streams, 2)
    return out


# -- the webhook receiver -----------------------------------------------------------------


class Receiver(asyncio.Protocol):
    """One connection of the webhook receiver: each POST's JSON body is an event; a
    ``message`` event's data id goes to ``sent``; every request gets ``200``."""

    def __init__(self, sent: Sent, stats: JsonDict) -> None:
        self.sent = sent
        self.stats = stats
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in self.buf[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            event = json.loads(body)
            self.stats["posts"] += 1
            if event.get("event") == "message":
                self.sent.arrived(event["data"].get("id"))
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")


async def webhooks_scenario(target: Target, pid: Optional[int], args: argparse.Namespace
                            ) -> JsonDict:
    loop = asyncio.get_running_loop()
    sent = Sent()
    stats: JsonDict = {"posts": 0}
    server = await loop.create_server(lambda: Receiver(sent, stats), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    prefix = run_id()
    agents = [f"wh{prefix}-{i}" for i in range(args.agents)]
    senders = [f"wh{prefix}-sender-{i}" for i in range(args.senders)]
    await register_all(target, senders)
    await register_all(target, agents, webhook=f"http://127.0.0.1:{port}/hook")
    cpu0 = time.process_time()
    broker0 = servers.cpu_seconds(pid) if pid else 0.0
    counts = await send_at_rate(target, senders, agents, args.rate, args.duration, sent)
    await settle(sent, args.grace)
    broker_cpu = servers.cpu_seconds(pid) - broker0 if pid else None
    cpu = time.process_time() - cpu0
    server.close()
    return {
        "scenario": "webhooks", "agents": args.agents, "rate": args.rate,
        "seconds": args.duration, **counts, "posts": stats["posts"],
        "delivered": len(sent.seen), "lost": len(sent.at) - len(sent.seen),
        "duplicates": sent.duplicates, **percentiles(sent.latencies),
        "rssAfterMB": rss_mb(pid),
        "brokerCpuUsPerMessage": per_message(broker_cpu, counts["sent"]),
        "loadgenCpuBusy": round(cpu / (args.duration + 0.5), 3),
    }


# -- running it ---------------------------------------------------------------------------


def report(result: JsonDict) -> None:
    print(json.dumps(result), flush=True)
    targets = TARGETS[result["scenario"]]
    rows: List[Tuple[str, Any, str]] = [
        ("delivered / lost / duplicates",
         f"{result['delivered']} / {result['lost']} / {result['duplicates']}", ""),
        ("latency p50 / p90 / p99 / max ms",
         f"{result['p50Ms']} / {result['p90Ms']} / {result['p99Ms']} / {result['maxMs']}",
         f"p99 < {targets['p99Ms']:g} ms"),
    ]
    if result["scenario"] == "streams":
        rows.append(("broker RSS without / with streams MB",
                     f"{result['rssWithoutStreamsMB']} / {result['rssWithStreamsMB']}",
                     f"< {targets['rssMB']:g} MB"))
        rows.append(("memory per stream KB", result.get("perStreamKB"),
                     f"< {targets['perStreamKB']:g} KB"))
    rows.append(("broker CPU per message us (send+event)", result["brokerCpuUsPerMessage"],
                 ""))
    rows.append(("sends late (open loop behind)", result["senderLate"], ""))
    for name, value, goal in rows:
        print(f"{name:38s} {str(value):28s} {goal}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["streams", "webhooks"])
    parser.add_argument("--streams", type=int, default=10000, help="open event streams")
    parser.add_argument("--agents", type=int, default=200, help="agents with a webhook")
    parser.add_argument("--rate", type=float, help="messages per second (streams: 500, "
                                                   "webhooks: 1000)")
    parser.add_argument("--senders", type=int, default=8, help="sending connections")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of sending")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds to wait for the last events after the sends")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds before each RSS reading")
    parser.add_argument("--storage", default="sqlite")
    parser.add_argument("--python", default=servers.default_python(),
                        help="the broker's interpreter")
    parser.add_argument("--url", help="a running broker instead of a started one")
    parser.add_argument("--secret", help="its shared secret (with --url)")
    parser.add_argument("--pid", type=int, help="its process id, for RSS (with --url)")
    args = parser.parse_args(argv)
    if args.rate is None:
        args.rate = 500.0 if args.scenario == "streams" else 1000.0
    limit = raise_open_files()
    needed = (args.streams if args.scenario == "streams" else 0) + args.senders + 200
    if limit < needed:
        raise SystemExit(f"the open-files hard limit is {limit}: {needed} are needed")
    scenario = streams_scenario if args.scenario == "streams" else webhooks_scenario
    if args.url:
        try:
            result = asyncio.run(scenario(Target(args.url, args.secret or ""), args.pid, args))
        except BenchError as error:
            raise SystemExit(str(error)) from None
        report(result)
        return 0
    workdir = servers.workspace()
    agents = (args.streams if args.scenario == "streams" else args.agents) + args.senders
    caps = {"maxConnections": agents + 500, "maxStreams": agents + 100,
            "maxAgents": agents + 100}
    broker = servers.broker(args.python, args.storage, workdir, caps)
    try:
        with broker.start():
            result = asyncio.run(scenario(broker.target, broker.pid, args))
            result["peakRssMB"] = broker.rss()["peakMB"]
    except (servers.StartError, BenchError) as error:
        raise SystemExit(str(error)) from None
    finally:
        servers.cleanup(workdir)
    result["storage"] = args.storage
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
