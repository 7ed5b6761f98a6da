"""The transitions of :mod:`relay.rules.delivery`, tested directly as pure functions.

Expectations from the seed §5.1 state machine and EXTENSIONS.md §1-§4 and §10:
the lease checks in order (403, 409 ``not_leased`` including a passed deadline,
409 ``lease_mismatch``), the four ack outcomes and their ``attempts``,
``maxDeliveries`` and its error text, ``retryAfterSeconds``, renew, requeue,
cancel, the failure notices and the v1.0 poll page. (404 for an unknown id is the
store's: tests/stores/test_contracts.py.)
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from relay.rules import delivery
from relay.rules.delivery import Message, Rules
from relay.wire.errors import RelayError
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED, notice_id

NOW = 1_000_000.0
LEASE = 60


def rules(max_attempts: int = 3, max_deliveries: int = 0, notify: bool = True) -> Rules:
    return Rules(max_attempts=max_attempts, max_deliveries=max_deliveries,
                 notify_failures=notify, inbox_max_messages=0, inbox_max_bytes=0,
                 notify_v2=notify, roles={})


def leased(kind: str = "request", now: float = NOW, **fields: Any) -> Message:
    message = Message(id="q1", sender="alpha", to="beta", created=now - 10, kind=kind, **fields)
    delivery.lease(message, LEASE, now)
    return message


def settle(message: Message, transition: Any, now: float = NOW, policy: Optional[Rules] = None
           ) -> Any:
    """As the store settles: time first (a lapsed lease), then the transition."""
    notices = delivery.catch_up(message, now, policy or rules())
    outcome = transition(message, now)
    return outcome, notices


def error_of(message: Message, transition: Any, now: float = NOW) -> RelayError:
    with pytest.raises(RelayError) as info:
        settle(message, transition, now)
    return info.value


# -- lease -----------------------------------------------------------------------------------


def test_a_lease_is_fresh_and_counts_a_delivery():
    message = leased(deliveries=2, not_before=NOW - 1)
    assert (message.status, message.deliveries, message.not_before) == (LEASED, 3, None)
    assert message.lease_until == int(NOW * 1000) + LEASE * 1000
    assert len(message.lease_id) == 32 and int(message.lease_id, 16) >= 0
    first = message.lease_id
    delivery.lease(message, LEASE, NOW)
    assert message.lease_id != first


@pytest.mark.parametrize(("offset_ms", "lapsed"), [(-1, False), (0, True), (1, True)])
def test_a_lease_lapses_at_its_deadline(offset_ms, lapsed):
    message = leased()
    at = (message.lease_until + offset_ms) / 1000
    assert delivery.lease_lapsed(message, at) is lapsed


# -- the lease checks, in the order of §10 --------------------------------------------------------


@pytest.mark.parametrize("transition", [
    lambda lease_id: delivery.ack("beta", lease_id, "completed", None, rules()),
    lambda lease_id: delivery.ack("beta", lease_id, "retry", None, rules()),
    lambda lease_id: delivery.ack("beta", lease_id, "release", None, rules()),
    lambda lease_id: delivery.ack("beta", lease_id, "reject", None, rules()),
    lambda lease_id: delivery.renew("beta", lease_id, 30),
])
def test_the_lease_checks_of_every_outcome_and_renew(transition):
    message = leased()
    good, other = message.lease_id, "0" * 32
    stranger = leased()
    stranger.to = "gamma"
    e = error_of(stranger, transition(stranger.lease_id))
    assert (e.status, e.code) == (403, "forbidden"), "the recipient first"
    e = error_of(leased(), transition(other))
    assert (e.status, e.code) == (409, "lease_mismatch")
    lapsed_at = message.lease_until / 1000
    e = error_of(message, transition(good), now=lapsed_at)
    assert (e.status, e.code) == (409, "not_leased"), "a passed deadline, swept or not"
    e = error_of(message, transition(other), now=lapsed_at)
    assert (e.status, e.code) == (409, "not_leased"), "not_leased before lease_mismatch"
    for status in (QUEUED, DONE, FAILED):
        m = leased()
        m.status = status
        e = error_of(m, transition(m.lease_id))
        assert (e.status, e.code) == (409, "not_leased")


# -- ack outcomes (§2) ---------------------------------------------------------------------------


def ack(message: Message, outcome: str, error: Optional[str] = None,
        policy: Optional[Rules] = None, retry_after: Optional[int] = None) -> delivery.Outcome:
    transition = delivery.ack("beta", message.lease_id, outcome, error, policy or rules(),
                              retry_after)
    return settle(message, transition, policy=policy)[0]


def test_completed_is_done_with_the_attempts_unchanged():
    message = leased(attempts=2)
    outcome = ack(message, "completed")
    assert outcome.value == {"ok": True, "status": DONE, "attempts": 2}
    assert (message.status, message.lease_id, message.lease_until) == (DONE, None, None)
    assert outcome.notices == () and outcome.reply is None


def test_retry_requeues_with_one_more_attempt():
    message = leased()
    outcome = ack(message, "retry", "flaky")
    assert outcome.value == {"ok": True, "status": QUEUED, "attempts": 1}
    assert (message.status, message.lease_id, message.error, message.not_before) == (
        QUEUED, None, "flaky", None)


def test_a_retry_past_max_attempts_fails_with_the_acks_error_and_a_notice():
    message = leased(attempts=3)
    outcome = ack(message, "retry", "still broken", rules(max_attempts=3, max_deliveries=1))
    assert outcome.value == {"ok": True, "status": FAILED, "attempts": 4}
    assert message.error == "still broken", "the attempts rule decides, not maxDeliveries"
    (notice,) = outcome.notices
    assert notice.body["relayNotice"]["error"] == "still broken"


def test_a_retry_at_max_attempts_is_requeued():
    message = leased(attempts=2)
    assert ack(message, "retry", policy=rules(max_attempts=3)).value["status"] == QUEUED


def test_release_requeues_without_penalty():
    message = leased(attempts=1)
    assert ack(message, "release").value == {"ok": True, "status": QUEUED, "attempts": 1}


@pytest.mark.parametrize(("error", "expected"), [(None, "rejected"), ("poison", "poison"),
                                                 ("", "")])
def test_reject_fails_at_once(error, expected):
    message = leased(attempts=1)
    outcome = ack(message, "reject", error)
    assert outcome.value == {"ok": True, "status": FAILED, "attempts": 1}
    assert message.error == expected and message.lease_id is None
    (notice,) = outcome.notices
    assert notice.body["relayNotice"]["error"] == expected


@pytest.mark.parametrize("outcome", ["retry", "release"])
@pytest.mark.parametrize(("seconds", "not_before"), [(None, None), (0, None), (30, NOW + 30)])
def test_retry_after_holds_the_requeued_message_back(outcome, seconds, not_before):
    message = leased()
    ack(message, outcome, retry_after=seconds)
    assert message.not_before == not_before
    assert delivery.deliverable(message, NOW) is (not_before is None)
    assert delivery.deliverable(message, NOW + 30) is True


@pytest.mark.parametrize("outcome", ["retry", "release"])
def test_the_last_delivery_ending_without_completion_fails_the_message(outcome):
    policy = rules(max_attempts=10, max_deliveries=2)
    message = leased(deliveries=1)  # this lease is its second delivery
    result = ack(message, outcome, "ignored", policy)
    assert result.value["status"] == FAILED
    assert message.error == "delivered 2 times without completion"
    once = leased(deliveries=0)
    ack(once, outcome, policy=rules(max_deliveries=1))
    assert once.error == "delivered 1 times without completion", "n in digits, also for 1"


def test_completion_on_the_last_delivery_is_done():
    message = leased(deliveries=4)
    assert ack(message, "completed", policy=rules(max_deliveries=5)).value["status"] == DONE


# -- failure notices (§4) -------------------------------------------------------------------------


def test_a_failure_notice_answers_the_request_from_its_recipient():
    message = leased(root_id="root", attempts=1)
    (notice,) = ack(message, "reject", "bad input").notices
    assert (notice.id, notice.sender, notice.to, notice.kind, notice.type, notice.ack) == (
        notice_id("q1"), "beta", "alpha", "reply", "message", False)
    assert (notice.parent_id, notice.reply_to, notice.root_id) == ("q1", "q1", "root")
    assert notice.body == {"relayNotice": {"event": "failed", "messageId": "q1",
                                           "attempts": 1, "deliveries": 1,
                                           "error": "bad input"}}
    assert (notice.status, notice.expires_at, notice.not_before) == (QUEUED, None, None)
    (without_root,) = ack(leased(), "reject").notices
    assert without_root.root_id == "q1"


@pytest.mark.parametrize(("kind", "notify"), [("message", True), ("reply", True),
                                              ("request", False)])
def test_no_notice_for_plain_messages_or_when_notices_are_off(kind, notify):
    assert ack(leased(kind=kind), "reject", policy=rules(notify=notify)).notices == ()


def test_a_cancelled_request_gets_no_notice():
    message = leased()
    outcome = delivery.cancel("alpha", None)(message, NOW)
    assert outcome.notices == ()


def test_requests_that_expire_unprocessed_get_an_expired_notice():
    queued = Message(id="a", sender="alpha", to="beta", created=NOW, kind="request")
    lease_held = leased()
    done = leased()
    ack(done, "completed")
    plain = Message(id="p", sender="alpha", to="beta", created=NOW)
    notices = delivery.expiry_notices([queued, lease_held, done, plain], NOW, rules())
    assert [n.id for n in notices] == [notice_id("a"), notice_id("q1")]
    assert all(n.body["relayNotice"]["event"] == "expired" and
               n.body["relayNotice"]["error"] == "expired unprocessed" for n in notices)
    assert queued.error is None, "the expired message itself is left as it was"


# -- lapse ---------------------------------------------------------------------------------------


def test_a_lapsed_lease_is_queued_again_with_the_recovery_mark():
    message = leased()
    at = message.lease_until / 1000
    assert delivery.catch_up(message, at, rules()) == ()
    assert (message.status, message.lease_id, message.recovery) == (QUEUED, None, True)
    assert message.attempts == 0, "a lapse is no attempt"


def test_an_exhausted_lapsed_lease_fails_with_a_notice():
    message = leased()
    (notice,) = delivery.catch_up(message, message.lease_until / 1000, rules(max_deliveries=1))
    assert (message.status, message.error) == (FAILED, "delivered 1 times without completion")
    assert notice.body["relayNotice"]["error"] == message.error


def test_nothing_happens_to_a_live_lease():
    message = leased()
    assert delivery.catch_up(message, NOW + LEASE - 1, rules()) == ()
    assert message.status == LEASED


# -- renew (§1) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [1, 5, 86400])
def test_renew_sets_the_deadline_from_now_and_keeps_the_rest(seconds):
    message = leased(attempts=2)
    lease_id, deliveries = message.lease_id, message.deliveries
    later = NOW + 30
    outcome, _ = settle(message, delivery.renew("beta", lease_id, seconds), now=later)
    assert outcome.value == {"ok": True, "leaseId": lease_id,
                             "leaseUntil": int(later * 1000) + seconds * 1000}
    assert (message.lease_id, message.attempts, message.deliveries) == (lease_id, 2, deliveries)


# -- requeue and cancel (§3, §10) -------------------------------------------------------------


def failed(reason: str = "rejected") -> Message:
    message = leased(attempts=2, not_before=None)
    if reason == "cancelled":
        delivery.cancel("alpha", "no longer needed")(message, NOW)
    else:
        ack(message, "reject", "bad")
    return message


@pytest.mark.parametrize("agent", ["alpha", "beta", None])
def test_requeue_resets_a_failed_message(agent):
    message = failed()
    outcome = delivery.requeue(agent)(message, NOW)
    assert outcome.value == {"ok": True, "status": QUEUED, "attempts": 0}
    assert (message.status, message.attempts, message.deliveries, message.error,
            message.not_before, message.dead_reason) == (QUEUED, 0, 0, None, None, None)


def test_requeue_refusals():
    e = error_of(failed(), delivery.requeue("gamma"))
    assert (e.status, e.code) == (403, "forbidden")
    e = error_of(failed("cancelled"), delivery.requeue("beta"))
    assert (e.status, e.code) == (403, "forbidden"), "a cancelled message: only its sender"
    assert delivery.requeue("alpha")(failed("cancelled"), NOW).value["status"] == QUEUED
    for message in (leased(), Message(id="x", sender="alpha", to="beta", created=NOW)):
        e = error_of(message, delivery.requeue("alpha"))
        assert (e.status, e.code) == (409, "wrong_state")
    e = error_of(leased(), delivery.requeue("gamma"))
    assert e.code == "forbidden", "403 before 409"


@pytest.mark.parametrize(("reason", "error"), [(None, "cancelled by sender"), ("stop", "stop")])
@pytest.mark.parametrize("state", [QUEUED, LEASED])
def test_cancel_fails_a_queued_or_leased_message(reason, error, state):
    message = leased(attempts=1)
    if state == QUEUED:
        ack(message, "release")
    outcome = delivery.cancel("alpha", reason)(message, NOW)
    assert outcome.value == {"ok": True, "status": FAILED, "attempts": 1}
    assert (message.status, message.error, message.lease_id) == (FAILED, error, None)


def test_cancel_refusals():
    e = error_of(leased(), delivery.cancel("beta", None))
    assert (e.status, e.code) == (403, "forbidden"), "only the sender"
    done = leased()
    ack(done, "completed")
    for message in (done, failed()):
        e = error_of(message, delivery.cancel("alpha", None))
        assert (e.status, e.code) == (409, "wrong_state")
    assert delivery.cancel(None, None)(leased(), NOW).value["status"] == FAILED, "the operator"


# -- what time does to a message --------------------------------------------------------------


def test_due_expired_and_deliverable():
    message = Message(id="m", sender="a", to="b", created=NOW, not_before=NOW + 5,
                      expires_at=NOW + 10)
    assert [delivery.deliverable(message, t) for t in (NOW, NOW + 5, NOW + 9.9, NOW + 10)] == [
        False, True, True, False]
    assert delivery.expired(message, NOW + 10) and not delivery.expired(message, NOW + 9.99)
    assert delivery.due(message, NOW + 5) and not delivery.due(message, NOW + 4.99)
    message.status = LEASED
    assert not delivery.deliverable(message, NOW + 6)


# -- the v1.0 poll page (§5.1, §7) ------------------------------------------------------------


def msg(i: int, body_bytes: int = 0, recovery: bool = False) -> Message:
    return Message(id=f"m{i}", sender="a", to="b", created=NOW, seq=i,
                   body={"t": "x" * body_bytes}, recovery=recovery)


def test_within_budget_is_never_empty_when_there_is_something():
    big = [msg(i, 1000) for i in range(3)]
    assert delivery.within_budget(big, 0) == big[:1]
    assert delivery.within_budget(big, big[0].size() + big[1].size()) == big[:2]
    assert delivery.within_budget([], 0) == []


def test_a_poll_page_gives_recoveries_first_once_and_the_cursor_never_moves_back():
    recovered = [msg(1, recovery=True)]
    fresh = [msg(5), msg(6), msg(7)]
    page, cursor, unmarked = delivery.poll_page(recovered, fresh, 3, "m4", 10**6)
    assert [m.id for m in page] == ["m1", "m5", "m6"] and cursor == "m6"
    assert unmarked == recovered and recovered[0].recovery is False
    page, cursor, unmarked = delivery.poll_page([msg(2, recovery=True)], [], 50, "m6", 10**6)
    assert ([m.id for m in page], cursor) == (["m2"], "m6"), "a recovery alone keeps the cursor"
    assert delivery.poll_page([], [], 50, None, 10**6) == ([], None, [])
    assert delivery.poll_page([], [], 50, "m9", 10**6) == ([], "m9", [])


def test_a_poll_page_holds_at_most_limit_messages():
    recovered = [msg(i, recovery=True) for i in range(3)]
    page, cursor, _ = delivery.poll_page(recovered, [msg(9)], 2, "m8", 10**6)
    assert [m.id for m in page] == ["m0", "m1"] and cursor == "m8"
    assert recovered[2].recovery is True, "a recovery not served keeps its mark"
