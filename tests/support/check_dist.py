"""Checks of the files `make dist` builds: the wheel carries everything an installed
(not editable) broker reads at run time, the sdist what a release's source needs.

Run by `make dist` as ``python tests/support/check_dist.py DIR``, and by
tests/project/test_packaging.py on a wheel it builds.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]


def wheel_problems(wheel: Path) -> List[str]:
    """What the wheel lacks or holds that it should not; empty when it is right."""
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"relay/{page}/static/{p.name}" for page in ("broker/ops", "broker/inbox")
              for p in (REPO / "relay" / page / "static").iterdir()
              if p.is_file() and not p.name.endswith(".py")}
    wanted |= {p.relative_to(REPO).as_posix() for p in (REPO / "relay" / "store").rglob("*.sql")}
    wanted |= {"twisted/plugins/relay_plugin.py", "twisted/plugins/relay_stores.py"}
    problems = [f"{wheel.name} lacks {name}" for name in sorted(wanted - names)]
    # Twisted's own package is not shipped: only the plugin files live under twisted/
    problems += [f"{wheel.name} holds {name}" for name in sorted(names)
                 if name.startswith("twisted/") and "/plugins/" not in name]
    return problems


def sdist_problems(sdist: Path) -> List[str]:
    """What the sdist lacks: the packages' sources and data, the docs and the config."""
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {"setup.cfg", "pyproject.toml", "README.md", "CHANGELOG.md", "conf/relay.yaml",
              "docs/CONFIG.md", "relay/broker/ops/static/index.html", "relay/store/sqlite-v9.sql",
              "relay/store/postgres/migration-1.sql",
              "relay/broker/inbox/static/index.html", "relay/broker/inbox/static/inbox.js",
              "twisted/plugins/relay_plugin.py", "twisted/plugins/relay_stores.py",
              "relay/broker/operations.py"}
    return [f"{sdist.name} lacks {name}" for name in sorted(wanted - names)]


def main(directory: str) -> int:
    """Check the one wheel and the one sdist in ``directory``; print what is wrong."""
    folder = Path(directory)
    wheels = sorted(folder.glob("dsh_agent_relay-*.whl"))
    sdists = sorted(folder.glob("dsh?agent?relay-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"check_dist: expected one wheel and one sdist in {folder}, found "
              f"{[p.name for p in wheels + sdists]}", file=sys.stderr)
        return 1
    problems = wheel_problems(wheels[0]) + sdist_problems(sdists[0])
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_dist: {wheels[0].name} and {sdists[0].name} hold what a release needs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "dist"))
