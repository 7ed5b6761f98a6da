"""The events of REACH §11 as pure rules: which change of a message is an event for whom,
without its body; the resume position; the SSE records. The streams are
tests/api/test_events.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from relay.rules import events
from relay.rules.delivery import Message
from relay.testing import START
from relay.wire.protocol import DONE, LEASED, QUEUED


def message(**state: Any) -> Message:
    m = Message("m1", "alpha", "beta", START, body={"text": "secret body"}, kind="request",
                root_id="r", parent_id="p")
    for key, value in state.items():
        setattr(m, key, value)
    return m


def test_a_new_message_is_a_message_event_for_its_recipient_without_its_body():
    (event,) = events.derive(None, message(), START)
    assert event[:2] == ("beta", "message")
    assert json.loads(event[2]) == {"id": "m1", "from": "alpha", "to": "beta",
                                    "kind": "request", "rootId": "r", "parentId": "p"}
    assert "secret body" not in event[2]


def test_a_status_change_is_a_status_event_for_the_sender():
    before = message().state()
    leased = message(status=LEASED, deliveries=1, lease_until=1, lease_id="l")
    assert events.derive(before, leased, START) == [
        ("alpha", "status", '{"id":"m1","to":"beta","status":"leased","attempts":0,'
                            '"deliveries":1}')]
    done = message(status=DONE, attempts=1, deliveries=1, error="e")
    assert json.loads(events.derive(leased.state(), done, START)[0][2])["error"] == "e"
    # back in the queue: the recipient may pull it again, the sender sees "queued"
    back = message(status=QUEUED, deliveries=1)
    assert [e[:2] for e in events.derive(leased.state(), back, START)] == [
        ("beta", "message"), ("alpha", "status")]
    # a renewal changes no status
    renewed = message(status=LEASED, deliveries=1, lease_until=2, lease_id="l")
    assert events.derive(leased.state(), renewed, START) == []


def test_a_delayed_message_is_a_message_event_when_its_delay_ends():
    held = message(not_before=START + 60)
    assert events.derive(None, held, START) == []
    assert events.derive(None, held, START + 60)[0][1] == "message"
    released = message()  # the store clears not_before once the delay ended
    assert [e[:2] for e in events.derive(held.state(), released, START + 61)] == [
        ("beta", "message")]
    # a retry after a delay: the sender sees "queued" at once, the recipient later
    leased = message(status=LEASED, deliveries=1, lease_until=1, lease_id="l")
    retried = message(status=QUEUED, attempts=1, deliveries=1, not_before=START + 30)
    assert [e[:2] for e in events.derive(leased.state(), retried, START)] == [
        ("alpha", "status")]


@pytest.mark.parametrize(("text", "position"), [
    (None, None), ("", None), ("  ", None), ("0", 0), ("42", 42), ("-1", -1), ("x", -1),
    ("1" * 21, -1), ("٣", -1), ("1.5", -1),
])
def test_the_resume_position(text, position):
    assert events.parse_event_id(text) == position


def test_resume_refuses_unknown_and_trimmed_positions():
    assert events.resume(None, 5, 10) is None
    assert events.resume(5, 5, 10) is None
    assert events.resume(10, 5, 10) is None
    assert events.resume(11, 5, 10) == "unknown event id"
    assert events.resume(-1, 0, 10) == "unknown event id"
    assert "eventRetentionSeconds" in events.resume(4, 5, 10)


def test_sse_records():
    assert events.sse_record(7, "message", '{"a":1}') == b'id: 7\nevent: message\ndata: {"a":1}\n\n'
    assert events.reset_record(9, "why") == b'id: 9\nevent: reset\ndata: {"reason":"why"}\n\n'
