"""The ops listener in memory: /healthz, /metrics, the dashboard's JSON API and its
access rules, roles with their queues and leases (REACH §13); the counters behind them;
the HTTP metrics of the main listener, and requests counted by wire."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families
from treq.testing import StubTreq
from twisted.internet.defer import succeed
from twisted.web.client import readBody
from twisted.web.http_headers import Headers

from relay.broker.counters import FLOW_SAMPLES, MAX_FLOW_PAIRS, OTHER, Counters, Histogram
from relay.broker.loopback import MemoryAgent
from relay.broker.ops import metrics
from relay.broker.ops.web import OpsAPI
from relay.broker.site import RelaySite
from relay.store.interface import QueueDepth
from relay.store.memory import MemoryStore
from relay.testing import START, make_api
from tests.support import REPO

TOKEN = "ops-token-1"


class Ops:
    """A broker's API (signed client) and its ops app (plain client)."""

    def __init__(self, tokens=(), store=None, **broker: Any) -> None:
        self.api, self.client, self.clock = make_api(store=store, **broker)
        self.broker = self.api.broker
        self.ops = OpsAPI(self.broker, self.clock, tokens, lockout=self.api.auth.lockout)
        self.http = StubTreq(self.ops.resource())

    async def get(self, path: str, headers: Optional[Dict[str, str]] = None,
                  method: str = "GET", body: Optional[bytes] = None) -> Tuple[int, Any, Any]:
        response = await self.http.request(method, "http://127.0.0.1:19122" + path,
                                           headers=headers or {}, data=body)
        content = await response.content()
        kind = response.headers.getRawHeaders("content-type", [""])[0]
        parsed = json.loads(content) if kind.startswith("application/json") else content
        return response.code, parsed, response

    async def traffic(self) -> None:
        """beta and gamma register; alpha sends; beta completes one, retries one into failure."""
        c = self.client
        for agent in ("beta", "gamma"):
            assert (await c.post(agent, "/register", {}))[0] == 200
        for i in range(3):
            assert (await c.post("alpha", "/messages", {"id": f"m{i}", "to": "beta"}))[0] == 201
        assert (await c.post("alpha", "/messages", {"id": "m0", "to": "beta"}))[0] == 200
        assert (await c.post("alpha", "/messages", {"id": "g0", "to": "gamma"}))[0] == 201
        _, pulled, _ = await c.post("beta", "/v1/pull", {"limit": 2})
        first, second = pulled["messages"]
        await c.post("beta", "/v1/ack", {"messageId": first["id"], "leaseId": first["leaseId"],
                                         "outcome": "completed"})
        await c.post("beta", "/v1/ack", {"messageId": second["id"],
                                         "leaseId": second["leaseId"], "outcome": "retry",
                                         "error": "handler crashed"})
        await c.post("gamma", "/v1/pull", {"limit": 1, "leaseSeconds": 30})


def families(text: bytes) -> Dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text.decode("utf-8"))}


def value(family, **labels) -> float:
    for sample in family.samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()) and (
                sample.name == family.name or sample.name == family.name + "_total"):
            return sample.value
    raise AssertionError(f"no sample {labels} in {family.name}")


# -- /healthz ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_healthz_says_ok_and_the_details_only_with_the_token():
    from relay import __version__

    ops = Ops(tokens=(TOKEN,))
    code, body, _ = await ops.get("/healthz")
    assert (code, body) == (200, {"ok": True})
    code, body, _ = await ops.get("/healthz", {"Authorization": "Bearer wrong"})
    assert (code, body) == (200, {"ok": True})
    code, body, _ = await ops.get("/healthz", {"Authorization": f"Bearer {TOKEN}"})
    assert (code, body) == (200, {"ok": True, "storage": "memory", "version": __version__,
                                  "diskFreeBytes": None})


@pytest_twisted.ensureDeferred
async def test_without_a_token_healthz_gives_details_to_loopback_host_names_only():
    """A foreign ``Host`` on a loopback listener (DNS rebinding) learns the verdict only."""
    ops = Ops(store=NearlyFullDisk(), minFreeDiskMB=64)
    code, body, _ = await ops.get("/healthz", {"Host": "evil.example:19122"})
    assert code == 503 and set(body) == {"ok", "reason"} and body["ok"] is False
    code, body, _ = await ops.get("/healthz", {"Host": "localhost:19122"})
    assert code == 503 and body["diskFreeBytes"] == 10 * 2**20 and "version" in body


class NearlyFullDisk(MemoryStore):
    def space_left(self):
        return 10 * 2**20


class FailingCommits(MemoryStore):
    def health(self):
        return succeed("commits are failing: OSError: [Errno 28] No space left on device")


@pytest_twisted.ensureDeferred
async def test_healthz_is_503_with_the_reason_while_commits_fail():
    ops = Ops(store=FailingCommits())
    code, body, _ = await ops.get("/healthz")
    assert code == 503 and body["ok"] is False
    assert body["reason"] == "commits are failing: OSError: [Errno 28] No space left on device"
    assert "agents" not in body and "peers" not in body




@pytest_twisted.ensureDeferred
async def test_a_nearly_full_disk_is_reported_and_refuses_new_messages_only():
    ops = Ops(store=NearlyFullDisk(), minFreeDiskMB=64)
    assert (await ops.client.post("beta", "/register", {}))[0] == 200
    code, body, _ = await ops.get("/healthz")
    assert (code, body["ok"], body["diskFreeBytes"]) == (503, False, 10 * 2**20)
    assert "10 MB free, broker.minFreeDiskMB is 64" in body["reason"]
    code, refused, _ = await ops.client.post("alpha", "/messages", {"to": "beta"})
    assert (code, refused["error"]["code"]) == (503, "busy")
    assert (await ops.client.post("beta", "/v1/pull", {}))[0] == 200, "draining still works"
    _, overview, _ = await ops.get("/api/overview")
    # the dashboard and relay stats give /healthz's verdict
    assert (overview["broker"]["healthy"], overview["broker"]["health"]) == (False, body["reason"])
    assert overview["limits"]["diskFreeBytes"] == 10 * 2**20
    assert overview["limits"]["sendsRefused"] == body["reason"]
    assert overview["totals"]["sendsRefused"] == {"disk_full": 1}
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_disk_free_bytes"]) == 10 * 2**20
    assert value(f["relay_sends_refused"], reason="disk_full") == 1
    ops.broker.policy = dataclasses.replace(ops.broker.policy, min_free_disk_bytes=2**20)
    assert (await ops.get("/healthz"))[0] == 200
    assert (await ops.client.post("alpha", "/messages", {"to": "beta"}))[0] == 201


@pytest_twisted.ensureDeferred
async def test_quotas_and_refusals_are_in_the_overview_and_metrics():
    ops = Ops(inboxMaxMessages=2, maxAgents=5)
    assert (await ops.client.post("beta", "/register", {}))[0] == 200
    for i in range(3):
        await ops.client.post("alpha", "/messages", {"to": "beta", "id": f"q{i}"})
    _, overview, _ = await ops.get("/api/overview")
    assert overview["limits"] == {"inboxMaxMessages": 2, "inboxMaxBytes": 100 * 2**20,
                                  "maxAgents": 5, "agentsRegistered": 1,
                                  "minFreeDiskBytes": 64 * 2**20, "diskFreeBytes": None,
                                  "sendsRefused": None}
    (row,) = overview["agents"]
    assert (row["agent"], row["queued"], row["inboxFull"]) == ("beta", 2, True)
    assert overview["totals"]["sendsRefused"] == {"inbox_full": 1}
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_sends_refused"], reason="inbox_full") == 1
    assert value(f["relay_sends_refused"], reason="disk_full") == 0
    assert value(f["relay_agents_registered"]) == 1
    assert "relay_disk_free_bytes" not in f, "a store in memory has no disk"


@pytest_twisted.ensureDeferred
async def test_group_sends_are_counted_in_the_overview_and_metrics():
    ops = Ops(agents={"alpha": {}, "beta": {}, "gamma": {}},
              groups={"team": {"members": ["alpha", "beta", "gamma"]}})
    for i in range(2):
        code, answer, *_ = await ops.client.post("alpha", "/messages",
                                             {"to": "group:team", "id": f"g{i}"})
        assert code == 201 and len(answer["copies"]) == 2
    await ops.client.post("alpha", "/messages", {"to": "group:team", "id": "g0"})  # repeat
    _, overview, _ = await ops.get("/api/overview")
    assert overview["totals"]["groupSends"] == {"team": 2}
    assert overview["totals"]["sent"] == 4, "each copy is a message sent"
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_group_sends"], group="team") == 2
    assert value(f["relay_messages_sent"]) == 4


@pytest_twisted.ensureDeferred
async def test_healthz_is_503_while_the_broker_stops():
    ops = Ops()
    ops.ops.stopping = True
    code, body, _ = await ops.get("/healthz")
    assert (code, body["reason"]) == (503, "the broker is stopping")


# -- access --------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("path", ["/metrics", "/", "/api/overview", "/api/leases",
                                  "/api/dead-letters", "/static/dashboard.js", "/nope"])
async def test_every_route_but_healthz_needs_the_token(path):
    ops = Ops(tokens=("old", TOKEN))
    code, body, response = await ops.get(path)
    assert code == 401 and body["error"]["code"] == "unauthenticated"
    challenges = response.headers.getRawHeaders("www-authenticate")
    assert 'Basic realm="relay ops"' in challenges and 'Bearer realm="relay ops"' in challenges
    assert (await ops.get(path, {"Authorization": "Bearer wrong"}))[0] == 401
    expected = 404 if path == "/nope" else 200
    assert (await ops.get(path, {"Authorization": f"Bearer {TOKEN}"}))[0] == expected
    assert (await ops.get(path, {"Authorization": "Bearer old"}))[0] == expected
    basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    assert (await ops.get(path, {"Authorization": f"Basic {basic}"}))[0] == expected
    assert (await ops.get(path, {"Authorization": "Basic %%%"}))[0] == 401


@pytest_twisted.ensureDeferred
async def test_without_a_token_only_loopback_host_names_are_served():
    """A page that rebinds its own name to 127.0.0.1 cannot read the dashboard."""
    ops = Ops()
    for host in ("127.0.0.1:19122", "localhost", "[::1]:19122"):
        assert (await ops.get("/api/overview", {"Host": host}))[0] == 200
    code, body, _ = await ops.get("/api/overview", {"Host": "evil.example:19122"})
    assert code == 403 and body["error"]["code"] == "forbidden"
    assert (await ops.get("/healthz", {"Host": "lb.internal"}))[0] == 200


@pytest_twisted.ensureDeferred
async def test_the_main_listener_serves_none_of_this():
    ops = Ops()
    for path in ("/healthz", "/metrics", "/api/overview"):
        code, body, _ = await ops.client.get("alpha", path)
        assert (code, body["error"]["code"]) == (404, "not_found")


# -- /metrics ------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_metrics_report_the_traffic():
    ops = Ops(maxAttempts=0)
    await ops.traffic()
    ops.clock.advance(7)
    code, text, response = await ops.get("/metrics")
    assert code == 200
    assert response.headers.getRawHeaders("content-type") == [metrics.CONTENT_TYPE]
    f = families(text)
    assert value(f["relay_messages_sent"]) == 4
    assert value(f["relay_messages_delivered"]) == 3
    assert value(f["relay_messages_acked"], outcome="completed") == 1
    assert value(f["relay_messages_acked"], outcome="retry") == 1
    assert value(f["relay_messages_dead_lettered"], reason="attempts") == 1
    queue = f["relay_queue_messages"]
    assert value(queue, agent="beta", state="queued") == 1
    assert value(queue, agent="beta", state="failed") == 1
    assert value(queue, agent="beta", state="leased") == 0
    assert value(queue, agent="beta", state="delayed") == 0
    assert value(queue, agent="gamma", state="leased") == 1
    assert value(f["relay_queue_oldest_message_age_seconds"], agent="beta") == 7
    assert value(f["relay_agents_online"]) == 2
    assert value(f["relay_pull_waiting"]) == 0
    assert value(f["relay_build_info"], storage="memory") == 1
    for reason in ("bad_signature", "unknown_agent", "locked"):
        assert value(f["relay_auth_failures"], reason=reason) == 0
    ops.clock.advance(30)
    await ops.broker.sweep_leases()
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_lease_expirations"]) == 1
    assert value(f["relay_queue_messages"], agent="gamma", state="queued") == 1


# Every series the operations guide documents, with its labels (a histogram's
# ``le`` aside): the names dashboards and alert rules are written against.
DOCUMENTED_SERIES = {
    "relay_queue_messages": {"agent", "state"},
    "relay_queue_oldest_message_age_seconds": {"agent"},
    "relay_messages_sent": set(),
    "relay_messages_delivered": set(),
    "relay_messages_acked": {"outcome"},
    "relay_messages_dead_lettered": {"reason"},
    "relay_messages_expired": set(),
    "relay_lease_expirations": set(),
    "relay_pull_waiting": set(),
    "relay_agents_online": set(),
    "relay_http_requests": {"route", "code"},
    "relay_http_request_duration_seconds": {"route"},
    "relay_auth_failures": {"reason"},
    "relay_lockouts": set(),
    "relay_store_commit_seconds": set(),
    "relay_build_info": {"version", "storage"},
}


@pytest_twisted.ensureDeferred
async def test_every_documented_series_is_scraped_with_its_labels():
    ops = Ops(maxAttempts=0)
    await ops.traffic()
    ops.broker.counters.http_answered("send", 201, 0.01)
    ops.broker.counters.commit_seconds.observe(0.001)
    f = families((await ops.get("/metrics"))[1])
    for name, labels in DOCUMENTED_SERIES.items():
        assert name in f, name
        seen = {key for sample in f[name].samples for key in sample.labels} - {"le"}
        assert seen == labels, (name, seen)
    assert "relay_messages_sent_total" in {s.name for s in f["relay_messages_sent"].samples}
    guide = (REPO / "docs" / "OPERATIONS.md").read_text(
        encoding="utf-8")
    assert [name for name in DOCUMENTED_SERIES if name not in guide] == []


@pytest_twisted.ensureDeferred
async def test_expired_messages_are_counted():
    ops = Ops()
    c = ops.client
    assert (await c.post("beta", "/register", {}))[0] == 200
    assert (await c.post("alpha", "/messages", {"to": "beta", "ttlSeconds": 5}))[0] == 201
    assert (await c.post("alpha", "/messages", {"to": "beta"}))[0] == 201
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_messages_expired"]) == 0
    ops.clock.advance(6)
    assert await ops.broker.sweep_expired() == 1
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_messages_expired"]) == 1
    assert value(f["relay_queue_messages"], agent="beta", state="queued") == 1
    assert (await ops.get("/api/overview"))[1]["totals"]["expired"] == 1


@pytest_twisted.ensureDeferred
async def test_auth_failures_and_lockouts_are_counted():
    ops = Ops(security={"lockAfterFailures": 2})
    await ops.client.post("beta", "/register", {})
    for _ in range(2):
        await ops.client.post("beta", "/register", {}, secret="wrong")
    await ops.client.post("beta", "/register", {})
    await ops.client.get(None, "/peers")
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_auth_failures"], reason="bad_signature") == 2
    assert value(f["relay_auth_failures"], reason="locked") == 1
    assert value(f["relay_auth_failures"], reason="missing_headers") == 1
    assert value(f["relay_lockouts"]) == 1


@pytest_twisted.ensureDeferred
async def test_a_waiting_pull_is_a_gauge():
    from tests.support.api import Broker

    b = Broker()
    await b.register("beta")
    ops = OpsAPI(b.broker, b.clock)
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 5})
    scrape = metrics.Scrape(b.clock.seconds(), [], b.broker.waiters.count(), 0, "v", "memory")
    f = families(metrics.render(ops.counters, scrape))
    assert value(f["relay_pull_waiting"]) == 1
    b.advance(5)
    assert waiting.result.code == 200 and b.broker.waiters.count() == 0


@pytest_twisted.ensureDeferred
async def test_the_broker_answers_what_ops_asks_of_it():
    from tests.support.api import Broker

    b = Broker()
    await b.register("beta")
    assert (b.broker.storage(), b.broker.disk_free(), b.broker.waiting()) == ("memory", None, 0)
    b.store.space_left = lambda: 12345
    waiting = b.post("beta", "/v1/pull", {"waitSeconds": 5})
    assert (b.broker.disk_free(), b.broker.waiting()) == (12345, 1)
    b.advance(5)
    assert waiting.result.code == 200 and b.broker.waiting() == 0


def test_ops_asks_the_broker_and_the_broker_imports_nothing_of_ops():
    """Layers point down: relay/broker/ops reads the broker's answers, never its store or
    waiters, and the broker (with its counters) knows nothing of relay/ops."""
    import re

    import relay

    root = Path(relay.__file__).parent
    reaching = [f"{path.name}: {m.group(0)}" for path in sorted((root / "broker/ops").glob("*.py"))
                for m in re.finditer(r"\.(store|waiters)\b(?!\.interface)",
                                     path.read_text(encoding="utf-8"))]
    assert reaching == []
    for name in ("broker/operations.py", "broker/counters.py"):
        text = (root / name).read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import) relay\.broker\.ops", text, re.MULTILINE), name


def test_per_agent_series_are_capped_and_the_rest_summed():
    depths = [QueueDepth(f"a{i:04d}", queued=i, oldest_queued=START - i) for i in range(1, 1006)]
    capped = metrics.capped_depths(depths)
    assert len(capped) == 1001
    assert capped[0].agent == "a1005" and capped[999].agent == "a0006"
    other = capped[-1]
    assert other.agent == OTHER and other.queued == 1 + 2 + 3 + 4 + 5
    assert other.oldest_queued == START - 5
    scrape = metrics.Scrape(START, depths, 0, 0, "v", "memory")
    f = families(metrics.render(Counters(), scrape))
    agents = {s.labels["agent"] for s in f["relay_queue_messages"].samples}
    assert len(agents) == 1001 and OTHER in agents


# -- the HTTP metrics of the main listener ----------------------------------------------


@pytest_twisted.ensureDeferred
async def test_http_requests_are_counted_by_route_code_and_duration():
    ops = Ops()
    counters = ops.broker.counters
    agent = MemoryAgent(RelaySite(ops.api.resource(), counters=counters, reactor=ops.clock),
                        ops.clock)
    for path in (b"/", b"/peers", b"/nowhere"):
        response = await agent.request(b"GET", b"http://127.0.0.1:19121" + path, Headers())
        await readBody(response)
    assert counters.http == {"info": {200: 1}, "peers": {401: 1}, "unmatched": {401: 1}}
    assert counters.http_seconds["peers"].count == 1


# -- counters --------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_upper_bounds():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.total == pytest.approx(3.65) and h.count == 4


def test_flow_is_bounded_per_interval_and_kept_for_the_window():
    c = Counters()
    c.sample(100.0)
    for i in range(MAX_FLOW_PAIRS + 10):
        c.message_stored("alpha", f"r{i}")
    c.message_stored("alpha", "r0")
    assert sum(len(row) for row in c.flow.values()) == MAX_FLOW_PAIRS + 1
    assert c.flow[OTHER][OTHER] == 10
    c.sample(110.0)
    c.message_stored("alpha", "r0")
    flow = c.recent_flow(limit=2)
    assert flow["since"] is None  # the window still reaches back to the start
    assert flow["pairs"][0] == {"from": OTHER, "to": OTHER, "count": 10}
    assert flow["pairs"][1] == {"from": "alpha", "to": "r0", "count": 3}
    for i in range(1, FLOW_SAMPLES + 1):
        c.sample(110.0 + 10 * i)
    # the window holds FLOW_SAMPLES intervals: the one from 100 to 110 has left it
    assert c.recent_flow() == {"since": 110.0,
                               "pairs": [{"from": "alpha", "to": "r0", "count": 1}]}
    c.sample(1000.0)
    assert c.recent_flow() == {"since": 120.0, "pairs": []}


def test_throughput_is_a_rate_per_interval():
    c = Counters()
    c.sample(0.0)
    for _ in range(20):
        c.message_stored("a", "b")
    c.messages_delivered(10)
    c.http_answered("send", 201, 0.01)
    c.http_answered("send", 503, 0.01)
    c.sample(10.0)
    (point,) = c.throughput()
    assert point["at"] == 10.0 and point["sent"] == 2.0 and point["delivered"] == 1.0
    assert point["requests"] == 0.2 and point["errors"] == 0.1


# -- the JSON API ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_overview_cards_only_when_asked_for_and_at_most_the_budget(monkeypatch):
    from relay.wire import protocol

    ops = Ops()
    card = {"description": "d" * 2000, "skills": ["s" * 100] * 50}
    for i in range(3):
        assert (await ops.client.post(f"a{i}", "/register", {"card": card}))[0] == 200
    _, plain, _ = await ops.get("/api/overview")
    assert all("card" not in row for row in plain["agents"])
    _, full, _ = await ops.get("/api/overview?cards=true")
    assert [row["card"] for row in full["agents"]] == [card] * 3
    assert full["cardsOmitted"] == 0
    monkeypatch.setattr(protocol, "PEERS_BUDGET_BYTES", 2 * len(protocol.compact_json(card)))
    _, bounded, _ = await ops.get("/api/overview?cards=true")
    assert [row["card"] for row in bounded["agents"]] == [card, card, None]
    assert bounded["cardsOmitted"] == 1
    code, refused, _ = await ops.get("/api/overview?cards=yes")
    assert (code, refused["error"]["code"]) == (400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_overview_lists_agents_queues_totals_and_flow():
    ops = Ops(maxAttempts=0)
    await ops.traffic()
    ops.clock.advance(3)
    code, overview, _ = await ops.get("/api/overview")
    assert code == 200
    rows = {row["agent"]: row for row in overview["agents"]}
    assert set(rows) == {"beta", "gamma"}
    assert rows["beta"] == {"agent": "beta", "registered": True, "online": True,
                            "lastSeen": int(START), "queued": 1, "leased": 0,
                            "delayed": 0, "failed": 1, "oldestAgeSeconds": 3.0,
                            "inboxFull": False, "selfcheck": False, "streams": 0,
                            "webhook": None}
    assert rows["gamma"]["leased"] == 1
    assert "cardsOmitted" not in overview, "cards only when asked for"
    totals = overview["totals"]
    assert (totals["sent"], totals["delivered"], totals["failed"]) == (4, 3, 1)
    assert overview["broker"]["healthy"] is True and overview["broker"]["health"] is None
    assert {"from": "alpha", "to": "beta", "count": 3} in overview["flow"]["pairs"]


class _Request:
    """Just enough of a request for an event stream held in memory."""

    def __init__(self) -> None:
        from twisted.web.http_headers import Headers

        self.responseHeaders = Headers()
        self.written: List[bytes] = []

    def setResponseCode(self, code: int) -> None:
        self.code = code

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None


@pytest_twisted.ensureDeferred
async def test_overview_and_metrics_show_streams_and_webhook_health_never_the_url():
    ops = Ops()
    c = ops.client
    assert (await c.post("beta", "/register",
                         {"webhook": {"url": "http://127.0.0.1:9/secret-path"}}))[0] == 200
    ops.broker.streams.open("beta", _Request(), None)
    ops.broker.streams.open("gamma", _Request(), None)
    code, overview, _ = await ops.get("/api/overview")
    rows = {row["agent"]: row for row in overview["agents"]}
    assert rows["beta"]["streams"] == 1 and rows["gamma"]["streams"] == 1
    assert rows["beta"]["webhook"] == {"lastDelivered": None, "failingSince": None,
                                       "disabled": False, "failures": 0}
    assert rows["gamma"]["webhook"] is None
    assert overview["totals"]["eventStreams"] == 2
    assert "secret-path" not in json.dumps(overview) and "127.0.0.1:9" not in json.dumps(
        overview)
    code, text, _ = await ops.get("/metrics")
    assert b"relay_event_streams 2.0" in text and b"relay_webhook_attempts_total 0.0" in text
    assert b"secret-path" not in text
    ops.broker.stop()


@pytest_twisted.ensureDeferred
async def test_dead_letters_and_leases_never_carry_a_body():
    ops = Ops(maxAttempts=0)
    await ops.traffic()
    code, dead, _ = await ops.get("/api/dead-letters")
    assert code == 200
    (letter,) = dead["deadLetters"]
    assert letter["id"] == "m1" and letter["error"] == "handler crashed"
    assert (letter["from"], letter["to"], letter["attempts"]) == ("alpha", "beta", 1)
    assert "body" not in letter
    code, leases, _ = await ops.get("/api/leases?limit=5")
    (lease,) = leases["leases"]
    assert lease["id"] == "g0" and lease["secondsLeft"] == 30 and "body" not in lease
    assert "leaseId" not in lease


@pytest_twisted.ensureDeferred
async def test_the_page_and_its_files_are_served_with_a_strict_policy():
    ops = Ops()
    code, page, response = await ops.get("/")
    assert code == 200 and b"/static/dashboard.js" in page
    policy = response.headers.getRawHeaders("content-security-policy")[0]
    assert "default-src 'self'" in policy
    code, script, response = await ops.get("/static/dashboard.js")
    assert code == 200 and b"/api/overview" in script
    assert b"http://" not in script.replace(b"http://www.w3.org/2000/svg", b"")
    assert (await ops.get("/static/../web.py"))[0] == 404
    code, body, _ = await ops.get("/static/other.js")
    assert (code, body["error"]["code"]) == (404, "not_found")


# -- operator actions ----------------------------------------------------------------


JSON = {"Content-Type": "application/json"}


@pytest_twisted.ensureDeferred
async def test_the_operator_requeues_a_dead_letter_and_cancels_a_lease():
    ops = Ops(maxAttempts=0)
    await ops.traffic()
    code, result, _ = await ops.get("/api/requeue", JSON, "POST", b'{"messageId": "m1"}')
    assert (code, result) == (200, {"ok": True, "status": "queued", "attempts": 0})
    assert (await ops.get("/api/dead-letters"))[1]["deadLetters"] == []
    code, result, _ = await ops.get("/api/cancel", JSON, "POST", b'{"messageId": "g0"}')
    assert code == 200 and result["status"] == "failed"
    (letter,) = (await ops.get("/api/dead-letters"))[1]["deadLetters"]
    assert (letter["id"], letter["reason"], letter["error"]) == (
        "g0", "cancelled", "cancelled by the operator")
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_messages_dead_lettered"], reason="cancelled") == 1
    assert value(f["relay_messages_dead_lettered"], reason="attempts") == 1
    code, body, _ = await ops.get("/api/requeue", JSON, "POST", b'{"messageId": "m2"}')
    assert (code, body["error"]["code"]) == (409, "wrong_state")
    code, body, _ = await ops.get("/api/requeue", JSON, "POST", b'{"messageId": "nope"}')
    assert (code, body["error"]["code"]) == (404, "no_such_message")
    code, body, _ = await ops.get("/api/requeue", JSON, "POST", b"{}")
    assert (code, body["error"]["code"]) == (400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_actions_are_json_posts_from_the_listeners_own_origin():
    ops = Ops(tokens=(TOKEN,), maxAttempts=0)
    await ops.traffic()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = b'{"messageId": "m1"}'
    assert (await ops.get("/api/requeue", JSON, "POST", body))[0] == 401
    form = dict(auth, **{"Content-Type": "text/plain"})
    assert (await ops.get("/api/requeue", form, "POST", body))[0] == 400
    foreign = dict(auth, Origin="http://evil.example", **JSON)
    assert (await ops.get("/api/requeue", foreign, "POST", body))[0] == 403
    own = dict(auth, Origin="http://127.0.0.1:19122", Host="127.0.0.1:19122", **JSON)
    assert (await ops.get("/api/requeue", own, "POST", body))[0] == 200
    assert (await ops.get("/api/requeue", dict(auth), "GET"))[0] == 404


# -- authentication locks ---------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_an_operator_lists_and_clears_an_agents_locks():
    ops = Ops(tokens=(TOKEN,))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    c = ops.client
    for _ in range(5):
        assert (await c.get("alpha", "/peers", secret="wrong"))[0] == 401
    code, body, _ = await c.get("alpha", "/peers")
    assert (code, body["error"]["code"]) == (403, "locked")
    assert "`relay unlock alpha`" in body["error"]["message"]
    ops.clock.advance(60)
    code, listed, _ = await ops.get("/api/locks", auth)
    assert (code, listed) == (200, {"locks": [{"agent": "alpha", "address": "127.0.0.1",
                                               "secondsLeft": 240.0}]})
    unlock = dict(auth, **JSON)
    assert (await ops.get("/api/unlock", JSON, "POST", b'{"agent": "alpha"}'))[0] == 401
    code, answer, _ = await ops.get("/api/unlock", unlock, "POST", b'{"agent": "alpha"}')
    assert (code, answer) == (200, {"agent": "alpha", "unlocked": 1})
    assert (await c.get("alpha", "/peers"))[0] == 200
    assert (await ops.get("/api/locks", auth))[1] == {"locks": []}
    code, answer, _ = await ops.get("/api/unlock", unlock, "POST", b'{"agent": "alpha"}')
    assert (code, answer) == (200, {"agent": "alpha", "unlocked": 0}), "nothing to clear"
    for bad in (b'{"agent": "no such/name"}', b'{}', b'{"agent": 5}'):
        code, answer, _ = await ops.get("/api/unlock", unlock, "POST", bad)
        assert (code, answer["error"]["code"]) == (400, "bad_request")
    foreign = dict(unlock, Origin="http://evil.example")
    assert (await ops.get("/api/unlock", foreign, "POST", b'{"agent": "alpha"}'))[0] == 403


@pytest_twisted.ensureDeferred
async def test_refusals_lockouts_and_auth_failures_are_in_the_overview():
    """A 429 used to show only as a Prometheus counter: the overview counts them
    (from the answers the listener's site counts, as /metrics does)."""
    ops = Ops(security={"lockAfterFailures": 2})
    for _ in range(2):
        await ops.client.post("beta", "/register", {}, secret="wrong")
    for route, code in (("peers", 429), ("pull", 429), ("pull", 200), ("send", 503)):
        ops.broker.counters.http_answered(route, code, 0.001)
    _, overview, _ = await ops.get("/api/overview")
    totals = overview["totals"]
    assert totals["rateLimited"] == 2
    assert totals["lockouts"] == 1
    assert totals["authFailures"] == {"bad_signature": 2}


@pytest_twisted.ensureDeferred
async def test_online_agents_come_first_and_throwaway_agents_are_marked():
    ops = Ops()
    c = ops.client
    for agent in ("zeta", "selfcheck-0123abcd-a", "alpha"):
        await c.post(agent, "/register", {})
    ops.clock.advance(100)  # all three go offline
    await c.post("zeta", "/register", {})
    await c.post("zeta", "/messages", {"id": "m1", "to": "alpha"})
    _, overview, _ = await ops.get("/api/overview")
    order = [(row["agent"], row["online"], row["selfcheck"]) for row in overview["agents"]]
    assert order == [("zeta", True, False), ("alpha", False, False),
                     ("selfcheck-0123abcd-a", False, True)]


TEAM = {"alpha": {}, "dan": {}, "erin": {}}


ROLES = {"triage": {"members": ["dan", "erin"], "selfJoin": True},
         "audit": {"members": ["erin"]}}


async def busy_roles() -> Ops:
    ops = Ops(agents=TEAM, roles=ROLES)
    c = ops.client
    for n in range(4):
        assert (await c.post("alpha", "/messages", {"to": "role:triage", "id": f"t{n}"}))[0] == 201
    assert (await c.post("dan", "/v1/pull", {"limit": 2}))[0] == 200
    assert (await c.post("erin", "/v1/pull", {"limit": 1, "role": "triage"}))[0] == 200
    return ops


# -- roles (REACH §13) ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_overview_lists_each_role_with_its_queue_and_leases_by_member():
    ops = await busy_roles()
    code, overview, _ = await ops.get("/api/overview")
    assert code == 200
    assert overview["roles"] == [
        {"name": "audit", "members": ["erin"], "selfJoin": False, "queued": 0, "leased": 0,
         "delayed": 0, "failed": 0, "leasesBy": {}},
        {"name": "triage", "members": ["dan", "erin"], "selfJoin": True, "queued": 1,
         "leased": 3, "delayed": 0, "failed": 0, "leasesBy": {"dan": 2, "erin": 1}},
    ]
    # the role's queue is a row of its own among the queues
    (row,) = [a for a in overview["agents"] if a["agent"] == "role:triage"]
    assert (row["queued"], row["leased"]) == (1, 3)


@pytest_twisted.ensureDeferred
async def test_metrics_count_role_queues_and_leases_by_member():
    ops = await busy_roles()
    f = families((await ops.get("/metrics"))[1])
    assert value(f["relay_queue_messages"], agent="role:triage", state="queued") == 1
    assert value(f["relay_role_leases"], role="triage", member="dan") == 2
    assert value(f["relay_role_leases"], role="triage", member="erin") == 1


@pytest_twisted.ensureDeferred
async def test_the_dashboard_has_a_roles_table():
    ops = Ops()
    page = (await ops.get("/"))[1]
    assert b'id="roles"' in page
    code, overview, _ = await ops.get("/api/overview")
    assert overview["roles"] == []


# -- requests by wire ----------------------------------------------------------------------


def test_requests_are_counted_per_wire():
    from relay.broker.counters import Counters

    counters = Counters()
    for route, code in (("v2_pull", 200), ("v2_pull", 401), ("v2_send", 200), ("pull", 200),
                        ("unmatched", 404)):
        counters.http_answered(route, code, 0.001)
    assert counters.requests_by_wire() == {"seed": 2, "v2": 3}


@pytest.mark.parametrize("raw", [
    b"GET /api/%ff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /healthz%ed%a0%80 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: \xff\xfe\r\n\r\n",
])
def test_a_url_or_host_that_is_not_utf8_is_the_uniform_400(raw):
    """As on the main listener: not Klein's plain-text 400 and logged traceback."""
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    ops = Ops()
    site = RelaySite(ops.ops.resource(), reactor=ops.clock)
    peer = IPv4Address("TCP", "127.0.0.1", 40000)
    channel = site.buildProtocol(peer)
    transport = StringTransport(peerAddress=peer,
                                hostAddress=IPv4Address("TCP", "127.0.0.1", 19122))
    channel.makeConnection(transport)
    channel.dataReceived(raw)
    ops.clock.advance(0)
    head, _, body = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), transport.value()
    assert json.loads(body) == {"error": {"code": "bad_request",
                                          "message": "the request URL is not valid UTF-8"}}
