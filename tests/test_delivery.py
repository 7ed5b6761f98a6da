"""The delivery record: a stored body is decoded only when it is read."""

from relay.delivery import Message


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
    from relay.delivery import lease

    message = Message(id="m1", sender="alpha", to="beta", created=0.0)
    lease(message, 1.5, 100.25)
    assert message.lease_until == 101750 and isinstance(message.lease_until, int)
