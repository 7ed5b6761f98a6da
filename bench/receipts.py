"""Cost of the agent's receipt store: microseconds per ``put`` with N receipts held.

    .venv/bin/python bench/receipts.py                    # 1,000 and 10,000 held
    .venv/bin/python bench/receipts.py --held 100,1000 --puts 50 --dir /var/tmp

For each N, a receipts file of the earlier JSON format
(``~/.dsh-agent-relay-receipts-<hash>.json``) holding N one-hour-old receipts
is written into a fresh directory and opened with ``ReceiptStore.for_agent``,
which moves them into its SQLite file; then ``put`` is timed for ``--puts``
new receipts, each with a ~200-byte reply body. Prints the time to open the
store (the one-time move included) and the mean, median and worst ``put``.
The directory should be on the disk the agent's home directory is on (write
and fsync costs differ per file system).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List

from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.agent.receipts import ReceiptStore, legacy_receipts_path  # noqa: E402

AGENT = "bench-worker"
NOW = 1_700_000_000.0
HELD_AGE_SECONDS = 3600.0


def reply(request_id: str) -> Dict[str, object]:
    return {
        "id": str(uuid.uuid4()),
        "to": "requester",
        "body": {"text": "r" * 200},
        "replyTo": request_id,
        "parentId": request_id,
        "rootId": request_id,
    }


def write_old_file(path: Path, held: int) -> None:
    receipts = {}
    for _ in range(held):
        request_id = str(uuid.uuid4())
        receipts[request_id] = {"at": NOW - HELD_AGE_SECONDS, "reply": reply(request_id)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"version": 1, "receipts": receipts}, handle)


def measure(directory: Path, held: int, puts: int) -> Dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="receipts-", dir=directory) as name:
        return measure_in(Path(name), held, puts)


def measure_in(home: Path, held: int, puts: int) -> Dict[str, float]:
    write_old_file(legacy_receipts_path(AGENT, home), held)
    clock = Clock()
    clock.advance(NOW)
    started = time.perf_counter()
    store = ReceiptStore.for_agent(AGENT, home, clock)
    opened = time.perf_counter() - started
    if len(store) != held:
        raise SystemExit(f"the store holds {len(store)} receipts, expected {held}")
    timings: List[float] = []
    for _ in range(puts):
        request_id = str(uuid.uuid4())
        body = reply(request_id)
        started = time.perf_counter()
        store.put(request_id, body)
        timings.append(time.perf_counter() - started)
    store.close()
    return {
        "held": held,
        "open_ms": opened * 1e3,
        "put_mean_us": statistics.mean(timings) * 1e6,
        "put_median_us": statistics.median(timings) * 1e6,
        "put_max_us": max(timings) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", default="1000,10000", help="comma-separated receipt counts")
    parser.add_argument("--puts", type=int, default=100, help="timed puts per count")
    parser.add_argument("--dir", default=".", help="where the temporary homes are made")
    args = parser.parse_args()
    directory = Path(args.dir)
    print(f"{'held':>8} {'open ms':>9} {'put mean µs':>12} {'median µs':>10} {'max µs':>9}")
    for held in (int(n) for n in args.held.split(",")):
        row = measure(directory, held, args.puts)
        print(
            f"{row['held']:>8} {row['open_ms']:>9.1f} {row['put_mean_us']:>12.0f} "
            f"{row['put_median_us']:>10.0f} {row['put_max_us']:>9.0f}"
        )


if __name__ == "__main__":
    main()
