"""Ids, names and addresses of :mod:`relay.wire.protocol`, tested directly.

Expectations come from the specs: seed §2 (ids are strings the broker keeps
verbatim), EXTENSIONS.md §4 (failure notice ids derived from the request id),
§10 (``requeue``/``cancel`` refuse a missing or non-string ``messageId``), REACH §13
(agent and team names ``[A-Za-z0-9_.-]{1,64}``), seed §3 (loopback hosts).
The 256-character bound of an id is the relay's own (docs/PROTOCOL.md).
"""

from __future__ import annotations

import uuid

import pytest

from relay.wire import protocol
from relay.wire.protocol import (
    MAX_ID_CHARS,
    NOTICE_ID_PREFIX,
    address_group,
    check_id,
    check_new_id,
    is_loopback_host,
    is_selfcheck_agent,
    is_valid_agent_name,
    notice_id,
    optional_id,
    optional_query_id,
    required_id,
)
from tests.support.protocol import CONTENT, refusal

LONGEST = "i" * MAX_ID_CHARS
TOO_LONG = "i" * (MAX_ID_CHARS + 1)


# -- notice ids -------------------------------------------------------------------------


def test_a_notice_id_is_derived_from_the_request_id_alone():
    request_id = "9b2f0c1e-5d4a-4c39-8f1e-2a7b6c5d4e3f"
    derived = notice_id(request_id)
    assert derived == notice_id(request_id), "one request, one notice id, on every broker"
    assert derived == NOTICE_ID_PREFIX + str(uuid.uuid5(protocol.NOTICE_NAMESPACE, request_id))
    assert derived.startswith("relay-notice-")
    assert notice_id(request_id + "x") != derived


@pytest.mark.parametrize("request_id", ["a", LONGEST, "ünïcødé-✓", "relay-notice-x"])
def test_every_notice_id_is_in_the_reserved_space_and_fits_the_id_limit(request_id):
    derived = notice_id(request_id)
    assert len(derived) <= MAX_ID_CHARS
    refusal(check_new_id, derived, "id", field="id")


# -- check_id, optional_query_id, check_new_id ------------------------------------------


@pytest.mark.parametrize("value", ["", "x", LONGEST, "é" * MAX_ID_CHARS, "😀" * MAX_ID_CHARS,
                                   "with space", "a/b?c=d"])
def test_an_id_of_at_most_256_characters_is_kept_verbatim(value):
    assert check_id(value, "messageId") is value


@pytest.mark.parametrize("value", [TOO_LONG, "é" * (MAX_ID_CHARS + 1), CONTENT * 20])
def test_an_id_of_257_characters_is_refused_naming_the_field(value):
    error = refusal(check_id, value, "replyTo", field="replyTo")
    assert error.message == "replyTo must be at most 256 characters"


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("abc", "abc"),
                                                 (LONGEST, LONGEST)])
def test_a_query_id_is_none_when_absent_or_empty(value, expected):
    assert optional_query_id(value, "since") == expected


def test_a_query_id_over_the_limit_is_refused():
    refusal(optional_query_id, TOO_LONG, "since", field="since")


@pytest.mark.parametrize("value", ["x", LONGEST, "relay-notice", "relay_notice-1",
                                   "RELAY-NOTICE-1", " relay-notice-1", "my-relay-notice-1"])
def test_a_new_id_outside_the_reserved_space_is_taken(value):
    assert check_new_id(value, "id") == value


@pytest.mark.parametrize("value", ["relay-notice-", "relay-notice-1",
                                   NOTICE_ID_PREFIX + str(uuid.uuid4())])
def test_a_new_id_in_the_reserved_space_is_refused(value):
    error = refusal(check_new_id, value, "reply.id", field="reply.id")
    assert "relay-notice-" in error.message


def test_a_new_id_is_checked_for_length_first():
    error = refusal(check_new_id, NOTICE_ID_PREFIX + TOO_LONG, "id", field="id")
    assert error.message == "id must be at most 256 characters"


# -- required_id, optional_id -----------------------------------------------------------


@pytest.mark.parametrize("value", ["m1", LONGEST, "ü"])
def test_a_required_id_is_a_non_empty_string(value):
    assert required_id({"messageId": value}, "messageId") == value


@pytest.mark.parametrize("body", [{}, {"messageId": None}, {"messageId": ""},
                                  {"messageId": 5}, {"messageId": True}, {"messageId": ["m1"]},
                                  {"messageId": {"id": CONTENT}}, {"leaseId": "l1"}])
def test_a_missing_or_non_string_required_id_is_refused(body):
    error = refusal(required_id, body, "messageId", field="messageId")
    assert error.message == "messageId is required (a non-empty string)"


def test_a_required_id_over_the_limit_is_refused():
    refusal(required_id, {"leaseId": TOO_LONG}, "leaseId", field="leaseId")


@pytest.mark.parametrize(("body", "expected"), [({}, None), ({"parentId": None}, None),
                                                ({"parentId": "p"}, "p"),
                                                ({"parentId": LONGEST}, LONGEST)])
def test_an_optional_id_is_none_when_absent_or_null(body, expected):
    assert optional_id(body, "parentId") == expected


@pytest.mark.parametrize("value", ["", 0, 1, False, [], {}, TOO_LONG])
def test_an_optional_id_present_must_be_a_non_empty_string(value):
    refusal(optional_id, {"parentId": value}, "parentId", field="parentId")


# -- agent names --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "alpha", "A-b_c.d", "0", "x" * 64, "...", "-", "_"])
def test_legal_agent_names(name):
    assert is_valid_agent_name(name) is True


@pytest.mark.parametrize("name", ["", "x" * 65, "a b", "a/b", "a:b", "group:x", "role:x",
                                  "é", "ａ", "a\n", "\na", "a\x00", "٣", "a@b"])
def test_illegal_agent_names(name):
    assert is_valid_agent_name(name) is False


@pytest.mark.parametrize(("name", "expected"), [
    ("selfcheck-0123abcd-a", True), ("selfcheck-0123abcd-b", True),
    ("selfcheck-0123abcd-c", False), ("selfcheck-0123ABCD-a", False),
    ("selfcheck-0123abc-a", False), ("selfcheck-0123abcd-a\n", False),
    ("xselfcheck-0123abcd-a", False), ("selfcheck-0123abcd-ab", False),
])
def test_selfcheck_agents(name, expected):
    assert is_selfcheck_agent(name) is expected


# -- hosts --------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.1.2.3", "127.255.255.255",
                                  "::1", "::1%lo", "::ffff:127.0.0.1", "::ffff:127.9.9.9",
                                  "0:0:0:0:0:0:0:1"])
def test_loopback_hosts(host):
    assert is_loopback_host(host) is True


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "10.0.0.1", "128.0.0.1",
                                  "::ffff:10.0.0.1", "2001:db8::1", "fe80::1%lo",
                                  "localhost.", "localhost.example", "127.0.0.1.nip.io",
                                  "127.1", "not a host"])
def test_other_hosts_are_not_loopback(host):
    assert is_loopback_host(host) is False


@pytest.mark.parametrize(("host", "group"), [
    ("192.0.2.7", "192.0.2.7"),
    ("127.0.0.1", "127.0.0.1"),
    ("::ffff:192.0.2.7", "192.0.2.7"),  # one IPv4 client, however it reached the socket
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2::9", "2001:db8:1:2::/64"),
    ("2001:DB8:1:2::9", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::1", "::1"),
    ("unix-socket", "unix-socket"),
])
def test_address_groups(host, group):
    assert address_group(host) == group


def test_two_hosts_of_one_ipv6_64_share_a_group_and_other_64s_do_not():
    assert address_group("2001:db8:0:1::a") == address_group("2001:db8:0:1:ffff::b")
    assert address_group("2001:db8:0:1::a") != address_group("2001:db8:0:2::a")
    assert address_group("192.0.2.1") != address_group("192.0.2.2")
