"""Storage benchmark: send and pull+ack throughput per backend as the store fills up.

For each backend, and for each depth (messages already stored for ten other agents:
0, 10k, 100k and 1M by default), a fresh broker is started, prefilled through the HTTP
API with concurrent senders (the time this took is reported), and measured with the
load generator's ``pull-ack`` and ``send`` scenarios; the broker's peak RSS
(``VmHWM``) is read at the end of each level. Each figure is also given relative to
the same backend at depth 0.

    .venv/bin/python bench/depth.py                           # sqlite, jsonl, memory; up to 1M
    .venv/bin/python bench/depth.py --max-depth 100000        # skip the 1M level
    .venv/bin/python bench/depth.py --backends sqlite --levels 0,10000
    .venv/bin/python bench/depth.py --broker-url URL --secret S --broker-pid PID

Against ``--broker-url`` the levels are cumulative on that one broker.

``--priorities`` measures instead what a pull costs in the puller's own queues as
they fill (REACH §14: a pull at any depth stays flat-cost): in process, on the
store itself. Each level queues ``depth`` messages in one agent's inbox and a role
it holds (half each, every priority 0..8 in both), then the ``--pulls`` measured
messages at priority 9, to the inbox and the role in turn: urgent work arriving
behind a backlog. Each pull(limit 1)+ack takes one of these at every level, the
others queued behind it, so the levels differ by the depth alone (microseconds per
pull+ack). With ``--scattered`` the measured messages are spread evenly through the
filling instead, so at depth each pull reads and writes pages no other pull touches:
what a cold message costs besides the depth.

On SQLite the WAL is checkpointed after the filling and every 200 pulls, outside the
timed pulls (a broker's checkpointer does this in a thread, once a second); without
it the automatic checkpoint at 8192 pages copies the WAL back inside a measured
commit at one level and not at another, as the WAL happens to stand. The
checkpoints of what the pulls wrote are timed apart (``checkpoint us/pull``). The
filled heap is frozen before the pulls (``gc.freeze``), so a full collection of the
backlog, whose cost per allocation does not grow with it, does not land inside one
level's pulls and not another's.
With ``--instructions`` the pulls are counted by callgrind instead (a run with the
pulls minus one without, per pull+ack): a count that does not depend on the
machine's load.

    .venv/bin/python bench/depth.py --priorities                      # 0 to 100k
    .venv/bin/python bench/depth.py --priorities --instructions --backends memory,sqlite
    .venv/bin/python bench/depth.py --priorities --backends postgres --postgres-dsn DSN
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import loadgen
import servers
from run_suite import ExternalBroker, ManagedBroker, render, say

JsonDict = Dict[str, Any]


def run_backend(fresh: Any, levels: Sequence[int], args: argparse.Namespace,
                target: Optional[loadgen.Target] = None,
                rss: Any = None) -> JsonDict:
    """The depth scenario for one backend, without e2e-latency."""
    return loadgen.scenario_depth(
        target, levels, args.concurrency, args.workers, args.duration, args.pull_messages,
        fill_concurrency=args.fill_concurrency, rss=rss, include_e2e=args.e2e, log=say,
        fresh=fresh, repeat=args.repeat)


def table_rows(results: Dict[str, JsonDict]) -> List[List[str]]:
    """One row per backend and depth: rates, their ratio to depth 0, RSS, prefill time."""
    rows = [["backend", "depth", "send req/s", "vs 0", "pull-ack msg/s", "vs 0",
             "peak RSS MB", "prefill s", "prefill msg/s"]]
    for backend, doc in results.items():
        levels = doc["levels"]
        base = levels[0] if levels and levels[0]["depth"] == 0 else None
        for row in levels:
            send = row["send"]["rate"]
            pull = row["pullAck"]["rate"]
            rows.append([
                backend, f"{row['depth']:,}", f"{send:,.0f}",
                f"{send / base['send']['rate']:.0%}" if base and base["send"]["rate"] else "-",
                f"{pull:,.0f}",
                f"{pull / base['pullAck']['rate']:.0%}"
                if base and base["pullAck"]["rate"] else "-",
                str(row.get("rss", {}).get("peakMB", "-")),
                str(row["prefill"]["seconds"]), str(row["prefill"]["rate"]),
            ])
    return rows


# -- pulls by priority at depth (REACH §14) -------------------------------------------

PRIORITY_LEVELS = "0,10000,50000,100000"
# The priority of the measured messages; the others are queued at 0..TOP - 1.
TOP = 9
FILL_BATCH = 2000
# SQLite: pulls between two checkpoints of the WAL (a pull+ack writes 12 to 17 pages)
CHECKPOINT_PULLS = 200
_COLLECTED = re.compile(r"Collected : (\d+)")


def priority_store(backend: str, data_dir: str, dsn: Optional[str]) -> Any:
    """A fresh store of ``backend`` on a Clock, the worker holding the role ``triage``."""
    sys.path.insert(0, os.path.dirname(servers.BENCH_DIR))
    from twisted.internet.task import Clock

    from relay.store.plugins import open_configured_store
    from relay.testing import START, make_config

    clock = Clock()
    clock.advance(START)
    extra: Dict[str, Any] = {}
    if backend == "postgres":
        if not dsn:
            raise SystemExit("--backends postgres needs --postgres-dsn (a database it may fill)")
        extra["postgres"] = {"dsn": dsn}
    config = make_config(storage=backend, dataDir=data_dir, inboxMaxMessages=0,
                         inboxMaxBytes=0, agents={"alpha": {}, "worker": {}},
                         roles={"triage": {"members": ["worker"]}}, **extra)
    if backend == "postgres":
        from twisted.internet import reactor
        return open_configured_store(config, reactor), config, clock
    return open_configured_store(config, clock), config, clock


def priority_pulls(backend: str, depth: int, pulls: int, dsn: Optional[str] = None,
                   baseline: bool = False, scattered: bool = False) -> Tuple[float, float]:
    """Microseconds per pull(limit 1)+ack with ``depth`` messages queued besides the
    ``pulls`` measured (see the module's docstring), and of the checkpoint after them
    per pull. With ``baseline`` nothing is pulled (for the instruction count's
    subtraction). A store on a Clock commits on ``clock.advance`` and answers at once;
    PostgreSQL answers from its threads, so it runs under the reactor."""
    from twisted.internet.defer import ensureDeferred

    if backend != "postgres":
        results: List[Any] = []
        ensureDeferred(_priority_pulls(backend, depth, pulls, dsn, baseline,
                                       scattered)).addBoth(results.append)
        if not results:
            raise SystemExit("the store did not answer on the Clock")
        if hasattr(results[0], "raiseException"):
            results[0].raiseException()
        return results[0]
    from twisted.internet import task

    found: List[Tuple[float, float]] = []

    async def run(reactor: Any) -> None:
        found.append(await _priority_pulls(backend, depth, pulls, dsn, baseline, scattered))

    try:
        task.react(run)
    except SystemExit as stop:
        if stop.code:
            raise
    return found[0]


def priority_fill(depth: int, pulls: int,
                  scattered: bool = False) -> Iterator[Tuple[str, int]]:
    """(queue, priority) of each message of a level, in the order sent: ``depth`` at
    priorities 0..TOP - 1, to the inbox and the role in turn and each getting every
    priority, then the ``pulls`` measured ones at TOP (``scattered``: spread evenly
    among the others)."""
    total = depth + pulls
    if scattered:
        measured = {i * total // pulls for i in range(pulls)} if pulls else set()
    else:
        measured = set(range(depth, total))
    queues = ("worker", "role:triage")
    k = m = 0
    for n in range(total):
        if n in measured:
            yield queues[m % 2], TOP
            m += 1
        else:
            yield queues[k % 2], (k // 2) % TOP
            k += 1


async def _priority_pulls(backend: str, depth: int, pulls: int, dsn: Optional[str],
                          baseline: bool, scattered: bool) -> Tuple[float, float]:
    from relay.broker.operations import Policy
    from relay.rules import delivery
    from relay.testing import new_message

    with tempfile.TemporaryDirectory() as data_dir:
        if backend == "postgres":
            _reset_postgres(dsn)
        store, config, clock = priority_store(backend, data_dir, dsn)

        async def settled(d: Any) -> Any:
            if backend != "postgres":
                clock.advance(0)
                clock.advance(0)
            return await d

        def checkpoint() -> float:
            """Seconds a checkpoint of the WAL back to the start takes (SQLite; its
            checkpointer does this work in a thread, and its close)."""
            started = time.perf_counter()
            if backend == "sqlite":
                store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            return time.perf_counter() - started

        rules = Policy.from_config(config).rules
        now = clock.seconds()
        pending = []
        for n, (queue, priority) in enumerate(priority_fill(depth, pulls, scattered)):
            message = new_message("alpha", queue, now, id=f"m{n:08d}")
            message.priority = priority
            pending.append(store.add(message, rules))
            if len(pending) >= FILL_BATCH:
                for d in pending:
                    await settled(d)
                pending = []
        for d in pending:
            await settled(d)
        checkpoint()
        # The backlog is the heap a long-running broker carries: a full collection
        # walks it once per so many allocations (a cost per allocation that does not
        # grow with it), and one falling inside 500 pulls at one level and not at
        # another (or in the run counted and not in its baseline) would be read as
        # the pulls' cost. Frozen, the collector leaves it out; the pulls' own garbage
        # is still collected.
        gc.collect()
        gc.freeze()
        elapsed = checkpoints = 0.0
        if not baseline:
            for n in range(pulls):
                if n and n % CHECKPOINT_PULLS == 0:
                    checkpoints += checkpoint()
                started = time.perf_counter()
                (message,) = await settled(store.pull("worker", 1, 60, now, rules))
                if message.priority != TOP:
                    raise SystemExit(f"pulled a message of priority {message.priority}")
                transition = delivery.ack("worker", message.lease_id, "completed", None, rules)
                await settled(store.settle(message.id, transition, now, rules))
                elapsed += time.perf_counter() - started
        checkpoints += checkpoint()
        gc.unfreeze()
        await settled(store.close())
    if not pulls or baseline:
        return 0.0, 0.0
    return elapsed / pulls * 1e6, checkpoints / pulls * 1e6


def _reset_postgres(dsn: Optional[str]) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


def _child(python: str, backend: str, depth: int, pulls: int, dsn: Optional[str],
           baseline: bool = False, scattered: bool = False) -> List[str]:
    """The command line of one measurement in a process of its own (a fresh heap, and
    a reactor that runs once)."""
    argv = [python, os.path.abspath(__file__), "--priority-child", backend, str(depth),
            str(pulls)]
    if baseline:
        argv.append("--baseline")
    if scattered:
        argv.append("--scattered")
    if dsn:
        argv += ["--postgres-dsn", dsn]
    return argv


def priority_wall(python: str, backend: str, depth: int, pulls: int,
                  dsn: Optional[str], scattered: bool = False) -> Tuple[float, float]:
    """Microseconds per pull+ack at ``depth``, and of the checkpoints of what the pulls
    wrote per pull, measured in a child process."""
    run = subprocess.run(_child(python, backend, depth, pulls, dsn, scattered=scattered),
                         capture_output=True, text=True, check=True)
    pull, checkpoint = run.stdout.split()[-2:]
    return float(pull), float(checkpoint)


def priority_instructions(python: str, backend: str, depth: int, pulls: int,
                          dsn: Optional[str], scattered: bool = False) -> float:
    """Instructions per pull+ack at ``depth``, counted by callgrind (a run with the
    pulls minus one without)."""
    counts = []
    # One hash seed for both runs: with a random one the filling's dicts and sets
    # differ by millions of instructions at 100k, more than the pulls themselves.
    env = dict(os.environ, PYTHONHASHSEED="0")
    for baseline in (False, True):
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                *_child(python, backend, depth, pulls, dsn, baseline, scattered)]
        run = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
        found = _COLLECTED.search(run.stderr)
        if found is None:
            raise SystemExit(f"callgrind reported no count:\n{run.stderr[-2000:]}")
        counts.append(int(found.group(1)))
    return (counts[0] - counts[1]) / pulls


def priority_main(args: argparse.Namespace) -> int:
    """Pull cost by backend and depth; a table, and the JSON with ``--out``."""
    levels = [int(x) for x in (args.levels or PRIORITY_LEVELS).split(",") if x.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unit = "instructions/pull+ack" if args.instructions else "us/pull+ack"
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    busy = servers.busy_note()
    if busy and not args.instructions:
        say(busy)
    rows = [["backend", "depth", unit, "vs 0"]]
    if not args.instructions:
        rows[0].append("checkpoint us/pull")
    results: Dict[str, List[JsonDict]] = {}
    for backend in backends:
        base = None
        for depth in levels:
            say(f"[{backend}] {depth:,} queued, {args.pulls} pulls")
            entry: JsonDict = {"depth": depth}
            if args.instructions:
                cost = priority_instructions(args.python, backend, depth, args.pulls,
                                             args.postgres_dsn, args.scattered)
            else:
                cost, entry["checkpoint"] = min(
                    priority_wall(args.python, backend, depth, args.pulls, args.postgres_dsn,
                                  args.scattered)
                    for _ in range(args.repeat))
            entry["cost"] = cost
            base = cost if base is None else base
            results.setdefault(backend, []).append(entry)
            rows.append([backend, f"{depth:,}", f"{cost:,.1f}",
                         f"{cost / base:.0%}" if base else "-"])
            if not args.instructions:
                rows[-1].append(f"{entry['checkpoint']:,.1f}")
    print(render(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"scenario": "priority-depth", "unit": unit, "pulls": args.pulls,
                       "scattered": args.scattered,
                       "results": results, "busyNote": busy}, fh, indent=1)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse options, run every backend, print the table and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="sqlite,jsonl,memory")
    p.add_argument("--levels", default="0,10000,100000,1000000")
    p.add_argument("--max-depth", type=int, default=None,
                   help="drop levels above this (1M takes minutes to prefill over HTTP)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("-c", "--concurrency", type=int, default=8)
    p.add_argument("-w", "--workers", type=int, default=4)
    p.add_argument("--pull-messages", type=int, default=20000,
                   help="messages queued for the pull-ack workers at each level")
    p.add_argument("--fill-concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2,
                   help="pull-ack and send runs per level, best kept (others' load only "
                        "lowers a rate)")
    p.add_argument("--e2e", action="store_true", help="also measure e2e-latency per level")
    p.add_argument("--python", default=servers.default_python())
    p.add_argument("--broker-url")
    p.add_argument("--secret", default=os.environ.get("RELAY_SECRET", ""))
    p.add_argument("--broker-pid", type=int)
    p.add_argument("--out", help="write the full JSON result here")
    p.add_argument("--priorities", action="store_true",
                   help="pull cost in the puller's own queues with priorities, in process "
                        f"(levels {PRIORITY_LEVELS} unless --levels)")
    p.add_argument("--pulls", type=int, default=500, help="with --priorities: pulls measured")
    p.add_argument("--instructions", action="store_true",
                   help="with --priorities: count instructions with callgrind, not time")
    p.add_argument("--postgres-dsn", help="with --priorities --backends postgres: a database "
                   "whose public schema it may drop")
    p.add_argument("--priority-child", nargs=3, metavar=("BACKEND", "DEPTH", "PULLS"),
                   help=argparse.SUPPRESS)
    p.add_argument("--scattered", action="store_true",
                   help="with --priorities: the measured messages spread through the filling")
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.priority_child:
        backend, depth, pulls = args.priority_child
        print(*priority_pulls(backend, int(depth), int(pulls), args.postgres_dsn,
                              args.baseline, args.scattered))
        return 0
    if args.priorities:
        if args.levels == "0,10000,100000,1000000":
            args.levels = None
        args.repeat = max(1, args.repeat)
        return priority_main(args)

    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if args.max_depth is not None:
        levels = [lv for lv in levels if lv <= args.max_depth]
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    results: Dict[str, JsonDict] = {}
    skipped: Dict[str, str] = {}
    started = time.time()
    workdir = servers.workspace()
    busy = servers.busy_note()
    if busy:
        say(busy)
    try:
        if args.broker_url:
            target = loadgen.Target(args.broker_url, args.secret)
            label = str(loadgen.handshake(target).get("storage") or "external")
            ext = ExternalBroker(target, args.broker_pid)
            results[label] = run_backend(None, levels, args, target,
                                         ext.rss if args.broker_pid else None)
        else:
            for storage in [b.strip() for b in args.backends.split(",") if b.strip()]:
                probe = servers.broker(python, storage, workdir)
                try:
                    probe.start()
                except servers.StartError as exc:
                    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                    say(f"SKIP backend {storage}: broker did not start ({lines[-1].strip()})")
                    skipped[storage] = lines[-1].strip()
                    continue
                finally:
                    probe.stop()
                say(f"[{storage}] levels {levels}")
                results[storage] = run_backend(
                    lambda s=storage: ManagedBroker(python, s, workdir), levels, args)
    finally:
        servers.cleanup(workdir)

    doc = {"scenario": "storage-depth", "date": time.strftime("%Y-%m-%d %H:%M:%S",
                                                          time.localtime(started)),
           "cores": os.cpu_count(), "brokerPython": python, "levels": levels,
           "results": results, "skipped": skipped, "busyNote": busy,
           "elapsedSeconds": round(time.time() - started, 1)}
    print(json.dumps({"scenario": "storage-depth", "skipped": skipped, "table": table_rows(
        results)}, separators=(",", ":")))
    print(f"storage benchmark {doc['date']}, {doc['cores']} cores, broker python {python}")
    if busy:
        print(busy)
    for storage, why in skipped.items():
        print(f"skipped backend {storage}: {why}")
    if results:
        print(render(table_rows(results)))
    print(f"(elapsed {doc['elapsedSeconds']}s)")
    out = args.out or os.path.join(servers.BENCH_DIR, "results",
                                   time.strftime("depth-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"full result: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
