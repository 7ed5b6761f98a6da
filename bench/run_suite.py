"""Run the whole benchmark suite and print a summary with ratios to the Klein ceiling.

    .venv/bin/python bench/run_suite.py --quick          # about 4 minutes (two backends)
    .venv/bin/python bench/run_suite.py                  # full run, about 13 minutes
    .venv/bin/python bench/run_suite.py --backends memory,sqlite,jsonl
    .venv/bin/python bench/run_suite.py --python .venv-pypy/bin/python
    .venv/bin/python bench/run_suite.py --broker-url http://127.0.0.1:19121 --secret S

For each backend the suite starts a fresh broker (``twistd -n relay --config <temp>``)
per scenario, so one scenario's stored messages never weigh on the next; ``depth``
keeps one broker across its levels. The ceilings (bare twisted.web, bare Klein) are
started with the same interpreter as the broker and measured by the same load
generator in the same run. A backend whose broker does not start is skipped with a line
saying why. The full result is also written to ``bench/results/suite-<time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import loadgen
import servers

JsonDict = Dict[str, Any]

PROFILES: Dict[str, JsonDict] = {
    "quick": {
        "duration": 3.0, "warmup": 1.0, "concurrency": 8, "workers": 4,
        "pullMessages": 24000, "pollMessages": 4000, "pollWorkers": 2,
        "e2eDuration": 5.0, "rate": 200.0, "askers": 1,
        "depthLevels": [0, 1000, 10000], "depthDuration": 3.0, "depthPullMessages": 8000,
    },
    "full": {
        "duration": 10.0, "warmup": 2.0, "concurrency": 8, "workers": 4,
        "pullMessages": 70000, "pollMessages": 10000, "pollWorkers": 2,
        "e2eDuration": 15.0, "rate": 200.0, "askers": 1,
        "depthLevels": [0, 1000, 10000, 100000], "depthDuration": 5.0,
        "depthPullMessages": 15000,
    },
}


PYPY_WARMUP_SECONDS = 8.0
PULL_RATE_BOUND = 9000  # msg/s no broker here has reached; sizes the pull-ack prefill


def is_pypy(python: str) -> bool:
    """True when ``python`` is a PyPy interpreter."""
    out = subprocess.run(
        [python, "-c", "import platform; print(platform.python_implementation())"],
        capture_output=True, text=True, timeout=60,
    ).stdout
    return out.strip() == "PyPy"


def say(line: str) -> None:
    """Progress goes to stderr so stdout holds only results."""
    print(line, file=sys.stderr, flush=True)


def run_scenarios(prof: JsonDict, scenarios: Sequence[str], fresh: Callable[[str], Any],
                  label: str, managed: bool, repeat: int = 1,
                  python: str = sys.executable) -> JsonDict:
    """Run each scenario against a broker from ``fresh(name)``; collect results and RSS.

    ``fresh(name)`` returns a context manager yielding a ``(target, rss_fn)`` pair: a
    new broker per scenario (and per depth level) when the suite manages the broker,
    the same one when it was given a URL. Throughput scenarios run ``repeat`` times
    (a fresh broker each time) and keep the best rate; depth repeats inside each level.
    """
    out: JsonDict = {}
    for name in scenarios:
        times = 1 if name in ("depth", "e2e-latency", "request-reply") else repeat
        docs = [run_one(prof, name, fresh, label, managed, repeat, python)
                for _ in range(times)]
        doc = loadgen.best_of(docs) if times > 1 else docs[0]
        doc["backend"] = label
        loadgen.emit(doc)
        out[name] = doc
    return out


def run_one(prof: JsonDict, name: str, fresh: Callable[[str], Any], label: str,
            managed: bool, repeat: int, python: str = sys.executable) -> JsonDict:
    """One run of one scenario on a broker from ``fresh(name)`` (see run_scenarios);
    ``python`` runs the worker agent of ``request-reply``."""
    say(f"[{label}] {name} ...")
    depth_fresh = (lambda name=name: fresh(name)) if managed else None
    with (contextlib.nullcontext((None, None)) if managed and name == "depth"
          else fresh(name)) as (tgt, rss):
        cpu = (lambda: rss()["cpuSeconds"]) if rss is not None else None
        if name == "send":
            doc = loadgen.scenario_send(tgt, prof["concurrency"], prof["duration"],
                                        prof["warmup"], cpu=cpu)
        elif name == "pull-ack":
            doc = loadgen.scenario_pull_ack(tgt, prof["workers"], prof["duration"],
                                            prof["warmup"], prof["pullMessages"], cpu=cpu)
        elif name == "poll":
            doc = loadgen.scenario_poll(tgt, prof["pollWorkers"], prof["duration"],
                                        prof["warmup"], prof["pollMessages"])
        elif name == "e2e-latency":
            doc = loadgen.scenario_e2e(tgt, prof["rate"], prof["e2eDuration"],
                                       prof["warmup"])
        elif name == "request-reply":
            doc = loadgen.scenario_request_reply(tgt, prof["askers"], prof["e2eDuration"],
                                                 prof["warmup"], worker_python=python)
        elif name == "depth":
            doc = loadgen.scenario_depth(
                tgt, prof["depthLevels"], prof["concurrency"], prof["workers"],
                prof["depthDuration"], prof["depthPullMessages"], prof["rate"],
                rss=rss, log=say, fresh=depth_fresh, repeat=repeat)
        else:
            raise ValueError(name)
        if rss is not None:
            doc["rss"] = rss()
    return doc


class ManagedBroker:
    """Context manager: start a fresh broker, yield (target, rss), stop it."""

    def __init__(self, python: str, storage: str, workdir: str,
                 profile: Optional[str] = None) -> None:
        self.server = servers.broker(python, storage, workdir, profile=profile)

    def __enter__(self) -> Any:
        self.server.start()
        return self.server.target, self.server.rss

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


class ExternalBroker:
    """Context manager for a broker the suite did not start (RSS only with --broker-pid)."""

    def __init__(self, target: loadgen.Target, pid: Optional[int]) -> None:
        self.target = target
        self.pid = pid

    def rss(self) -> JsonDict:
        status = servers.read_status(self.pid) if self.pid else {}
        return {"rssMB": round(status.get("VmRSS", 0.0), 1),
                "peakMB": round(status.get("VmHWM", 0.0), 1)}

    def __enter__(self) -> Any:
        return self.target, (self.rss if self.pid else None)

    def __exit__(self, *exc: Any) -> None:
        return None


def profile_path(directory: Optional[str], storage: str, scenario: str) -> Optional[str]:
    """Where to save the broker's cProfile stats for one scenario (None: no profiling).

    Depth levels share one name per backend; the last level's broker wins.
    """
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    return os.path.abspath(os.path.join(directory, f"{storage}-{scenario}.pstats"))


def measure_ceilings(python: str, workdir: str, prof: JsonDict,
                     into: Optional[JsonDict] = None) -> JsonDict:
    """Rate of the bare twisted.web and bare Klein servers under the ``send`` load.

    Called at the start and at the end of the suite: ``into`` holds the earlier
    results, each kind keeps its best run (other load on the machine only lowers a
    rate) and ``runs`` lists every rate measured.
    """
    out: JsonDict = dict(into or {})
    for kind in ("web", "klein"):
        server = servers.ceiling(python, kind, workdir)
        say(f"[ceiling] {kind} ...")
        try:
            server.start()
        except servers.StartError as exc:
            say(f"SKIP ceiling {kind}: {str(exc).splitlines()[0]}")
            continue
        try:
            doc = loadgen.scenario_send(server.target, prof["concurrency"], prof["duration"],
                                        prof["warmup"], name=f"ceiling-{kind}",
                                        do_register=False,
                                        cpu=lambda pid=server.pid: servers.cpu_seconds(pid))
            doc["rss"] = server.rss()
        finally:
            server.stop()
        loadgen.emit(doc)
        runs = [*out.get(kind, {}).get("runs", []), doc["rate"]]
        if kind not in out or doc["rate"] > out[kind]["rate"]:
            out[kind] = doc
        out[kind]["runs"] = runs
    return out


def _ratio(value: Optional[float], ceiling: Optional[float]) -> str:
    if value is None:
        return "-"
    if not ceiling:
        return f"{value:,.0f}"
    return f"{value:,.0f} ({value / ceiling:.0%})"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_rows(result: JsonDict) -> List[List[str]]:
    """Rows of (figure, one cell per backend) for the summary table."""
    ceil = result["ceilings"].get("klein", {}).get("rate")
    backends = list(result["backends"])
    rows: List[List[str]] = [["figure", *backends]]

    def add(name: str, get: Callable[[JsonDict], str]) -> None:
        cells = []
        for b in backends:
            try:
                cells.append(get(result["backends"][b]))
            except (KeyError, TypeError, IndexError):
                cells.append("-")
        rows.append([name, *cells])

    add("send req/s (of klein)", lambda r: _ratio(r["send"]["rate"], ceil))
    add("send: broker CPU busy", lambda r: _pct(r["send"]["serverCpuBusy"]))
    add("send: loadgen CPU us/req", lambda r: str(r["send"]["loadgenCpuUsPerRequest"]))
    add("send latency p50/p99 ms", lambda r: "{} / {}".format(
        _ms(r["send"]["latencyMs"]["p50"]), _ms(r["send"]["latencyMs"]["p99"])))
    add("pull-ack msg/s (of klein)", lambda r: _ratio(r["pull-ack"]["rate"], ceil))
    add("pull-ack: broker CPU busy", lambda r: _pct(r["pull-ack"]["serverCpuBusy"]))
    add("poll msg/s (of klein)", lambda r: _ratio(r["poll"]["rate"], ceil))
    add("poll req/s (of klein)", lambda r: _ratio(r["poll"]["requestRate"], ceil))
    add("e2e mode", lambda r: r["e2e-latency"]["mode"])
    add("e2e p50/p99/max ms", lambda r: "{} / {} / {}".format(
        *(_ms(r["e2e-latency"]["latencyMs"][k]) for k in ("p50", "p99", "max"))))
    add("e2e requests/msg (+acks)", lambda r: "{} ({})".format(
        r["e2e-latency"]["requestsPerMessage"], r["e2e-latency"]["requestsPerMessageWithAcks"]))
    add("e2e lost/duplicates", lambda r: "{} / {}".format(
        r["e2e-latency"]["lost"], r["e2e-latency"]["duplicates"]))
    add("request-reply mode", lambda r: r["request-reply"]["mode"])
    add("request-reply p50/p99 ms", lambda r: "{} / {}".format(
        _ms(r["request-reply"]["latencyMs"]["p50"]), _ms(r["request-reply"]["latencyMs"]["p99"])))
    add("request-reply round trips/s", lambda r: "{} ({} unanswered)".format(
        r["request-reply"]["rate"], r["request-reply"]["unanswered"]))
    levels: List[int] = []
    for b in backends:
        for row in result["backends"][b].get("depth", {}).get("levels", []):
            if row["depth"] not in levels:
                levels.append(row["depth"])

    def level(r: JsonDict, depth: int) -> JsonDict:
        return next(x for x in r["depth"]["levels"] if x["depth"] == depth)

    for d in levels:
        add(f"depth {d:,}: send req/s", lambda r, d=d: _ratio(level(r, d)["send"]["rate"], ceil))
        add(f"depth {d:,}: pull-ack msg/s",
            lambda r, d=d: _ratio(level(r, d)["pullAck"]["rate"], ceil))
        add(f"depth {d:,}: e2e p50/p99 ms", lambda r, d=d: "{} / {}".format(
            _ms(level(r, d)["e2e"]["latencyMs"]["p50"]),
            _ms(level(r, d)["e2e"]["latencyMs"]["p99"])))
        add(f"depth {d:,}: peak RSS MB", lambda r, d=d: str(level(r, d)["rss"]["peakMB"]))
    add("peak RSS MB (all scenarios)", lambda r: str(peak_rss(r)))
    return rows


def peak_rss(backend: JsonDict) -> float:
    """The largest peak RSS of any scenario (and any depth level) of one backend."""
    peaks = [0.0]
    for doc in backend.values():
        if isinstance(doc, dict):
            peaks.append(doc.get("rss", {}).get("peakMB", 0.0))
            peaks.extend(row.get("rss", {}).get("peakMB", 0.0) for row in doc.get("levels", []))
    return max(peaks)


def render(rows: List[List[str]]) -> str:
    """Left-aligned text table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse options, run ceilings and every backend, print the summary."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short durations, depth up to 10k")
    p.add_argument("--backends", default="sqlite,memory",
                   help="storage backends to start (comma-separated)")
    p.add_argument("--scenarios", default="send,pull-ack,poll,e2e-latency,request-reply,depth")
    p.add_argument("--python", default=servers.default_python(),
                   help="interpreter for the broker and the ceilings (e.g. .venv-pypy/bin/python)")
    p.add_argument("--broker-url", help="measure this running broker instead of starting one")
    p.add_argument("--secret", default=os.environ.get("RELAY_SECRET", ""),
                   help="shared secret of --broker-url")
    p.add_argument("--broker-pid", type=int, help="pid of --broker-url, for its RSS")
    p.add_argument("--no-ceiling", action="store_true", help="skip the ceiling servers")
    p.add_argument("--levels", help="depth levels, e.g. 0,1000,10000,100000")
    p.add_argument("--out", help="write the full JSON result here")
    p.add_argument("--repeat", type=int, default=None,
                   help="runs per throughput figure, best kept (default: 1 quick, 2 full)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of load before each measured window (default: the "
                        "profile's; at least 8 on PyPy, whose JIT needs traffic to warm)")
    p.add_argument("--profile", metavar="DIR",
                   help="run each started broker under cProfile, saving DIR/<backend>-"
                        "<scenario>.pstats (figures are then slower; for finding hot spots)")
    args = p.parse_args(argv)

    prof = dict(PROFILES["quick" if args.quick else "full"])
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    prof["repeat"] = args.repeat
    if args.levels:
        prof["depthLevels"] = [int(x) for x in args.levels.split(",") if x.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    if args.warmup is not None:
        prof["warmup"] = args.warmup
    elif is_pypy(python):
        prof["warmup"] = max(prof["warmup"], PYPY_WARMUP_SECONDS)
    # pull-ack drains a prefilled queue: it must last through warm-up and window.
    window = prof["warmup"] + prof["duration"]
    prof["pullMessages"] = max(prof["pullMessages"], int(PULL_RATE_BOUND * window))
    workdir = servers.workspace()
    busy = servers.busy_note()
    if busy:
        say(busy)
    started = time.time()
    result: JsonDict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "profile": "quick" if args.quick else "full",
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                    "loadgenPython": platform.python_version()},
        "brokerPython": python, "settings": prof, "ceilings": {}, "backends": {},
        "skipped": {}, "busyNote": busy,
    }
    try:
        if not args.no_ceiling:
            result["ceilings"] = measure_ceilings(python, workdir, prof)
        if args.broker_url:
            if not args.secret:
                p.error("--broker-url needs --secret (or RELAY_SECRET)")
            target = loadgen.Target(args.broker_url, args.secret)
            info = loadgen.handshake(target)
            label = str(info.get("storage") or "external")
            ext = ExternalBroker(target, args.broker_pid)
            result["backends"][label] = run_scenarios(prof, scenarios, lambda _: ext, label,
                                                      managed=False, repeat=args.repeat,
                                                      python=python)
            result["brokerInfo"] = {label: info}
            if not args.no_ceiling:
                result["ceilings"] = measure_ceilings(python, workdir, prof,
                                                      result["ceilings"])
        else:
            for storage in [b.strip() for b in args.backends.split(",") if b.strip()]:
                probe = servers.broker(python, storage, workdir)
                try:
                    probe.start()
                    info = loadgen.handshake(probe.target)
                except servers.StartError as exc:
                    reason = str(exc).strip().splitlines()
                    why = next((ln for ln in reversed(reason) if ln.strip()), reason[0])
                    say(f"SKIP backend {storage}: broker did not start ({why.strip()})")
                    result["skipped"][storage] = "\n".join(reason[-10:])
                    continue
                finally:
                    probe.stop()
                if info.get("storage") not in (None, storage):
                    say(f"note: {storage} config reports storage={info.get('storage')}")
                result.setdefault("brokerInfo", {})[storage] = info
                result["backends"][storage] = run_scenarios(
                    prof, scenarios,
                    lambda name, s=storage: ManagedBroker(python, s, workdir,
                                                     profile_path(args.profile, s, name)),
                    storage, managed=True, repeat=args.repeat, python=python)
            if not args.no_ceiling:
                result["ceilings"] = measure_ceilings(python, workdir, prof,
                                                      result["ceilings"])
    finally:
        servers.cleanup(workdir)
    result["elapsedSeconds"] = round(time.time() - started, 1)

    print()
    print(f"dsh-agent-relay benchmark ({result['profile']}) {result['date']}, "
          f"{result['machine']['cores']} cores, broker python {python}")
    if busy:
        print(busy)
    for kind, doc in result["ceilings"].items():
        runs = ", ".join(f"{r:,.0f}" for r in doc.get("runs", []))
        print(f"ceiling {kind:<5} {doc['rate']:>9,.0f} req/s  (p50 {doc['latencyMs']['p50']} ms;"
              f" best of runs at start and end: {runs}; server CPU busy "
              f"{_pct(doc['serverCpuBusy'])}; loadgen CPU {doc['loadgenCpuUsPerRequest']} us/req)")
    for storage, why in result["skipped"].items():
        print(f"skipped backend {storage}: {why.splitlines()[-1] if why else 'did not start'}")
    if result["backends"]:
        print(render(summary_rows(result)))
    print(f"(elapsed {result['elapsedSeconds']}s)")
    out = args.out or os.path.join(servers.BENCH_DIR, "results",
                                   time.strftime("suite-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1, default=list)
    print(f"full result: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
