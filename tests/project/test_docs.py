"""The documentation, run: every example program, the certificate commands, and
every documented ``relay`` and ``twistd`` command line.

A code block that is a whole program is kept as a file under docs/examples/
and marked in the page with ``<!-- example: docs/examples/NAME -->`` on the
line before it; the block must be that file, byte for byte, so the page
cannot drift from what is run here. The README's quick start is run as
written by .ci/quickstart.py (it needs port 19121, which tests leave alone).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import yaml

from relay.agent import tap as agent_tap
from relay.broker import tap
from relay.cli.commands import COMMANDS
from relay.cli.parser import Exit, build_parser
from relay.client.settings import UsageError
from tests.support import REPO
from tests.support.processes import BrokerProcess, free_port

EXAMPLES = REPO / "docs" / "examples"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
RUN_SECONDS = 60
# A mismatched scheme is reported at once, not after the 2 + 4 + 8 s of retries.
PROMPT_SECONDS = 5.0

MARKER = re.compile(r"<!-- example: (docs/examples/[\w.-]+) -->\n```(\w+)\n(.*?)```", re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> Iterator[Tuple[Path, str]]:
    """Every fenced block of ``language`` in the README and docs/, with its page."""
    for page in PAGES:
        for found in FENCE.finditer(page.read_text(encoding="utf-8")):
            if found.group(1) == language:
                yield page, found.group(2)


def command_lines(text: str) -> Iterator[str]:
    """The commands of a shell block: continuations joined, comments dropped."""
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s+)#(\s.*)?$", "", line).strip()
        if line:
            yield line


# -- example files ----------------------------------------------------------------


def test_every_marked_block_is_its_example_file() -> None:
    referenced = set()
    for page in PAGES:
        for found in MARKER.finditer(page.read_text(encoding="utf-8")):
            path, _, text = found.groups()
            assert (REPO / path).read_text(encoding="utf-8") == text, (page.name, path)
            referenced.add(path)
    assert referenced >= {
        f"docs/examples/{p.name}" for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")
    } - {"docs/examples/myhandlers.py"}  # the README names it, the quick start runs it


def test_every_python_block_is_an_example_file() -> None:
    marked = {
        found.group(3)
        for page in PAGES
        for found in MARKER.finditer(page.read_text(encoding="utf-8"))
    }
    for page, text in blocks("python"):
        assert text in marked, f"{page.name}: a Python block that is not a docs/examples/ file"


@pytest.mark.process
def test_the_relay_client_example_runs(tmp_path: Path) -> None:
    broker = BrokerProcess(str(tmp_path)).start()
    try:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(tmp_path),
            "PYTHONPATH": str(REPO),
            "DSH_RELAY_BROKER_URL": broker.url,
            "DSH_RELAY_SECRET": broker.secret,
        }
        for _ in range(2):  # and again: it leaves nothing behind that trips a second run
            done = subprocess.run(
                [sys.executable, str(EXAMPLES / "relay_client.py")],
                capture_output=True, text=True, timeout=RUN_SECONDS, env=env,
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.splitlines() == [
                "broker dsh-agent-relay 0.3.0, protocol 1.0",
                "beta got {'text': 'hi'} from example-alpha",
                "alpha got a receipt for its message: True",
                "alpha also leased the ack it read with recv",
                "alpha got the reply {'text': '4'}",
            ]
    finally:
        broker.stop()


V12_EXAMPLES = {
    "request_reply.py": [
        "answer: you asked: what time is it?",
        "the request failed: a question needs a text",
        "no answer within 2 s",
    ],
    "long_handler.py": [
        "done with a long task: delivered 1x, retried 0x",
        "done with upstream: delivered 2x, retried 1x",
    ],
    "dead_letters.py": [
        "the request failed: unknown item lamp",
        "among the dead letters: True (unknown item lamp)",
        "after the requeue: 3 lamps left",
    ],
}


@pytest.mark.parametrize("name", sorted(V12_EXAMPLES))
@pytest.mark.process
def test_the_v12_examples_run(tmp_path: Path, name: str) -> None:
    broker = BrokerProcess(str(tmp_path)).start()
    try:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(tmp_path),
            "PYTHONPATH": str(REPO),
            "DSH_RELAY_BROKER_URL": broker.url,
            "DSH_RELAY_SECRET": broker.secret,
        }
        for _ in range(2):  # and again: what a run leaves behind does not trip the next
            done = subprocess.run(
                [sys.executable, str(EXAMPLES / name)],
                capture_output=True, text=True, timeout=RUN_SECONDS, env=env,
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.splitlines() == V12_EXAMPLES[name]
    finally:
        broker.stop()


def test_the_example_handler() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_handlers", EXAMPLES / "myhandlers.py")
    assert spec is not None and spec.loader is not None
    myhandlers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(myhandlers)

    assert myhandlers.answer({"body": {"text": "hi"}}) == "you said: hi"
    with pytest.raises(ValueError, match="no text"):
        myhandlers.answer({"body": {}})


# -- documented command lines -------------------------------------------------------


class _Parsed(agent_tap.Options):
    """relay-agent's options, parsed without loading a handler or reading settings."""

    def postOptions(self) -> None:
        pass


def _plugin_arguments(argv: List[str], plugin: str) -> List[str]:
    return argv[argv.index(plugin) + 1:]


def test_every_documented_relay_command_parses() -> None:
    parser, _ = build_parser(COMMANDS)
    checked = 0
    for page, text in blocks("sh"):
        for line in command_lines(text):
            line = re.split(r"\s+(?:>|\||&&|;)\s*", line)[0]
            argv = shlex.split(line.removeprefix("sudo "))
            if not argv:
                continue
            if argv[0] == "relay":
                try:
                    parser.parse_args(argv[1:])
                except (UsageError, Exit) as problem:
                    pytest.fail(f"{page.name}: {line}: {problem}")
                checked += 1
            elif os.path.basename(argv[0]) == "twistd":
                if "relay-agent" in argv:
                    _Parsed().parseOptions(_plugin_arguments(argv, "relay-agent"))
                elif "relay" in argv:
                    tap.Options().parseOptions(_plugin_arguments(argv, "relay"))
                else:
                    continue
                checked += 1
    assert checked >= 12


@pytest.mark.process
def test_shell_blocks_are_posix(tmp_path: Path) -> None:
    """No bash-only syntax in an sh block: `dash -n` parses every one."""
    dash = shutil.which("dash")
    if dash is None:
        pytest.skip("dash is not installed")
    for page, text in blocks("sh"):
        script = tmp_path / "block.sh"
        script.write_text(text, encoding="utf-8")
        done = subprocess.run([dash, "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{page.name}: {done.stderr}\n{text}"


# -- the TLS section of docs/DEPLOY.md, end to end -----------------------------------


def deploy_block(language: str, containing: str) -> str:
    (found,) = [text for page, text in blocks(language)
                if page.name == "DEPLOY.md" and containing in text]
    return found


def deploy_line(host: str, *fragments: str, without: str = "") -> str:
    """The one command of DEPLOY.md's sh blocks holding every fragment, for ``host``."""
    found = [
        line
        for page, text in blocks("sh")
        if page.name == "DEPLOY.md"
        for line in command_lines(text)
        if all(f in line for f in fragments) and not (without and without in line)
    ]
    assert len(found) == 1, found
    return found[0].replace("relay.example.org:19443", host)


class Shell:
    """Runs documented command lines with ``sh`` in a checkout with its own home."""

    def __init__(self, checkout: Path, home: Path) -> None:
        self.checkout = checkout
        self.env = {
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "HOME": str(home),
            "PYTHONPATH": str(REPO),
        }

    def __call__(self, script: str) -> Tuple[int, str, str, float]:
        started = time.monotonic()
        done = subprocess.run(
            ["sh", "-c", script], cwd=self.checkout, env=self.env,
            capture_output=True, text=True, timeout=RUN_SECONDS,
        )
        return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def start_broker(checkout: Path, config: Dict, plain_port: int) -> subprocess.Popen:
    """``twistd -n relay --config conf/relay.yaml`` as DEPLOY.md runs it (no --pidfile)."""
    import urllib.request

    (checkout / "conf" / "relay.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    log_path = checkout / "broker.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [str(BIN / "twistd"), "-n", "relay", "--config", "conf/relay.yaml"],
            cwd=checkout, stdout=log, stderr=subprocess.STDOUT,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
        )
    deadline = time.monotonic() + RUN_SECONDS
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{plain_port}/", timeout=1):
                return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait(10)
                raise RuntimeError(log_path.read_text()) from None
            time.sleep(0.05)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@pytest.mark.process
def test_the_documented_certificates_serve_and_verify(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    checkout, home = tmp_path / "checkout", tmp_path / "home"
    (checkout / "conf").mkdir(parents=True)
    home.mkdir()
    sh = Shell(checkout, home)
    for script in ("tls-certificates.sh", "tls-client-certificate.sh"):
        status, _, err, _ = sh((EXAMPLES / script).read_text())
        assert status == 0, err
    assert sorted(p.name for p in (checkout / "conf" / "tls").iterdir()) == [
        "ca.crt", "server.crt", "server.key"
    ]
    assert (home / "relay-ca" / "ca.key").stat().st_mode & 0o077 == 0

    plain, tls = free_port(), free_port()
    block = deploy_block("yaml", "ssl:19443:privateKey=tls/server.key")
    written = block.replace("19121", str(plain))
    config = yaml.safe_load(written.replace("19443", str(tls)))
    broker = start_broker(checkout, config, plain)
    try:
        assert not list(checkout.glob("*.pid")), "no pid file in the foreground"
        selfcheck = deploy_line(f"localhost:{tls}", "https://", "selfcheck", without="--client")
        status, out, err, _ = sh(selfcheck)
        assert status == 0 and out.strip().endswith("selfcheck passed"), out + err

        status, _, err, took = sh(
            f"relay --broker https://localhost:{plain} --ca-file ~/relay-ca/ca.crt handshake"
        )
        assert status == 1 and took < PROMPT_SECONDS, (err, took)
        assert "the broker speaks plain HTTP here" in err and "is this the https port?" in err
        status, _, err, took = sh(f"relay --broker http://localhost:{tls} handshake")
        assert status == 1 and took < PROMPT_SECONDS, (err, took)
        assert err == (
            "error: bad_request: this port speaks TLS: use an https:// URL "
            "(is this the https port?)\n"
        )
    finally:
        stop(broker)

    config["broker"].update(yaml.safe_load(deploy_block("yaml", "tlsClientCA"))["broker"])
    broker = start_broker(checkout, config, plain)
    try:
        with_certificate = deploy_line(f"localhost:{tls}", "--client-cert", "selfcheck")
        status, out, err, _ = sh(with_certificate)
        assert status == 0 and out.strip().endswith("selfcheck passed"), out + err
        status, out, err, _ = sh(selfcheck)
        assert status == 1 and "requires a client certificate and none was given" in out + err
        if shutil.which("curl"):
            status, out, err, _ = sh(deploy_line(f"localhost:{tls}", "curl --cacert"))
            assert status == 0 and '"protocol":"1.0"' in out.replace(" ", ""), err
    finally:
        stop(broker)


CITED_TEST = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`|`::(test_\w+)`")


def test_every_test_the_docs_cite_exists() -> None:
    """A page that says "shown by tests/x.py::test_y" names a test that exists
    (``::test_z`` right after names one in the same file)."""
    cited = 0
    for page in PAGES:
        current = None
        for found in CITED_TEST.finditer(page.read_text(encoding="utf-8")):
            path, name = (found.group(1), found.group(2)) if found.group(1) else (
                current, found.group(3))
            assert path is not None, f"{page.name}: `::{name}` with no file before it"
            current = path
            source = (REPO / path).read_text(encoding="utf-8")
            assert re.search(rf"^(async )?def {name}\(", source, re.M), (
                f"{page.name} cites {path}::{name}, which does not exist")
            cited += 1
    assert cited >= 20
