"""Soak benchmark (issue 8): constant mixed load on a real broker for a set duration.

Senders send, workers pull and ack (``completed``, sometimes ``retry``), a v1.0
client polls, and agents heartbeat and ask for status, at a constant total rate.
Every ``--interval`` seconds it prints throughput, p50/p99 latency, errors and
the broker's RSS; at the end it reports the RSS growth after warm-up, which
must stay under 10 % for a flat memory profile. Not a test: it prints figures
(and saves them as JSON in ``bench/results/``).

    python bench/soak.py --storage sqlite --duration 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from typing import Any, Dict, List

from loadgen import Conn, make_body, register
from servers import BENCH_DIR, broker, busy_note, cleanup, default_python, read_status, workspace

RECIPIENTS = [f"soak-w{i}" for i in range(4)]
SENDERS = [f"soak-s{i}" for i in range(4)]


class Stats:
    """Latencies and outcomes of one interval (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: List[float] = []
        self.errors = 0
        self.by_op: Dict[str, int] = {}

    def record(self, op: str, seconds: float, ok: bool) -> None:
        with self.lock:
            self.latencies.append(seconds)
            self.by_op[op] = self.by_op.get(op, 0) + 1
            if not ok:
                self.errors += 1

    def take(self) -> Dict[str, Any]:
        with self.lock:
            latencies, self.latencies = sorted(self.latencies), []
            errors, self.errors = self.errors, 0
            by_op, self.by_op = self.by_op, {}
        n = len(latencies)

        def pct(p: float) -> float:
            return round(latencies[min(n - 1, int(p * n))] * 1000, 2) if n else 0.0

        return {"requests": n, "errors": errors, "p50ms": pct(0.50), "p99ms": pct(0.99),
                "ops": by_op}


def client(target, rate: float, stats: Stats, stop: threading.Event, seed: int) -> None:
    """One paced client doing a random mix of the broker's operations."""
    rng = random.Random(seed)
    conn = Conn(target)
    leased: List[Dict[str, Any]] = []
    next_at = time.monotonic()
    cursors: Dict[str, Any] = {}
    try:
        while not stop.is_set():
            next_at += 1.0 / rate
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            roll = rng.random()
            started = time.monotonic()
            try:
                if leased and roll < 0.35:
                    op = "ack"
                    m = leased.pop()
                    outcome = "retry" if rng.random() < 0.05 else "completed"
                    status, _ = conn.call("POST", "/v1/ack", {
                        "messageId": m["id"], "leaseId": m["leaseId"], "outcome": outcome},
                        m["to"])
                    ok = status in (200, 409)
                elif roll < 0.65:
                    op = "send"
                    body = make_body(rng.choice(RECIPIENTS), pad=rng.choice((100, 400, 2000)),
                                     extra={"kind": "soak"})
                    body["kind"] = "request"
                    status, _ = conn.call("POST", "/messages", body, rng.choice(SENDERS))
                    ok = status == 201
                elif roll < 0.85:
                    op = "pull"
                    agent = rng.choice(RECIPIENTS)
                    status, doc = conn.call("POST", "/v1/pull",
                                            {"limit": 5, "leaseSeconds": 30}, agent)
                    ok = status == 200
                    if ok:
                        leased.extend(doc["messages"])
                elif roll < 0.92:
                    op = "status"
                    ids = [m["id"] for m in leased[:10]] or ["none"]
                    status, _ = conn.call("POST", "/v1/status", {"messageIds": ids},
                                          rng.choice(RECIPIENTS))
                    ok = status == 200
                elif roll < 0.97:
                    op = "poll"
                    agent = rng.choice(SENDERS)
                    since = cursors.get(agent)
                    path = "/messages?limit=50" + (f"&since={since}" if since else "")
                    status, doc = conn.call("GET", path, None, agent)
                    ok = status == 200
                    if ok:
                        cursors[agent] = doc["cursor"]
                else:
                    op = "register"
                    agent = rng.choice(RECIPIENTS + SENDERS)
                    status, _ = conn.call("POST", "/register", {}, agent)
                    ok = status == 200
            except Exception:  # noqa: BLE001 (counted as an error, the soak goes on)
                op, ok = "exception", False
                conn.close()
            stats.record(op, time.monotonic() - started, ok)
            if len(leased) > 200:  # abandon the oldest: their leases expire (the sweep)
                del leased[:100]
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", default="sqlite", choices=("sqlite", "jsonl", "memory"))
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the RSS baseline (default: 20%% of duration)")
    parser.add_argument("--rate", type=float, default=300.0, help="total requests/second")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--python", default=default_python())
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else 0.2 * args.duration

    note = busy_note()
    if note:
        print(note)
    work = workspace()
    server = broker(args.python, args.storage, work, extra={"sweepSeconds": 1})
    rows: List[Dict[str, Any]] = []
    try:
        server.start()
        target = server.target
        register(target, RECIPIENTS + SENDERS)
        stats = Stats()
        stop = threading.Event()
        threads = [threading.Thread(target=client, daemon=True,
                                    args=(target, args.rate / args.clients, stats, stop, i))
                   for i in range(args.clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        print(f"soak: storage={args.storage} duration={args.duration:.0f}s "
              f"warmup={warmup:.0f}s rate={args.rate:.0f}/s clients={args.clients}")
        print(f"{'t(s)':>6} {'req/s':>7} {'p50ms':>7} {'p99ms':>7} {'errors':>6} {'rssMB':>7}")
        baseline = None
        last = started
        while time.monotonic() - started < args.duration:
            time.sleep(max(0.0, min(args.interval, args.duration - (time.monotonic() - started))))
            now = time.monotonic()
            row = stats.take()
            row["t"] = round(now - started, 1)
            row["rps"] = round(row["requests"] / max(1e-9, now - last), 1)
            row["rssMB"] = round(read_status(server.pid).get("VmRSS", 0.0), 1)
            last = now
            rows.append(row)
            if baseline is None and row["t"] >= warmup:
                baseline = row["rssMB"]
            print(f"{row['t']:>6.0f} {row['rps']:>7.1f} {row['p50ms']:>7.2f} "
                  f"{row['p99ms']:>7.2f} {row['errors']:>6} {row['rssMB']:>7.1f}", flush=True)
        stop.set()
        for t in threads:
            t.join(10)
        final = rows[-1]["rssMB"] if rows else 0.0
        baseline = baseline or final
        growth = (final - baseline) / baseline * 100 if baseline else 0.0
        total = sum(r["requests"] for r in rows)
        errors = sum(r["errors"] for r in rows)
        p99 = max((r["p99ms"] for r in rows), default=0.0)
        verdict = "flat" if growth < 10 else "GROWING"
        print(f"total {total} requests, {errors} errors, worst interval p99 {p99} ms")
        print(f"RSS after warm-up {baseline} MB -> end {final} MB: {growth:+.1f}% ({verdict}, "
              f"limit +10%); peak {server.rss()['peakMB']} MB")
        summary = {"storage": args.storage, "duration": args.duration, "warmup": warmup,
                   "rate": args.rate, "total": total, "errors": errors, "worstP99ms": p99,
                   "rssBaselineMB": baseline, "rssFinalMB": final, "rssGrowthPct":
                   round(growth, 2), "intervals": rows}
        out = os.path.join(BENCH_DIR, "results",
                           time.strftime("soak-%Y%m%d-%H%M%S.json", time.gmtime()))
        with open(out, "w") as fh:
            json.dump(summary, fh, indent=1)
        print(f"saved {os.path.relpath(out)}")
    finally:
        server.stop()
        if not args.keep:
            cleanup(work)


if __name__ == "__main__":
    main()
