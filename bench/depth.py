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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

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
    args = p.parse_args(argv)

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
