"""Keyrings on every wire (WIRE-V2 §4) and the v2/v3 entry point of the Authenticator
(:meth:`relay.rules.auth.Authenticator.verify_v2`): the seed wire's rails on the second wire.
Pure: a ``task.Clock``."""

from __future__ import annotations

from typing import Optional

import pytest
import yaml
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock

from relay.broker.tap import Options, makeService
from relay.rules.auth import FAILURE_REASONS, Authenticator, Signed
from relay.rules.config import AgentConfig, parse_config
from relay.wire.errors import RelayError
from relay.wire.signing import sign as seed_sign
from relay.wire.v2.signing import SignedHeaders, SigningKey, signed_headers

NOW = 1_755_250_000
SHARED = "s" * 32
OLD, NEW, BETA = "o" * 32, "n" * 32, "b" * 32
BODY = b'{"agent":"alpha","limit":1}'
SOURCE = "10.0.0.1"


def clock_at(now: float = NOW) -> Clock:
    clock = Clock()
    clock.advance(now)
    return clock


def ring_agents(not_after: Optional[float] = NOW + 100):
    """alpha: its secret OLD (legacy, expiring at ``not_after``) and the key k2 (NEW)."""
    return {
        "alpha": AgentConfig(secret=OLD, keys={"legacy": SigningKey((OLD,), not_after),
                                               "k2": SigningKey((NEW,))}),
        "beta": AgentConfig(secret=BETA),
    }


def make_auth(clock: Clock, agents=None, require_nonce: bool = False, after: int = 5):
    heard = []
    auth = Authenticator(clock, SHARED, ring_agents() if agents is None else agents,
                         lock_after_failures=after, require_nonce=require_nonce,
                         on_failure=heard.append)
    return auth, heard


def seed(auth: Authenticator, secret: str, agent: str = "alpha", timestamp=None,
         nonce: Optional[str] = None, source: str = SOURCE) -> Signed:
    ts = int(auth.clock.seconds()) if timestamp is None else timestamp
    signature = seed_sign(secret, "POST", "/v1/pull", ts, BODY, agent if nonce else None,
                          nonce)
    return auth.verify(b"POST", b"/v1/pull", agent.encode(), str(ts).encode(),
                       signature.encode(), BODY, None if nonce is None else nonce.encode(),
                       source=source)


def v2(auth: Authenticator, secret: str, agent: str = "alpha", key_id: Optional[str] = None,
       timestamp=None, body: bytes = BODY, source: str = SOURCE, method: str = "POST",
       path: str = "/v1/pull", without: Optional[str] = None) -> Signed:
    ts = int(auth.clock.seconds()) if timestamp is None else timestamp
    headers = signed_headers(secret, agent, method, path, body, timestamp=ts, key_id=key_id)
    raw = {name.lower().encode(): value.encode() for name, value in headers.items()}
    signed = SignedHeaders.read(raw.get)
    if without is not None:
        signed = signed._replace(**{without: None})
    return auth.verify_v2(method.encode(), path.encode(), signed, body, source)


def refused(f, *args, **kwargs) -> RelayError:
    with pytest.raises(RelayError) as info:
        f(*args, **kwargs)
    return info.value


# -- the seed wire verifies with every live key of the ring -------------------------------


def test_a_seed_request_verifies_with_a_second_key_and_says_which():
    auth, _ = make_auth(clock_at())
    assert seed(auth, OLD)[:2] == ("alpha", None)
    assert seed(auth, OLD).key_id == "legacy" and seed(auth, NEW).key_id == "k2"
    assert seed(auth, NEW).scheme == "seed"


def test_a_seed_request_signed_with_a_key_past_not_after_is_refused_without_counting():
    clock = clock_at()
    auth, heard = make_auth(clock, after=2)
    clock.advance(100)
    assert seed(auth, OLD).key_id == "legacy", "still good at its notAfter second"
    clock.advance(1)
    for _ in range(3):
        error = refused(seed, auth, OLD)
        assert (error.status, error.code) == (401, "unauthenticated")
        assert "past its notAfter" in error.message
    assert heard == ["expired_key"] * 3
    assert not auth.lockout.is_locked("alpha", SOURCE), "an expired key is no guess"
    assert seed(auth, NEW).key_id == "k2", "the new key goes on working"


def test_a_wrong_secret_after_not_after_is_still_a_bad_signature():
    clock = clock_at(NOW + 200)
    auth, heard = make_auth(clock)
    error = refused(seed, auth, "w" * 32)
    assert error.message.startswith("invalid signature") and heard == ["bad_signature"]


def test_a_seed_nonce_is_accepted_once_whichever_key_signed():
    auth, heard = make_auth(clock_at())
    nonce = "n" * 20
    assert seed(auth, NEW, nonce=nonce).nonce == nonce
    assert "replayed" in refused(seed, auth, NEW, nonce=nonce).message
    assert "replayed" in refused(seed, auth, OLD, nonce=nonce).message
    assert heard == ["replayed", "replayed"]


def test_shared_secrets_are_every_agents_legacy_key():
    auth = Authenticator(clock_at(), SHARED, {}, shared_secrets=(NEW, SHARED))
    assert auth.keyring("anyone") == {"legacy": SigningKey((NEW, SHARED))}
    assert seed(auth, SHARED, agent="anyone").key_id == "legacy"
    assert v2(auth, NEW, agent="anyone").key_id == "legacy"
    assert v2(auth, SHARED, agent="anyone", key_id="legacy").scheme == "v3"


# -- verify_v2 -----------------------------------------------------------------------------


def test_v2_verifies_with_any_live_key_and_v3_with_the_named_one():
    auth, heard = make_auth(clock_at())
    assert v2(auth, OLD) == Signed("alpha", None, NOW, SOURCE, "legacy", "v2")
    assert v2(auth, NEW) == Signed("alpha", None, NOW, SOURCE, "k2", "v2")
    assert v2(auth, NEW, key_id="k2") == Signed("alpha", None, NOW, SOURCE, "k2", "v3")
    assert v2(auth, OLD, key_id="legacy").scheme == "v3"
    assert heard == []


def test_a_v3_request_naming_an_unknown_key_is_401_unknown_key():
    auth, heard = make_auth(clock_at())
    error = refused(v2, auth, NEW, key_id="k9")
    assert (error.status, error.code, error.message) == (401, "unknown_key", "unknown relay key id")
    assert error.to_body() == {"error": {"code": "unknown_key",
                                         "message": "unknown relay key id"}}
    assert heard == ["unknown_key"]


def test_a_key_past_not_after_is_401_unknown_key_on_v3_and_v2():
    clock = clock_at()
    auth, heard = make_auth(clock, after=2)
    clock.advance(101)
    for _ in range(3):
        assert refused(v2, auth, OLD, key_id="legacy").code == "unknown_key"
        assert refused(v2, auth, OLD).code == "unknown_key"
    assert heard == ["expired_key"] * 6
    assert not auth.lockout.is_locked("alpha", SOURCE)
    assert v2(auth, NEW).key_id == "k2"


def test_an_agent_the_broker_does_not_know_is_401_unknown_agent():
    auth, heard = make_auth(clock_at())
    error = refused(v2, auth, NEW, agent="zeta")
    assert (error.status, error.code) == (401, "unknown_agent") and heard == ["unknown_agent"]


@pytest.mark.parametrize("header", ["agent", "timestamp", "signature"])
def test_a_missing_header_is_401_unauthenticated(header):
    auth, heard = make_auth(clock_at())
    error = refused(v2, auth, NEW, without=header)
    assert (error.status, error.code, error.message) == (
        401, "unauthenticated", "missing authentication headers")
    assert heard == ["missing_headers"]


def test_skew_and_bad_signatures_count_toward_the_lockout_shared_with_the_seed_wire():
    clock = clock_at()
    auth, heard = make_auth(clock, after=3)
    assert refused(v2, auth, NEW, timestamp=NOW - 301).message == "timestamp skew"
    assert refused(v2, auth, "w" * 32).message == "invalid signature"
    assert refused(seed, auth, "w" * 32).code == "unauthenticated"
    locked = refused(v2, auth, NEW)
    assert (locked.status, locked.code) == (403, "locked")
    assert refused(seed, auth, NEW).code == "locked", "one lockout for both wires"
    assert v2(auth, NEW, source="10.0.0.2").agent == "alpha", "the lock is per address"
    assert heard == ["clock_skew", "bad_signature", "bad_signature", "locked", "locked"]
    clock.advance(300)
    assert v2(auth, NEW).agent == "alpha"


def test_a_success_resets_the_count_of_its_address():
    auth, _ = make_auth(clock_at(), after=2)
    refused(v2, auth, "w" * 32)
    v2(auth, NEW)
    refused(v2, auth, "w" * 32)
    assert not auth.lockout.is_locked("alpha", SOURCE)


def test_unknown_keys_and_agents_never_lock():
    auth, _ = make_auth(clock_at(), after=1)
    refused(v2, auth, NEW, key_id="k9")
    refused(v2, auth, NEW, agent="zeta")
    refused(v2, auth, NEW, without="signature")
    assert v2(auth, NEW).agent == "alpha"


class Reports:
    """A SharedLockouts whose counting is still under way."""

    def __init__(self) -> None:
        self.counting = Deferred()
        self.seen = []

    def failed(self, agent, address):
        self.seen.append(("failed", agent, address))
        return self.counting

    def succeeded(self, agent, address):
        self.seen.append(("succeeded", agent, address))

    def unlocked(self, agent):
        raise AssertionError("not used")


def test_a_counted_failure_carries_the_shared_count_to_wait_for():
    auth, _ = make_auth(clock_at())
    shared = Reports()
    auth.lockout.share(shared)
    error = refused(v2, auth, "w" * 32)
    assert error.pending is shared.counting
    v2(auth, NEW)
    assert shared.seen == [("failed", "alpha", SOURCE), ("succeeded", "alpha", SOURCE)]


def test_require_nonce_refuses_the_v2_wire_which_carries_none():
    auth, heard = make_auth(clock_at(), require_nonce=True)
    error = refused(v2, auth, NEW, key_id="k2")
    assert (error.status, error.code) == (401, "unauthenticated")
    assert "security.requireNonce" in error.message and heard == ["bad_nonce"]


def test_the_agent_header_is_read_in_lower_case():
    auth, _ = make_auth(clock_at())
    assert v2(auth, NEW, agent=" Alpha ").agent == "alpha"


def test_a_get_signs_the_empty_body_as_the_reference_reads_it():
    auth, _ = make_auth(clock_at())
    ts = NOW
    headers = signed_headers(NEW, "alpha", "GET", "/healthz", b"", timestamp=ts)
    raw = {name.lower().encode(): value.encode() for name, value in headers.items()}
    signed = auth.verify_v2(b"GET", b"/healthz", SignedHeaders.read(raw.get), b"{}", SOURCE)
    assert signed.key_id == "k2"


def test_every_reason_is_a_metrics_label():
    assert {"unknown_key", "expired_key"} <= set(FAILURE_REASONS)


# -- reloads -------------------------------------------------------------------------------


def config_of(agents):
    return parse_config({"broker": {"secret": SHARED}, "agents": agents}, "/srv/relay")


def test_a_replacement_authenticator_adds_and_removes_keys_and_keeps_the_locks():
    clock = clock_at()
    before = config_of({"alpha": {"secret": OLD}})
    old = Authenticator.from_config(before, clock)
    assert refused(v2, old, NEW, key_id="k2").code == "unknown_key"
    assert refused(seed, old, NEW).code == "unauthenticated"
    for _ in range(4):
        refused(v2, old, "w" * 32, source="10.0.0.9")
    added = config_of({"alpha": {"secret": OLD, "keys": {"k2": {"secret": NEW}}}})
    new = Authenticator.from_config(added, clock, replacing=old)
    assert v2(new, NEW, key_id="k2").key_id == "k2" and seed(new, NEW).key_id == "k2"
    assert refused(v2, new, "w" * 32, source="10.0.0.9").code == "unauthenticated"
    assert refused(v2, new, NEW, source="10.0.0.9").code == "locked", "the count carried over"
    removed = config_of({"alpha": {"keys": {"k2": {"secret": NEW}}}})
    last = Authenticator.from_config(removed, clock, replacing=new)
    assert refused(seed, last, OLD).code == "unauthenticated"
    assert refused(v2, last, OLD, key_id="legacy").code == "unknown_key"
    assert v2(last, NEW).key_id == "k2"


def test_sighup_applies_a_key_rotation(tmp_path):
    conf = tmp_path / "relay.yaml"

    def write(alpha):
        conf.write_text(yaml.safe_dump({"broker": {"secret": SHARED, "storage": "memory"},
                                        "agents": {"alpha": alpha}}))
        conf.chmod(0o600)

    write({"secret": OLD})
    options = Options()
    options.parseOptions(["--config", str(conf)])
    reactor = MemoryReactorClock()
    reactor.advance(NOW)
    service = makeService(options, reactor)
    clock = service.api.auth.clock
    now = int(clock.seconds())

    def v2_at(secret, key_id=None):
        headers = signed_headers(secret, "alpha", "POST", "/v1/pull", BODY, timestamp=now,
                                 key_id=key_id)
        raw = {name.lower().encode(): value.encode() for name, value in headers.items()}
        return service.api.auth.verify_v2(b"POST", b"/v1/pull", SignedHeaders.read(raw.get),
                                          BODY, SOURCE)

    assert refused(v2_at, NEW, "k2").code == "unknown_key"
    write({"secret": OLD, "keys": {"k2": {"secret": NEW},
                                   "legacy": {"notAfter": now - 1}}})
    assert service.reload() is True
    assert v2_at(NEW, "k2").key_id == "k2"
    assert refused(v2_at, OLD).code == "unknown_key", "the old secret is past its notAfter"
    write({"secret": OLD, "keys": {"k2": {"secret": NEW, "notAfter": "soon"}}})
    assert service.reload() is False, "a bad notAfter keeps the running keys"
    assert v2_at(NEW, "k2").key_id == "k2"
