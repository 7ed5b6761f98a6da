"""The failover drill: two brokers on PostgreSQL lose the primary under load, and keep
every promise they made.

    .venv/bin/python bench/failover.py            # about a minute (make failover-drill)
    .venv/bin/python bench/failover.py --short    # about half as long (what CI runs)
    .venv/bin/python bench/failover.py --asynchronous --stall 1   # what async loses

In a temporary folder, on free loopback ports (never the machine's own cluster), the
drill makes two clusters of the machine's PostgreSQL: a primary, and a synchronous
streaming standby cloned from it with ``pg_basebackup -R``. Two brokers
(``twistd -n relay``, ``broker.storage: postgres``) share it through a libpq
multi-host DSN (``host=127.0.0.1,127.0.0.1 port=P1,P2 target_session_attrs=read-write``
for one, its URI form for the other).
Load runs through both: senders, pullers that ack what they lease, a long-poll and a
v1.0 poller. Then the primary's postmaster is killed with SIGKILL, the standby is
promoted with ``pg_ctl promote``, the load goes on, and at the end every acknowledged
fact is checked against the promoted database:

- every send answered ``201`` (or ``200 duplicate``) is stored;
- every ack answered ``done`` is still done, and so is the message of an ack that
  was retried after a lost answer and refused as ``409 not_leased`` (the lost one
  completed it: a plain ack is not answered again as a duplicate);
- no message was leased twice (the lease outlives the drill, so a second lease could
  only be a broken promise);
- the v1.0 poller's pages, in order, are exactly the recipient's stored messages: no
  gap, no repeat.

It prints the time to recover, the answers by status during the switch and what was
lost, and exits 1 when anything acknowledged was lost or a broker answered anything
but success, ``503 busy`` or that ``409``. Everything it starts is stopped and the folder removed,
on success, failure, timeout or Ctrl-C. As root, the clusters run as the ``postgres``
user (PostgreSQL refuses root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import loadgen
import servers

JsonDict = Dict[str, Any]

PROFILES: Dict[str, JsonDict] = {
    # seconds of load before the kill, between the kill and the promotion, and after
    # the promotion; senders and pullers over both brokers; the whole run's bound
    "short": {"before": 2.0, "promoteAfter": 0.5, "after": 2.0, "senders": 2, "pullers": 2,
              "bound": 120.0},
    "full": {"before": 8.0, "promoteAfter": 1.0, "after": 8.0, "senders": 4, "pullers": 4,
             "bound": 300.0},
}
PG_ROOT = "/usr/lib/postgresql"
PG_TOOLS = ("initdb", "pg_ctl", "pg_basebackup")
# A sender's pause between two sends: load that leaves the shared cores to the brokers.
SEND_PAUSE = 0.01
RETRY_PAUSE = 0.05
LONG_POLL_SECONDS = 5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class DrillError(Exception):
    """The drill could not be set up or run (not a lost fact: those are its result)."""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- PostgreSQL clusters ----------------------------------------------------------------


def _version_key(name: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", name)) or (0,)


def find_postgres_bin(given: Optional[str] = None) -> Optional[str]:
    """The folder of the PostgreSQL server tools (initdb, pg_ctl, pg_basebackup):
    ``given``, else the newest ``/usr/lib/postgresql/<v>/bin``, else the one on PATH;
    None when there is none."""

    def complete(folder: str) -> bool:
        return all(os.access(os.path.join(folder, t), os.X_OK) for t in PG_TOOLS)

    if given:
        return given if complete(given) else None
    with contextlib.suppress(OSError):
        for version in sorted(os.listdir(PG_ROOT), key=_version_key, reverse=True):
            folder = os.path.join(PG_ROOT, version, "bin")
            if complete(folder):
                return folder
    on_path = shutil.which("initdb")
    if on_path and complete(os.path.dirname(on_path)):
        return os.path.dirname(on_path)
    return None


def _children(pid: int) -> List[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


class Cluster:
    """One PostgreSQL cluster in ``root/name``, listening on 127.0.0.1:``port`` and in
    ``root`` for its Unix socket, run by ``user`` (None: the current user)."""

    def __init__(self, bindir: str, root: str, name: str, port: int,
                 user: Optional[str]) -> None:
        self.bindir = bindir
        self.root = root
        self.name = name
        self.port = port
        self.user = user
        self.data = os.path.join(root, name)
        self.log_path = os.path.join(root, f"{name}.log")
        self.orphans: List[int] = []

    @property
    def dsn(self) -> str:
        """A libpq DSN of this cluster alone."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def run(self, tool: str, *args: str, timeout: float = 60.0) -> str:
        """Run one PostgreSQL tool as the cluster's user; its output, or DrillError."""
        argv = [os.path.join(self.bindir, tool), *args]
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        try:
            done = subprocess.run(argv, cwd=self.root, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise DrillError(f"{tool} ({self.name}) did not finish in {timeout:.0f}s") from None
        output = done.stdout.decode("utf-8", "replace")
        if done.returncode != 0:
            raise DrillError(f"{tool} ({self.name}) exited with {done.returncode}:\n"
                             f"{output.strip()}\n{self.log_tail()}")
        return output

    def configure(self, settings: Dict[str, str]) -> None:
        """Append settings to postgresql.conf (a later line wins over an earlier one)."""
        with open(os.path.join(self.data, "postgresql.conf"), "a") as fh:
            fh.write("\n# failover drill\n")
            for key, value in settings.items():
                fh.write(f"{key} = '{value}'\n")

    def init(self, settings: Dict[str, str]) -> None:
        """initdb (trust authentication, user ``postgres``), loopback only, then
        ``settings``."""
        self.run("initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                 "--no-sync", "--locale=C")
        self.configure({"port": str(self.port), "listen_addresses": "127.0.0.1",
                        "unix_socket_directories": self.root, **settings})

    def start(self) -> None:
        self.run("pg_ctl", "-D", self.data, "-l", self.log_path, "-w", "-t", "60", "start",
                 timeout=90)

    def cpu_seconds(self) -> float:
        """CPU time the cluster has used so far: the postmaster, the children it has
        reaped and the ones still running (0.0 when it is not running)."""
        pid = self.postmaster_pid()
        if pid is None:
            return 0.0
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for proc, fields in ((pid, (11, 12, 13, 14)),
                             *((child, (11, 12)) for child in _children(pid))):
            try:
                with open(f"/proc/{proc}/stat") as fh:
                    values = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(values[i]) for i in fields) / tick
        return total

    def promote(self) -> None:
        self.run("pg_ctl", "-D", self.data, "-w", "-t", "60", "promote", timeout=90)

    def postmaster_pid(self) -> Optional[int]:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as fh:
                return int(fh.readline().strip())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would; its children see it die and exit
        by themselves (the ones still there are killed by :meth:`stop`)."""
        pid = self.postmaster_pid()
        if pid is None:
            raise DrillError(f"{self.name} has no postmaster.pid")
        self.orphans = _children(pid)
        os.kill(pid, signal.SIGKILL)

    def wal_senders(self) -> List[int]:
        """Process ids of the processes streaming this cluster's WAL to standbys."""
        pid = self.postmaster_pid()
        found = []
        for child in _children(pid) if pid is not None else []:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as fh:
                    if b"walsender" in fh.read():
                        found.append(child)
            except OSError:
                continue
        return found

    def stop(self) -> None:
        """Stop the cluster at once (no checkpoint) and kill what is left of a killed one."""
        pid = self.postmaster_pid()
        if pid is not None and os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(DrillError):
                self.run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "-t", "20",
                         "stop", timeout=30)
        for child in self.orphans:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""


def _connect(dsn: str) -> Any:
    import psycopg

    return psycopg.connect(dsn, autocommit=True, connect_timeout=3)


def cluster_user() -> Optional[str]:
    """Who runs the clusters: ``postgres`` as root (PostgreSQL refuses root), else
    the current user (None)."""
    return "postgres" if os.geteuid() == 0 else None


def hand_over(root: str, user: Optional[str]) -> None:
    """Give the empty folder ``root`` to ``user`` (nothing to do for None)."""
    if user is None:
        return
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        raise DrillError(f"PostgreSQL refuses to run as root and there is no "
                         f"{user!r} user to run it as") from None
    os.chown(root, account.pw_uid, account.pw_gid)


class Pair:
    """A primary and its synchronous streaming standby, in ``root`` (a context manager:
    both are stopped on exit). ``root`` must be empty and is handed to ``user``."""

    def __init__(self, bindir: str, root: str, ports: Tuple[int, int],
                 user: Optional[str] = None, synchronous: bool = True) -> None:
        self.user = user if user is not None else cluster_user()
        self.synchronous = synchronous
        self.primary = Cluster(bindir, root, "primary", ports[0], self.user)
        self.standby = Cluster(bindir, root, "standby", ports[1], self.user)
        self.root = root

    @property
    def multi_host_dsn(self) -> str:
        """The DSN a broker is given: both hosts, the writable one chosen at connect."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
                "user=postgres dbname=postgres target_session_attrs=read-write")

    @property
    def multi_host_uri(self) -> str:
        """:attr:`multi_host_dsn` in the URI form."""
        return (f"postgresql://postgres@127.0.0.1:{self.primary.port},"
                f"127.0.0.1:{self.standby.port}/postgres?target_session_attrs=read-write")

    def __enter__(self) -> Pair:
        hand_over(self.root, self.user)
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        p = self.primary
        p.init({
            "wal_level": "replica", "max_wal_senders": "4", "wal_keep_size": "64MB",
            "max_connections": "60", "shared_buffers": "16MB",
            # every commit waits until the standby has the WAL on disk
            "synchronous_standby_names": "*" if self.synchronous else "",
            "synchronous_commit": "on",
        })
        p.start()
        s = self.standby
        s.run("pg_basebackup", "-h", "127.0.0.1", "-p", str(p.port), "-U", "postgres",
              "-D", s.data, "-R", "-X", "stream", "--no-sync", "-c", "fast", timeout=120)
        # Once promoted, the standby is alone: it must not wait for a standby of its own.
        s.configure({"port": str(s.port), "synchronous_standby_names": ""})
        s.start()
        deadline = time.monotonic() + 30
        while True:
            with _connect(p.dsn) as conn:
                row = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
            if row is not None and (row[0] == "sync" or not self.synchronous):
                return
            if time.monotonic() > deadline:
                raise DrillError("the standby did not stream within 30s:\n" + s.log_tail())
            time.sleep(0.1)

    def __exit__(self, *exc: Any) -> None:
        self.standby.stop()
        self.primary.stop()


# -- load -------------------------------------------------------------------------------


class Ledger:
    """Every answer the load got, and every fact a broker acknowledged."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answers: List[Tuple[float, str, str, int]] = []  # (time, broker, operation, status)
        self.sent: Dict[str, str] = {}  # acknowledged send: id -> recipient
        self.unsent: Set[str] = set()  # sends given up at the drill's bound
        self.grants: Dict[str, List[str]] = {}  # id -> lease ids seen
        self.completed: Set[str] = set()
        # acks retried after an unanswered try and answered 409 not_leased: the
        # message is done by the try whose answer was lost (checked at the end)
        self.completed_unanswered: Set[str] = set()
        self.polled: List[str] = []  # the v1.0 poller's ids, in page order
        self.problems: List[str] = []

    def answer(self, broker: str, operation: str, status: int) -> None:
        with self.lock:
            self.answers.append((time.monotonic(), broker, operation, status))


class Load:
    """Threads that drive both brokers through the switch (raw-socket signed clients)."""

    def __init__(self, targets: Sequence[loadgen.Target], prof: JsonDict, bound: float,
                 ledger: Ledger) -> None:
        self.targets = list(targets)
        self.names = [chr(ord("A") + i) for i in range(len(targets))]
        self.prof = prof
        self.bound = bound  # monotonic time after which nothing is retried
        self.ledger = ledger
        self.stop_sending = threading.Event()
        self.senders_done = threading.Event()
        self.stop_all = threading.Event()
        self.threads: List[threading.Thread] = []
        self.conns: List[loadgen.Conn] = []

    def call(self, i: int, conn: loadgen.Conn, operation: str, method: str, path: str,
             body: Any, agent: str, expected: Tuple[int, ...] = ()) -> Tuple[int, Any]:
        """One request; a broken connection is recorded as status 0 (no answer). An
        answer other than a success, ``503``, or one of ``expected`` is a problem."""
        try:
            status, doc = conn.call(method, path, body, agent)
        except (OSError, loadgen.HttpError):
            conn.close()
            status, doc = 0, None
        self.ledger.answer(self.names[i], operation, status)
        if status not in (0, 503, *expected) and not 200 <= status < 300:
            with self.ledger.lock:
                self.ledger.problems.append(f"{operation} through broker {self.names[i]} "
                                            f"answered {status}: {_code(doc)}")
        return status, doc

    def conn(self, i: int) -> loadgen.Conn:
        conn = loadgen.Conn(self.targets[i], timeout=LONG_POLL_SECONDS + 15)
        self.conns.append(conn)
        return conn

    def start(self) -> None:
        senders = [self._thread(self._sender, f"send{n}", ("work", "log"))
                   for n in range(self.prof["senders"])]
        senders.append(self._thread(self._sender, "slowsend", ("slow",), 0.3))
        self.threads += [self._thread(self._puller, n, "work", 10, 0)
                         for n in range(self.prof["pullers"])]
        self.threads.append(self._thread(self._puller, 0, "slow", 1, LONG_POLL_SECONDS))
        self.threads.append(self._thread(self._poller))
        self.threads += senders
        self.senders = senders

        def watch() -> None:
            for t in senders:
                t.join()
            self.senders_done.set()

        self.threads.append(self._thread(watch))

    def _thread(self, fn: Any, *args: Any) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        return t

    def finish(self, timeout: float) -> None:
        """Stop sending, let pullers and the poller drain, then stop everything."""
        self.stop_sending.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.stop_all.set()
        for c in self.conns:
            c.close()
        for t in self.threads:
            t.join(LONG_POLL_SECONDS + 5)

    def _sender(self, name: str, recipients: Sequence[str], pause: float = SEND_PAUSE) -> None:
        """Sends with ids of its own, each retried (same id) until acknowledged; one
        message through A, the next through B."""
        conns = [self.conn(i) for i in range(len(self.targets))]
        n = 0
        while not self.stop_sending.is_set() and not self.stop_all.is_set():
            message_id = f"{name}-{n:06d}"
            to = recipients[n % len(recipients)]
            i = n % len(conns)
            while True:
                status, doc = self.call(i, conns[i], "send", "POST", "/messages",
                                        {"id": message_id, "to": to, "body": {"n": n}}, name)
                if status in (200, 201):
                    with self.ledger.lock:
                        self.ledger.sent[message_id] = to
                    break
                if status not in (0, 503):  # a refusal (recorded as a problem): go on
                    break
                if time.monotonic() > self.bound or self.stop_all.is_set():
                    with self.ledger.lock:
                        self.ledger.unsent.add(message_id)
                    return
                time.sleep(RETRY_PAUSE)
            n += 1
            time.sleep(pause)

    def _puller(self, n: int, agent: str, limit: int, wait: int) -> None:
        """Leases (alternating brokers) and acks each message completed (its ack retried
        until answered); drains after the senders stop."""
        conns = [self.conn(i) for i in range(len(self.targets))]
        turn = n
        empty_after_senders = 0
        operation = "long-poll" if wait else "pull"
        while not self.stop_all.is_set():
            done_sending = self.senders_done.is_set()
            i = turn % len(conns)
            turn += 1
            # the drain after the senders stopped does not wait
            request = {"limit": limit, **({"waitSeconds": wait} if wait and not done_sending
                                          else {})}
            status, doc = self.call(i, conns[i], operation, "POST", "/v1/pull", request, agent)
            if status != 200:
                time.sleep(RETRY_PAUSE)
                continue
            messages = doc.get("messages") or []
            if not messages:
                if done_sending:
                    empty_after_senders += 1
                    if empty_after_senders >= 2:
                        return
                continue
            for m in messages:
                with self.ledger.lock:
                    self.ledger.grants.setdefault(m["id"], []).append(m["leaseId"])
                self._ack(conns, turn, m, agent)

    def _ack(self, conns: Sequence[loadgen.Conn], turn: int, m: JsonDict, agent: str) -> None:
        """Ack ``m`` completed; retried on ``503`` or no answer. A retried ack is
        ``409 not_leased`` when the unanswered one completed the message (a plain ack
        is not answered again as a duplicate; PROTOCOL.md): the end checks it."""
        ack = {"messageId": m["id"], "leaseId": m["leaseId"], "outcome": "completed"}
        unanswered = False
        while not self.stop_all.is_set():
            i = turn % len(conns)
            turn += 1
            status, doc = self.call(i, conns[i], "ack", "POST", "/v1/ack", ack, agent,
                                    expected=(409,) if unanswered else ())
            if status == 200 and isinstance(doc, dict) and doc.get("status") == "done":
                with self.ledger.lock:
                    self.ledger.completed.add(m["id"])
                return
            if unanswered and status == 409 and _code(doc) == "not_leased":
                with self.ledger.lock:
                    self.ledger.completed_unanswered.add(m["id"])
                return
            if unanswered and status == 409:  # another 409: a problem after all
                with self.ledger.lock:
                    self.ledger.problems.append(f"a retried ack answered 409: {_code(doc)}")
            if status not in (0, 503) or time.monotonic() > self.bound:
                return
            unanswered = True
            time.sleep(RETRY_PAUSE)

    def _poller(self) -> None:
        """The v1.0 poller of ``log``: pages by cursor, alternating brokers, until a
        page after the senders stopped is empty."""
        conns = [self.conn(i) for i in range(len(self.targets))]
        cursor: Optional[str] = None
        turn = 0
        while not self.stop_all.is_set():
            done_sending = self.senders_done.is_set()
            i = turn % len(conns)
            turn += 1
            path = "/messages?limit=20" + (f"&since={cursor}" if cursor else "")
            status, doc = self.call(i, conns[i], "v1.0 poll", "GET", path, None, "log")
            if status != 200:
                time.sleep(RETRY_PAUSE)
                continue
            messages = doc.get("messages") or []
            with self.ledger.lock:
                self.ledger.polled += [m["id"] for m in messages]
            if messages:
                cursor = messages[-1]["id"]
            elif done_sending:
                return
            else:
                time.sleep(0.05)


def _code(doc: Any) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return str(doc["error"].get("code"))
    return "-"


# -- the drill --------------------------------------------------------------------------


def register(target: loadgen.Target, agents: Sequence[str], timeout: float = 30.0) -> None:
    """Register ``agents``, retrying ``503 busy`` (a busy machine's slow database)."""
    deadline = time.monotonic() + timeout
    conn = loadgen.Conn(target, timeout=timeout)
    try:
        for agent in agents:
            while True:
                status, doc = conn.call("POST", "/register", {}, agent)
                if status == 200:
                    break
                if status != 503 or time.monotonic() > deadline:
                    raise DrillError(f"POST /register for {agent} answered {status}: "
                                     f"{_code(doc)}")
                time.sleep(RETRY_PAUSE)
    finally:
        conn.close()


def stored_facts(dsn: str, ledger: Ledger) -> JsonDict:
    """What the promoted database holds of what the brokers acknowledged."""
    asked = list(set(ledger.sent) | ledger.completed_unanswered)
    with _connect(dsn) as conn:
        rows = conn.execute("SELECT id, status FROM relay_messages WHERE id = ANY(%s)",
                            (asked,)).fetchall()
        log_ids = [r[0] for r in conn.execute(
            "SELECT id FROM relay_messages WHERE recipient = 'log' ORDER BY seq").fetchall()]
    status = dict(rows)
    lost_sends = sorted(set(ledger.sent) - set(status))
    undone = sorted(m for m in ledger.completed if status.get(m) != "done")
    # A retried ack refused as not leased while the message is not done: the
    # unanswered try did not complete it, and the lease was lost.
    lost_leases = sorted(m for m in ledger.completed_unanswered if status.get(m) != "done")
    twice = sorted(m for m, leases in ledger.grants.items() if len(leases) > 1)
    seen = Counter(ledger.polled)
    gap = [m for m in log_ids if m not in seen]
    repeats = sorted(m for m, c in seen.items() if c > 1)
    return {
        "lostSends": lost_sends,
        "lostCompletions": undone,
        "completedUnanswered": len(ledger.completed_unanswered),
        "lostLeases": lost_leases,
        "leasedTwice": twice,
        "pollerGap": gap,
        "pollerRepeats": repeats,
        "pollerOutOfOrder": not gap and not repeats and ledger.polled != log_ids,
        "leasedUnseen": sum(1 for m, to in ledger.sent.items()
                            if to != "log" and m not in ledger.grants),
    }


def recovery(ledger: Ledger, killed: float, names: Sequence[str]) -> Dict[str, Optional[float]]:
    """Seconds from the kill to each broker's first acknowledged send after the last
    request it failed (None: it never acknowledged one again)."""
    out: Dict[str, Optional[float]] = {}
    for name in names:
        mine = [(t, op, status) for t, broker, op, status in ledger.answers
                if broker == name and t > killed]
        failed = [t for t, _, status in mine if status in (0, 503)]
        after = max(failed, default=killed)
        served = [t for t, op, status in mine
                  if op == "send" and status in (200, 201) and t > after]
        out[name] = round(min(served) - killed, 2) if served else None
    return out


def run_drill(prof: JsonDict, bindir: str, python: str, synchronous: bool = True,
              stall: float = 0.0) -> JsonDict:
    """Set up, load, kill, promote, check; everything stopped and removed on return.

    ``synchronous=False`` runs the standby asynchronously; ``stall`` seconds before
    the kill the primary stops streaming its WAL (its WAL sender is stopped), as a
    lagging standby or a slow network would: what asynchronous replication loses."""
    started = time.monotonic()
    bound = started + prof["bound"]
    workdir = tempfile.mkdtemp(prefix="relay-failover-")
    os.chmod(workdir, 0o711)  # the clusters' user passes through to its own folder
    pgroot = os.path.join(workdir, "pg")
    os.mkdir(pgroot, 0o700)
    brokers: List[servers.Server] = []
    load: Optional[Load] = None
    version = os.path.basename(os.path.dirname(bindir))
    try:
        mode = "synchronous" if synchronous else "asynchronous"
        say(f"PostgreSQL {version}: a primary and its {mode} standby in {pgroot}")
        with Pair(bindir, pgroot, (servers.free_port(), servers.free_port()),
                  synchronous=synchronous) as pair:
            say(f"  primary on :{pair.primary.port}, standby on :{pair.standby.port}")
            secret = None
            # A has the key=value form of the multi-host DSN, B the URI form
            for dsn in (pair.multi_host_dsn, pair.multi_host_uri):
                extra = {"postgres": {"dsn": dsn, "poolSize": 4}, "leaseSeconds": 3600,
                         "maxDeliveries": 0, **({"secret": secret} if secret else {})}
                server = servers.broker(python, "postgres", workdir, extra=extra)
                server.start(timeout=60)
                secret = secret or server.secret
                brokers.append(server)
            targets = [loadgen.Target(s.url, secret or "") for s in brokers]
            say(f"  brokers A {brokers[0].url} and B {brokers[1].url}")
            register(targets[0], ["work", "slow", "log"])
            ledger = Ledger()
            load = Load(targets, prof, bound, ledger)
            load.start()
            time.sleep(prof["before"])
            stalled = pair.primary.wal_senders() if stall else []
            if stall:
                say(f"  the primary stops streaming its WAL for {stall:.1f}s")
                for pid in stalled:
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(stall)
            say("  SIGKILL of the primary's postmaster")
            killed = time.monotonic()
            pair.primary.kill()
            for pid in stalled:  # it dies with the primary, without sending more
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(prof["promoteAfter"])
            pair.standby.promote()
            promoted = time.monotonic() - killed
            say(f"  pg_ctl promote returned {promoted:.2f}s after the kill")
            time.sleep(prof["after"])
            load.finish(max(5.0, bound - time.monotonic()))
            alive = [t for t in load.threads if t.is_alive()]
            if alive:
                raise DrillError(f"{len(alive)} load threads still ran at the drill's bound")
            recovered = recovery(ledger, killed, load.names)
            facts = stored_facts(pair.standby.dsn, ledger)
            last = max((t for t, _, _, _ in ledger.answers), default=killed)
            end_of_switch = killed + max([r for r in recovered.values() if r is not None],
                                         default=last - killed)
            in_switch = [(op, status) for t, _, op, status in ledger.answers
                         if killed <= t <= end_of_switch]
            during = Counter(str(status) for _, status in in_switch)
            by_operation = Counter(f"{op} {status}" for op, status in in_switch)
            result = {
                "postgres": version, "replication": mode, "stallSeconds": stall,
                "seconds": round(time.monotonic() - started, 1),
                "promoteSeconds": round(promoted, 2), "recoverSeconds": recovered,
                "answersDuringSwitch": dict(sorted(during.items())),
                "answersDuringSwitchByOperation": dict(sorted(by_operation.items())),
                "answers": dict(sorted(Counter(f"{op} {status}" for _, _, op, status
                                               in ledger.answers).items())),
                "acknowledged": {"sends": len(ledger.sent), "completions": len(ledger.completed),
                                 "leases": len(ledger.grants), "polled": len(ledger.polled)},
                "gaveUp": len(ledger.unsent), "problems": ledger.problems[:20], **facts,
            }
            result["lost"] = (len(facts["lostSends"]) + len(facts["lostCompletions"])
                              + len(facts["lostLeases"])
                              + len(facts["leasedTwice"]) + len(facts["pollerGap"])
                              + len(facts["pollerRepeats"]) + int(facts["pollerOutOfOrder"]))
            result["ok"] = (result["lost"] == 0 and not ledger.problems
                            and not ledger.unsent
                            and all(r is not None for r in recovered.values()))
            return result
    finally:
        if load is not None:
            load.stop_all.set()
            load.stop_sending.set()
            for c in load.conns:
                c.close()
        for server in brokers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def render(r: JsonDict) -> str:
    rec = ", ".join(f"{b} {s:.2f} s" if s is not None else f"{b} never"
                    for b, s in r["recoverSeconds"].items())
    ack = r["acknowledged"]
    lines = [
        f"failover drill on PostgreSQL {r['postgres']}, {r['replication']} standby"
        + (f", WAL stalled {r['stallSeconds']:.1f} s before the kill" if r["stallSeconds"]
           else "") + f" ({r['seconds']} s in all)",
        f"  promote returned      {r['promoteSeconds']:.2f} s after the kill",
        f"  time to recover       {rec} (from the kill to the first send acknowledged "
        "after the last failed request)",
        "  answers in the switch " + (", ".join(f"{k}: {v}" for k, v in
                                               r["answersDuringSwitch"].items()) or "none")
        + "  (0 = no answer)",
        "    by operation        " + (", ".join(
            f"{k}: {v}" for k, v in r["answersDuringSwitchByOperation"].items()) or "none"),
        f"  acknowledged          {ack['sends']} sends, {ack['completions']} completions, "
        f"{ack['leases']} messages leased, {ack['polled']} polled by v1.0",
        f"  lost sends            {len(r['lostSends'])}",
        f"  lost completions      {len(r['lostCompletions'])}",
        f"  leased twice          {len(r['leasedTwice'])}",
        f"  leases lost           {len(r['lostLeases'])}",
        f"  v1.0 poller gap       {len(r['pollerGap'])} missed, "
        f"{len(r['pollerRepeats'])} repeated"
        + (", out of order" if r["pollerOutOfOrder"] else ""),
    ]
    if r["completedUnanswered"] and not r["lostLeases"]:
        lines.append(f"  (acks whose answer was lost, retried and answered 409 not_leased: "
                     f"{r['completedUnanswered']}, each message found done)")
    if r["leasedUnseen"]:
        lines.append(f"  (leased in an answer lost in the switch: {r['leasedUnseen']}, "
                     "delivered again when that lease ends)")
    if r["gaveUp"]:
        lines.append(f"  sends never acknowledged by the bound: {r['gaveUp']}")
    for problem in r["problems"]:
        lines.append(f"  unexpected: {problem}")
    lines.append("  lost: nothing" if r["ok"] else "  FAILED: see above")
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the drill as Ctrl-C does: through its clean-up."""
    before = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="the shorter drill CI runs")
    p.add_argument("--pg-bin", help="folder of initdb, pg_ctl and pg_basebackup "
                   f"(default: the newest {PG_ROOT}/<version>/bin, else PATH)")
    p.add_argument("--python", default=servers.default_python(),
                   help="the interpreter the brokers run on")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--asynchronous", action="store_true",
                   help="replicate asynchronously (with --stall: see what that loses)")
    p.add_argument("--stall", type=float, default=0.0, metavar="SECONDS",
                   help="stop the primary's WAL sender this long before the kill")
    args = p.parse_args(argv)
    if not 0 <= args.stall <= 30:
        p.error("--stall must be from 0 to 30 seconds")
    bindir = find_postgres_bin(args.pg_bin)
    if bindir is None:
        say(f"failover drill: no PostgreSQL server tools ({', '.join(PG_TOOLS)}) in "
            f"{args.pg_bin or PG_ROOT + '/<version>/bin or on PATH'}")
        return 2
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    try:
        with stop_signals_interrupt():
            result = run_drill(PROFILES["short" if args.short else "full"], bindir, python,
                               synchronous=not args.asynchronous, stall=args.stall)
    except KeyboardInterrupt:
        say("failover drill: interrupted; everything it started is stopped")
        return 130
    except (DrillError, servers.StartError) as e:
        say(f"failover drill: could not run: {e}")
        return 2
    except Exception:  # noqa: BLE001 (the drill did not run through: exit 2, as above)
        say("failover drill: could not run:\n" + traceback.format_exc())
        return 2
    print(json.dumps(result) if args.json else render(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
