"""Run the whole benchmark suite and print a summary with ratios to the Klein ceiling
(and to the reference broker with ``--reference``).

    .venv/bin/python bench/run_suite.py --quick          # about 6 minutes (two backends)
    .venv/bin/python bench/run_suite.py                  # full run
    .venv/bin/python bench/run_suite.py --backends memory,sqlite,jsonl
    .venv/bin/python bench/run_suite.py --python .venv-pypy/bin/python
    .venv/bin/python bench/run_suite.py --broker-url http://127.0.0.1:19121 --secret S
    .venv/bin/python bench/run_suite.py --quick --reference /tmp/refbroker
    .venv/bin/python bench/run_suite.py --scenarios many-agents --many-agents-seconds 300

For each backend the suite starts a fresh broker (``twistd -n relay --config <temp>``)
per scenario run, so one scenario's stored messages never weigh on the next; ``depth``
starts one per level. With ``--reference DIR`` the reference broker (``node
broker/src/index.js --config <temp>`` from that checkout) runs the same scenarios,
interleaved: per scenario and repeat, ours then the reference, each on a fresh broker.
The ceilings (bare twisted.web, bare Klein) are started with the same interpreter as
our broker and measured by the same load generator in the same run. A backend whose
broker does not start, or a scenario a broker cannot run, is skipped with a line saying
why. The full result is also written to ``bench/results/suite-<time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import loadgen
import servers

JsonDict = Dict[str, Any]

MANY_AGENTS: JsonDict = {"manyAgents": 1000, "manyHolders": 500, "manySenders": 50,
                         "manyRate": 200.0, "manyPollInterval": 1.0}
PROFILES: Dict[str, JsonDict] = {
    "quick": {
        "duration": 3.0, "warmup": 1.0, "concurrency": 8, "workers": 4,
        "pullMessages": 24000, "pollMessages": 4000, "pollWorkers": 2,
        "e2eDuration": 5.0, "rate": 200.0, "askers": 1,
        "depthLevels": [0, 1000, 10000], "depthDuration": 3.0, "depthPullMessages": 8000,
        **MANY_AGENTS, "manySeconds": 20.0, "lifeSenders": 4, "lifeWorkers": 4,
    },
    "full": {
        "duration": 10.0, "warmup": 2.0, "concurrency": 8, "workers": 4,
        "pullMessages": 70000, "pollMessages": 10000, "pollWorkers": 2,
        "e2eDuration": 15.0, "rate": 200.0, "askers": 1,
        "depthLevels": [0, 1000, 10000, 100000], "depthDuration": 5.0,
        "depthPullMessages": 15000,
        **MANY_AGENTS, "manySeconds": 60.0, "lifeSenders": 4, "lifeWorkers": 4,
    },
}


KNOWN_SCENARIOS = ("send", "pull-ack", "poll", "e2e-latency", "lifecycle", "request-reply",
                   "many-agents", "depth")
# The performance goals, in server CPU per operation on CPython.
GOAL_US_PER_SEND = 110
GOAL_US_PER_PULLED = 150
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


# Scenarios run once per broker (not best-of-repeat): latency and the long runs.
SINGLE_RUN = ("depth", "e2e-latency", "request-reply", "many-agents")
# Raised for every broker the suite starts: many-agents holds ~550 loopback connections.
OUR_EXTRA: JsonDict = {"maxConnectionsPerAddress": 100000}
REFERENCE = "reference"


class Side:
    """One broker the suite measures: ours with one backend, ours at a given URL, or the
    reference broker. ``fresh(name)`` returns a context manager yielding ``(target,
    rss)`` (see :func:`run_one`)."""

    def __init__(self, label: str, fresh: Callable[[str], Any], managed: bool,
                 python: str, info: JsonDict, reference: bool = False) -> None:
        self.label = label
        self.fresh = fresh
        self.managed = managed
        self.python = python
        self.info = info
        self.reference = reference

    def skip_reason(self, name: str) -> str:
        """Why this broker does not run scenario ``name`` ("" when it does)."""
        caps = self.info.get("capabilities")
        caps = caps if isinstance(caps, dict) else {}
        if self.reference and name == "request-reply" and not caps.get("pullFilter"):
            return ("the reference broker has no v1.2 pull by parent (no "
                    "capabilities.pullFilter in GET /), the path request-reply measures "
                    "with the relay's own agent runtime; ours only")
        return ""


def run_scenarios(prof: JsonDict, scenarios: Sequence[str], fresh: Callable[[str], Any],
                  label: str, managed: bool, repeat: int = 1,
                  python: str = sys.executable) -> JsonDict:
    """Run each scenario against one broker from ``fresh(name)`` (see run_interleaved)."""
    side = Side(label, fresh, managed, python, {})
    return run_interleaved(prof, scenarios, [side], repeat)[label]


def run_interleaved(prof: JsonDict, scenarios: Sequence[str], sides: Sequence[Side],
                    repeat: int = 1, skipped: Optional[JsonDict] = None) -> JsonDict:
    """Run every scenario on every broker, interleaved: per scenario and per repeat,
    each broker in turn (ours first), a fresh broker per run where the suite manages
    it. Throughput scenarios run ``repeat`` times and keep the best rate; depth repeats
    inside each level and, when every broker is managed, interleaves per level.

    Returns ``{label: {scenario: result}}``; a scenario a broker cannot run is left
    out of its results and its reason recorded in ``skipped[label][scenario]``. A
    failure of the reference broker is recorded the same way and does not end the run.
    """
    out: JsonDict = {side.label: {} for side in sides}
    skipped = skipped if skipped is not None else {}

    def attempt(side: Side, name: str, run: Callable[[], JsonDict]) -> Optional[JsonDict]:
        if not side.reference:
            return run()
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - the reference's failure is a result
            why = f"failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
            say(f"[{side.label}] {name} {why}")
            skipped.setdefault(side.label, {})[name] = why
            return None

    for name in scenarios:
        active = []
        for side in sides:
            why = side.skip_reason(name)
            if why:
                say(f"SKIP [{side.label}] {name}: {why}")
                skipped.setdefault(side.label, {})[name] = why
            else:
                active.append(side)
        docs: Dict[str, List[JsonDict]] = {side.label: [] for side in active}
        if name == "depth" and len(active) > 1 and all(s.managed for s in active):
            for level in prof["depthLevels"]:
                for side in active:
                    level_prof = dict(prof, depthLevels=[level])
                    doc = attempt(side, name, lambda s=side, p=level_prof, n=name: run_one(
                        p, n, s.fresh, s.label, s.managed, repeat, s.python))
                    if doc is not None:
                        if docs[side.label]:
                            docs[side.label][0]["levels"].extend(doc["levels"])
                        else:
                            docs[side.label].append(doc)
        else:
            times = 1 if name in SINGLE_RUN else repeat
            for _ in range(times):
                for side in active:
                    doc = attempt(side, name, lambda s=side, n=name: run_one(
                        prof, n, s.fresh, s.label, s.managed, repeat, s.python))
                    if doc is not None:
                        docs[side.label].append(doc)
        for side in active:
            runs = docs[side.label]
            if not runs:
                continue
            doc = loadgen.best_of(runs) if len(runs) > 1 else runs[0]
            doc["backend"] = side.label
            loadgen.emit(doc)
            out[side.label][name] = doc
    return out


def run_one(prof: JsonDict, name: str, fresh: Callable[[str], Any], label: str,
            managed: bool, repeat: int, python: str = sys.executable) -> JsonDict:
    """One run of one scenario on a broker from ``fresh(name)``: a new broker per call
    (and per depth level) when the suite manages the broker, the same one when it was
    given a URL; ``python`` runs the worker agent of ``request-reply``."""
    say(f"[{label}] {name} ...")
    depth_fresh = (lambda name=name: fresh(name)) if managed else None
    with (contextlib.nullcontext((None, None)) if managed and name == "depth"
          else fresh(name)) as (tgt, rss):
        cpu = (lambda: rss()["cpuSeconds"]) if rss is not None and \
            "cpuSeconds" in rss() else None
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
        elif name == "lifecycle":
            doc = loadgen.scenario_lifecycle(tgt, prof["lifeSenders"], prof["lifeWorkers"],
                                             prof["duration"], prof["warmup"], cpu=cpu)
        elif name == "request-reply":
            doc = loadgen.scenario_request_reply(tgt, prof["askers"], prof["e2eDuration"],
                                                 prof["warmup"], worker_python=python)
        elif name == "many-agents":
            doc = loadgen.scenario_many_agents(
                tgt, prof["manyAgents"], prof["manyHolders"], prof["manySenders"],
                prof["manyRate"], prof["manySeconds"], prof["warmup"],
                prof["manyPollInterval"], rss=rss, cpu=cpu)
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
        self.server = servers.broker(python, storage, workdir, extra=OUR_EXTRA,
                                     profile=profile)

    def __enter__(self) -> Any:
        self.server.start()
        return self.server.target, self.server.rss

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


class ReferenceBroker(ManagedBroker):
    """Context manager: start a fresh reference broker, yield (target, rss), stop it."""

    def __init__(self, node: str, checkout: str, workdir: str, storage: str) -> None:
        self.server = servers.reference_broker(node, checkout, workdir, storage)


class ExternalBroker:
    """Context manager for a broker the suite did not start (RSS only with --broker-pid)."""

    def __init__(self, target: loadgen.Target, pid: Optional[int]) -> None:
        self.target = target
        self.pid = pid

    def rss(self) -> JsonDict:
        status = servers.read_status(self.pid) if self.pid else {}
        return {"rssMB": round(status.get("VmRSS", 0.0), 1),
                "peakMB": round(status.get("VmHWM", 0.0), 1),
                "cpuSeconds": round(servers.cpu_seconds(self.pid), 2) if self.pid else 0.0}

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


def _num(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _get(doc: JsonDict, *path: Any) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _level(r: JsonDict, depth: int) -> JsonDict:
    return next(x for x in r["depth"]["levels"] if x["depth"] == depth)


def depth_levels(result: JsonDict) -> List[int]:
    """Every depth level measured on any broker, in order of first appearance."""
    levels: List[int] = []
    for doc in result["backends"].values():
        for row in doc.get("depth", {}).get("levels", []):
            if row["depth"] not in levels:
                levels.append(row["depth"])
    return levels


def summary_rows(result: JsonDict) -> List[List[str]]:
    """Rows of (figure, one cell per broker) for the summary table. Rates of our
    brokers carry their fraction of the Klein ceiling; the reference's do not."""
    klein = result["ceilings"].get("klein", {}).get("rate")
    backends = list(result["backends"])
    rows: List[List[str]] = [["figure", *backends]]

    def add(name: str, get: Callable[[JsonDict, Optional[float]], str]) -> None:
        cells = []
        for b in backends:
            try:
                cells.append(get(result["backends"][b], None if b == REFERENCE else klein))
            except (KeyError, TypeError, IndexError, StopIteration):
                cells.append("-")
        if any(c != "-" for c in cells):
            rows.append([name, *cells])

    add("send req/s (of klein)", lambda r, c: _ratio(r["send"]["rate"], c))
    add("send: server CPU us/req", lambda r, c: _num(r["send"]["serverCpuUsPerRequest"]))
    add("send: broker CPU busy", lambda r, c: _pct(r["send"]["serverCpuBusy"]))
    add("send: loadgen CPU us/req", lambda r, c: str(r["send"]["loadgenCpuUsPerRequest"]))
    add("send latency p50/p99 ms", lambda r, c: "{} / {}".format(
        _ms(r["send"]["latencyMs"]["p50"]), _ms(r["send"]["latencyMs"]["p99"])))
    add("pull-ack msg/s (of klein)", lambda r, c: _ratio(r["pull-ack"]["rate"], c))
    add("pull-ack: server CPU us/msg",
        lambda r, c: _num(r["pull-ack"]["serverCpuUsPerMessage"]))
    add("pull-ack: broker CPU busy", lambda r, c: _pct(r["pull-ack"]["serverCpuBusy"]))
    add("poll msg/s (of klein)", lambda r, c: _ratio(r["poll"]["rate"], c))
    add("poll req/s (of klein)", lambda r, c: _ratio(r["poll"]["requestRate"], c))
    add("e2e mode", lambda r, c: r["e2e-latency"]["mode"])
    add("e2e p50/p99/max ms", lambda r, c: "{} / {} / {}".format(
        *(_ms(r["e2e-latency"]["latencyMs"][k]) for k in ("p50", "p99", "max"))))
    add("e2e requests/msg (+acks)", lambda r, c: "{} ({})".format(
        r["e2e-latency"]["requestsPerMessage"], r["e2e-latency"]["requestsPerMessageWithAcks"]))
    add("e2e lost/duplicates", lambda r, c: "{} / {}".format(
        r["e2e-latency"]["lost"], r["e2e-latency"]["duplicates"]))
    add("lifecycle msg/s (sent+pulled+acked)", lambda r, c: _ratio(r["lifecycle"]["rate"], c))
    add("lifecycle: server CPU us/msg",
        lambda r, c: _num(r["lifecycle"]["serverCpuUsPerMessage"]))
    add("lifecycle: sends/s, backlog at end", lambda r, c: "{} / {:,}".format(
        _num(r["lifecycle"]["sendRate"], 0), r["lifecycle"]["backlogAtEnd"]))
    add("lifecycle cycle p50/p99 ms", lambda r, c: "{} / {}".format(
        _ms(r["lifecycle"]["cycleLatencyMs"]["p50"]),
        _ms(r["lifecycle"]["cycleLatencyMs"]["p99"])))
    add("request-reply mode", lambda r, c: r["request-reply"]["mode"])
    add("request-reply p50/p99 ms", lambda r, c: "{} / {}".format(
        _ms(r["request-reply"]["latencyMs"]["p50"]), _ms(r["request-reply"]["latencyMs"]["p99"])))
    add("request-reply round trips/s", lambda r, c: "{} ({} unanswered)".format(
        r["request-reply"]["rate"], r["request-reply"]["unanswered"]))
    add("many-agents mode", lambda r, c: r["many-agents"]["mode"])
    add("many-agents delivery p50/p99 ms", lambda r, c: "{} / {}".format(
        _ms(r["many-agents"]["latencyMs"]["p50"]), _ms(r["many-agents"]["latencyMs"]["p99"])))
    add("many-agents delivered/sent", lambda r, c: "{:,} / {:,}".format(
        r["many-agents"]["delivered"], r["many-agents"]["sent"]))
    add("many-agents: server CPU busy, us/msg", lambda r, c: "{} / {}".format(
        _pct(r["many-agents"]["serverCpuBusy"]),
        _num(r["many-agents"]["serverCpuUsPerMessage"])))
    add("many-agents RSS MB start/end/max", lambda r, c: "{} / {} / {}".format(
        *(_get(r, "many-agents", "rssOverTime", k) for k in ("startMB", "endMB", "maxMB"))))
    for d in depth_levels(result):
        add(f"depth {d:,}: send req/s",
            lambda r, c, d=d: _ratio(_level(r, d)["send"]["rate"], c))
        add(f"depth {d:,}: pull-ack msg/s",
            lambda r, c, d=d: _ratio(_level(r, d)["pullAck"]["rate"], c))
        add(f"depth {d:,}: server CPU us/send, /msg", lambda r, c, d=d: "{} / {}".format(
            _num(_level(r, d)["send"].get("serverCpuUsPerRequest")),
            _num(_level(r, d)["pullAck"].get("serverCpuUsPerMessage"))))
        add(f"depth {d:,}: e2e p50/p99 ms", lambda r, c, d=d: "{} / {}".format(
            _ms(_level(r, d)["e2e"]["latencyMs"]["p50"]),
            _ms(_level(r, d)["e2e"]["latencyMs"]["p99"])))
        add(f"depth {d:,}: peak RSS MB", lambda r, c, d=d: str(_level(r, d)["rss"]["peakMB"]))
    add("peak RSS MB (all scenarios)", lambda r, c: str(peak_rss(r)))
    return rows


# (figure, path into a broker's results, higher is better). Ratios are ours/reference.
def _ratio_figures(result: JsonDict) -> List[Tuple[str, Callable[[JsonDict], float], bool]]:
    figs: List[Tuple[str, Callable[[JsonDict], float], bool]] = [
        ("send msg/s", lambda r: r["send"]["rate"], True),
        ("send: server CPU us/req", lambda r: r["send"]["serverCpuUsPerRequest"], False),
        ("pull-ack msg/s", lambda r: r["pull-ack"]["rate"], True),
        ("pull-ack: server CPU us/msg", lambda r: r["pull-ack"]["serverCpuUsPerMessage"],
         False),
        ("poll msg/s", lambda r: r["poll"]["rate"], True),
        ("e2e latency p50", lambda r: r["e2e-latency"]["latencyMs"]["p50"], False),
        ("e2e latency p99", lambda r: r["e2e-latency"]["latencyMs"]["p99"], False),
        ("lifecycle msg/s", lambda r: r["lifecycle"]["rate"], True),
        ("lifecycle: server CPU us/msg", lambda r: r["lifecycle"]["serverCpuUsPerMessage"],
         False),
        ("many-agents delivery p50", lambda r: r["many-agents"]["latencyMs"]["p50"], False),
        ("many-agents delivery p99", lambda r: r["many-agents"]["latencyMs"]["p99"], False),
        ("many-agents: server CPU us/msg",
         lambda r: r["many-agents"]["serverCpuUsPerMessage"], False),
        ("many-agents max RSS", lambda r: r["many-agents"]["rssOverTime"]["maxMB"], False),
    ]
    for d in depth_levels(result):
        figs += [
            (f"depth {d:,}: send req/s", lambda r, d=d: _level(r, d)["send"]["rate"], True),
            (f"depth {d:,}: pull-ack msg/s", lambda r, d=d: _level(r, d)["pullAck"]["rate"],
             True),
            (f"depth {d:,}: server CPU us/send",
             lambda r, d=d: _level(r, d)["send"]["serverCpuUsPerRequest"], False),
            (f"depth {d:,}: server CPU us/pulled+acked msg",
             lambda r, d=d: _level(r, d)["pullAck"]["serverCpuUsPerMessage"], False),
            (f"depth {d:,}: e2e p50", lambda r, d=d: _level(r, d)["e2e"]["latencyMs"]["p50"],
             False),
        ]
    return figs


def reference_ratios(result: JsonDict) -> JsonDict:
    """``{our backend: {figure: ours / reference}}`` for every figure both have."""
    ref = result["backends"].get(REFERENCE)
    if ref is None:
        return {}
    out: JsonDict = {}
    for b, ours in result["backends"].items():
        if b == REFERENCE:
            continue
        row: JsonDict = {}
        for name, get, _ in _ratio_figures(result):
            try:
                mine, theirs = float(get(ours)), float(get(ref))
            except (KeyError, TypeError, IndexError, StopIteration, ValueError):
                continue
            if theirs > 0:
                row[name] = float(f"{mine / theirs:.4g}")
        out[b] = row
    return out


def ratio_rows(result: JsonDict, ratios: JsonDict) -> List[List[str]]:
    """Rows of (figure, better when, one ours/reference cell per backend of ours)."""
    backends = list(ratios)
    rows = [["ours / reference", "better", *backends]]
    for name, _, higher in _ratio_figures(result):
        cells = [f"{ratios[b][name]:.3g}x" if name in ratios[b] else "-" for b in backends]
        if any(c != "-" for c in cells):
            rows.append([name, "above 1" if higher else "below 1", *cells])
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


def probe_broker(server: servers.Server) -> JsonDict:
    """Start ``server`` once, read its ``GET /`` and stop it; StartError if it cannot."""
    try:
        server.start()
        return loadgen.handshake(server.target)
    finally:
        server.stop()


def start_failure(exc: servers.StartError) -> Tuple[str, str]:
    """(the last meaningful line, the last ten lines) of a broker that did not start."""
    reason = str(exc).strip().splitlines()
    why = next((ln for ln in reversed(reason) if ln.strip()), reason[0])
    return why.strip(), "\n".join(reason[-10:])


def reference_about(checkout: str, node: str) -> JsonDict:
    """Where the reference broker came from: its checkout, commit and Node version."""
    about: JsonDict = {"dir": os.path.abspath(checkout), "node": node}
    for key, argv, cwd in (("commit", ["git", "rev-parse", "HEAD"], checkout),
                           ("nodeVersion", [node, "--version"], None)):
        try:
            about[key] = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                                        timeout=30).stdout.strip() or None
        except OSError:
            about[key] = None
    return about


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse options, run ceilings and every broker, print the summary."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short durations, depth up to 10k")
    p.add_argument("--backends", default="sqlite,memory",
                   help="storage backends to start (comma-separated)")
    p.add_argument("--scenarios", default="send,pull-ack,poll,e2e-latency,lifecycle,"
                                          "request-reply,many-agents,depth")
    p.add_argument("--python", default=servers.default_python(),
                   help="interpreter for the broker and the ceilings (e.g. .venv-pypy/bin/python)")
    p.add_argument("--broker-url", help="measure this running broker instead of starting one")
    p.add_argument("--secret", default=os.environ.get("RELAY_SECRET", ""),
                   help="shared secret of --broker-url")
    p.add_argument("--broker-pid", type=int, help="pid of --broker-url, for its RSS")
    p.add_argument("--reference", metavar="DIR",
                   help="also measure the reference broker (Node.js) from this checkout, "
                        "interleaved with ours, and print ours/reference ratios")
    p.add_argument("--reference-node", default="node", metavar="NODE",
                   help="the Node.js that runs the reference broker (default: node)")
    p.add_argument("--reference-storage", default="jsonl", choices=["jsonl", "sqlite"],
                   help="the reference broker's broker.storage (sqlite needs Node >= 22.5; "
                        "default jsonl, what it uses on Node 20)")
    p.add_argument("--many-agents-seconds", type=float, default=None, metavar="S",
                   help="measured seconds of many-agents (default 20 quick, 60 full; "
                        "300 shows whether memory stays flat)")
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
    if args.many_agents_seconds is not None:
        prof["manySeconds"] = args.many_agents_seconds
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in KNOWN_SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios {', '.join(unknown)} (known: {', '.join(KNOWN_SCENARIOS)})")
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    if os.sep in python and not os.path.exists(python):
        p.error(f"--python {args.python}: no such interpreter (for PyPy: make "
                ".venv-pypy/.installed-stamp, which needs pypy3)")
    if args.reference:
        problem = servers.reference_dir_problem(args.reference)
        if problem:
            p.error(f"--reference: {problem}")
        if shutil.which(args.reference_node) is None and not os.path.exists(args.reference_node):
            p.error(f"--reference-node {args.reference_node}: not found")
    if args.broker_url and not args.secret:
        p.error("--broker-url needs --secret (or RELAY_SECRET)")
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
        "skipped": {}, "skippedScenarios": {}, "busyNote": busy,
    }
    try:
        if not args.no_ceiling:
            result["ceilings"] = measure_ceilings(python, workdir, prof)
        sides: List[Side] = []
        if args.broker_url:
            target = loadgen.Target(args.broker_url, args.secret)
            info = loadgen.handshake(target)
            label = str(info.get("storage") or "external")
            ext = ExternalBroker(target, args.broker_pid)
            sides.append(Side(label, lambda _name: ext, False, python, info))
            result.setdefault("brokerInfo", {})[label] = info
        else:
            for storage in [b.strip() for b in args.backends.split(",") if b.strip()]:
                try:
                    info = probe_broker(servers.broker(python, storage, workdir,
                                                       extra=OUR_EXTRA))
                except servers.StartError as exc:
                    why, tail = start_failure(exc)
                    say(f"SKIP backend {storage}: broker did not start ({why})")
                    result["skipped"][storage] = tail
                    continue
                if info.get("storage") not in (None, storage):
                    say(f"note: {storage} config reports storage={info.get('storage')}")
                result.setdefault("brokerInfo", {})[storage] = info
                sides.append(Side(
                    storage,
                    lambda name, s=storage: ManagedBroker(python, s, workdir,
                                                          profile_path(args.profile, s, name)),
                    True, python, info))
        if args.reference:
            result["reference"] = reference_about(args.reference, args.reference_node)

            def fresh_ref(_name: str) -> ReferenceBroker:
                return ReferenceBroker(args.reference_node, args.reference, workdir,
                                       args.reference_storage)

            try:
                info = probe_broker(fresh_ref("probe").server)
            except servers.StartError as exc:
                why, tail = start_failure(exc)
                say(f"SKIP the reference broker: it did not start ({why})")
                result["skipped"][REFERENCE] = tail
            else:
                result["reference"]["info"] = info
                result.setdefault("brokerInfo", {})[REFERENCE] = info
                sides.append(Side(REFERENCE, fresh_ref, True, python, info, reference=True))
        result["backends"] = run_interleaved(prof, scenarios, sides, args.repeat,
                                             result["skippedScenarios"])
        if not args.no_ceiling:
            result["ceilings"] = measure_ceilings(python, workdir, prof, result["ceilings"])
    finally:
        servers.cleanup(workdir)
    result["elapsedSeconds"] = round(time.time() - started, 1)
    result["referenceRatios"] = reference_ratios(result)

    print()
    print(f"dsh-agent-relay benchmark ({result['profile']}) {result['date']}, "
          f"{result['machine']['cores']} cores, broker python {python}")
    if "reference" in result:
        ref = result["reference"]
        print(f"reference broker: {ref['dir']} (commit {ref.get('commit') or '?'}, node "
              f"{ref.get('nodeVersion') or '?'}, storage "
              f"{ref.get('info', {}).get('storage', '?')})")
    if busy:
        print(busy)
    for kind, doc in result["ceilings"].items():
        runs = ", ".join(f"{r:,.0f}" for r in doc.get("runs", []))
        print(f"ceiling {kind:<5} {doc['rate']:>9,.0f} req/s  (p50 {doc['latencyMs']['p50']} ms;"
              f" best of runs at start and end: {runs}; server CPU busy "
              f"{_pct(doc['serverCpuBusy'])}; loadgen CPU {doc['loadgenCpuUsPerRequest']} us/req)")
    for storage, why in result["skipped"].items():
        print(f"skipped backend {storage}: {why.splitlines()[-1] if why else 'did not start'}")
    for label, names in result["skippedScenarios"].items():
        for name, why in names.items():
            print(f"skipped {name} on {label}: {why}")
    if result["backends"]:
        print(render(summary_rows(result)))
        print(f"goals on CPython: server CPU <= {GOAL_US_PER_SEND} us per send, "
              f"<= {GOAL_US_PER_PULLED} us per pulled+acked message")
    if result["referenceRatios"]:
        print()
        print(render(ratio_rows(result, result["referenceRatios"])))
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
