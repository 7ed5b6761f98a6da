"""The client side of TLS: RelayClient, the ``relay`` command and the agent runtime.

Every test talks to a real ``twistd -n relay`` process over TLS, with
certificates made at test time by the helpers of ``tests.support.tls``. Three
brokers serve the whole module: one with a certificate from the test CA, one
that also requires client certificates (``tlsClientCA``), and one whose
certificate names another host. Each is stopped when the module ends.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

import pytest
import pytest_twisted
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from twisted.internet import defer
from twisted.internet.task import Clock, deferLater

from relay.agent import tap as agent_tap
from relay.cli import run
from relay.client.client import RelayClient
from relay.client.settings import UsageError, resolve_settings
from relay.client.trust import make_http_client
from relay.wire.errors import RelayError
from tests.support.cli import python_relay
from tests.support.tls import (
    SECRET,
    Broker,
    free_port,
    make_certificate,
    new_key,
    write_cert,
    write_config,
    write_key,
)

# Real-time bound on one client call; a retried TLS failure would exceed it.
CALL_TIMEOUT = 5.0
# A TLS failure must come back well before the first 2 s retry delay.
FAST_SECONDS = 1.5
AGENT_DEADLINE = 15.0


# -- certificates and brokers ---------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PEM files: ca, other-ca, server, misnamed (for relay.example only), client,
    other-client (signed by other-ca), client.pem (certificate and key in one),
    encrypted.key, and junk.crt (no certificate)."""
    d = tmp_path_factory.mktemp("client-pki")
    ca_key, other_key = new_key(), new_key()
    ca = make_certificate("relay test CA", ca_key)
    other_ca = make_certificate("untrusted CA", other_key)
    write_cert(d / "ca.crt", ca)
    write_cert(d / "other-ca.crt", other_ca)
    leaves = {
        "server": ((ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, ("127.0.0.1", "localhost")),
        "misnamed": ((ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, ("relay.example",)),
        "nameless": ((ca, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, ()),
        "client": ((ca, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH, ()),
        "other-client": ((other_ca, other_key), ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    }
    for name, (issuer, purpose, names) in leaves.items():
        key = new_key()
        write_key(d / f"{name}.key", key)
        write_cert(d / f"{name}.crt", make_certificate(name, key, issuer, purpose, names))
    (d / "client.pem").write_bytes(
        (d / "client.crt").read_bytes() + (d / "client.key").read_bytes()
    )
    client_key = serialization.load_pem_private_key((d / "client.key").read_bytes(), None)
    (d / "encrypted.key").write_bytes(
        client_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    (d / "junk.crt").write_text("not a certificate\n")
    return d


class RunningBroker:
    """A broker process and the https URL to reach it."""

    def __init__(self, process: Broker, url: str) -> None:
        self.process = process
        self.url = url


def _start(
    tmp_path_factory: pytest.TempPathFactory, pki: Path, cert: str, **broker: Any
) -> Iterator[RunningBroker]:
    directory = tmp_path_factory.mktemp(f"broker-{cert}")
    port = free_port()
    listen = f"ssl:{port}:interface=127.0.0.1:privateKey={pki}/{cert}.key:certKey={pki}/{cert}.crt"
    process = Broker(directory, write_config(directory, listen=[listen], **broker))
    try:
        process.wait_listening([("127.0.0.1", port)])
        yield RunningBroker(process, f"https://127.0.0.1:{port}")
    finally:
        process.stop()


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[RunningBroker]:
    """A broker whose certificate comes from the test CA and names 127.0.0.1."""
    yield from _start(tmp_path_factory, pki, "server")


@pytest.fixture(scope="module")
def mtls_broker(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[RunningBroker]:
    """A broker that requires client certificates signed by the test CA."""
    yield from _start(tmp_path_factory, pki, "server", tlsClientCA=str(pki / "ca.crt"))


@pytest.fixture(scope="module")
def misnamed_broker(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[RunningBroker]:
    """A broker whose (trusted) certificate names relay.example, not 127.0.0.1."""
    yield from _start(tmp_path_factory, pki, "misnamed")


@pytest.fixture(scope="module")
def nameless_broker(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[RunningBroker]:
    """A broker whose (trusted) certificate has no subjectAltName: its common name
    ("nameless") is all it says."""
    yield from _start(tmp_path_factory, pki, "nameless")


# -- helpers ----------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def make_client(url: str, agent: str, clock: Any = None, **tls: Optional[str]) -> RelayClient:
    from twisted.internet import reactor

    return RelayClient(
        url, agent, SECRET, clock=clock or reactor, reactor=reactor, timeout=CALL_TIMEOUT, **tls
    )


async def bounded(d: defer.Deferred) -> Any:
    """Wait for ``d`` at most CALL_TIMEOUT real seconds."""
    from twisted.internet import reactor

    return await d.addTimeout(CALL_TIMEOUT, reactor)


async def tls_failure_of(url: str, **tls: Optional[str]) -> RelayError:
    """The RelayError of a handshake that must fail at once, without any retry.

    Retry delays run on a Clock that never advances, so a retry would hang
    until :func:`bounded` gives up.
    """
    clock = Clock()
    client = make_client(url, "alpha", clock=clock, **tls)
    started = time.monotonic()
    with pytest.raises(RelayError) as caught:
        await bounded(client.handshake())
    assert time.monotonic() - started < FAST_SECONDS
    assert clock.getDelayedCalls() == []
    return caught.value


async def round_trip(client_a: RelayClient, client_b: RelayClient) -> None:
    """Register both, send a to b, find it in b's inbox."""
    assert (await bounded(client_a.handshake()))["protocol"] == "1.0"
    await bounded(client_a.register())
    await bounded(client_b.register())
    sent = await bounded(client_a.send(client_b.agent, {"text": "over tls"}))
    inbox = await bounded(client_b.recv())
    assert [(m["id"], m["body"]) for m in inbox["messages"]] == [(sent["id"], {"text": "over tls"})]


class Outcome:
    def __init__(self, status: int, out: str, err: str) -> None:
        self.status = status
        self.out = out
        self.err = err


async def cli(argv: List[str], home: Path, env: Optional[Mapping[str, str]] = None) -> Outcome:
    from twisted.internet import reactor

    out, err = io.StringIO(), io.StringIO()
    status = await bounded(
        defer.Deferred.fromCoroutine(run(reactor, argv, env=env or {}, home=home, out=out, err=err))
    )
    return Outcome(status, out.getvalue(), err.getvalue())


# -- RelayClient ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_client_round_trip_with_a_ca_file(tls_broker: RunningBroker, pki: Path) -> None:
    ca = str(pki / "ca.crt")
    a = make_client(tls_broker.url, unique("alpha"), ca_file=ca)
    b = make_client(tls_broker.url, unique("beta"), ca_file=ca)
    await round_trip(a, b)


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_untrusted_certificate_is_an_immediate_tls_error(
    tls_broker: RunningBroker, pki: Path
) -> None:
    error = await tls_failure_of(tls_broker.url, ca_file=str(pki / "other-ca.crt"))
    assert (error.status, error.code) == (0, "tls_error")
    assert tls_broker.url in error.message
    assert "certificate verify failed" in error.message
    assert str(pki / "other-ca.crt") in error.message and "--ca-file" in error.message

    error = await tls_failure_of(tls_broker.url)  # the system store knows no test CA
    assert error.code == "tls_error"
    assert "system trust store" in error.message and "--ca-file" in error.message


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_certificate_for_another_host_is_an_immediate_tls_error(
    misnamed_broker: RunningBroker, pki: Path
) -> None:
    error = await tls_failure_of(misnamed_broker.url, ca_file=str(pki / "ca.crt"))
    assert error.code == "tls_error"
    assert "not valid for '127.0.0.1'" in error.message


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_a_certificate_naming_no_host_is_an_immediate_tls_error(
    nameless_broker: RunningBroker, pki: Path
) -> None:
    """Any certificate of the trusted CA without names (an agent's, say) must not pass
    for the broker's, though Twisted's own check lets it through."""
    error = await tls_failure_of(nameless_broker.url, ca_file=str(pki / "ca.crt"))
    assert error.code == "tls_error"
    assert "names no host (it has no subjectAltName)" in error.message


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_client_certificate_required(mtls_broker: RunningBroker, pki: Path) -> None:
    ca = str(pki / "ca.crt")
    error = await tls_failure_of(mtls_broker.url, ca_file=ca)
    assert error.code == "tls_error"
    assert "requires a client certificate" in error.message and "--client-cert" in error.message

    foreign = str(pki / "other-client.crt")
    error = await tls_failure_of(
        mtls_broker.url, ca_file=ca, client_cert=foreign, client_key=str(pki / "other-client.key")
    )
    assert error.code == "tls_error"
    assert f"refused the client certificate {foreign}" in error.message

    cert, key = str(pki / "client.crt"), str(pki / "client.key")
    a = make_client(mtls_broker.url, unique("alpha"), ca_file=ca, client_cert=cert, client_key=key)
    # The key may also sit in the certificate file.
    b = make_client(
        mtls_broker.url, unique("beta"), ca_file=ca, client_cert=str(pki / "client.pem")
    )
    await round_trip(a, b)


@pytest.mark.parametrize(
    "name, reason",
    [
        ("missing.crt", "cannot read CA file {path}: No such file or directory"),
        (".", "cannot read CA file {path}: Is a directory"),
        ("junk.crt", "no PEM certificate found in CA file {path}"),
        ("client.key", "no PEM certificate found in CA file {path}"),
        ("broken.crt", "malformed certificate in CA file {path}"),
    ],
)
def test_bad_ca_file_is_a_relay_error_naming_the_path(pki: Path, name: str, reason: str) -> None:
    path = pki / name
    if name == "broken.crt":
        path.write_text("-----BEGIN CERTIFICATE-----\nbm90IGRlcg==\n-----END CERTIFICATE-----\n")
    with pytest.raises(RelayError) as caught:
        RelayClient("https://127.0.0.1:1", "alpha", SECRET, clock=Clock(), ca_file=str(path))
    assert (caught.value.status, caught.value.code) == (0, "bad_ca_file")
    assert caught.value.message.startswith(reason.format(path=path))


@pytest.mark.parametrize(
    "cert, key, reason",
    [
        ("missing.crt", None, "cannot read client certificate {cert}"),
        ("client.crt", "missing.key", "cannot read client key {key}"),
        ("junk.crt", None, "no PEM certificate found in client certificate {cert}"),
        ("client.crt", None, "no PEM private key found in {cert}; give the key with --client-key"),
        ("client.crt", "encrypted.key", "the private key in {key} is encrypted"),
        ("client.crt", "broken.key", "malformed private key in {key}: "),
        ("client.crt", "other-client.key", "the client certificate {cert} does not match"),
    ],
)
def test_bad_client_certificate_is_a_relay_error_naming_the_path(
    pki: Path, cert: str, key: Optional[str], reason: str
) -> None:
    cert_path = str(pki / cert)
    key_path = str(pki / key) if key else None
    if key == "broken.key":
        (pki / key).write_text(
            "-----BEGIN PRIVATE KEY-----\nbm90IGRlcg==\n-----END PRIVATE KEY-----\n"
        )
    with pytest.raises(RelayError) as caught:
        make_http_client(Clock(), client_cert=cert_path, client_key=key_path)
    assert caught.value.code == "bad_client_cert"
    assert caught.value.message.startswith(reason.format(cert=cert_path, key=key_path))


# -- the relay command ---------------------------------------------------------------


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_cli_round_trip_with_ca_file_flag_and_env(
    tls_broker: RunningBroker, pki: Path, tmp_path: Path
) -> None:
    alpha, beta = unique("alpha"), unique("beta")
    base = ["--broker", tls_broker.url, "--secret", SECRET]
    flag = ["--ca-file", str(pki / "ca.crt")]
    env = {"DSH_RELAY_CA_FILE": str(pki / "ca.crt")}
    assert (await cli(["register", "--agent", beta, *base, *flag], tmp_path)).status == 0
    sent = await cli(["send", beta, "hello", "--agent", alpha, "--json", *base], tmp_path, env)
    assert sent.status == 0, sent.err
    got = await cli(["recv", "--agent", beta, "--json", *base, *flag], tmp_path)
    assert got.status == 0, got.err
    assert [m["body"] for m in json.loads(got.out)["messages"]] == [{"text": "hello"}]


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_cli_untrusted_certificate_exits_1_at_once(
    tls_broker: RunningBroker, pki: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    outcome = await cli(
        ["handshake", "--broker", tls_broker.url, "--ca-file", str(pki / "other-ca.crt")],
        tmp_path,
    )
    assert time.monotonic() - started < FAST_SECONDS  # the default 3 retries did not run
    assert outcome.status == 1
    lines = outcome.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: tls_error: TLS handshake with {tls_broker.url}"
    )


@pytest.mark.process
def test_cli_process_untrusted_certificate_one_line_no_traceback(
    tls_broker: RunningBroker, pki: Path, tmp_path: Path
) -> None:
    status, out, err = python_relay(
        ["handshake", "--broker", tls_broker.url],
        tmp_path,
        {"DSH_RELAY_CA_FILE": str(pki / "other-ca.crt")},
        timeout=30,
    )
    assert status == 1 and out == ""
    assert err.startswith("error: tls_error: ") and "certificate verify failed" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_cli_client_certificate_from_flags_env_and_settings_file(
    mtls_broker: RunningBroker, pki: Path, tmp_path: Path
) -> None:
    base = ["--broker", mtls_broker.url, "--secret", SECRET, "--ca-file", str(pki / "ca.crt")]
    refused = await cli(["register", "--agent", unique("a"), *base], tmp_path)
    assert refused.status == 1
    assert refused.err.startswith("error: tls_error: ") and "--client-cert" in refused.err

    flags = ["--client-cert", str(pki / "client.crt"), "--client-key", str(pki / "client.key")]
    assert (await cli(["register", "--agent", unique("a"), *base, *flags], tmp_path)).status == 0

    env = {
        "DSH_RELAY_CLIENT_CERT": str(pki / "client.crt"),
        "DSH_RELAY_CLIENT_KEY": str(pki / "client.key"),
    }
    outcome = await cli(["register", "--agent", unique("b"), *base], tmp_path, env)
    assert outcome.status == 0, outcome.err

    (tmp_path / ".dsh-relay.json").write_text(
        json.dumps(
            {
                "brokerUrl": mtls_broker.url,
                "secret": SECRET,
                "caFile": str(pki / "ca.crt"),
                "clientCert": str(pki / "client.pem"),
            }
        )
    )
    outcome = await cli(["peers", "--agent", unique("c"), "--json"], tmp_path)
    assert outcome.status == 0, outcome.err


@pytest_twisted.ensureDeferred
async def test_cli_bad_ca_file_exits_1_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.crt"
    outcome = await cli(
        ["handshake", "--broker", "https://127.0.0.1:1", "--ca-file", str(missing)], tmp_path
    )
    assert outcome.status == 1
    assert (
        outcome.err
        == f"error: bad_ca_file: cannot read CA file {missing}: No such file or directory\n"
    )


def test_tls_settings_precedence(tmp_path: Path) -> None:
    (tmp_path / ".dsh-relay.json").write_text(
        json.dumps({"caFile": "file-ca", "clientCert": "file-cert", "clientKey": "file-key"})
    )
    stored = resolve_settings({}, {}, tmp_path)
    # relative paths in the settings file are relative to the file
    assert (stored.ca_file, stored.client_cert, stored.client_key) == (
        str(tmp_path / "file-ca"),
        str(tmp_path / "file-cert"),
        str(tmp_path / "file-key"),
    )
    env = {"DSH_RELAY_CA_FILE": "env-ca", "DSH_RELAY_CLIENT_CERT": "env-cert"}
    from_env = resolve_settings({}, env, tmp_path)
    assert (from_env.ca_file, from_env.client_cert, from_env.client_key) == (
        "env-ca",
        "env-cert",
        str(tmp_path / "file-key"),
    )
    flags: Dict[str, Optional[str]] = {"client_cert": "flag-cert", "client_key": "flag-key"}
    from_flags = resolve_settings(flags, env, tmp_path)
    assert (from_flags.ca_file, from_flags.client_cert, from_flags.client_key) == (
        "env-ca",
        "flag-cert",
        "flag-key",
    )
    (tmp_path / ".dsh-relay.json").unlink()
    with pytest.raises(UsageError, match="client key .* without a client certificate"):
        resolve_settings({"client_key": "k"}, {}, tmp_path)


# -- the agent runtime -----------------------------------------------------------------


def agent_options(url: str, agent: str, home: Path, *extra: str) -> agent_tap.Options:
    options = agent_tap.Options()
    options.parseOptions(
        [
            "--broker",
            url,
            "--agent",
            agent,
            "--secret",
            SECRET,
            "--receipts-dir",
            str(home),
            "--handler",
            "tests.processes.test_client_tls.shout",
            "--poll-interval",
            "0.2",
            *extra,
        ]
    )
    return options


def shout(message: Dict[str, Any]) -> str:
    """The handler of the agent test: the request text in capitals."""
    return str(message["body"]["text"]).upper()


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_agent_runtime_answers_a_request_with_a_client_certificate(
    mtls_broker: RunningBroker, pki: Path, tmp_path: Path
) -> None:
    from twisted.internet import reactor

    tls = [
        "--ca-file",
        str(pki / "ca.crt"),
        "--client-cert",
        str(pki / "client.crt"),
        "--client-key",
        str(pki / "client.key"),
    ]
    worker = unique("worker")
    options = agent_options(mtls_broker.url, worker, tmp_path, *tls)
    assert options.settings.client_cert == str(pki / "client.crt")
    service = agent_tap.makeService(options, reactor)
    fatal: List[RelayError] = []
    service.on_fatal = fatal.append  # never stop the test's reactor
    service.startService()
    try:
        asker = make_client(
            mtls_broker.url,
            unique("asker"),
            ca_file=str(pki / "ca.crt"),
            client_cert=str(pki / "client.pem"),
        )
        await bounded(asker.register())
        deadline = time.monotonic() + AGENT_DEADLINE
        while True:  # the request needs a registered recipient
            peers = await bounded(asker.peers())
            if worker in {p["agent"] for p in peers["peers"]}:
                break
            assert not fatal and time.monotonic() < deadline
            await deferLater(reactor, 0.1)
        request = await bounded(asker.send(worker, {"text": "shout this"}, kind="request"))
        while True:
            answer = await bounded(asker.pull())
            replies = [m for m in answer["messages"] if m.get("parentId") == request["id"]]
            if replies:
                break
            assert time.monotonic() < deadline
            await deferLater(reactor, 0.1)
        assert replies[0]["body"] == {"text": "SHOUT THIS"}
        assert not fatal
    finally:
        await bounded(defer.maybeDeferred(service.stopService))


@pytest_twisted.ensureDeferred
@pytest.mark.process
async def test_agent_runtime_stops_on_an_untrusted_broker(
    tls_broker: RunningBroker, pki: Path, tmp_path: Path
) -> None:
    from twisted.internet import reactor

    options = agent_options(
        tls_broker.url, unique("worker"), tmp_path, "--ca-file", str(pki / "other-ca.crt")
    )
    service = agent_tap.makeService(options, reactor)
    stopped: defer.Deferred = defer.Deferred()
    service.on_fatal = stopped.callback
    service.startService()
    try:
        error = await bounded(stopped)
    finally:
        await bounded(defer.maybeDeferred(service.stopService))
    assert error.code == "tls_error" and "certificate verify failed" in error.message


def test_agent_options_refuse_bad_tls_files(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "missing.crt"
    with pytest.raises(SystemExit):
        agent_options("https://127.0.0.1:1", "w", tmp_path, "--ca-file", str(missing))
    assert f"bad_ca_file: cannot read CA file {missing}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_options(
            "https://127.0.0.1:1",
            "w",
            tmp_path,
            "--client-cert",
            str(pki / "client.crt"),
            "--client-key",
            str(pki / "encrypted.key"),
        )
    assert "bad_client_cert: the private key in" in capsys.readouterr().err
