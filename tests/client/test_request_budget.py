"""What the client's own loops cost the broker: requests per message, counted at an
in-memory broker with a Clock (not timed). Every local client shares the loopback
address's rate budget, so each request they save is one more message a minute."""

from __future__ import annotations

import collections
import io
from pathlib import Path
from typing import Any, Dict, List, Tuple

from twisted.internet import defer

from relay.agent.receipts import ReceiptStore
from relay.agent.runtime import AgentService
from relay.cli import run
from relay.cli.state import REMEMBER_SECONDS
from relay.client.client import RelayClient
from relay.testing import SECRET, make_api
from tests.support.client import Recording, relay_stub

URL = "http://127.0.0.1:19121"


class Fleet:
    """An in-memory broker, a recording HTTP client shared by every client, a worker
    agent runtime that answers every request, and ``relay`` runs in one home."""

    def __init__(self, home: Path) -> None:
        self.api, _, self.clock = make_api()
        self.stub = relay_stub(self.api.resource(), self.clock)
        self.http = Recording(self.stub)
        self.home = home
        worker = RelayClient(URL, "worker", SECRET, clock=self.clock, http=self.http)
        receipts = ReceiptStore.for_agent("worker", home, self.clock)
        self.worker = AgentService(worker, lambda message: "ok", clock=self.clock,
                                   receipts=receipts)
        self.worker.startService()
        self.settle()

    def settle(self, seconds: float = 0.0) -> None:
        for _ in range(8):
            self.stub.flush()
        if seconds:
            self.clock.advance(seconds)
            for _ in range(8):
                self.stub.flush()

    def relay(self, *argv: str) -> str:
        out, err = io.StringIO(), io.StringIO()
        d = defer.ensureDeferred(run(self.clock, ["--agent", "alpha", "--secret", SECRET,
                                                  *argv], env={}, home=self.home, out=out,
                                     err=err, http=self.http))
        results: List[Any] = []
        d.addBoth(results.append)
        for _ in range(50):
            self.settle(0.01)
            if results:
                break
        assert results == [0], (results, err.getvalue())
        return out.getvalue()

    def count(self, since: int) -> Dict[Tuple[str, str, str], int]:
        return dict(collections.Counter(
            (method, path.split("?")[0], (headers.get("X-Relay-Agent") or ["-"])[0])
            for method, path, headers, _ in self.http.requests[since:]))


def test_a_script_of_asks_costs_five_requests_an_answer(tmp_path: Path) -> None:
    """`relay ask` costed 7 requests an answer: a handshake and a registration each
    run, the send, the pull of the answer and its ack, the worker's pull and ack.
    Runs within REMEMBER_SECONDS of each other reuse the handshake and the
    registration: 5 an answer (the first run still makes both)."""
    fleet = Fleet(tmp_path)
    since = len(fleet.http.requests)
    for _ in range(10):
        assert fleet.relay("ask", "worker", "q") == "ok\n"
    counts = fleet.count(since)
    assert sum(counts.values()) == 52
    assert counts[("GET", "/", "-")] == 1
    assert counts[("POST", "/register", "alpha")] == 1
    for step in (("POST", "/messages", "alpha"), ("POST", "/v1/pull", "alpha"),
                 ("POST", "/v1/ack", "alpha"), ("POST", "/v1/pull", "worker"),
                 ("POST", "/v1/ack", "worker")):
        assert counts[step] == 10, step


def test_what_a_run_remembers_is_asked_again_after_a_minute(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.relay("ask", "worker", "q")
    for _ in range(int(REMEMBER_SECONDS) + 1):
        fleet.settle(1)
    since = len(fleet.http.requests)
    fleet.relay("ask", "worker", "q")
    counts = fleet.count(since)
    assert counts[("GET", "/", "-")] == 1
    assert counts[("POST", "/register", "alpha")] == 1


def test_watch_after_an_ask_makes_no_handshake_or_registration(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.relay("ask", "worker", "q")
    beta = RelayClient(URL, "beta", SECRET, clock=fleet.clock, http=fleet.http)
    beta.send("alpha", {"text": "a note"})
    fleet.settle()
    since = len(fleet.http.requests)
    out = fleet.relay("watch", "--count", "1")
    assert "a note" in out
    assert fleet.count(since) == {("GET", "/messages", "alpha"): 1}


def test_the_agent_runtime_costs_two_requests_a_request(tmp_path: Path) -> None:
    """A pull (held until the request arrives) and the ack that carries the reply."""
    fleet = Fleet(tmp_path)
    asker = RelayClient(URL, "alpha", SECRET, clock=fleet.clock, http=fleet.http)
    d = asker.register()
    fleet.settle()
    assert d.called
    since = len(fleet.http.requests)
    for _ in range(5):
        answer = asker.request("worker", {"text": "q"})
        fleet.settle(0.01)
        assert answer.called
    counts = fleet.count(since)
    assert counts[("POST", "/v1/pull", "worker")] == 5
    assert counts[("POST", "/v1/ack", "worker")] == 5
    assert sum(n for (_, _, agent), n in counts.items() if agent == "worker") == 10
