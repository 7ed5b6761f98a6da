"""``relay mcp install``: the change to Claude Code's and Codex's MCP config, shown,
agreed to, written; never the secret itself."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path
from typing import Any, List

import pytest
import pytest_twisted
from twisted.internet import defer

from relay.cli import run
from relay.mcp.install import claude_config, codex_config
from relay.testing import SECRET

BROKER = "http://127.0.0.1:19121"


def toml(text: str) -> Any:
    """``text`` parsed as TOML (Python 3.11+; older interpreters skip the check)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads(text)


class Outcome:
    def __init__(self, status: int, out: str, err: str) -> None:
        self.status, self.out, self.err = status, out, err


def install(home: Path, secret_file: Path, *argv: str, stdin: str = "",
            env: Any = None) -> defer.Deferred:
    from twisted.internet import reactor

    out, err = io.StringIO(), io.StringIO()
    d = defer.Deferred.fromCoroutine(run(
        reactor, ["mcp", "install", "--agent", "alice", "--secret-file", str(secret_file),
                  "--broker", BROKER, *argv],
        env=env or {}, home=home, out=out, err=err, stdin=io.StringIO(stdin)))
    return d.addCallback(lambda status: Outcome(status, out.getvalue(), err.getvalue()))


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "conf" / "relay.secret"
    path.parent.mkdir()
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def relay_args(args: List[str], secret_file: Path) -> None:
    assert args[:7] == ["mcp", "--broker", BROKER, "--agent", "alice", "--secret-file",
                        str(secret_file)]


@pytest_twisted.ensureDeferred
async def test_claude_code_user_config_is_shown_asked_then_written(tmp_path, secret_file):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".claude.json").write_text(json.dumps({"numStartups": 3, "mcpServers": {
        "other": {"command": "x"}}}))
    (home / ".claude.json").chmod(0o600)
    refused = await install(home, secret_file, "--for", "claude", stdin="n\n")
    assert refused.status == 1 and "not written" in refused.err
    assert '+    "relay": {' in refused.out and refused.out.startswith("--- ")
    assert json.loads((home / ".claude.json").read_text())["mcpServers"] == {
        "other": {"command": "x"}}
    done = await install(home, secret_file, "--for", "claude", "--skill", "review",
                         stdin="y\n")
    assert done.status == 0, done.err
    config = json.loads((home / ".claude.json").read_text())
    assert config["numStartups"] == 3 and config["mcpServers"]["other"] == {"command": "x"}
    server = config["mcpServers"]["relay"]
    relay_args(server["args"], secret_file)
    assert server["args"][-2:] == ["--skill", "review"]
    assert Path(server["command"]).name == "relay"
    text = (home / ".claude.json").read_text()
    assert SECRET not in text and SECRET not in done.out + done.err
    assert stat.S_IMODE((home / ".claude.json").stat().st_mode) == 0o600
    again = await install(home, secret_file, "--for", "claude", "--skill", "review")
    assert again.status == 0 and "nothing to change" in again.out


@pytest_twisted.ensureDeferred
async def test_codex_config_keeps_the_rest_and_replaces_an_older_relay_table(
        tmp_path, secret_file):
    codex = tmp_path / "codex"
    codex.mkdir()
    (codex / "config.toml").write_text(
        'model = "o3"\n\n[mcp_servers.relay]\ncommand = "old"\n\n[mcp_servers.relay.env]\n'
        'A = "1"\n\n[mcp_servers.docs]\ncommand = "docs"\n')
    done = await install(tmp_path, secret_file, "--for", "codex", "--yes",
                         env={"CODEX_HOME": str(codex)})
    assert done.status == 0, done.err
    config = toml((codex / "config.toml").read_text())
    assert config["model"] == "o3" and config["mcp_servers"]["docs"] == {"command": "docs"}
    server = config["mcp_servers"]["relay"]
    relay_args(server["args"], secret_file)
    assert server["startup_timeout_sec"] == 30 and "env" not in server
    assert SECRET not in (codex / "config.toml").read_text()


@pytest_twisted.ensureDeferred
async def test_a_new_codex_config_is_private(tmp_path, secret_file):
    done = await install(tmp_path, secret_file, "--for", "codex", "--yes")
    assert done.status == 0, done.err
    path = tmp_path / ".codex" / "config.toml"
    assert "+[mcp_servers.relay]" in done.out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest_twisted.ensureDeferred
async def test_the_secret_itself_is_never_written(tmp_path, secret_file):
    from twisted.internet import reactor

    err = io.StringIO()
    status = await defer.Deferred.fromCoroutine(run(
        reactor, ["mcp", "install", "--for", "codex", "--yes", "--agent", "alice",
                  "--secret", SECRET], env={}, home=tmp_path, out=io.StringIO(), err=err))
    assert status == 2 and "--secret-file" in err.getvalue()
    assert not (tmp_path / ".codex").exists()


@pytest_twisted.ensureDeferred
async def test_a_secret_file_others_can_read_is_warned_about(tmp_path, secret_file):
    secret_file.chmod(0o644)
    done = await install(tmp_path, secret_file, "--for", "codex", "--yes")
    assert f"warning: other users can read {secret_file}; chmod 600 it" in done.err


@pytest_twisted.ensureDeferred
async def test_install_needs_a_client_and_a_config_it_can_read(tmp_path, secret_file):
    missing = await install(tmp_path, secret_file)
    assert missing.status == 2 and "--for claude or --for codex" in missing.err
    (tmp_path / ".claude.json").write_text("[1, 2]")
    broken = await install(tmp_path, secret_file, "--for", "claude", "--yes")
    assert broken.status == 2 and "it is not a JSON object" in broken.err


def test_the_config_texts() -> None:
    assert json.loads(claude_config(None, "relay", ["mcp"])) == {
        "mcpServers": {"relay": {"type": "stdio", "command": "relay", "args": ["mcp"],
                                 "env": {}}}}
    text = codex_config('x = [\n  ["a"],\n]\n', "/bin/relay", ["mcp", 'a "b"'])
    assert toml(text) == {"x": [["a"]], "mcp_servers": {"relay": {
        "command": "/bin/relay", "args": ["mcp", 'a "b"'], "startup_timeout_sec": 30}}}


@pytest_twisted.ensureDeferred
async def test_the_project_scope_writes_mcp_json_in_the_working_directory(
        tmp_path, secret_file, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    done = await install(tmp_path / "home", secret_file, "--for", "claude",
                         "--scope", "project", "--yes")
    assert done.status == 0, done.err
    assert "relay" in json.loads((tmp_path / ".mcp.json").read_text())["mcpServers"]
