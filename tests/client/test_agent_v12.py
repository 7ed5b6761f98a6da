"""The agent runtime on a broker with the delivery extensions v1.2 (lease renewal,
the reply in the ack, the handler's outcomes, peer cards), and its fallbacks on a
v1.1 broker. In memory, driven by a Clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from twisted.internet import defer
from twisted.logger import capturedLogs, formatEvent

from relay.agent.receipts import ReceiptStore
from relay.agent.runtime import AgentService, Reject, Release, Retry, card_of
from relay.client.client import RelayClient
from relay.rules.delivery import notice_id
from relay.testing import START
from tests.support.client import Net, assert_v11_requests


class Fleet(Net):
    """An in-memory broker, the requester ``alpha`` and a runtime for ``worker``."""

    def __init__(self, tmp_path: Path, **broker: Any) -> None:
        super().__init__(**broker)
        self.home = tmp_path
        self.alpha = self.client("alpha")
        self.run(self.alpha.register())
        self.services: List[AgentService] = []

    def runtime(self, handler: Any, client: Optional[RelayClient] = None,
                **kwargs: Any) -> AgentService:
        client = client or self.client("worker")
        receipts = ReceiptStore.for_agent(client.agent, self.home, self.clock)
        service = AgentService(client, handler, clock=self.clock, receipts=receipts, **kwargs)
        service.startService()
        self.settle()
        self.services.append(service)
        return service

    def ask(self, text: str = "hi", **fields: Any) -> str:
        return self.run(self.alpha.send("worker", {"text": text}, kind="request", **fields))["id"]

    def entry(self, message_id: str) -> Dict[str, Any]:
        (entry,) = self.run(self.alpha.status([message_id]))["messages"]
        return entry

    def answers(self, request_id: str) -> List[Dict[str, Any]]:
        """The replies to ``request_id`` in alpha's inbox (v1.0 receipts left out)."""
        found = self.run(self.alpha.query(parent_id=request_id))["messages"]
        return [m for m in found if m["type"] == "message"]

    def calls(self, path: str) -> List[Dict[str, Any]]:
        return self.http.bodies(path)

    def stop(self) -> None:
        for service in self.services:
            d = service.stopService()
            self.settle()
            assert d.called


class Slow:
    """A handler whose calls finish when the test says so."""

    def __init__(self) -> None:
        self.pending: List[defer.Deferred] = []

    def __call__(self, message: Dict[str, Any]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        self.pending.append(d)
        return d


def upper(message: Dict[str, Any]) -> str:
    return message["body"]["text"].upper()


def test_a_handler_runs_for_hours_on_a_short_lease(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    slow = Slow()
    fleet.runtime(slow, lease_seconds=30)
    request = fleet.ask("think hard")
    fleet.settle()
    for _ in range(2 * 3600 // 10):
        fleet.settle(10)
    assert fleet.entry(request)["status"] == "leased"
    renewals = fleet.calls("/v1/lease/renew")
    assert len(renewals) == 2 * 3600 // 10
    assert renewals[0] == {"messageId": request, "leaseId": renewals[0]["leaseId"],
                           "leaseSeconds": 30}
    slow.pending[0].callback("done at last")
    fleet.settle()
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"], entry["deliveries"]) == ("done", 0, 1)
    fleet.settle(60)
    assert len(fleet.calls("/v1/lease/renew")) == len(renewals), "renewing stopped"
    fleet.stop()


def test_the_brokers_own_lease_is_renewed_every_third_of_it(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, leaseSeconds=90)
    slow = Slow()
    fleet.runtime(slow)
    request = fleet.ask()
    fleet.settle(29)
    assert fleet.calls("/v1/lease/renew") == []
    fleet.settle(1)
    (renewal,) = fleet.calls("/v1/lease/renew")
    assert "leaseSeconds" not in renewal, "the broker's default, as for the pull"
    for _ in range(30):
        fleet.settle(10)
    assert fleet.entry(request)["status"] == "leased"
    slow.pending[0].callback("ok")
    fleet.settle()
    assert fleet.entry(request)["status"] == "done"
    fleet.stop()


def test_a_lease_found_gone_is_not_acknowledged(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    slow = Slow()
    fleet.runtime(slow, lease_seconds=30)
    request = fleet.ask()
    fleet.settle()
    fleet.run(fleet.alpha.cancel(request, "no longer needed"))
    with capturedLogs() as events:
        fleet.settle(10)
        slow.pending[0].callback("too late")
        fleet.settle()
    text = "\n".join(formatEvent(e) for e in events)
    assert f"the lease of {request} is gone (not_leased)" in text
    assert f"{request} not acknowledged: its lease is gone" in text
    assert not any(ack["messageId"] == request for ack in fleet.calls("/v1/ack"))
    assert fleet.entry(request)["error"] == "no longer needed"
    assert fleet.answers(request) == []
    fleet.stop()


def test_the_reply_is_in_the_ack_and_no_receipt_is_kept(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    service = fleet.runtime(upper)
    request = fleet.ask("hello", ack=True, root_id="conversation")
    fleet.settle()
    (ack,) = [a for a in fleet.calls("/v1/ack") if a["messageId"] == request]
    assert ack["outcome"] == "completed" and ack["reply"]["body"] == {"text": "HELLO"}
    (reply,) = fleet.answers(request)
    assert (reply["id"], reply["body"], reply["kind"], reply["rootId"]) == (
        ack["reply"]["id"], {"text": "HELLO"}, "reply", "conversation")
    assert fleet.entry(request)["status"] == "done"
    assert len(service.receipts) == 0
    assert not [m for m in fleet.http.bodies("/messages") if m.get("from") == "worker"]
    receipts = [m for m in fleet.run(fleet.alpha.recv())["messages"] if m["type"] == "ack"]
    assert [m["replyTo"] for m in receipts] == [request], "the v1.0 receipt, once"
    fleet.stop()


def test_retry_after_from_the_handler(tmp_path: Path) -> None:
    calls: List[str] = []

    def busy(message: Dict[str, Any]) -> str:
        calls.append(message["id"])
        if len(calls) == 1:
            raise Retry("upstream busy", after=30)
        return "now"

    fleet = Fleet(tmp_path)
    fleet.runtime(busy)
    request = fleet.ask()
    fleet.settle()
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"], entry["error"]) == ("queued", 1, "upstream busy")
    assert entry["notBefore"] == int((START + 30) * 1000)
    fleet.settle(29)
    assert len(calls) == 1
    fleet.settle(1)
    assert len(calls) == 2 and fleet.entry(request)["status"] == "done"
    fleet.stop()


def test_release_gives_the_request_back_without_an_attempt(tmp_path: Path) -> None:
    calls: List[str] = []

    def picky(message: Dict[str, Any]) -> str:
        calls.append(message["id"])
        if len(calls) < 3:
            raise Release(after=10 if len(calls) == 2 else None)
        return "fine"

    fleet = Fleet(tmp_path)
    fleet.runtime(picky)
    request = fleet.ask()
    fleet.settle()
    assert len(calls) == 2, "released without a delay: leased again at once"
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"]) == ("queued", 0)
    fleet.settle(10)
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"], entry["deliveries"]) == ("done", 0, 3)
    fleet.stop()


def test_reject_fails_at_once_and_the_sender_gets_the_notice(tmp_path: Path) -> None:
    def poison(message: Dict[str, Any]) -> str:
        raise Reject("not a diff")

    fleet = Fleet(tmp_path)
    fleet.runtime(poison)
    request = fleet.ask()
    fleet.settle()
    entry = fleet.entry(request)
    assert (entry["status"], entry["error"], entry["attempts"]) == ("failed", "not a diff", 0)
    (notice,) = fleet.answers(request)
    assert notice["id"] == notice_id(request)
    assert notice["body"]["relayNotice"]["error"] == "not a diff"
    fleet.stop()


def test_a_failing_handler_is_retried_later_without_holding_the_lease(tmp_path: Path) -> None:
    calls: List[str] = []

    def flaky(message: Dict[str, Any]) -> str:
        calls.append(message["id"])
        if len(calls) == 1:
            raise RuntimeError("model timed out")
        return "ok"

    fleet = Fleet(tmp_path)
    fleet.runtime(flaky, retry_delay=5)
    request = fleet.ask()
    fleet.settle()
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"], entry["error"]) == (
        "queued", 1, "model timed out")
    assert entry["notBefore"] == int((START + 5) * 1000)
    fleet.settle(5)
    assert fleet.entry(request)["status"] == "done"
    fleet.stop()


def test_a_refused_reply_is_retried_after_the_delay(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, agents={"worker": {"allowed_targets": ["nobody"]}})
    fleet.runtime(upper, retry_delay=5)
    request = fleet.ask()
    fleet.settle()
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"], entry["error"]) == (
        "queued", 1, "reply not accepted: forbidden")
    assert fleet.answers(request) == []
    fleet.stop()


def test_shutdown_releases_what_is_still_running(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    slow = Slow()
    service = fleet.runtime(slow, lease_seconds=30, shutdown_grace=20)
    request = fleet.ask()
    fleet.settle()
    stopping = service.stopService()
    fleet.settle(20)
    assert stopping.called
    entry = fleet.entry(request)
    assert (entry["status"], entry["attempts"]) == ("queued", 0)
    renewals = len(fleet.calls("/v1/lease/renew"))
    slow.pending[0].callback("finished after all")
    fleet.settle(30)
    assert len(fleet.calls("/v1/lease/renew")) == renewals
    assert fleet.entry(request)["status"] == "queued", "the late result is not acknowledged"


def test_the_card_goes_with_every_heartbeat(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    card = card_of("reviews Python diffs", ["review", "python"])
    fleet.runtime(upper, card=card, heartbeat_interval=30)
    fleet.settle(30)
    beats = [b for b in fleet.calls("/register") if b["agent"] == "worker"]
    assert beats == [{"agent": "worker", "card": card}] * 2
    peers = {p["agent"]: p for p in fleet.run(fleet.alpha.peers())["peers"]}
    assert peers["worker"]["card"] == card
    fleet.stop()


def test_card_of() -> None:
    assert card_of(None, []) is None
    assert card_of("d", []) == {"description": "d"}
    assert card_of("", ["a", "b"]) == {"skills": ["a", "b"]}


# -- on a v1.1 broker ------------------------------------------------------------------------


@pytest.mark.parametrize("raised, outcome", [(Reject("bad"), "retry"), (Release(), None),
                                             (Retry("later", after=5), "retry")])
def test_on_a_v11_broker_the_outcomes_fall_back(tmp_path: Path, raised: Exception,
                                                outcome: Optional[str]) -> None:
    def handler(message: Dict[str, Any]) -> str:
        raise raised

    fleet = Fleet(tmp_path, v11=True, long_poll=True)
    fleet.runtime(handler, retry_delay=0, card={"skills": ["x"]})
    request = fleet.ask()
    fleet.settle()
    fleet.settle(5)
    acks = [a["outcome"] for a in fleet.calls("/v1/ack") if a["messageId"] == request]
    assert acks[:1] == ([outcome] if outcome else [])
    if outcome is None:
        assert fleet.entry(request)["status"] == "leased", "left to lapse"
    worker = [r for r in fleet.http.requests if r[2].get("X-Relay-Agent") == ["worker"]]
    assert_v11_requests(worker)
    fleet.stop()


def test_on_a_v11_broker_a_long_handler_is_not_renewed_and_receipts_are_used(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path, v11=True, long_poll=True)
    slow = Slow()
    service = fleet.runtime(slow, lease_seconds=30)
    request = fleet.ask()
    fleet.settle(20)
    slow.pending[0].callback("answer")
    fleet.settle()
    assert fleet.calls("/v1/lease/renew") == []
    assert fleet.entry(request)["status"] == "done"
    assert service.receipts.get(request)["reply"]["body"] == {"text": "answer"}
    worker = [r for r in fleet.http.requests if r[2].get("X-Relay-Agent") == ["worker"]]
    assert_v11_requests(worker)
    fleet.stop()


# -- twistd relay-agent ------------------------------------------------------------------------


def test_the_plugin_makes_a_card_from_description_and_skills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.agent import tap as agent_tap

    monkeypatch.setenv("HOME", str(tmp_path))
    options = agent_tap.Options()
    options.parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat", "--broker",
                          "http://127.0.0.1:1", "--description", "reviews diffs",
                          "--skill", "review", "--skill", "python"])
    service = agent_tap.makeService(options)
    assert service.card == {"description": "reviews diffs", "skills": ["review", "python"]}
    bare = agent_tap.Options()
    bare.parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat"])
    assert agent_tap.makeService(bare).card is None


@pytest.mark.parametrize("argv, message", [
    (["--description", "x" * 2001], "--description: at most 2000 characters"),
    (["--skill", ""], "--skill '': 1 to 100 characters"),
    (["--skill", "s" * 101], "1 to 100 characters"),
    ([arg for i in range(51) for arg in ("--skill", f"s{i}")], "--skill: at most 50 skills"),
])
def test_a_card_the_broker_would_refuse_stops_the_start(
    argv: List[str], message: str, capsys: pytest.CaptureFixture, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relay.agent import tap as agent_tap

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        agent_tap.Options().parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat",
                                          *argv])
    assert info.value.code == 78
    err = capsys.readouterr().err
    assert err.startswith("relay-agent: error: ") and message in err, err
