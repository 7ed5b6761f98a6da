"""``twistd relay-agent``: its options, the handler named by ``--exec`` or ``--handler`` and
its problems in one line, the service it makes, its pid file, and the peer card made from
``--description`` and ``--skill`` (EXTENSIONS.md §8).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, List, Optional

import pytest

from relay.agent import AgentService, ExecHandler, card_of
from relay.agent.receipts import receipts_path


def refused(argv: List[str], capsys: pytest.CaptureFixture) -> str:
    """The one line ``twistd relay-agent`` prints for options it cannot start with."""
    from relay.agent import tap as agent_tap

    with pytest.raises(SystemExit) as info:
        agent_tap.Options().parseOptions(argv)
    assert info.value.code == 78  # EX_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relay-agent: error: "), err
    assert err.endswith(" (see `twistd relay-agent --help`)\n")
    return err


@pytest.fixture
def importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A working directory of its own; the modules a test imports are forgotten after it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


# -- options and handlers ------------------------------------------------------------------


def test_plugin_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from relay.agent import tap as agent_tap

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DSH_RELAY_SECRET", raising=False)
    options = agent_tap.Options()
    options.parseOptions(
        ["--agent", "worker", "--secret", "s", "--exec", "cat", "--concurrency", "3"]
    )
    assert options.settings.agent == "worker"
    assert options["concurrency"] == 3
    for flag in ("--broker", "--url"):
        named = agent_tap.Options()
        named.parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat", flag, "http://b:5"])
        assert named.settings.broker_url == "http://b:5"
    assert "exactly one" in refused(["--agent", "w", "--secret", "s"], capsys)
    assert "exactly one" in refused(
        ["--agent", "w", "--secret", "s", "--exec", "cat", "--handler", "json:dumps"], capsys
    )
    assert "no agent" in refused(["--secret", "s", "--exec", "cat"], capsys)
    loaded = agent_tap.Options()
    loaded.parseOptions(["--agent", "w", "--secret", "s", "--handler", "json:dumps"])
    assert loaded.handler is json.dumps


@pytest.mark.parametrize(
    "spec, source, message",
    [
        ("nosuch:answer", None,
         "cannot load handler 'nosuch:answer': No module named 'nosuch' (looked in {cwd} and "
         "the installed packages)"),
        ("nosuch.deeper:answer", None, "No module named 'nosuch'"),
        ("myhandlers:answer", "import numpy_that_is_missing\n",
         "importing myhandlers failed: No module named 'numpy_that_is_missing'"),
        ("myhandlers:answer", "1 / 0\n",
         "importing myhandlers failed: ZeroDivisionError: division by zero"),
        ("myhandlers:answer", "def answer(:\n",
         "importing myhandlers failed: SyntaxError: "),
        ("myhandlers:other", "def answer(m):\n    return 'x'\n",
         "module myhandlers has no 'other'"),
        ("myhandlers:answer", "answer = 3\n", "answer is not callable"),
        ("myhandlers", None, "expected MODULE:CALLABLE"),
    ],
)
def test_handler_problems_are_one_line(
    importing: Path,
    capsys: pytest.CaptureFixture,
    spec: str,
    source: Optional[str],
    message: str,
) -> None:
    tmp_path = importing
    if source is not None:
        (tmp_path / "myhandlers.py").write_text(source, encoding="utf-8")
    err = refused(["--agent", "w", "--secret", "s", "--handler", spec], capsys)
    assert message.format(cwd=tmp_path) in err


def test_a_handler_in_the_working_directory_is_found(importing: Path) -> None:
    from relay.agent import tap as agent_tap

    tmp_path = importing
    (tmp_path / "cwd_handlers.py").write_text("def answer(m):\n    return 'hi'\n")
    options = agent_tap.Options()
    options.parseOptions(["--agent", "w", "--secret", "s", "--handler", "cwd_handlers:answer"])
    assert options.handler({"body": {}}) == "hi"


def test_make_service_builds_an_agent_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.agent import tap as agent_tap

    monkeypatch.setenv("HOME", str(tmp_path))
    options = agent_tap.Options()
    options.parseOptions(
        ["--agent", "worker", "--secret", "s", "--broker", "http://127.0.0.1:1", "--exec", "cat"]
    )
    service = agent_tap.makeService(options)
    assert isinstance(service, AgentService)
    assert service.client.agent == "worker"
    assert service.receipts.path == receipts_path("worker", tmp_path)
    assert isinstance(service.handler, ExecHandler)
    assert service.use_events
    options = agent_tap.Options()
    options.parseOptions(["--agent", "worker", "--secret", "s", "--exec", "cat", "--no-events"])
    assert not agent_tap.makeService(options).use_events


@pytest.mark.parametrize(
    "given, nodaemon, chosen",
    [
        ("twistd.pid", True, ""),  # the foreground: no pid file
        ("twistd.pid", False, "relay-agent-w.pid"),  # detached: its own
        ("/run/relay/w.pid", True, "/run/relay/w.pid"),  # asked for: kept
        ("", False, ""),
    ],
)
def test_the_agent_chooses_its_own_pid_file(
    given: str, nodaemon: bool, chosen: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from twisted.scripts.twistd import ServerOptions

    monkeypatch.setenv("HOME", str(tmp_path))
    argv = (["--nodaemon"] if nodaemon else []) + [f"--pidfile={given}", "relay-agent"]
    options = ServerOptions()
    options.parseOptions(argv + ["--agent", "w", "--secret", "s", "--exec", "cat"])
    assert options["pidfile"] == (os.path.abspath(chosen) if chosen else "")
    broker = ServerOptions()
    broker.parseOptions((["--nodaemon"] if nodaemon else []) + [f"--pidfile={given}", "relay"])
    expected = chosen.replace("relay-agent-w.pid", "relay.pid")
    assert broker["pidfile"] == (os.path.abspath(expected) if expected else "")


# -- the peer card (EXTENSIONS.md §8) ------------------------------------------------------


def test_card_of() -> None:
    assert card_of(None, []) is None
    assert card_of("d", []) == {"description": "d"}
    assert card_of("", ["a", "b"]) == {"skills": ["a", "b"]}


def test_the_plugin_makes_a_card_from_description_and_skills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.agent import tap as agent_tap

    monkeypatch.setenv("HOME", str(tmp_path))
    options = agent_tap.Options()
    options.parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat", "--broker",
                          "http://127.0.0.1:1", "--description", "reviews diffs",
                          "--skill", "review", "--skill", "python"])
    service = agent_tap.makeService(options)
    assert service.card == {"description": "reviews diffs", "skills": ["review", "python"]}
    bare = agent_tap.Options()
    bare.parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat"])
    assert agent_tap.makeService(bare).card is None


@pytest.mark.parametrize("argv, message", [
    (["--description", "x" * 2001], "--description: at most 2000 characters"),
    (["--skill", ""], "--skill '': 1 to 100 characters"),
    (["--skill", "s" * 101], "1 to 100 characters"),
    ([arg for i in range(51) for arg in ("--skill", f"s{i}")], "--skill: at most 50 skills"),
])
def test_a_card_the_broker_would_refuse_stops_the_start(
    argv: List[str], message: str, capsys: pytest.CaptureFixture, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relay.agent import tap as agent_tap

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        agent_tap.Options().parseOptions(["--agent", "w", "--secret", "s", "--exec", "cat",
                                          *argv])
    assert info.value.code == 78
    err = capsys.readouterr().err
    assert err.startswith("relay-agent: error: ") and message in err, err
