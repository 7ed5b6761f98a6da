"""The wheel carries everything an installed (not editable) broker reads at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_holds_the_dashboard_sql_and_plugins(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "dropin.cache")
    shutil.copytree(REPO / "relay", source / "relay", ignore=ignore)
    shutil.copytree(REPO / "twisted", source / "twisted", ignore=ignore)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=source, capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    # setuptools warns about a data directory it would leave out of the packages
    assert "absent from the `packages` configuration" not in built.stderr
    (wheel,) = tmp_path.glob("dsh_agent_relay-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = {p.name for p in (REPO / "relay" / "ops" / "static").iterdir() if p.is_file()}
    assert static and {f"relay/ops/static/{n}" for n in static} <= names
    scripts = {p.name for p in (REPO / "relay" / "store").glob("*.sql")}
    assert scripts and {f"relay/store/{n}" for n in scripts} <= names
    assert {"twisted/plugins/relay_plugin.py", "twisted/plugins/relay_stores.py"} <= names
    # Twisted's own package is not shipped: only the plugin files live under twisted/
    assert not {n for n in names if n.startswith("twisted/") and "/plugins/" not in n}
