"""``relay stats``: the ops listener's overview in the terminal, found from flags,
the environment or the broker config."""

from __future__ import annotations

import argparse
import json

import pytest
import pytest_twisted
from treq.testing import StubTreq

from relay.broker.ops.web import OpsAPI
from relay.cli.commands.ops import ops_target, ops_url
from relay.client.settings import UsageError
from relay.testing import make_api
from tests.support.cli import run_cli


async def ops_with_traffic(tokens=()):
    api, client, clock = make_api(maxAttempts=0)
    for agent in ("beta", "gamma"):
        await client.post(agent, "/register", {})
    for i in range(2):
        await client.post("alpha", "/messages", {"to": "beta", "id": f"s{i}"})
    return OpsAPI(api.broker, clock, tokens)


@pytest_twisted.ensureDeferred
async def test_stats_prints_the_overview(tmp_path):
    ops = await ops_with_traffic()
    outcome = await run_cli(["stats", "--ops", "http://127.0.0.1:19122"], tmp_path,
                            http=StubTreq(ops.resource()))
    assert outcome.status == 0, outcome.err
    lines = outcome.out.splitlines()
    assert lines[0].startswith("broker ") and "storage memory, healthy" in lines[0]
    assert "queued 2" in lines[1] and "sent 2" in lines[2]
    beta = next(line for line in lines if line.startswith("beta "))
    assert beta.split()[:4] == ["beta", "yes", "2", "0"]
    assert beta.split()[-4:] == ["0", "s", "0", "-"], "oldest, streams, no webhook"
    assert lines[0].endswith("up 0 s"), "ages read as elsewhere"
    assert any(line.startswith("event streams 0") for line in lines)
    assert any(line.split()[:3] == ["alpha", "beta", "2"] for line in lines)


@pytest_twisted.ensureDeferred
async def test_stats_json_is_the_overview_document(tmp_path):
    ops = await ops_with_traffic(tokens=("t",))
    env = {"DSH_RELAY_OPS": "http://127.0.0.1:19122", "DSH_RELAY_OPS_TOKEN": "t"}
    outcome = await run_cli(["stats", "--json"], tmp_path, env=env,
                            http=StubTreq(ops.resource()))
    assert outcome.status == 0, outcome.err
    document = json.loads(outcome.out)
    assert document["totals"]["sent"] == 2 and len(document["agents"]) == 2


@pytest_twisted.ensureDeferred
async def test_stats_without_the_token_is_an_error(tmp_path):
    ops = await ops_with_traffic(tokens=("t",))
    outcome = await run_cli(["stats", "--ops", "http://127.0.0.1:19122"], tmp_path,
                            http=StubTreq(ops.resource()))
    assert outcome.status == 1 and "unauthenticated" in outcome.err


@pytest_twisted.ensureDeferred
async def test_a_missing_config_and_a_config_without_ops_listener_are_told_apart(tmp_path):
    outcome = await run_cli(["stats", "--config", str(tmp_path / "none.yaml")], tmp_path)
    assert outcome.status == 2
    assert f"no such config file: {tmp_path / 'none.yaml'}" in outcome.err
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker: {listen: ['tcp:19121:interface=127.0.0.1']}\n")
    outcome = await run_cli(["stats", "--config", str(conf)], tmp_path)
    assert outcome.status == 2
    assert f"{conf} has no broker.opsListen" in outcome.err


def test_outside_a_checkout_stats_tries_relay_init_config_then_the_default_address(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ops_target(args(config=None), {}, tmp_path) == ("http://127.0.0.1:19122", None)
    init = tmp_path / ".dsh-agent-relay" / "relay.yaml"
    init.parent.mkdir()
    init.write_text("broker: {opsListen: ['tcp:19300:interface=127.0.0.1'], opsToken: t}\n")
    assert ops_target(args(config=None), {}, tmp_path) == ("http://127.0.0.1:19300", "t")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "relay.yaml").write_text(
        "broker: {opsListen: ['tcp:19400:interface=127.0.0.1']}\n")
    assert ops_target(args(config=None), {}, tmp_path) == ("http://127.0.0.1:19400", None)


@pytest_twisted.ensureDeferred
async def test_stats_counts_refusals_and_folds_offline_agents(tmp_path):
    api, client, clock = make_api()
    for agent in ("old", "selfcheck-0123abcd-a", "busy"):
        await client.post(agent, "/register", {})
    clock.advance(100)
    await client.post("busy", "/register", {})
    api.broker.counters.http_answered("pull", 429, 0.001)
    ops = OpsAPI(api.broker, clock)
    outcome = await run_cli(["stats", "--ops", "http://127.0.0.1:19122"], tmp_path,
                            http=StubTreq(ops.resource()))
    lines = outcome.out.splitlines()
    assert "refused: rate-limited (429) 1  sends refused 0  auth failures 0  lockouts 0" in lines
    assert [line.split()[0] for line in lines if line.split()[1:2] in (["yes"], ["no"])] == [
        "busy"]
    assert "2 offline agents with no messages not shown (--all lists them)" in lines
    outcome = await run_cli(["stats", "--all", "--ops", "http://127.0.0.1:19122"], tmp_path,
                            http=StubTreq(ops.resource()))
    assert "selfcheck-0123abcd-a" in outcome.out and "not shown" not in outcome.out


def args(**values):
    defaults = {"ops": None, "ops_token": None, "config": "conf/relay.yaml"}
    defaults.update(values)
    return argparse.Namespace(**defaults)


def test_the_listener_and_token_come_from_the_config(tmp_path):
    conf = tmp_path / "relay.yaml"
    (tmp_path / "ops.token").write_text("\nnew-token\nold-token\n")
    conf.write_text("broker: {opsListen: ['ssl:19443:privateKey=k.pem:interface=0.0.0.0'], "
                    "opsTokenFile: ops.token}\n")
    assert ops_target(args(config=str(conf)), {}) == ("https://127.0.0.1:19443", "new-token")
    assert ops_target(args(config=str(conf), ops="http://x:1/"), {"DSH_RELAY_OPS_TOKEN": "e"}) \
        == ("http://x:1", "e")
    assert not (tmp_path / "relay.secret").exists()


def test_ops_urls_of_endpoint_strings():
    assert ops_url("tcp:19122:interface=127.0.0.1") == "http://127.0.0.1:19122"
    assert ops_url("tcp6:19122") == "http://[::1]:19122"
    assert ops_url("tcp:port=9:interface=\\:\\:1") == "http://[::1]:9"
    with pytest.raises(UsageError):
        ops_url("unix:/run/ops.sock")


# -- relay unlock -------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_unlock_clears_an_agents_lock_with_the_ops_token(tmp_path):
    api, client, clock = make_api()
    ops = OpsAPI(api.broker, clock, ("t",), lockout=api.auth.lockout)
    for _ in range(5):
        assert (await client.get("alpha", "/peers", secret="wrong"))[0] == 401
    code, body, _ = await client.get("alpha", "/peers")
    assert code == 403 and "relay unlock alpha" in body["error"]["message"]
    env = {"DSH_RELAY_OPS": "http://127.0.0.1:19122", "DSH_RELAY_OPS_TOKEN": "t"}
    outcome = await run_cli(["unlock", "alpha"], tmp_path, env=env,
                            http=StubTreq(ops.resource()))
    assert (outcome.status, outcome.out) == (0, "alpha: unlocked (1 lock cleared)\n"), outcome.err
    assert (await client.get("alpha", "/peers"))[0] == 200
    outcome = await run_cli(["unlock", "alpha", "--json"], tmp_path, env=env,
                            http=StubTreq(ops.resource()))
    assert json.loads(outcome.out) == {"agent": "alpha", "unlocked": 0}


@pytest_twisted.ensureDeferred
async def test_unlock_without_the_token_or_of_a_bad_name_is_an_error(tmp_path):
    api, client, clock = make_api()
    ops = OpsAPI(api.broker, clock, ("t",), lockout=api.auth.lockout)
    outcome = await run_cli(["unlock", "alpha", "--ops", "http://127.0.0.1:19122"], tmp_path,
                            http=StubTreq(ops.resource()))
    assert outcome.status == 1 and "unauthenticated" in outcome.err
    outcome = await run_cli(["unlock", "no/such", "--ops", "http://127.0.0.1:19122",
                             "--ops-token", "t"], tmp_path, http=StubTreq(ops.resource()))
    assert outcome.status == 1 and "agent must be an agent name" in outcome.err


def test_a_webhooks_health_in_a_word_never_its_url():
    from relay.cli.commands.ops import _webhook

    assert _webhook(None, 100.0) == "-"
    assert _webhook({"disabled": True, "failingSince": 10.0, "lastDelivered": None}, 100.0) == (
        "disabled")
    assert _webhook({"disabled": False, "failingSince": 40.0, "lastDelivered": 5.0},
                    100.0) == "failing 1 min"
    assert _webhook({"disabled": False, "failingSince": None, "lastDelivered": 98.0},
                    100.0) == "ok 2 s ago"
