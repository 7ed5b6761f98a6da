"""Numbers and fields of :mod:`relay.wire.protocol`, tested directly.

The rules come from the specs: the seed's ``limit`` ("default 50, clamped to
1-200", query strings included) and v1.1 ``leaseSeconds`` (an invalid one is
``400``); EXTENSIONS.md's "integer N..M" (a JSON integer, not a float such as
``30.0`` or ``3e1``, a string or a boolean, else ``400`` naming the field), §10's
``null`` = absent, unknown keys ignored in ``reply`` but ``400`` in ``card``, and
the limits of §1-§8 (renew 1..86400, ``retryAfterSeconds`` 0..43200,
``delaySeconds`` 0..86400, ``reason`` and ``error`` at most 1000 characters,
cards of 2000 / 50 x 100 code points); REACH §16 (the same number rules).
"""

from __future__ import annotations

import uuid

import pytest

from relay.wire.protocol import (
    KEEP_CARD,
    MAX_PEERS_LIMIT,
    PEERS_BUDGET_BYTES,
    AckRequest,
    clamp_limit,
    parse_ack,
    parse_card,
    parse_lease_seconds,
    parse_peers_query,
    parse_query_filters,
    parse_reason,
    parse_renew,
    parse_reply,
    parse_send_options,
    parse_status_ids,
    parse_wait_seconds,
    peers_page,
    strict_int,
    team_listing,
)
from tests.support.protocol import CONTENT, refusal

NAN, INF = float("nan"), float("inf")
NOT_INTEGERS = [30.0, 30.5, 3e1, "30", True, False, [30], {"n": 30}, "", CONTENT]

# -- limit: clamped, never refused (seed §4) ----------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (None, 50), (1, 1), (50, 50), (200, 200), (201, 200), (10**30, 200), (0, 1), (-5, 1),
    (7.9, 7), (0.5, 1), (-0.5, 1), (199.99, 199), (1e300, 200), (-1e300, 1),
    ("10", 10), (" 10 ", 10), ("10.7", 10), ("1e2", 100), ("0", 1), ("-3", 1), ("999", 200),
    ("", 50), ("abc", 50), (CONTENT, 50), ("nan", 50), ("inf", 50), ("-inf", 50),
    (NAN, 50), (INF, 50), (-INF, 50), (True, 50), (False, 50), ([5], 50), ({"n": 5}, 50),
])
def test_limits_are_floored_and_clamped_to_1_to_200(value, expected):
    assert clamp_limit(value) == expected


def test_a_limit_default_is_the_callers():
    assert clamp_limit(None, 20) == 20
    assert clamp_limit("x", 7) == 7


# -- leaseSeconds of /v1/pull (v1.1: integral, 1..86400) ----------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), (1, 1), (600, 600), (86400, 86400), (30.0, 30), (3e1, 30),
])
def test_pull_lease_seconds(value, expected):
    assert parse_lease_seconds({"leaseSeconds": value}) == expected
    assert parse_lease_seconds({}) is None


@pytest.mark.parametrize("value", [0, -1, 86401, 10**20, 0.5, 30.5, 86400.5, "30", "",
                                   True, False, NAN, INF, [30], {"s": CONTENT}])
def test_pull_lease_seconds_refused(value):
    error = refusal(parse_lease_seconds, {"leaseSeconds": value}, field="leaseSeconds")
    assert error.message == "leaseSeconds must be an integer from 1 to 86400"


# -- wait of GET /messages (decimal digits, 0..20) ----------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (None, 0), ("0", 0), ("1", 1), ("20", 20), ("020", 20), ("007", 7), (0, 0), (20, 20),
    (5.0, 5),
])
def test_wait_seconds(value, expected):
    assert parse_wait_seconds(value, "wait") == expected


@pytest.mark.parametrize("value", ["21", "-1", "", " 5", "5 ", "+5", "5.0", "1e1", "0x5",
                                   "0020", "٣", "true", CONTENT, 21, -1, 5.5, True, False,
                                   NAN, [5]])
def test_wait_seconds_refused(value):
    error = refusal(parse_wait_seconds, value, "wait", field="wait")
    assert error.message == "wait must be an integer from 0 to 20"


# -- strict integers (EXTENSIONS.md: "integer N..M") ----------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None), ({"n": None}, None), ({"n": 0}, 0), ({"n": 7}, 7), ({"n": 10}, 10),
])
def test_strict_integers_in_range(body, expected):
    assert strict_int(body, "n", 0, 10) == expected


@pytest.mark.parametrize("value", [-1, 11, 10**20, *NOT_INTEGERS, 0.0, 10.0, NAN, INF])
def test_strict_integers_refuse_floats_strings_booleans_and_the_out_of_range(value):
    error = refusal(strict_int, {"n": value}, "n", 0, 10, field="n")
    assert error.message == "n must be an integer from 0 to 10"


# -- reason of /v1/cancel -------------------------------------------------------------------


@pytest.mark.parametrize("reason", [None, "", "why", "r" * 1000, "😀" * 1000, "é" * 1000])
def test_a_reason_of_at_most_1000_code_points(reason):
    assert parse_reason({"reason": reason}) == reason
    assert parse_reason({}) is None


@pytest.mark.parametrize("reason", ["r" * 1001, "😀" * 1001, 5, True, [CONTENT],
                                    {"t": CONTENT}])
def test_a_reason_too_long_or_not_a_string_is_refused(reason):
    error = refusal(parse_reason, {"reason": reason}, field="reason")
    assert error.message == "reason must be a string of at most 1000 characters"


# -- ttlSeconds and delaySeconds of a send (§7) -------------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    ({}, (None, 0)), ({"ttlSeconds": None, "delaySeconds": None}, (None, 0)),
    ({"ttlSeconds": 1}, (1, 0)), ({"ttlSeconds": 10**9}, (10**9, 0)),
    ({"delaySeconds": 0}, (None, 0)), ({"delaySeconds": 86400}, (None, 86400)),
    ({"ttlSeconds": 60, "delaySeconds": 5}, (60, 5)),
])
def test_send_options(body, expected):
    assert parse_send_options(body) == expected


# The upper bound of ttlSeconds is the broker's (capabilities.messageTtl.maxSeconds),
# checked where the configuration is known. A fractional ttlSeconds is refused by
# the §10 number rule; §10 "TTL" says "a fractional TTL is floored to whole seconds",
# read here as the configured messageTtlDays (whose maxSeconds is an integer).
@pytest.mark.parametrize("value", [0, -1, 30.0, 30.5, "30", True, False, [1], INF])
def test_ttl_seconds_refused(value):
    error = refusal(parse_send_options, {"ttlSeconds": value}, field="ttlSeconds")
    assert error.message == "ttlSeconds must be an integer of at least 1"


@pytest.mark.parametrize("value", [-1, 86401, 5.0, 0.5, "5", True, False, [5]])
def test_delay_seconds_refused(value):
    error = refusal(parse_send_options, {"delaySeconds": value}, field="delaySeconds")
    assert error.message == "delaySeconds must be an integer from 0 to 86400"


# -- /v1/lease/renew (§1) ---------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "expected"), [(None, None), (1, 1), (86400, 86400)])
def test_a_renew_body(seconds, expected):
    body = {"messageId": "m", "leaseId": "l", "leaseSeconds": seconds}
    assert parse_renew(body) == ("m", "l", expected)
    assert parse_renew({"messageId": "m", "leaseId": "l"}) == ("m", "l", None)


@pytest.mark.parametrize(("body", "field"), [
    ({"leaseId": "l"}, "messageId"),
    ({"messageId": "m"}, "leaseId"),
    ({"messageId": 5, "leaseId": "l"}, "messageId"),
    ({"messageId": "m", "leaseId": ""}, "leaseId"),
    ({"messageId": "m", "leaseId": "l", "leaseSeconds": 0}, "leaseSeconds"),
    ({"messageId": "m", "leaseId": "l", "leaseSeconds": 86401}, "leaseSeconds"),
    ({"messageId": "m", "leaseId": "l", "leaseSeconds": 30.0}, "leaseSeconds"),  # §10
    ({"messageId": "m", "leaseId": "l", "leaseSeconds": "30"}, "leaseSeconds"),
    ({"messageId": "m", "leaseId": "l", "leaseSeconds": True}, "leaseSeconds"),
])
def test_refused_renew_bodies(body, field):
    refusal(parse_renew, body, field=field)


# -- reply in the ack (§6, §10) -------------------------------------------------------------


def test_a_reply_gets_its_defaults():
    reply = parse_reply({})
    assert str(uuid.UUID(reply["id"])) == reply["id"]
    assert {k: v for k, v in reply.items() if k != "id"} == {"body": {}, "kind": "reply",
                                                             "ack": False}
    assert parse_reply({"id": None, "body": None, "kind": None, "ack": None})["kind"] == "reply"


def test_a_full_reply_is_kept_and_unknown_keys_are_ignored():
    reply = {"id": "r-1", "body": {"answer": 42}, "kind": "message", "ack": True}
    assert parse_reply({**reply, "ttlSeconds": "x", "note": CONTENT, "type": 5}) == reply


@pytest.mark.parametrize("field", ["to", "from", "parentId", "replyTo", "rootId"])
@pytest.mark.parametrize("value", ["beta", None, CONTENT])
def test_the_broker_set_fields_in_a_reply_are_refused_even_null(field, value):
    error = refusal(parse_reply, {field: value}, field=f"reply.{field}")
    assert error.message == f"reply.{field} is set by the broker"


@pytest.mark.parametrize(("reply", "field"), [
    ({"id": ""}, "reply.id"), ({"id": 5}, "reply.id"), ({"id": ["r"]}, "reply.id"),
    ({"id": "x" * 257}, "reply.id"), ({"id": "relay-notice-1"}, "reply.id"),
    ({"body": []}, "reply.body"), ({"body": CONTENT}, "reply.body"),
    ({"kind": "request"}, "reply.kind"), ({"kind": CONTENT}, "reply.kind"),
    ({"ack": "yes"}, "reply.ack"), ({"ack": 1}, "reply.ack"),
])
def test_refused_replies(reply, field):
    refusal(parse_reply, reply, field=field)


@pytest.mark.parametrize("reply", [[], "text", 5, True])
def test_a_reply_must_be_an_object(reply):
    error = refusal(parse_reply, reply, field="reply")
    assert error.message == "reply must be an object"


# -- /v1/ack (v1.1 + §2, §6, §10) -------------------------------------------------------------


def ack(**fields):
    return {"messageId": "m", "leaseId": "l", "outcome": "completed", **fields}


def test_an_ack_body_becomes_an_ack_request():
    request = parse_ack(ack())
    assert isinstance(request, AckRequest)
    assert (request.message_id, request.lease_id, request.outcome, request.error,
            request.retry_after, request.reply) == ("m", "l", "completed", None, None, None)


@pytest.mark.parametrize("outcome", ["completed", "retry", "release", "reject"])
def test_every_outcome_is_taken_with_an_error(outcome):
    request = parse_ack(ack(outcome=outcome, error="e" * 1000))
    assert (request.outcome, request.error) == (outcome, "e" * 1000)


@pytest.mark.parametrize(("outcome", "seconds"), [("retry", 0), ("retry", 43200),
                                                  ("release", 5), ("release", None),
                                                  ("completed", None), ("reject", None)])
def test_retry_after_goes_with_retry_and_release(outcome, seconds):
    assert parse_ack(ack(outcome=outcome, retryAfterSeconds=seconds)).retry_after == seconds


def test_a_reply_goes_with_completed():
    request = parse_ack(ack(reply={"id": "r-1", "body": {"a": 1}}))
    assert request.reply == {"id": "r-1", "body": {"a": 1}, "kind": "reply", "ack": False}
    assert parse_ack(ack(outcome="retry", reply=None)).reply is None  # null = absent


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"messageId": None}, "messageId", "messageId is required (a non-empty string)"),
    ({"leaseId": 7}, "leaseId", "leaseId is required (a non-empty string)"),
    ({"outcome": None}, "outcome", None),
    ({"outcome": "done"}, "outcome", None),
    ({"outcome": "Completed"}, "outcome", None),
    ({"outcome": CONTENT}, "outcome", None),
    ({"error": 5}, "error", "error must be a string of at most 1000 characters"),
    ({"error": "e" * 1001}, "error", "error must be a string of at most 1000 characters"),
    ({"error": [CONTENT]}, "error", "error must be a string of at most 1000 characters"),
    ({"outcome": "retry", "retryAfterSeconds": 43201}, "retryAfterSeconds",
     "retryAfterSeconds must be an integer from 0 to 43200"),
    ({"outcome": "retry", "retryAfterSeconds": -1}, "retryAfterSeconds", None),
    ({"outcome": "retry", "retryAfterSeconds": 5.0}, "retryAfterSeconds", None),
    ({"outcome": "retry", "retryAfterSeconds": "5"}, "retryAfterSeconds", None),
    ({"outcome": "release", "retryAfterSeconds": True}, "retryAfterSeconds", None),
    ({"retryAfterSeconds": 5}, "retryAfterSeconds",
     "retryAfterSeconds goes only with retry or release"),
    ({"outcome": "reject", "retryAfterSeconds": 0}, "retryAfterSeconds",
     "retryAfterSeconds goes only with retry or release"),
    ({"outcome": "retry", "reply": {}}, "reply", "reply goes only with completed"),
    ({"outcome": "reject", "reply": {"body": {"t": CONTENT}}}, "reply",
     "reply goes only with completed"),
    ({"reply": []}, "reply", "reply must be an object"),
    ({"reply": {"to": "x"}}, "reply.to", "reply.to is set by the broker"),
])
def test_refused_ack_bodies(fields, field, message):
    error = refusal(parse_ack, ack(**fields), field=field)
    if message is not None:
        assert error.message == message


# -- cards (§8, §10, cards count code points) -------------------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    ({}, KEEP_CARD),
    ({"card": None}, None),
    ({"card": {}}, {}),
    ({"card": {"description": "d"}}, {"description": "d"}),
    ({"card": {"description": "é" * 2000}}, {"description": "é" * 2000}),
    ({"card": {"description": "😀" * 2000}}, {"description": "😀" * 2000}),
    ({"card": {"description": None, "skills": None}}, {}),
    ({"card": {"skills": []}}, {"skills": []}),
    ({"card": {"skills": ["s" * 100] * 50}}, {"skills": ["s" * 100] * 50}),
    ({"card": {"skills": ["", "😀" * 100]}}, {"skills": ["", "😀" * 100]}),
    ({"card": {"description": "", "skills": ["a", "a"]}}, {"description": "",
                                                           "skills": ["a", "a"]}),
])
def test_cards(body, expected):
    assert parse_card(body) == expected


def test_a_card_is_copied_not_shared():
    skills = ["a"]
    card = parse_card({"card": {"skills": skills}})
    skills.append("b")
    assert card == {"skills": ["a"]}


@pytest.mark.parametrize(("card", "field"), [
    ([], "card"), ("card", "card"), (5, "card"), (True, "card"),
    ({"name": "x"}, "card.name"), ({"description": "d", "Skills": []}, "card.Skills"),
    ({"description": "d" * 2001}, "card.description"),
    ({"description": "😀" * 2001}, "card.description"),
    ({"description": 5}, "card.description"), ({"description": [CONTENT]}, "card.description"),
    ({"skills": "s"}, "card.skills"), ({"skills": ["s"] * 51}, "card.skills"),
    ({"skills": ["s" * 101]}, "card.skills"), ({"skills": [5]}, "card.skills"),
    ({"skills": [None]}, "card.skills"), ({"skills": {"a": CONTENT}}, "card.skills"),
])
def test_refused_cards(card, field):
    refusal(parse_card, {"card": card}, field=field)


# -- GET /peers paging --------------------------------------------------------------------------


@pytest.mark.parametrize(("query", "expected"), [
    ((None, None, None), (None, None, True)),
    (("", None, None), (None, None, True)),
    (("alpha", None, None), ("alpha", None, True)),
    ((None, "10", None), (None, 10, True)),
    ((None, " 10 ", None), (None, 10, True)),
    ((None, "0", None), (None, 1, True)),
    ((None, "-4", None), (None, 1, True)),
    ((None, "2.9", None), (None, 2, True)),
    ((None, "1000", None), (None, 1000, True)),
    ((None, "1001", None), (None, MAX_PEERS_LIMIT, True)),
    ((None, "", None), (None, None, True)),
    ((None, "x", None), (None, None, True)),
    ((None, "nan", None), (None, None, True)),
    ((None, "inf", None), (None, None, True)),
    ((None, None, "true"), (None, None, True)),
    ((None, None, "1"), (None, None, True)),
    ((None, None, "false"), (None, None, False)),
    ((None, None, "0"), (None, None, False)),
])
def test_peers_query(query, expected):
    assert parse_peers_query(*query) == expected


@pytest.mark.parametrize(("query", "field"), [
    (("a" * 257, None, None), "after"),
    ((None, None, ""), "cards"), ((None, None, "True"), "cards"), ((None, None, "yes"), "cards"),
    ((None, None, CONTENT), "cards"),
])
def test_refused_peers_queries(query, field):
    refusal(parse_peers_query, *query, field=field)


def peers(*names, card=None):
    return [{"agent": n, "online": True, "lastSeen": 1, **({"card": card} if card else {})}
            for n in names]


def test_a_peers_page_without_more_is_the_seed_shape():
    entries = peers("a", "b", "c")
    assert peers_page(entries, None, None) == {"peers": entries}
    assert peers_page(entries, None, 3) == {"peers": entries}
    assert peers_page([], None, None) == {"peers": []}


def test_peers_pages_follow_next():
    entries = peers("a", "b", "c", "d", "e")
    first = peers_page(entries, None, 2)
    assert first == {"peers": entries[:2], "next": "b"}
    second = peers_page(entries, first["next"], 2)
    assert second == {"peers": entries[2:4], "next": "d"}
    assert peers_page(entries, second["next"], 2) == {"peers": entries[4:]}
    assert peers_page(entries, "e", 2) == {"peers": []}
    assert peers_page(entries, "bb", None) == {"peers": entries[2:]}  # after a gone name


def test_a_peers_page_stops_at_its_byte_budget_but_never_empty():
    card = {"description": "d" * 1000}
    entries = peers("a", "b", "c", card=card)
    one = peers_page(entries, None, None, budget=10)
    assert one == {"peers": entries[:1], "next": "a"}
    two = peers_page(entries, None, None, budget=2 * 1100)
    assert two == {"peers": entries[:2], "next": "b"}
    assert peers_page(entries, None, None) == {"peers": entries}
    assert PEERS_BUDGET_BYTES == 4 * 1024 * 1024


class Team:
    def __init__(self, *members):
        self.members = members


def test_team_listing_is_sorted_by_name():
    teams = {"zeta": Team("b", "a"), "alpha": Team(), "mid": Team("x")}
    assert team_listing(teams) == [{"name": "alpha", "members": []},
                                   {"name": "mid", "members": ["x"]},
                                   {"name": "zeta", "members": ["b", "a"]}]
    assert team_listing({}) == []


# -- /v1/status ids ---------------------------------------------------------------------------


def test_status_ids_are_the_first_200():
    ids = [f"m{i}" for i in range(250)]
    assert parse_status_ids({"messageIds": ids}) == ids[:200]
    assert parse_status_ids({"messageIds": []}) == []


def test_status_ids_that_are_numbers_become_their_text():
    # The reference maps every id through String(); a number names no stored id
    # (ids are strings) but is not refused.
    assert parse_status_ids({"messageIds": [5, -1, "5"]}) == ["5", "-1", "5"]


@pytest.mark.parametrize("ids", [None, "m1", {"0": "m1"}, 5])
def test_status_ids_must_be_an_array(ids):
    error = refusal(parse_status_ids, {"messageIds": ids}, field="messageIds")
    assert error.message == "messageIds array is required"
    refusal(parse_status_ids, {}, field="messageIds")


@pytest.mark.parametrize("value", [None, True, ["m1"], {"id": CONTENT}, "x" * 257])
def test_status_ids_that_are_not_ids_are_refused(value):
    refusal(parse_status_ids, {"messageIds": ["ok", value]}, field="messageIds")


def test_only_the_first_200_status_ids_are_checked():
    assert len(parse_status_ids({"messageIds": ["m"] * 200 + [None]})) == 200


# -- query filters (v1.1, §5) ---------------------------------------------------------------


def test_query_filters_default_to_the_inbox_and_no_filter():
    assert parse_query_filters({}) == {"kind": None, "status": None, "from": None, "to": None,
                                       "rootId": None, "parentId": None, "box": "inbox"}


@pytest.mark.parametrize("field", ["kind", "status", "from", "to", "rootId", "parentId"])
def test_each_query_filter(field):
    assert parse_query_filters({field: "v"})[field] == "v"
    assert parse_query_filters({field: ""})[field] is None
    assert parse_query_filters({field: None})[field] is None
    for value in (5, True, ["v"], {"v": CONTENT}):
        error = refusal(parse_query_filters, {field: value}, field=field)
        assert error.message == f"{field} must be a string"
    refusal(parse_query_filters, {field: "v" * 257}, field=field)


@pytest.mark.parametrize("box", ["inbox", "sent", "all"])
def test_query_boxes(box):
    assert parse_query_filters({"box": box})["box"] == box


@pytest.mark.parametrize("box", ["", "Inbox", "trash", 1, True, ["all"], CONTENT])
def test_an_invalid_box_is_refused(box):
    error = refusal(parse_query_filters, {"box": box}, field="box")
    assert error.message == 'box must be "inbox", "sent" or "all"'
