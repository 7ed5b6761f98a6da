"""Scale-out figures: sqlite (one broker), then one, two and three brokers on one
PostgreSQL database, in the same run, with the same load generator.

    .venv/bin/python bench/scaleout.py --quick        # about 3 minutes
    .venv/bin/python bench/scaleout.py                # about 7 minutes
    .venv/bin/python bench/scaleout.py --brokers 1,2  # the fleet sizes to measure
    .venv/bin/python bench/scaleout.py --dsn postgresql://postgres@127.0.0.1/postgres

Scenarios (see README.md): ``send`` (C closed-loop senders), ``pull-ack`` (W
workers draining a prefilled queue) and ``e2e-latency`` (one sender, one
long-polling receiver). With several brokers, send and pull-ack split their
connections over all of them (the rates are summed; each broker serves its
share, like a balancer would) and e2e sends through the first and receives
through the last, so the latency includes the LISTEN/NOTIFY hop.

PostgreSQL runs in a temporary cluster of the machine's server (the tools of
``bench/failover.py``; as root, run by the ``postgres`` user) on a free port,
removed afterwards, so its CPU time is counted too: the figures give the CPU
milliseconds the brokers and the database spend per request, from which the
rate of a machine with more cores follows (README.md). With ``--dsn`` (or
without the server tools) the given server is used instead, a fresh database
per setup, and the database's CPU is not counted. Loopback only; every run is
bounded in time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import failover
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


@contextlib.contextmanager
def own_cluster(bindir: str) -> Iterator[failover.Cluster]:
    """A temporary PostgreSQL cluster on a free loopback port, removed on exit."""
    root = tempfile.mkdtemp(prefix="relay-scaleout-pg-")
    user = failover.cluster_user()
    cluster = failover.Cluster(bindir, root, "db", servers.free_port(), user)
    try:
        failover.hand_over(root, user)
        cluster.init({"max_connections": "100"})
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


class CpuMeter:
    """CPU seconds of the brokers and of the database, sampled when the load
    generator's window opens and closes (it calls :meth:`sample` then)."""

    def __init__(self, brokers: Sequence[servers.Server],
                 database: Optional[failover.Cluster]) -> None:
        self.brokers = brokers
        self.database = database
        self.samples: List[Tuple[float, float, float]] = []

    def sample(self) -> float:
        brokers = sum(servers.cpu_seconds(b.pid) for b in self.brokers)
        database = self.database.cpu_seconds() if self.database is not None else 0.0
        self.samples.append((time.time(), brokers, database))
        return brokers

    def window(self, operations: int) -> JsonDict:
        """Per-operation CPU ms and busy cores of the brokers and the database over the
        last window (empty without two samples or operations)."""
        if len(self.samples) < 2 or operations <= 0:
            return {}
        (t0, b0, d0), (t1, b1, d1) = self.samples[-2:]
        span = max(t1 - t0, 1e-9)
        out = {"brokerCpuMs": round((b1 - b0) / operations * 1e3, 3),
               "brokerCores": round((b1 - b0) / span, 2)}
        if self.database is not None:
            out.update(databaseCpuMs=round((d1 - d0) / operations * 1e3, 3),
                       databaseCores=round((d1 - d0) / span, 2))
        return out


def split(run: Callable[[loadgen.Target, int, Any], JsonDict],
          targets: Sequence[loadgen.Target], total: int,
          meter: Optional[CpuMeter] = None, count: str = "requests") -> JsonDict:
    """Run ``run(target, share, cpu)`` on every target at once; rates summed. The
    first target's window samples ``meter``, whose figures are per ``count`` of
    every target together (their windows open and close together)."""
    docs: List[Optional[JsonDict]] = [None] * len(targets)
    failures: List[BaseException] = []
    shares = [total // len(targets) + (i < total % len(targets)) for i in range(len(targets))]

    def one(i: int) -> None:
        try:
            cpu = meter.sample if meter is not None and i == 0 else None
            docs[i] = run(targets[i], shares[i], cpu)
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
    if meter is not None:
        out["cpu"] = meter.window(sum(d.get(count) or 0 for d in done))
    return out


def measure(prof: JsonDict, targets: Sequence[loadgen.Target],
            meter: Optional[CpuMeter] = None) -> JsonDict:
    """send, pull-ack and e2e-latency against one or more brokers of one store."""
    out: JsonDict = {}
    say("  send ...")
    out["send"] = split(lambda t, c, cpu: loadgen.scenario_send(t, c, prof["duration"],
                                                                prof["warmup"], cpu=cpu),
                        targets, prof["concurrency"], meter, "requests")
    say("  pull-ack ...")
    out["pull-ack"] = split(
        lambda t, w, cpu: loadgen.scenario_pull_ack(t, w, prof["duration"], prof["warmup"],
                                                    prof["pullMessages"] // len(targets),
                                                    cpu=cpu),
        targets, prof["workers"], meter, "messages")
    say("  e2e-latency ...")
    out["e2e-latency"] = loadgen.scenario_e2e(targets[0], prof["rate"], prof["e2eDuration"],
                                              prof["warmup"], receive_target=targets[-1])
    return out


def run_setup(python: str, workdir: str, storage: str, brokers: int,
              extra: Optional[JsonDict], prof: JsonDict,
              database: Optional[failover.Cluster] = None) -> JsonDict:
    started: List[servers.Server] = []
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
        return measure(prof, targets, CpuMeter(started, database))
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
    for scenario, unit in (("send", "request"), ("pull-ack", "message")):
        add(f"{scenario} CPU ms/{unit}: brokers",
            lambda r, s=scenario: f"{r[s]['cpu']['brokerCpuMs']:.3f}")
        add(f"{scenario} CPU ms/{unit}: database",
            lambda r, s=scenario: f"{r[s]['cpu']['databaseCpuMs']:.3f}")
        add(f"{scenario} busy cores: brokers + database",
            lambda r, s=scenario: "{brokerCores:.2f} + {databaseCores:.2f}".format(
                **r[s]["cpu"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--python", default=servers.default_python())
    p.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_POSTGRES_DSN"),
                   help="a server where the benchmark may create and drop databases "
                   "(default: a temporary cluster of its own, or the server on "
                   "127.0.0.1:5432 without the PostgreSQL server tools)")
    p.add_argument("--pg-bin", help="folder of initdb and pg_ctl (default: as "
                   "bench/failover.py finds them)")
    p.add_argument("--brokers", default="1,2,3",
                   help="the numbers of brokers on one database to measure (default 1,2,3)")
    p.add_argument("--pool-size", type=int, default=10)
    args = p.parse_args(argv)
    try:
        fleet = [int(n) for n in args.brokers.split(",")]
    except ValueError:
        fleet = []
    if not fleet or not all(1 <= n <= 8 for n in fleet):
        p.error("--brokers takes numbers from 1 to 8, separated by commas (e.g. 1,2,3)")
    prof = PROFILES["quick" if args.quick else "full"]
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    bindir = None if args.dsn else failover.find_postgres_bin(args.pg_bin)
    if args.pg_bin and bindir is None:
        p.error(f"--pg-bin {args.pg_bin} has no initdb, pg_ctl and pg_basebackup")
    workdir = servers.workspace()
    results: Dict[str, JsonDict] = {}
    try:
        with failover.stop_signals_interrupt(), contextlib.ExitStack() as stack:
            cluster = stack.enter_context(own_cluster(bindir)) if bindir else None
            admin = cluster.dsn if cluster else (
                args.dsn or "postgresql://postgres@127.0.0.1:5432/postgres")
            if cluster:
                say(f"PostgreSQL: a temporary cluster on :{cluster.port}")
            say("sqlite, one broker")
            results["sqlite x1"] = run_setup(python, workdir, "sqlite", 1, None, prof)
            for brokers in fleet:
                say(f"postgres, {brokers} broker(s)")
                with Database(admin) as dsn:
                    extra = {"postgres": {"dsn": dsn, "poolSize": args.pool_size}}
                    results[f"postgres x{brokers}"] = run_setup(
                        python, workdir, "postgres", brokers, extra, prof, cluster)
    finally:
        servers.cleanup(workdir)
    print(servers.busy_note())
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
