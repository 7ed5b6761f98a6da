"""The agent runtime against the in-memory broker, driven by a Clock: requests
answered, handler failures and retries, receipts replayed, concurrency and shutdown; on
a broker with the extensions v1.2, long handlers on short leases, the reply in the ack,
the handler's outcomes and its card, and their fallbacks on a v1.1 broker; the
``--exec`` handler with real processes. The receipt store itself is
tests/client/test_receipts.py, ``twistd relay-agent`` tests/client/test_agent_plugin.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import pytest_twisted
from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure

from relay.agent.exec_handler import (
    ExecFailed,
    ExecHandler,
    exec_input,
)
from relay.agent.receipts import ReceiptStore, legacy_receipts_path
from relay.agent.runtime import (
    AgentService,
    Reject,
    Release,
    Retry,
    card_of,
    reply_body,
)
from relay.client.client import RelayClient
from relay.rules.delivery import notice_id
from relay.testing import SECRET as TEST_SECRET
from relay.testing import START
from relay.wire.errors import RelayError
from tests.support.client import Net, SeenAsV11, assert_v11_requests, relay_stub


def test_reply_body_shapes() -> None:
    assert reply_body({"a": 1}) == {"a": 1}
    assert reply_body("hi") == {"text": "hi"}
    assert reply_body(b"hi") == {"text": "hi"}
    assert reply_body(None) == {}
    assert reply_body([1, 2]) == {"result": [1, 2]}


# -- a broker, two clients and a runtime ------------------------------------------


class World:
    """An in-memory broker, the requester ``alpha`` and helpers to run ``worker``.

    With ``v11`` every client sees a v1.1 broker with long polling
    (:class:`SeenAsV11`): the runtime then falls back to receipts, held leases and
    the v1.1 outcomes.
    """

    def __init__(self, tmp_path: Path, v11: bool = False, **broker: Any) -> None:
        from relay.testing import make_api

        self.api, _, self.clock = make_api(**broker)
        resource = self.api.resource()
        self.stub = relay_stub(SeenAsV11(resource, long_poll=True) if v11 else resource, self.clock)
        self.home = tmp_path
        self.alpha = self.client("alpha")

    def client(self, agent: str) -> RelayClient:
        return RelayClient("http://127.0.0.1:19121", agent, TEST_SECRET, clock=self.clock,
                           http=self.stub)

    def runtime(
        self, handler: Any, client: Optional[RelayClient] = None, **kwargs: Any
    ) -> AgentService:
        client = client or self.client("worker")
        receipts = ReceiptStore.for_agent(client.agent, self.home, self.clock)
        return AgentService(client, handler, clock=self.clock, receipts=receipts, **kwargs)

    def settle(self, seconds: float = 0.0) -> None:
        """Let in-memory HTTP exchanges finish, then move the clock on."""
        for _ in range(5):
            self.stub.flush()
        if seconds:
            self.clock.advance(seconds)
            for _ in range(5):
                self.stub.flush()

    def run(self, coroutine: Any) -> Any:
        """The result of a client call that completes without the clock moving."""
        d = defer.ensureDeferred(coroutine)
        self.settle()
        results: List[Any] = []
        d.addBoth(results.append)
        assert results, "client call did not complete"
        if isinstance(results[0], Failure):
            results[0].raiseException()
        return results[0]

    def request(self, text: str, **fields: Any) -> str:
        self.run(self.alpha.register())
        return self.run(self.alpha.send("worker", {"text": text}, kind="request", **fields))["id"]

    def status(self, message_id: str) -> Tuple[str, int]:
        (entry,) = self.run(self.alpha.status([message_id]))["messages"]
        return entry["status"], entry["attempts"]

    def replies(self) -> List[Dict[str, Any]]:
        answer = self.run(self.alpha.query(kind="reply"))
        return answer["messages"]


class Recorder:
    """A handler that records calls and answers with upper-case text."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: List[str] = []
        self.fail = fail

    def __call__(self, message: Dict[str, Any]) -> Any:
        self.calls.append(message["id"])
        if self.fail:
            raise RuntimeError("handler is broken")
        return message["body"]["text"].upper()


def start(world: World, service: AgentService) -> None:
    service.startService()
    world.settle()


def stop(world: World, service: AgentService) -> None:
    d = service.stopService()
    world.settle()
    assert d.called


def test_request_reply_done(tmp_path: Path) -> None:
    world = World(tmp_path)
    handler = Recorder()
    service = world.runtime(handler)
    start(world, service)
    peers = world.run(world.alpha.peers())["peers"]
    assert [p["agent"] for p in peers] == ["worker"]

    request = world.request("hello", root_id="root-1")
    world.settle()
    assert handler.calls == [request]
    assert world.status(request)[0] == "done"
    (reply,) = world.replies()
    assert reply["body"] == {"text": "HELLO"}
    assert (reply["from"], reply["to"], reply["kind"]) == ("worker", "alpha", "reply")
    assert (reply["replyTo"], reply["parentId"], reply["rootId"]) == (request, request, "root-1")
    stop(world, service)


def test_root_id_defaults_to_the_request_id(tmp_path: Path) -> None:
    world = World(tmp_path)
    service = world.runtime(Recorder())
    start(world, service)
    request = world.request("x")
    world.settle()
    (reply,) = world.replies()
    assert reply["rootId"] == request
    stop(world, service)


def test_handler_failure_retries_then_fails_after_max_attempts(tmp_path: Path) -> None:
    """On a v1.1 broker the lease is held for the retry delay, then acked ``retry``."""
    world = World(tmp_path, v11=True, maxAttempts=3)
    handler = Recorder(fail=True)
    service = world.runtime(handler, retry_delay=5.0)
    start(world, service)
    request = world.request("boom")
    world.settle()
    assert handler.calls == [request]
    assert world.status(request) == ("leased", 0)  # held for the retry delay
    world.settle(4.9)
    assert world.status(request) == ("leased", 0)
    world.settle(0.1)
    assert len(handler.calls) == 2  # handed back with retry, leased again at once
    assert world.status(request) == ("leased", 1)
    for _ in range(4):
        world.settle(5)
    # spec 5.1: retry gives attempts+1 and "> maxAttempts -> failed"
    assert handler.calls == [request] * 4
    assert world.status(request) == ("failed", 4)
    # no answer: only the broker's failure notice (EXTENSIONS.md §4)
    (notice,) = world.replies()
    assert notice["body"]["relayNotice"]["event"] == "failed"
    assert notice["parentId"] == request
    stop(world, service)


class FailsWithItsOwnWords:
    def __call__(self, message: Dict[str, Any]) -> Any:
        raise ValueError("the model refused:\nquota exceeded")


@pytest.mark.parametrize("debug", [False, True])
def test_a_handler_failure_is_logged_with_its_message_not_the_body(
    tmp_path: Path, debug: bool
) -> None:
    from twisted.logger import capturedLogs, formatEvent

    world = World(tmp_path)
    service = world.runtime(FailsWithItsOwnWords(), retry_delay=0, debug=debug)
    with capturedLogs() as events:
        start(world, service)
        request = world.request("secret-body-marker")
        world.settle()
        stop(world, service)
    text = "\n".join(formatEvent(e) + str(e.get("log_failure", "")) for e in events)
    assert (
        f"agent worker: handler failed for {request}: ValueError: the model refused: quota "
        "exceeded; asking for a retry"
    ) in text
    assert "secret-body-marker" not in text
    tracebacks = [e for e in events if e.get("log_failure") is not None]
    assert bool(tracebacks) == debug
    assert world.run(world.alpha.status([request]))["messages"][0]["error"] == (
        "the model refused:\nquota exceeded"
    )


def test_a_refused_reply_holds_the_lease_before_the_retry(tmp_path: Path) -> None:
    """A reply the broker refuses (here the ACL; often a requester that has not
    registered yet) does not burn the request's attempts at once (v1.1: a held lease)."""
    world = World(tmp_path, v11=True, agents={"worker": {"allowed_targets": ["nobody"]}})
    service = world.runtime(Recorder(), retry_delay=5.0)
    start(world, service)
    request = world.request("hello")
    world.settle()
    assert world.status(request) == ("leased", 0)
    world.settle(5)
    assert world.status(request) == ("leased", 1)  # retried once, leased again
    stopped = service.stopService()
    world.settle()  # the runtime cuts the delay short, hands the request back, stops
    assert stopped.called
    assert world.status(request) == ("queued", 2)


def test_deferred_handler(tmp_path: Path) -> None:
    world = World(tmp_path)
    pending: List[defer.Deferred] = []

    def deferred_handler(message: Dict[str, Any]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        pending.append(d)
        return d

    service = world.runtime(deferred_handler)
    start(world, service)
    request = world.request("later")
    world.settle()
    assert world.status(request)[0] == "leased"
    pending[0].callback({"answer": 42})
    world.settle()
    assert world.status(request)[0] == "done"
    assert world.replies()[0]["body"] == {"answer": 42}
    stop(world, service)


def test_coroutine_handler(tmp_path: Path) -> None:
    async def coroutine_handler(message: Dict[str, Any]) -> str:
        return "from a coroutine"

    world = World(tmp_path)
    service = world.runtime(coroutine_handler)
    start(world, service)
    world.request("x")
    world.settle()
    assert world.replies()[0]["body"] == {"text": "from a coroutine"}
    stop(world, service)


class LosesAcks(RelayClient):
    """A client whose completed acks never reach the broker."""

    def ack_outcome(self, message_id: str, lease_id: str, outcome: str, error: Any = None,
                    **extensions: Any) -> Any:
        if outcome == "completed":
            return defer.fail(RelayError(0, "connection_error", "lost"))
        return super().ack_outcome(message_id, lease_id, outcome, error, **extensions)


def test_restart_after_lost_ack_replays_the_reply_without_running_the_handler(
    tmp_path: Path,
) -> None:
    """The receipts of a v1.1 broker (with v1.2 the reply is in the ack itself)."""
    world = World(tmp_path, v11=True)
    handler = Recorder()
    lossy = LosesAcks("http://127.0.0.1:19121", "worker", TEST_SECRET, clock=world.clock,
                      http=world.stub)
    first = world.runtime(handler, client=lossy, lease_seconds=60)
    start(world, first)
    request = world.request("once", ack=True)
    world.settle()
    assert handler.calls == [request]
    assert world.status(request)[0] == "leased"
    stop(world, first)

    # the lease lapses; a new process (new ReceiptStore from the same file) starts
    world.settle(61)
    world.run(world.api.broker.sweep_leases())
    assert world.status(request)[0] == "queued"
    handler_after_restart = Recorder()
    second = world.runtime(handler_after_restart)
    start(world, second)
    world.settle()
    assert handler_after_restart.calls == []
    assert world.status(request)[0] == "done"
    replies = world.replies()
    assert len(replies) == 1  # the replay reused the reply id: the broker saw a duplicate
    assert replies[0]["body"] == {"text": "ONCE"}
    receipts = [
        m
        for m in world.run(world.alpha.recv())["messages"]
        if m.get("type") == "ack" and m.get("replyTo") == request
    ]
    assert len(receipts) == 1  # the v1.0 receipt went out once, not once per delivery
    stop(world, second)


@pytest.mark.parametrize("v11", [False, True])
def test_a_receipt_from_the_old_json_file_is_replayed_after_an_upgrade(
    tmp_path: Path, v11: bool
) -> None:
    """A request answered by an earlier release, whose ack was lost, is not run again,
    whatever the broker offers now."""
    world = World(tmp_path, v11=v11)
    world.run(world.client("worker").register())
    request = world.request("answered before the upgrade")
    earlier = {
        "id": "reply-before-upgrade",
        "to": "alpha",
        "body": {"text": "EARLIER"},
        "replyTo": request,
        "parentId": request,
        "rootId": request,
    }
    legacy = legacy_receipts_path("worker", tmp_path)
    legacy.write_text(
        json.dumps({"version": 1, "receipts": {request: {"at": world.clock.seconds(),
                                                         "reply": earlier}}}),
        encoding="utf-8",
    )
    handler = Recorder()
    service = world.runtime(handler)
    assert not legacy.exists()
    start(world, service)
    world.settle()
    assert handler.calls == []
    assert world.status(request)[0] == "done"
    (reply,) = world.replies()
    assert (reply["id"], reply["body"]) == ("reply-before-upgrade", {"text": "EARLIER"})
    stop(world, service)


def test_receipts_and_replies_are_surfaced_not_run(tmp_path: Path) -> None:
    world = World(tmp_path)
    handler = Recorder()
    seen: Dict[str, List[str]] = {"receipt": [], "reply": []}
    service = world.runtime(
        handler,
        client=world.client("alpha"),
        on_receipt=lambda m: seen["receipt"].append(m["replyTo"]),
        on_reply=lambda m: seen["reply"].append(m["parentId"]),
    )
    worker = world.client("worker")
    world.run(worker.register())
    start(world, service)
    sent = world.run(world.alpha.send("worker", {"text": "please ack"}, ack=True))["id"]
    world.run(worker.ack(sent))
    answer = world.run(
        worker.send("alpha", {"text": "answer"}, kind="reply", reply_to=sent, parent_id=sent)
    )
    world.settle()
    assert handler.calls == []
    assert seen == {"receipt": [sent], "reply": [sent]}
    assert world.status(answer["id"])[0] == "done"
    stop(world, service)


def test_concurrency_limits_requests_in_flight(tmp_path: Path) -> None:
    world = World(tmp_path)
    pending: List[defer.Deferred] = []

    def handler(message: Dict[str, Any]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        pending.append(d)
        return d

    service = world.runtime(handler, concurrency=2)
    start(world, service)
    requests = [world.request(f"r{i}") for i in range(3)]
    world.settle(1)
    assert len(pending) == 2
    assert [world.status(r)[0] for r in requests].count("leased") == 2
    pending[0].callback("done")
    world.settle(1)
    assert len(pending) == 3
    for d in pending[1:]:
        d.callback("done")
    world.settle()
    assert [world.status(r)[0] for r in requests] == ["done"] * 3
    stop(world, service)


def test_shutdown_stops_pulling_and_waits_for_in_flight_handlers(tmp_path: Path) -> None:
    world = World(tmp_path)
    pending: List[defer.Deferred] = []

    def handler(message: Dict[str, Any]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        pending.append(d)
        return d

    service = world.runtime(handler, shutdown_grace=30)
    start(world, service)
    first = world.request("first")
    world.settle()
    stopping = service.stopService()
    world.settle()
    assert not stopping.called
    second = world.request("second")
    world.settle(5)
    assert world.status(second)[0] == "queued"  # no more leasing after stop
    pending[0].callback("finished")
    world.settle()
    assert stopping.called
    assert world.status(first)[0] == "done"


def test_shutdown_gives_up_after_the_grace_period(tmp_path: Path) -> None:
    """On a v1.1 broker the unfinished request's lease lapses (v1.2: it is released)."""
    world = World(tmp_path, v11=True)
    service = world.runtime(lambda message: defer.Deferred(), shutdown_grace=30)
    start(world, service)
    request = world.request("stuck")
    world.settle()
    stopping = service.stopService()
    world.settle(29)
    assert not stopping.called
    world.settle(1)
    assert stopping.called
    assert world.status(request)[0] == "leased"  # its lease lapses at the broker


def test_protocol_mismatch_is_fatal(tmp_path: Path) -> None:
    clock = Clock()
    from twisted.web.resource import Resource

    class OtherBroker(Resource):
        isLeaf = True

        def render(self, request: Any) -> bytes:
            return b'{"protocol": "2.0"}'

    client = RelayClient("http://x", "worker", "s", clock=clock, http=StubTreq(OtherBroker()))
    fatal: List[RelayError] = []
    service = AgentService(
        client,
        Recorder(),
        clock=clock,
        receipts=ReceiptStore(tmp_path / "r.sqlite3", clock),
        on_fatal=fatal.append,
    )
    service.startService()
    assert [e.code for e in fatal] == ["protocol_mismatch"]
    assert not clock.getDelayedCalls()
    assert service.stopService().called


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


# -- v1.2: long handlers, the reply in the ack, the handler's outcomes, the card -----------


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


# -- v1.2's fallbacks on a v1.1 broker -----------------------------------------------------


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


# -- the --exec handler (real processes, bounded) -------------------------------


def test_exec_input_is_text_or_json() -> None:
    assert exec_input({"body": {"text": "plain"}}) == b"plain"
    assert json.loads(exec_input({"body": {"n": 1}})) == {"n": 1}


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_exec_handler_reads_stdin_and_replies_with_stdout() -> Any:
    from twisted.internet import reactor

    handler = ExecHandler(
        'tr a-z A-Z; echo " $RELAY_FROM $RELAY_KIND"', reactor=reactor, timeout=10
    )
    text = yield handler({"id": "m1", "from": "alpha", "kind": "request", "body": {"text": "hi"}})
    assert text == "HI alpha request"


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_exec_handler_non_zero_exit_fails() -> Any:
    from twisted.internet import reactor

    handler = ExecHandler("cat >/dev/null; exit 3", reactor=reactor, timeout=10)
    with pytest.raises(ExecFailed, match="status 3"):
        yield handler({"id": "m", "body": {"text": "x"}})


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_a_failed_command_is_named_with_its_status_and_last_error_lines() -> Any:
    """It used to be "command exited with status 127", the error output discarded."""
    from twisted.internet import reactor

    handler = ExecHandler("cat >/dev/null; seq 1 8 >&2; printf 'no\\033 such tool: frob\\n' >&2;"
                          " exit 127", reactor=reactor, timeout=10)
    with pytest.raises(ExecFailed) as info:
        yield handler({"id": "m", "body": {"text": "x"}})
    assert str(info.value).startswith("command `cat >/dev/null; seq 1 8 >&2;")
    assert str(info.value).endswith(" exited with status 127")
    assert info.value.error_output == ("5", "6", "7", "8", "no\\x1b such tool: frob")


def test_the_agent_logs_a_failed_command_s_error_output_as_its_own_words(
    tmp_path: Path
) -> None:
    from twisted.logger import capturedLogs, formatEvent

    def handler(message: Dict[str, Any]) -> Any:
        raise ExecFailed("command `frob` exited with status 127", ("sh: frob: not found",))

    world = World(tmp_path)
    service = world.runtime(handler, retry_delay=0)
    with capturedLogs() as events:
        start(world, service)
        request = world.request("secret-body-marker")
        world.settle()
        stop(world, service)
    text = "\n".join(formatEvent(e) for e in events)
    assert (f"agent worker: handler failed for {request}: ExecFailed: command `frob` exited "
            "with status 127; asking for a retry") in text
    assert f"agent worker: {request}: the command's error output: sh: frob: not found" in text
    assert "secret-body-marker" not in text
    error = world.run(world.alpha.status([request]))["messages"][0]["error"]
    assert error == "command `frob` exited with status 127"  # the output stays in the log


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_exec_handler_times_out() -> Any:
    from twisted.internet import reactor

    handler = ExecHandler("exec sleep 30", reactor=reactor, timeout=0.3)
    with pytest.raises(ExecFailed, match="timed out"):
        yield handler({"id": "m", "body": {"text": "x"}})


@pytest_twisted.inlineCallbacks
@pytest.mark.process
def test_exec_script_as_an_agent(tmp_path: Path) -> Any:
    """A small script runs per request; the reply is its stdout; exit 1 means retry."""
    from twisted.internet import reactor

    script = tmp_path / "agent.py"
    script.write_text(
        "import sys\n"
        "text = sys.stdin.read()\n"
        "if text == 'fail':\n"
        "    sys.exit(1)\n"
        "print(text[::-1])\n",
        encoding="utf-8",
    )
    world = World(tmp_path)
    handler = ExecHandler(f"{sys.executable} {script}", reactor=reactor, timeout=20)
    service = world.runtime(handler, retry_delay=0)
    start(world, service)
    good = world.request("stressed")
    bad = world.request("fail")
    for _ in range(400):
        world.settle()
        if world.status(good)[0] == "done" and world.status(bad)[0] == "failed":
            break
        yield _sleep(reactor, 0.025)
    assert world.status(good)[0] == "done"
    answers = [r["body"] for r in world.replies() if "relayNotice" not in r["body"]]
    assert answers == [{"text": "desserts"}]
    assert world.status(bad) == ("failed", 4)
    d = service.stopService()
    world.settle()
    yield d


def _sleep(reactor: Any, seconds: float) -> defer.Deferred:
    from twisted.internet.task import deferLater

    return deferLater(reactor, seconds)
