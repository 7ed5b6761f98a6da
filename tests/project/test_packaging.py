"""The wheel carries everything an installed (not editable) broker reads at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.check_dist import sdist_problems, wheel_problems

pytestmark = pytest.mark.process



def _source(tmp_path: Path) -> Path:
    """A copy of what the packaging reads, without the checkout's build leftovers."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "dropin.cache")
    for folder in ("relay", "twisted", "docs", "conf"):
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    for secret in (source / "conf").glob("*.secret"):
        secret.unlink()
    return source


def test_wheel_holds_the_dashboard_sql_and_plugins(tmp_path: Path) -> None:
    source = _source(tmp_path)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=source, capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    # setuptools warns about a data directory it would leave out of the packages
    assert "absent from the `packages` configuration" not in built.stderr
    (wheel,) = tmp_path.glob("dsh_agent_relay-*.whl")
    assert wheel_problems(wheel) == []


def test_the_sdist_of_make_dist_holds_the_docs_and_the_config(tmp_path: Path) -> None:
    """What `make dist` builds (with the `build` front end) through the same hook."""
    source = _source(tmp_path)
    built = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path)],
        cwd=source, capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (sdist,) = tmp_path.glob("dsh?agent?relay-*.tar.gz")
    assert sdist_problems(sdist) == []
    with tarfile.open(sdist) as archive:
        assert not [n for n in archive.getnames() if n.endswith(".secret")]


def test_the_documented_installs_name_what_make_dist_builds() -> None:
    """README's install commands: `make dist` exists, and their wheel pattern is the
    name the build gives (the package is not on PyPI, so `pip install
    dsh-agent-relay[...]` is documented nowhere)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "make dist\n" in readme and '"$(ls dist/dsh_agent_relay-*.whl)[mcp' in readme
    dry = subprocess.run(["make", "-n", "dist"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert dry.returncode == 0 and "-m build --outdir dist" in dry.stdout, dry.stderr
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        assert "install 'dsh-agent-relay[" not in page.read_text(encoding="utf-8"), page
