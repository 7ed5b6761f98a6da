"""Scale-out figures: sqlite (one broker), postgres with one broker and with two
brokers on one database, in the same run, with the same load generator.

    .venv/bin/python bench/scaleout.py --quick        # about 2 minutes
    .venv/bin/python bench/scaleout.py                # about 5 minutes
    .venv/bin/python bench/scaleout.py --dsn postgresql://postgres@127.0.0.1/postgres

Scenarios (see README.md): ``send`` (C closed-loop senders), ``pull-ack`` (W
workers draining a prefilled queue) and ``e2e-latency`` (one sender, one
long-polling receiver). With two brokers, send and pull-ack split their
connections over both (the rates are summed; each broker serves its own half,
like a balancer would) and e2e sends through A and receives through B, so the
latency includes the LISTEN/NOTIFY hop. Each postgres setup gets a fresh
database, dropped afterwards. Loopback only; every run is bounded in time.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

import loadgen
import servers

JsonDict = Dict[str, Any]

PROFILES = {
    "quick": {"duration": 3.0, "warmup": 1.0, "concurrency": 8, "workers": 4,
              "pullMessages": 12000, "e2eDuration": 4.0, "rate": 200.0},
    "full": {"duration": 10.0, "warmup": 2.0, "concurrency": 8, "workers": 4,
             "pullMessages": 40000, "e2eDuration": 10.0, "rate": 200.0},
}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Database:
    """A fresh PostgreSQL database for one setup (created on enter, dropped on exit)."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin = admin_dsn
        self.name = f"relay_bench_{uuid.uuid4().hex[:10]}"

    def __enter__(self) -> str:
        import psycopg
        from psycopg.conninfo import make_conninfo

        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        return make_conninfo(self.admin, dbname=self.name)

    def __exit__(self, *exc: Any) -> None:
        import psycopg

        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def split(run: Callable[[loadgen.Target, int], JsonDict], targets: Sequence[loadgen.Target],
          total: int) -> JsonDict:
    """Run ``run(target, share)`` on every target at once; rates summed."""
    docs: List[Optional[JsonDict]] = [None] * len(targets)
    failures: List[BaseException] = []
    shares = [total // len(targets) + (i < total % len(targets)) for i in range(len(targets))]

    def one(i: int) -> None:
        try:
            docs[i] = run(targets[i], shares[i])
        except Exception as e:  # noqa: BLE001 (raised again below)
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    done = [d for d in docs if d is not None]
    out = dict(done[0])
    out["rate"] = round(sum(d["rate"] for d in done), 1)
    out["perBroker"] = [d["rate"] for d in done]
    if "latencyMs" in out:
        out["latencyMs"] = {k: max(d["latencyMs"][k] for d in done) for k in out["latencyMs"]}
    return out


def measure(prof: JsonDict, targets: Sequence[loadgen.Target]) -> JsonDict:
    """send, pull-ack and e2e-latency against one or more brokers of one store."""
    out: JsonDict = {}
    say("  send ...")
    out["send"] = split(lambda t, c: loadgen.scenario_send(t, c, prof["duration"],
                                                           prof["warmup"]),
                        targets, prof["concurrency"])
    say("  pull-ack ...")
    out["pull-ack"] = split(
        lambda t, w: loadgen.scenario_pull_ack(t, w, prof["duration"], prof["warmup"],
                                               prof["pullMessages"] // len(targets)),
        targets, prof["workers"])
    say("  e2e-latency ...")
    out["e2e-latency"] = loadgen.scenario_e2e(targets[0], prof["rate"], prof["e2eDuration"],
                                              prof["warmup"], receive_target=targets[-1])
    return out


def run_setup(python: str, workdir: str, storage: str, brokers: int,
              extra: Optional[JsonDict], prof: JsonDict) -> JsonDict:
    started = []
    try:
        secret = None
        for _ in range(brokers):
            # every broker of one fleet shares the first one's secret
            shared = dict(extra or {}, **({"secret": secret} if secret else {}))
            server = servers.broker(python, storage, workdir, extra=shared)
            server.start()
            secret = secret or server.secret
            started.append(server)
        targets = [loadgen.Target(s.url, secret) for s in started]
        return measure(prof, targets)
    finally:
        for server in started:
            server.stop()


def render(results: Dict[str, JsonDict]) -> str:
    names = list(results)
    rows = [["figure", *names]]

    def add(label: str, get: Callable[[JsonDict], str]) -> None:
        cells = []
        for name in names:
            try:
                cells.append(get(results[name]))
            except (KeyError, TypeError):
                cells.append("-")
        rows.append([label, *cells])

    add("send req/s", lambda r: f"{r['send']['rate']:,.0f}")
    add("send p50/p99 ms", lambda r: "{p50:.2f} / {p99:.2f}".format(**r["send"]["latencyMs"]))
    add("pull-ack msg/s", lambda r: f"{r['pull-ack']['rate']:,.0f}")
    add("e2e p50/p99/max ms",
        lambda r: "{p50:.2f} / {p99:.2f} / {max:.2f}".format(**r["e2e-latency"]["latencyMs"]))
    add("e2e lost/duplicates", lambda r: "{} / {}".format(r["e2e-latency"]["lost"],
                                                         r["e2e-latency"]["duplicates"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--python", default=servers.default_python())
    p.add_argument("--dsn", default=os.environ.get(
        "RELAY_BENCH_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a server where the benchmark may create and drop databases")
    p.add_argument("--pool-size", type=int, default=10)
    args = p.parse_args(argv)
    prof = PROFILES["quick" if args.quick else "full"]
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    workdir = servers.workspace()
    results: Dict[str, JsonDict] = {}
    try:
        say("sqlite, one broker")
        results["sqlite x1"] = run_setup(python, workdir, "sqlite", 1, None, prof)
        for brokers in (1, 2):
            say(f"postgres, {brokers} broker(s)")
            with Database(args.dsn) as dsn:
                extra = {"postgres": {"dsn": dsn, "poolSize": args.pool_size}}
                results[f"postgres x{brokers}"] = run_setup(python, workdir, "postgres",
                                                            brokers, extra, prof)
    finally:
        servers.cleanup(workdir)
    print(servers.busy_note())
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
