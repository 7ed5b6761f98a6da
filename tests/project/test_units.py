"""The systemd units in conf/: valid, hardened, and running what the plugins accept.

A unit cannot be started here (no systemd as PID 1), so the checks are what
systemd offers offline: ``systemd-analyze verify`` (with ExecStart pointed at
this checkout's twistd, the only thing missing on a machine without the
installation) and ``systemd-analyze security --offline=yes``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from twisted.scripts.twistd import ServerOptions

from relay.wire.errors import EXIT_CONFIG_ERROR
from tests.support import REPO

UNITS = {"relay.service": "relay.service", "relay-agent@.service": "relay-agent@worker.service"}
INSTALLED_TWISTD = "/opt/dsh-agent-relay/bin/twistd"
# The exposure score `systemd-analyze security` gives (0 best, 10 worst).
MAX_EXPOSURE = 3.0

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def service_section(name: str) -> Dict[str, List[str]]:
    """The [Service] settings of conf/NAME, each key with its values in order."""
    settings: Dict[str, List[str]] = {}
    section = None
    for line in (REPO / "conf" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def local_copy(tmp_path: Path, name: str) -> Path:
    """conf/NAME with ExecStart running this checkout's twistd."""
    twistd = str(Path(sys.executable).with_name("twistd"))
    text = (REPO / "conf" / name).read_text().replace(INSTALLED_TWISTD, twistd)
    path = tmp_path / name
    path.write_text(text)
    return path


@needs_analyze
@pytest.mark.parametrize("name", sorted(UNITS))
@pytest.mark.process
def test_the_unit_verifies(tmp_path: Path, name: str) -> None:
    local_copy(tmp_path, name)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / UNITS[name])],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout + done.stderr == ""


@needs_analyze
@pytest.mark.parametrize("name", sorted(UNITS))
@pytest.mark.process
def test_the_unit_is_hardened(tmp_path: Path, name: str) -> None:
    local_copy(tmp_path, name)
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(tmp_path / UNITS[name])],
        capture_output=True, text=True, timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    if done.returncode != 0 and found is None:
        pytest.skip(f"this systemd-analyze cannot score units offline: {done.stderr.strip()}")
    assert found is not None, done.stdout
    assert float(found.group(1)) < MAX_EXPOSURE, done.stdout


@pytest.mark.parametrize("name", sorted(UNITS))
def test_restart_after_a_crash_but_not_after_a_config_error(name: str) -> None:
    service = service_section(name)
    assert service["Restart"] == ["on-failure"]
    assert service["RestartPreventExitStatus"] == [str(EXIT_CONFIG_ERROR)]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_command_line_is_one_twistd_accepts(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ExecStart's arguments parse, with no pid file, in the foreground."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (command,) = service_section(name)["ExecStart"]
    argv = shlex.split(command.replace("%i", "worker").replace("$RELAY_AGENT_ARGS", ""))
    assert argv[0] == INSTALLED_TWISTD
    options = ServerOptions()
    if argv[argv.index("--pidfile=") + 1] == "relay-agent":
        argv += ["--secret", "s", "--exec", "cat"]  # what the environment file adds
    options.parseOptions(argv[1:])
    assert (options["nodaemon"], options["pidfile"]) == (True, "")
