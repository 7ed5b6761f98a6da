"""relay.rules.auth on its own (spec §3): signatures, skew, headers, names, lockout,
per-agent secrets, rate limits and bounded tables. Pure: a ``task.Clock``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from relay.rules.auth import Authenticator, Lockout, RateLimiter
from relay.rules.config import AgentConfig
from relay.testing import START
from relay.wire.errors import RelayError
from relay.wire.protocol import is_loopback_host
from relay.wire.signing import sign

SECRET = "s3cret"
NOW = 1_712_345_678
BODY = b'{"id":"m-1","to":"beta","body":{"text":"hi"}}'


def hmac_hex(secret: str, text: bytes) -> str:
    return hmac.new(secret.encode(), text, hashlib.sha256).hexdigest()


def clock_at(now: float = NOW) -> Clock:
    c = Clock()
    c.advance(now)
    return c


def make_auth(clock: Clock, agents=None, after: int = 5, seconds: float = 300.0,
              max_tracked: int = 50_000) -> Authenticator:
    return Authenticator(clock, SECRET, agents or {}, after, seconds, max_tracked)


def check(auth: Authenticator, agent: Optional[str] = "alpha", method: str = "POST",
          path: str = "/messages", body: bytes = BODY, timestamp: Optional[int] = None,
          secret: str = SECRET, signature: Optional[str] = None,
          source: str = "10.0.0.1") -> str:
    ts = int(auth.clock.seconds()) if timestamp is None else timestamp
    sig = signature if signature is not None else sign(secret, method, path, ts, body)
    return auth.verify(
        method.encode(), path.encode(), None if agent is None else agent.encode(),
        str(ts).encode(), sig.encode(), body, source=source,
    ).agent


def refused(f, *args, **kwargs) -> RelayError:
    with pytest.raises(RelayError) as info:
        f(*args, **kwargs)
    return info.value


# -- signing string and vectors -------------------------------------------------------


def test_signature_vector_matches_independent_hmac():
    expected = hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + BODY)
    assert sign(SECRET, "POST", "/messages", NOW, BODY) == expected
    auth = make_auth(clock_at())
    assert check(auth, signature=expected) == "alpha"


def test_signature_with_query_string_and_empty_body():
    path = "/messages?since=abc&limit=50"
    expected = hmac_hex(SECRET, b"GET\n/messages?since=abc&limit=50\n1712345678\n")
    assert sign(SECRET, "GET", path, NOW, b"") == expected
    auth = make_auth(clock_at())
    assert check(auth, method="GET", path=path, body=b"", signature=expected) == "alpha"
    e = refused(check, make_auth(clock_at()), method="GET", path="/messages", body=b"",
                signature=expected)
    assert (e.status, e.code) == (401, "unauthenticated"), "the query string is signed"


def test_signature_over_utf8_body_bytes():
    body = '{"to":"beta","body":{"t":"héllo ✓"}}'.encode()
    expected = hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + body)
    assert check(make_auth(clock_at()), body=body, signature=expected) == "alpha"


def test_uppercase_hex_signature_is_accepted():
    sig = hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + BODY).upper()
    assert check(make_auth(clock_at()), signature=sig) == "alpha"


@pytest.mark.parametrize("tamper", ["method", "path", "body", "timestamp", "secret"])
def test_any_change_breaks_the_signature(tamper):
    auth = make_auth(clock_at())
    sig = sign(SECRET, "POST", "/messages", NOW, BODY)
    kwargs = {"signature": sig}
    if tamper == "method":
        kwargs["method"] = "PUT"
    elif tamper == "path":
        kwargs["path"] = "/messages?x=1"
    elif tamper == "body":
        kwargs["body"] = BODY + b" "
    elif tamper == "timestamp":
        kwargs["timestamp"] = NOW - 1
    else:
        kwargs = {"secret": "other"}
    e = refused(check, auth, **kwargs)
    assert (e.status, e.code) == (401, "unauthenticated")


# -- skew ------------------------------------------------------------------------------


@pytest.mark.parametrize(("offset", "ok"), [(-300, True), (300, True), (-301, False),
                                            (301, False), (0, True), (-10**9, False)])
def test_skew_boundary_is_300_seconds(offset, ok):
    auth = make_auth(clock_at())
    if ok:
        assert check(auth, timestamp=NOW + offset) == "alpha"
    else:
        e = refused(check, auth, timestamp=NOW + offset)
        assert (e.status, e.code) == (401, "unauthenticated")


@pytest.mark.parametrize(("offset", "ok"), [(-300, True), (300, True), (-301, False),
                                            (301, False)])
def test_skew_boundary_holds_between_whole_seconds(offset, ok):
    """The clock is read in whole seconds, as the timestamps are: at NOW + 0.9 s a
    timestamp 300 s old is still inside the window."""
    auth = make_auth(clock_at(NOW + 0.9))
    if ok:
        assert check(auth, timestamp=NOW + offset) == "alpha"
    else:
        assert refused(check, auth, timestamp=NOW + offset).code == "unauthenticated"


def test_skew_uses_the_clock():
    clock = clock_at()
    auth = make_auth(clock)
    clock.advance(301)
    assert refused(check, auth, timestamp=NOW).code == "unauthenticated"


@pytest.mark.parametrize("timestamp", [b"", b"abc", b"1712345678.0", b"+1712345678",
                                       b"1e9", b"9" * 40])
def test_malformed_timestamp_is_401(timestamp):
    auth = make_auth(clock_at())
    sig = sign(SECRET, "POST", "/messages", NOW, BODY).encode()
    e = refused(auth.verify, b"POST", b"/messages", b"alpha", timestamp, sig, BODY)
    assert (e.status, e.code) == (401, "unauthenticated")


# -- headers and names -------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["agent", "timestamp", "signature"])
@pytest.mark.parametrize("value", [None, b""])
def test_missing_or_empty_headers_are_401(missing, value):
    auth = make_auth(clock_at())
    headers = {"agent": b"alpha", "timestamp": str(NOW).encode(),
               "signature": sign(SECRET, "POST", "/messages", NOW, BODY).encode()}
    headers[missing] = value
    e = refused(auth.verify, b"POST", b"/messages", headers["agent"],
                headers["timestamp"], headers["signature"], BODY)
    assert (e.status, e.code) == (401, "unauthenticated")


@pytest.mark.parametrize("name", ["a" * 65, "bad name", "a/b", "ünï", "a\nb", "a:b", "*"])
def test_bad_agent_names_are_401(name):
    auth = make_auth(clock_at())
    e = refused(auth.verify, b"POST", b"/messages", name.encode("utf-8"),
                str(NOW).encode(), sign(SECRET, "POST", "/messages", NOW, BODY).encode(), BODY)
    assert (e.status, e.code) == (401, "unauthenticated")


@pytest.mark.parametrize("name", ["a", "a" * 64, "Agent_1.x-y", "0"])
def test_good_agent_names(name):
    assert check(make_auth(clock_at()), agent=name) == name


# -- lockout -------------------------------------------------------------------------------


def test_lockout_after_five_failures_even_with_a_valid_signature():
    clock = clock_at()
    auth = make_auth(clock)
    for _ in range(4):
        assert refused(check, auth, secret="wrong").code == "unauthenticated"
    assert check(auth) == "alpha", "four failures do not lock"
    for _ in range(5):
        assert refused(check, auth, secret="wrong").code == "unauthenticated"
    e = refused(check, auth)
    assert (e.status, e.code) == (403, "locked")
    assert check(auth, agent="beta") == "beta", "the lock is per agent"


def test_unlock_after_lock_minutes():
    clock = clock_at()
    auth = make_auth(clock, seconds=300.0)
    for _ in range(5):
        refused(check, auth, secret="wrong")
    assert "; try again in 5 min, " in refused(check, auth).message
    clock.advance(299.5)
    locked = refused(check, auth)
    assert locked.code == "locked"
    assert locked.message == (
        "agent alpha is locked for this address after repeated authentication failures; "
        "try again in 1 s, or an operator clears it with `relay unlock alpha` or the dashboard"
    )
    clock.advance(0.5)
    assert check(auth) == "alpha"


def test_the_locked_message_counts_whole_minutes_up():
    clock = clock_at()
    auth = make_auth(clock, seconds=600.0)
    for _ in range(5):
        refused(check, auth, secret="wrong")
    clock.advance(61)
    assert "try again in 9 min, " in refused(check, auth).message  # 539 s left
    clock.advance(480)
    assert "try again in 59 s, " in refused(check, auth).message


def test_a_lock_holds_for_the_failing_address_only():
    """Five bad signatures from the attacker's address lock that address out for
    the agent; the agent's own address is served as before."""
    clock = clock_at()
    auth = make_auth(clock)
    for _ in range(5):
        refused(check, auth, secret="wrong", source="203.0.113.66")
    e = refused(check, auth, source="203.0.113.66")
    assert (e.status, e.code) == (403, "locked") and "for this address" in e.message
    assert check(auth, source="10.0.0.1") == "alpha"
    assert check(auth, source="127.0.0.1") == "alpha"
    assert auth.lockout.locks() == [("alpha", "203.0.113.66", 300.0)]


def test_failures_from_several_addresses_lock_the_agent_everywhere():
    clock = clock_at()
    heard = []
    auth = Authenticator(clock, SECRET, {}, on_lock=lambda *lock: heard.append(lock))
    for source in ("203.0.113.1", "203.0.113.2", "203.0.113.1", "203.0.113.2"):
        refused(check, auth, secret="wrong", source=source)
    assert check(auth, source="10.0.0.1") == "alpha", "two addresses: no agent-wide lock"
    refused(check, auth, secret="wrong", source="198.51.100.7")  # a third address, 5th failure
    e = refused(check, auth, source="10.0.0.1")
    assert (e.status, e.code) == (403, "locked")
    assert e.message.startswith("agent alpha is locked after authentication failures from "
                                "several addresses; try again in 5 min")
    assert heard == [("alpha", "*")]
    assert check(auth, agent="beta", source="10.0.0.1") == "beta", "the lock is per agent"
    clock.advance(300)
    assert check(auth, source="10.0.0.1") == "alpha"


def test_the_agent_wide_count_covers_one_lock_period():
    clock = clock_at()
    auth = make_auth(clock)
    for source in ("203.0.113.1", "203.0.113.2", "203.0.113.1", "203.0.113.2"):
        refused(check, auth, secret="wrong", source=source)
    clock.advance(300)  # the period of the first failure is over: the count starts again
    refused(check, auth, secret="wrong", source="198.51.100.7")
    assert check(auth, source="10.0.0.1") == "alpha"


def test_failures_from_one_address_never_lock_the_agent_everywhere():
    clock = clock_at()
    auth = make_auth(clock, seconds=60.0)
    for _ in range(10):  # an attacker that comes back as each lock ends
        for _ in range(5):
            refused(check, auth, secret="wrong", source="203.0.113.66")
        assert refused(check, auth, source="203.0.113.66").code == "locked"
        assert check(auth, source="10.0.0.1") == "alpha"
        clock.advance(60)


@pytest.mark.parametrize("per_address", [1, 4, 5])
def test_any_number_of_addresses_gets_at_most_eleven_guesses_a_period(per_address):
    """Five from each of two addresses, then the first from a third locks the agent:
    2 x lockAfterFailures + 1 guesses however many addresses try."""
    auth = make_auth(clock_at())
    guesses = 0
    for i in range(1000):
        for _ in range(per_address):
            error = refused(check, auth, secret="wrong", source=f"10.0.{i >> 8}.{i & 255}")
            if error.code == "locked":
                break
            guesses += 1
        else:
            continue
        break
    assert refused(check, auth, source="192.0.2.1").code == "locked"
    assert guesses <= 11 and guesses == {1: 5, 4: 9, 5: 11}[per_address]


def test_lockout_counts_ipv6_addresses_per_64():
    auth = make_auth(clock_at())
    for i in range(5):
        refused(check, auth, secret="wrong", source=f"2001:db8:1:2::{i + 1:x}")
    assert refused(check, auth, source="2001:db8:1:2:ffff::9").code == "locked"
    assert check(auth, source="2001:db8:1:3::1") == "alpha"
    assert auth.lockout.locks()[0][1] == "2001:db8:1:2::/64"


def test_a_success_resets_the_count_of_its_own_address_only():
    auth = make_auth(clock_at())
    for _ in range(4):
        refused(check, auth, secret="wrong", source="203.0.113.66")
    assert check(auth, source="10.0.0.1") == "alpha"
    refused(check, auth, secret="wrong", source="203.0.113.66")
    assert refused(check, auth, source="203.0.113.66").code == "locked"


def test_an_operator_unlock_clears_every_lock_and_count_of_the_agent():
    clock = clock_at()
    auth = make_auth(clock)
    for source in ("203.0.113.1", "203.0.113.2", "198.51.100.7", "203.0.113.1", "203.0.113.2"):
        refused(check, auth, secret="wrong", source=source)
    for _ in range(4):
        refused(check, auth, agent="beta", secret="wrong")
    assert refused(check, auth).code == "locked"
    assert auth.lockout.unlock("alpha") == (1, None)
    assert check(auth) == "alpha"
    assert auth.lockout.unlock("alpha") == (0, None)
    refused(check, auth, agent="beta", secret="wrong")
    assert refused(check, auth, agent="beta").code == "locked", "beta's count stays"


def test_a_bad_signature_says_what_to_check():
    error = refused(check, make_auth(clock_at()), secret="wrong")
    assert (error.code, error.message) == (
        "unauthenticated",
        "invalid signature; check the secret and the clock",
    )


def test_success_resets_the_failure_count():
    auth = make_auth(clock_at())
    for _ in range(3):
        for _ in range(4):
            refused(check, auth, secret="wrong")
        assert check(auth) == "alpha"


def test_skew_failures_count_towards_the_lockout():
    auth = make_auth(clock_at(), after=2)
    refused(check, auth, timestamp=NOW - 1000)
    refused(check, auth, timestamp=NOW + 1000)
    assert refused(check, auth).code == "locked"


def test_lockout_threshold_is_configurable():
    auth = make_auth(clock_at(), after=1)
    refused(check, auth, secret="wrong")
    assert refused(check, auth).code == "locked"


def test_lockout_from_config_minutes():
    from relay.testing import SECRET as CONFIG_SECRET
    from relay.testing import make_config

    clock = clock_at()
    auth = Authenticator.from_config(
        make_config(security={"lockAfterFailures": 2, "lockMinutes": 1}), clock)
    refused(check, auth, secret="wrong")
    refused(check, auth, secret="wrong")
    assert refused(check, auth, secret=CONFIG_SECRET).code == "locked"
    clock.advance(60)
    assert check(auth, secret=CONFIG_SECRET) == "alpha"


# -- per-agent secrets --------------------------------------------------------------------


def test_per_agent_secrets():
    agents = {"alpha": AgentConfig(secret="a-key"), "beta": AgentConfig(secret="b-key")}
    auth = make_auth(clock_at(), agents=agents)
    assert check(auth, agent="alpha", secret="a-key") == "alpha"
    assert check(auth, agent="beta", secret="b-key") == "beta"
    assert refused(check, auth, agent="alpha", secret="b-key").code == "unauthenticated"
    assert refused(check, auth, agent="alpha", secret=SECRET).code == "unauthenticated"
    e = refused(check, auth, agent="gamma", secret=SECRET)
    assert (e.status, e.code) == (401, "unknown_agent")


def test_without_agent_secrets_the_shared_secret_signs_for_everyone():
    agents = {"alpha": AgentConfig(allowed_targets=("beta",))}
    auth = make_auth(clock_at(), agents=agents)
    assert check(auth, agent="alpha") == "alpha"
    assert check(auth, agent="anyone") == "anyone"


# -- rate limits ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.8.7", "::1", "::ffff:127.0.0.1",
                                  "0:0:0:0:0:0:0:1", "::1%lo", "localhost"])
def test_loopback_addresses(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "192.168.1.2", "::ffff:10.0.0.1", "2001:db8::1",
                                  "0.0.0.0", "::", "unix", "localhost.evil.example",
                                  "fe80::1%lo", ""])
def test_remote_addresses(host):
    assert not is_loopback_host(host)


@pytest.mark.parametrize(("host", "limit"), [("127.0.0.1", 6), ("::1", 6),
                                             ("::ffff:127.0.0.1", 6), ("10.1.2.3", 3),
                                             ("::ffff:10.1.2.3", 3), ("2001:db8::7", 3)])
def test_rate_limit_per_address_per_minute(host, limit):
    clock = clock_at(60 * 1000)  # the start of a minute
    limiter = RateLimiter(clock, loopback=6, remote=3)
    for _ in range(limit):
        limiter.hit(host)
    e = refused(limiter.hit, host)
    assert (e.status, e.code) == (429, "rate_limited")
    limiter.hit("10.9.9.9")  # another address has its own budget
    clock.advance(120)
    for _ in range(limit):
        limiter.hit(host)
    assert refused(limiter.hit, host).code == "rate_limited"


def test_a_429_names_the_key_and_the_limit():
    limiter = RateLimiter(clock_at(60 * 1000), loopback=6, remote=3)
    for host, key, limit in (("127.0.0.1", "rateLimitLoopback", 6),
                             ("10.0.0.1", "rateLimitRemote", 3)):
        for _ in range(limit):
            limiter.hit(host)
        assert refused(limiter.hit, host).message == (
            f"rate limit exceeded: broker.{key} allows {limit} requests a minute from one "
            "address; slow down and retry")


def test_the_first_refusal_of_an_address_each_minute_is_reported():
    clock = clock_at(60 * 1000)
    heard = []
    limiter = RateLimiter(clock, loopback=2, remote=2,
                          on_refusal=lambda *refusal: heard.append(refusal))
    for _ in range(2):
        limiter.hit("10.0.0.1")
        limiter.hit("2001:db8::1")
    for _ in range(50):
        refused(limiter.hit, "10.0.0.1")
    refused(limiter.hit, "2001:db8::7")
    assert heard == [("10.0.0.1", "rateLimitRemote", 2),
                     ("2001:db8::/64", "rateLimitRemote", 2)]
    clock.advance(59)
    refused(limiter.hit, "10.0.0.1")
    assert len(heard) == 2, "once a minute"
    clock.advance(1)  # a new minute, the last one still weighs in full
    refused(limiter.hit, "10.0.0.1")
    assert heard[2:] == [("10.0.0.1", "rateLimitRemote", 2)]
    clock.advance(120)
    limiter.hit("10.0.0.1")
    assert len(heard) == 3


def test_rate_limit_default_budgets():
    clock = clock_at(60 * 1000)
    limiter = RateLimiter(clock, loopback=600, remote=120)
    for _ in range(600):
        limiter.hit("127.0.0.1")
    assert refused(limiter.hit, "127.0.0.1").code == "rate_limited"
    for _ in range(120):
        limiter.hit("203.0.113.5")
    assert refused(limiter.hit, "203.0.113.5").code == "rate_limited"


def test_rate_limit_slides_across_minutes():
    clock = clock_at(60 * 1000 + 30)  # half way through a minute
    limiter = RateLimiter(clock, loopback=10, remote=10)
    for _ in range(10):
        limiter.hit("10.0.0.1")
    clock.advance(30)  # a new minute begins: the last one still counts in full
    assert refused(limiter.hit, "10.0.0.1").code == "rate_limited"
    clock.advance(30)  # half of the previous minute remains in the window
    for _ in range(5):
        limiter.hit("10.0.0.1")
    assert refused(limiter.hit, "10.0.0.1").code == "rate_limited"


def test_refused_requests_do_not_extend_the_block():
    clock = clock_at(60 * 1000)
    limiter = RateLimiter(clock, loopback=2, remote=2)
    limiter.hit("10.0.0.1")
    limiter.hit("10.0.0.1")
    for _ in range(100):
        refused(limiter.hit, "10.0.0.1")
    clock.advance(120)
    limiter.hit("10.0.0.1")
    limiter.hit("10.0.0.1")


# -- bounded tables ---------------------------------------------------------------------------


def test_failure_and_lock_tables_are_bounded():
    auth = make_auth(clock_at(), after=2, max_tracked=1000)
    for i in range(100_000):
        refused(check, auth, agent=f"agent{i}", secret="wrong")
    failures, locks = auth.lockout.tracked()
    assert failures <= 1000 and locks <= 1000
    for i in range(5000):
        name = f"burn{i}"
        refused(check, auth, agent=name, secret="wrong")
        refused(check, auth, agent=name, secret="wrong")
    failures, locks = auth.lockout.tracked()
    assert failures <= 1000 and 0 < locks <= 1000


def test_default_tables_stay_bounded_for_100k_names():
    lockout = Lockout(clock_at(), after=5, seconds=300)
    for i in range(100_000):
        lockout.failed(f"agent{i}", "10.0.0.1")
    assert lockout.tracked()[0] <= 50_000


def test_the_addresses_counted_for_one_agent_are_bounded():
    """An attacker cycling through addresses gets no table entry per address: after
    five failures from three addresses the agent is locked, and its counts go."""
    auth = make_auth(clock_at())
    for i in range(10_000):
        refused(check, auth, secret="wrong", source=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert auth.lockout.tracked() == (0, 1)
    assert [(agent, address) for agent, address, _ in auth.lockout.locks()] == [("alpha", "*")]
    lockout = Lockout(clock_at(), after=5, seconds=300)
    for i in range(10_000):  # four from each address, two addresses a period
        clock = lockout.clock
        for _ in range(2):
            lockout.failed("alpha", f"10.0.{i >> 8 & 255}.{i & 255}")
        clock.advance(300)
    assert all(len(counts) <= 64 for counts in lockout._failures.values())


def test_rate_windows_are_bounded():
    limiter = RateLimiter(clock_at(), loopback=600, remote=120, max_tracked=1000)
    for i in range(100_000):
        limiter.hit(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert limiter.tracked() <= 1000
    limiter = RateLimiter(clock_at(), loopback=600, remote=120)
    for i in range(100_000):
        limiter.hit(f"2001:db8:{i >> 16:x}:{i & 0xffff:x}::1")
    assert limiter.tracked() <= 50_000


def test_ipv6_clients_are_limited_per_64():
    limiter = RateLimiter(clock_at(), loopback=600, remote=3)
    for i in range(3):
        limiter.hit(f"2001:db8:1:2::{i + 1:x}")  # three addresses of one /64
    assert refused(limiter.hit, "2001:db8:1:2:ffff::9").code == "rate_limited"
    limiter.hit("2001:db8:1:3::1")  # the next /64 has its own window
    limiter.hit("::ffff:10.0.0.1")  # an IPv4-mapped address counts as IPv4
    for _ in range(2):
        limiter.hit("10.0.0.1")
    assert refused(limiter.hit, "10.0.0.1").code == "rate_limited"
    for _ in range(600):
        limiter.hit("::1")  # loopback keeps its own address and limit


def test_lockout_and_rate_tables_stay_bounded_for_thousands_of_names_and_addresses():
    clock = Clock()
    clock.advance(START)
    auth = Authenticator(clock, "s3cret", {}, max_tracked=1000)
    for i in range(20_000):
        # Every name and address fails once: none is locked, each is refused as a bad login.
        with pytest.raises(RelayError) as refused:
            auth.verify(b"GET", b"/peers", f"a{i}".encode(), b"%d" % int(START), b"00", b"",
                        source=f"10.0.{i >> 8 & 255}.{i & 255}")
        assert (refused.value.status, refused.value.code) == (401, "unauthenticated")
    failures, locks = auth.lockout.tracked()
    assert failures <= 1000 and locks <= 1000
    # A real agent is still served, and its own lock still works.
    ok = sign("s3cret", "GET", "/peers", int(START))
    assert auth.verify(b"GET", b"/peers", b"alpha", b"%d" % int(START), ok.encode(),
                       b"", source="10.0.0.1").agent == "alpha"

    limiter = RateLimiter(clock, 600, 120, max_tracked=1000)
    for i in range(50_000):
        limiter.hit(f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}")
        if i % 5000 == 0:
            clock.advance(1)
    assert limiter.tracked() <= 1000
    for _ in range(120):
        limiter.hit("192.0.2.1")
    with pytest.raises(RelayError) as refused:
        limiter.hit("192.0.2.1")
    assert (refused.value.status, refused.value.code) == (429, "rate_limited")


# -- several secrets (rotation), failure reasons, reloads ------------------------------


def test_any_of_several_shared_secrets_verifies():
    auth = Authenticator(clock_at(), "new", {}, shared_secrets=("new", "old"))
    assert check(auth, secret="new") == "alpha"
    assert check(auth, secret="old") == "alpha"
    assert refused(check, auth, secret="other").code == "unauthenticated"


def test_any_of_an_agents_secrets_verifies_and_only_its_own():
    agents = {"alpha": AgentConfig(secrets=("a2", "a1")), "beta": AgentConfig(secret="b")}
    auth = Authenticator(clock_at(), SECRET, agents)
    assert check(auth, "alpha", secret="a1") == "alpha"
    assert check(auth, "alpha", secret="a2") == "alpha"
    assert refused(check, auth, "alpha", secret="b").code == "unauthenticated"
    assert refused(check, auth, "beta", secret="a1").code == "unauthenticated"


def test_every_refusal_names_its_reason():
    heard = []
    auth = Authenticator(clock_at(), SECRET, {}, lock_after_failures=2, on_failure=heard.append)
    refused(auth.verify, b"GET", b"/peers", None, b"1", b"x", b"")
    refused(check, auth, "bad name")
    refused(check, auth, timestamp=NOW - 1000)
    refused(check, auth, signature="0" * 64)
    refused(check, auth)  # locked now
    bad_ts = auth.verify
    refused(bad_ts, b"GET", b"/", b"beta", b"soon", b"x", b"")
    per_agent = Authenticator(clock_at(), SECRET, {"a": AgentConfig(secret="x")},
                              on_failure=heard.append)
    refused(check, per_agent, "zed")
    assert heard == ["missing_headers", "bad_agent_name", "clock_skew", "bad_signature",
                     "locked", "bad_timestamp", "unknown_agent"]


def test_a_replacement_authenticator_keeps_the_locks_under_new_settings():
    clock = clock_at()
    old = Authenticator(clock, SECRET, {}, lock_after_failures=1, lock_seconds=60)
    refused(check, old, signature="0" * 64)
    new = Authenticator(clock, "other", {}, lock_after_failures=3, lock_seconds=600,
                        lockout=old.lockout)
    assert new.lockout is old.lockout and (new.lockout.after, new.lockout.seconds) == (3, 600)
    assert refused(check, new, secret="other").code == "locked"


# -- signed nonce (EXTENSIONS.md §9) -----------------------------------------------------------

NONCE = "n0nce-0123456789_AB"


def check_nonce(auth: Authenticator, agent: str = "alpha", nonce: str = NONCE,
                secret: str = SECRET, signed_agent: Optional[str] = None,
                timestamp: Optional[int] = None) -> str:
    ts = int(auth.clock.seconds()) if timestamp is None else timestamp
    sig = sign(secret, "POST", "/messages", ts, BODY, signed_agent or agent, nonce)
    return auth.verify(b"POST", b"/messages", agent.encode(), str(ts).encode(),
                       sig.encode(), BODY, nonce.encode()).agent


def test_the_nonce_signing_string_has_the_agent_and_the_nonce():
    expected = hmac_hex(SECRET, b"POST\n/messages\n1712345678\n" + BODY + b"\nalpha\n" +
                        NONCE.encode())
    assert sign(SECRET, "POST", "/messages", NOW, BODY, "alpha", NONCE) == expected
    assert check_nonce(make_auth(clock_at())) == "alpha"


def test_a_nonce_is_accepted_once_and_a_replay_does_not_lock():
    auth = make_auth(clock_at(), after=2)
    check_nonce(auth)
    for _ in range(5):
        e = refused(check_nonce, auth)
        assert (e.status, e.code) == (401, "unauthenticated") and "replayed" in e.message
    assert check_nonce(auth, nonce=NONCE + "x") == "alpha", "replays did not lock the agent"
    assert check_nonce(auth, agent="beta") == "beta", "nonces are per agent"


def test_the_signature_covers_the_agent_name_with_a_nonce():
    auth = make_auth(clock_at())
    e = refused(check_nonce, auth, agent="beta", signed_agent="alpha")
    assert e.message.startswith("invalid signature")


@pytest.mark.parametrize("nonce", ["short", "x" * 65, "has space0123456789", "ünicode-0123456789",
                                   "slash/0123456789abc", ""])
def test_a_malformed_nonce_is_401(nonce):
    auth = make_auth(clock_at())
    assert refused(check_nonce, auth, nonce=nonce).code == "unauthenticated"


def test_require_nonce_refuses_requests_without_one():
    auth = Authenticator(clock_at(), SECRET, {}, require_nonce=True)
    assert "requires X-Relay-Nonce" in refused(check, auth).message
    assert check_nonce(auth) == "alpha"


def test_seen_nonces_expire_with_the_window_and_a_full_table_is_503():
    clock = clock_at()
    auth = Authenticator(clock, SECRET, {}, max_nonces=3)
    for i in range(3):
        check_nonce(auth, nonce=f"{NONCE}{i}")
    e = refused(check_nonce, auth, nonce=NONCE + "full")
    assert (e.status, e.code) == (503, "busy")
    assert len(auth.nonces) == 3, "no nonce was forgotten to make room"
    clock.advance(301)
    assert check_nonce(auth, nonce=NONCE + "later") == "alpha"
    assert len(auth.nonces) == 1, "expired entries were dropped"
    e = refused(check_nonce, auth, nonce=f"{NONCE}0", timestamp=NOW)
    assert e.message == "timestamp skew", "an old nonce is refused by the window itself"


class Reports:
    """A SharedLockouts that records what a Lockout reports."""

    def __init__(self) -> None:
        self.seen = []

    def failed(self, agent: str, address: str) -> Deferred:
        self.seen.append(("failed", agent, address))
        return succeed(None)

    def succeeded(self, agent: str, address: str) -> None:
        self.seen.append(("succeeded", agent, address))

    def unlocked(self, agent: str) -> Deferred:
        self.seen.append(("unlocked", agent))
        return succeed(None)


def test_a_shared_lockout_reports_and_takes_locks_decided_elsewhere():
    clock = clock_at()
    shared = Reports()
    lockout = Lockout(clock, after=3, seconds=300, shared=shared)
    assert lockout.failed("a", "::ffff:10.0.0.1").shared.called
    lockout.succeeded("a", "10.0.0.1")
    assert shared.seen == [("failed", "a", "10.0.0.1"), ("succeeded", "a", "10.0.0.1")]
    lockout.failed("b", "10.0.0.1")
    assert lockout.lock("b", clock.seconds() + 60) == "*"  # another broker locked b
    assert lockout.is_locked("b", "10.9.9.9") and lockout.tracked() == (0, 1)
    assert lockout.lock("b", clock.seconds() + 10) is None  # an earlier end changes nothing
    assert lockout.lock("c", clock.seconds() - 1) is None  # nor a lock already over
    assert lockout.lock("c", clock.seconds() + 30, "10.0.0.3") == "10.0.0.3"
    assert lockout.is_locked("c", "10.0.0.3") and not lockout.is_locked("c", "10.0.0.4")
    clock.advance(59)
    assert lockout.is_locked("b", "10.0.0.1") and not lockout.is_locked("c", "10.0.0.3")
    clock.advance(1)
    assert not lockout.is_locked("b", "10.0.0.1")
    lockout.failed("d", "10.0.0.1")
    lockout.failed("d", "10.0.0.1")
    lockout.clear("d", "10.0.0.1")  # another broker saw d succeed: the count starts over
    lockout.failed("d", "10.0.0.1")
    lockout.failed("d", "10.0.0.1")
    assert not lockout.is_locked("d", "10.0.0.1")
    assert ("succeeded", "d", "10.0.0.1") not in shared.seen, "a remote success is not reported"
    lockout.succeeded("e", "::ffff:10.0.0.5")  # no count here: another broker may have one
    assert shared.seen[-1] == ("succeeded", "e", "10.0.0.5")
    live, cleared = lockout.unlock("d")
    assert live == 0 and cleared.called
    assert shared.seen[-1] == ("unlocked", "d")


def test_a_replacement_authenticator_remembers_the_nonces_seen():
    """A reload must not let a captured request with a nonce be replayed."""
    from relay.testing import make_config

    clock = clock_at()
    heard = []
    config = make_config()
    old = Authenticator.from_config(config, clock, on_failure=heard.append)
    nonce = "n" * 20
    ts = int(clock.seconds())
    signature = sign(config.secret, "GET", "/peers", ts, b"", "alpha", nonce)

    def send(auth):
        return auth.verify(b"GET", b"/peers", b"alpha", str(ts).encode(),
                           signature.encode(), b"", nonce.encode()).agent

    assert send(old) == "alpha"
    new = Authenticator.from_config(config, clock, replacing=old, on_failure=heard.append)
    assert "replayed" in refused(send, new).message
    assert heard == ["replayed"]
