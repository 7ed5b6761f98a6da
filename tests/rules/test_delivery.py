"""The delivery record (a stored body is decoded only when it is read) and the
transitions of an ack with a reply and of a v1.0 receipt, applied directly."""

import pytest

from relay.rules import delivery
from relay.rules.delivery import Message
from relay.testing import RULES
from relay.wire import errors
from relay.wire.protocol import DONE, LEASED, QUEUED


def test_stored_body_is_decoded_on_first_read_and_kept_verbatim_until_then():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0,
                      body_json='{"text":"héllo","n":[1,2]}')
    assert message.body_json() == '{"text":"héllo","n":[1,2]}'
    assert message.body == {"text": "héllo", "n": [1, 2]}
    assert message.envelope()["body"] == {"text": "héllo", "n": [1, 2]}


def test_a_decoded_body_changed_in_place_is_what_gets_stored():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0, body_json='{"a":1}')
    message.body["a"] = 2
    assert message.body_json() == '{"a":2}'


def test_a_stored_null_body_decodes_once():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0, body_json="null")
    assert message.body is None and message.body is None
    message.body = None
    assert message.body is None and message.body_json() == "null"


def test_setting_the_body_replaces_the_stored_text():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0, body_json='{"a":1}')
    message.body = {"b": 2}
    assert message.body == {"b": 2}
    assert message.body_json() == '{"b":2}'


def test_a_message_without_a_body_has_an_empty_one():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0)
    assert message.body == {}
    assert message.body_json() == "{}"


def test_a_fractional_lease_has_a_whole_millisecond_deadline():
    from relay.rules.delivery import lease

    message = Message(id="m1", sender="alpha", to="beta", created=0.0)
    lease(message, 1.5, 100.25)
    assert message.lease_until == 101750 and isinstance(message.lease_until, int)



# -- an ack with a reply, a v1.0 receipt: pure transitions ---------------------------------

NOW = 1000.0
REPLY = {"id": "r1", "body": {"n": 1}, "ack": False, "kind": "reply"}


def _leased(**fields) -> Message:
    message = Message(id="q", sender="alpha", to="beta", created=0.0, kind="request", **fields)
    delivery.lease(message, 60, NOW)
    return message


def _reply_ack(message: Message, **extra) -> delivery.WithStored:
    transition = delivery.ack("beta", message.lease_id, "completed", None, RULES,
                              reply=REPLY, **extra)
    assert isinstance(transition, delivery.WithStored) and transition.other_id == "r1"
    return transition


def test_an_ack_with_a_reply_completes_and_stores_the_reply_when_none_is_stored():
    message = _leased()
    outcome = _reply_ack(message).decide(message, None, NOW)
    assert outcome.value == {"ok": True, "status": DONE, "attempts": 0, "replyId": "r1",
                             "duplicate": False}
    assert message.status == DONE and message.lease_id is None
    assert (outcome.reply.id, outcome.reply.sender, outcome.reply.to) == ("r1", "beta", "alpha")
    assert (outcome.reply.parent_id, outcome.reply.reply_to) == ("q", "q")


def test_the_same_ack_retried_after_its_answer_was_lost_is_a_duplicate():
    message = _leased()
    first = _reply_ack(message).decide(message, None, NOW)
    stored = first.reply
    done_state = message.state()
    # the retry carries the lease id it had: the lease is gone, the rule comes first
    again = _reply_ack(_leased()).decide(message, stored, NOW + 1)
    assert again.value == {"ok": True, "status": DONE, "attempts": 0, "replyId": "r1",
                           "duplicate": True}
    assert again.reply is None and not again.notices and message.state() == done_state


@pytest.mark.parametrize("change", ["other sender", "other parent", "not done"])
def test_a_stored_reply_that_is_not_this_acks_is_no_duplicate(change):
    message = _leased()
    stored = _reply_ack(message).decide(message, None, NOW).reply
    if change == "other sender":
        stored.sender = "gamma"
    elif change == "other parent":
        stored.parent_id = stored.reply_to = "elsewhere"
    else:
        message.status = LEASED
    assert delivery.repeated_reply(message, stored, "beta") is None


def test_a_reply_whose_id_is_taken_by_another_message_is_left_to_the_store():
    """The ack applies and hands over its reply; the store refuses the id (409)."""
    message = _leased()
    taken = Message(id="r1", sender="gamma", to="alpha", created=0.0)
    outcome = _reply_ack(message).decide(message, taken, NOW)
    assert outcome.reply.id == "r1" and outcome.value["duplicate"] is False


def test_a_nearly_full_disk_refuses_a_reply_but_not_its_duplicate():
    message = _leased()
    stored = _reply_ack(message).decide(message, None, NOW).reply
    again = _reply_ack(message, refuse_new="the disk is nearly full").decide(message, stored, NOW)
    assert again.value["duplicate"] is True
    fresh = _leased()
    with pytest.raises(delivery.NewMessagesRefused) as info:
        _reply_ack(fresh, refuse_new="the disk is nearly full").decide(fresh, None, NOW)
    assert (info.value.status, info.value.code) == (503, "busy")
    assert fresh.status == LEASED, "nothing changed"


def test_an_ack_without_a_reply_stays_a_plain_transition():
    message = _leased()
    transition = delivery.ack("beta", message.lease_id, "release", None, RULES,
                              refuse_new="the disk is nearly full")
    assert not isinstance(transition, delivery.WithStored)
    assert transition(message, NOW).value == {"ok": True, "status": QUEUED, "attempts": 0}


def test_a_receipt_stores_an_ack_message_back_to_the_sender_and_changes_nothing():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0)
    before = message.state()
    outcome = delivery.receipt("beta", b'{"status": "error", "error": "boom"}')(message, NOW)
    receipt = outcome.reply
    assert outcome.value == receipt.id and message.state() == before
    assert (receipt.sender, receipt.to, receipt.type, receipt.reply_to) == (
        "beta", "alpha", "ack", "m1")
    assert receipt.body == {"status": "error", "error": "boom"} and receipt.created == NOW


def test_a_receipt_checks_the_recipient_then_the_body_then_the_route_then_the_disk():
    message = Message(id="m1", sender="alpha", to="beta", created=0.0)

    def no_route(sender, recipient):
        raise errors.forbidden("not allowed")

    cases = [
        (delivery.receipt("alpha", b"{not json", no_route, "full"), 403),
        (delivery.receipt("beta", b"{not json", no_route, "full"), 400),
        (delivery.receipt("beta", b"{}", no_route, "full"), 403),
        (delivery.receipt("beta", b"{}", None, "full"), 503),
    ]
    for transition, status in cases:
        with pytest.raises(errors.RelayError) as info:
            transition(message, NOW)
        assert info.value.status == status
