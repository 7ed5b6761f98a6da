"""PostgreSQL failover, on clusters of their own: the drill of bench/failover.py in its
short mode (the primary killed under load, the standby promoted, nothing acknowledged
lost), and a broker that refuses to start on a standby.

Needs the PostgreSQL server tools (initdb, pg_ctl, pg_basebackup); without them the
tests skip, or fail where ``RELAY_TEST_POSTGRES_REQUIRED`` is set. They never touch the
server of ``RELAY_TEST_POSTGRES_DSN``: the clusters run on free ports in a temporary
folder, removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, Tuple

import pytest

from tests.conftest import skip_postgres
from tests.support import REPO
from tests.support.processes import BrokerProcess, free_port

pytestmark = [pytest.mark.process, pytest.mark.postgres]

BENCH = str(REPO / "bench")
DRILL_SECONDS = 150


def drill_module() -> Any:
    """bench/failover.py as a module (bench/ is a folder of scripts, not a package)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import failover

    return failover


@pytest.fixture(scope="module")
def pg_bin() -> str:
    bindir = drill_module().find_postgres_bin()
    if bindir is None:
        skip_postgres("the PostgreSQL server tools (initdb, pg_ctl, pg_basebackup) are not "
                      "installed: apt-get install postgresql")
    try:
        import psycopg
    except ImportError:
        pytest.fail("the postgres extra is not installed: pip install -e '.[test,postgres]'",
                    pytrace=False)
    try:  # nothing listens there: an OperationalError, unless the driver cannot run
        psycopg.connect(f"host=127.0.0.1 port={free_port()} connect_timeout=1").close()
    except psycopg.Error:
        pass
    except TypeError as e:  # psycopg's ctypes libpq binding on PyPy 7.3.11
        skip_postgres(f"psycopg cannot connect on this interpreter ({e}): the postgres "
                      "backend runs on CPython")
    return bindir


@pytest.fixture(scope="module")
def pair(pg_bin: str) -> Iterator[Any]:
    """A primary and its synchronous standby, for the tests that need no failover."""
    failover = drill_module()
    root = tempfile.mkdtemp(prefix="relay-test-standby-")
    try:
        with failover.Pair(pg_bin, root, (free_port(), free_port())) as made:
            yield made
    finally:
        shutil.rmtree(root, ignore_errors=True)


STANDBY_ADVICE = ("is a read-only standby: point {key} at the primary, or list every host "
                  "with target_session_attrs=read-write")


@pytest.mark.parametrize("attrs", ["", " target_session_attrs=read-write"])
def test_a_broker_pointed_only_at_a_standby_refuses_to_start(pair, tmp_path, attrs):
    broker = BrokerProcess(str(tmp_path), storage="postgres",
                           postgres={"dsn": pair.standby.dsn + attrs})
    code, output = broker.exit_status()
    assert code == 78, output
    (line,) = output.strip().splitlines()
    key = "broker.postgres.dsn"
    assert line == (f"relay: config error: {key}: 127.0.0.1:{pair.standby.port} "
                    + STANDBY_ADVICE.format(key=key))


def test_a_listen_dsn_on_a_standby_refuses_to_start(pair, tmp_path):
    broker = BrokerProcess(str(tmp_path), storage="postgres",
                           postgres={"dsn": pair.primary.dsn, "listenDsn": pair.standby.dsn})
    code, output = broker.exit_status()
    assert code == 78, output
    key = "broker.postgres.listenDsn"
    assert output.strip() == (f"relay: config error: {key}: 127.0.0.1:{pair.standby.port} "
                              + STANDBY_ADVICE.format(key=key))


@pytest.mark.parametrize("form", [
    "host=127.0.0.1,127.0.0.1 port={first},{second} user=postgres dbname=postgres "
    "target_session_attrs=read-write",
    "postgresql://postgres@127.0.0.1:{first},127.0.0.1:{second}/postgres"
    "?target_session_attrs=read-write",
])
def test_the_multi_host_dsn_starts_on_the_primary_whichever_host_comes_first(pair, tmp_path,
                                                                            form):
    dsn = form.format(first=pair.standby.port, second=pair.primary.port)
    broker = BrokerProcess(str(tmp_path), storage="postgres", postgres={"dsn": dsn})
    broker.start(timeout=60)
    try:
        assert broker.request("x", "GET", "/")[1]["storage"] == "postgres"
        assert broker.request("alpha", "POST", "/register", {})[0] == 200
    finally:
        broker.stop()


def run_drill(pg_bin: str, *options: str) -> Tuple[int, Dict[str, Any]]:
    """bench/failover.py --short with ``options``: its exit status and its result."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(BENCH, "failover.py"), "--short", "--json",
         "--pg-bin", pg_bin, "--python", sys.executable, *options],
        cwd=BENCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=DRILL_SECONDS)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the drill stops what it started
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the drill ran over {DRILL_SECONDS}s:\n{err.decode(errors='replace')}")
    assert proc.returncode in (0, 1), (f"the drill exited with {proc.returncode}:\n"
                                       + err.decode(errors="replace"))
    return proc.returncode, json.loads(out)


def test_the_failover_drill_loses_nothing_acknowledged(pg_bin):
    """The short drill: both brokers serve again after the promotion, and every
    acknowledged send, completion, lease and v1.0 page holds on the promoted standby."""
    code, result = run_drill(pg_bin)
    report = drill_module().render(result)
    assert result["lostSends"] == [] and result["lostCompletions"] == [], report
    assert result["leasedTwice"] == [] and result["lostLeases"] == [], report
    assert result["pollerGap"] == [] and result["pollerRepeats"] == [], report
    assert not result["pollerOutOfOrder"], report
    assert result["problems"] == [], "only successes and 503 busy during the switch:\n" + report
    assert all(s is not None for s in result["recoverSeconds"].values()), report
    assert result["acknowledged"]["sends"] > 0 and result["acknowledged"]["completions"] > 0
    assert result["ok"] and code == 0, report


def test_the_drill_sees_what_asynchronous_replication_loses(pg_bin):
    """The drill's checks can fail: with an asynchronous standby that missed the
    primary's last second, acknowledged sends are gone and the drill says so."""
    code, result = run_drill(pg_bin, "--asynchronous", "--stall", "1")
    assert result["replication"] == "asynchronous"
    assert result["lostSends"] and result["lost"] > 0
    assert not result["ok"] and code == 1
