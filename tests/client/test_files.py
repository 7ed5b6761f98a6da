"""The client side's one way to replace a file."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from relay.files.private import read_json, write_atomic, write_json_atomic


def test_write_atomic_replaces_the_file_privately_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old", encoding="utf-8")
    path.chmod(0o644)
    write_json_atomic(path, {"b": 1, "a": "é"})
    assert path.read_text(encoding="utf-8") == '{"a": "é", "b": 1}'
    assert read_json(path) == {"a": "é", "b": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"kept": true}', encoding="utf-8")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(path, "a lone surrogate \ud800 cannot be written as UTF-8")
    assert json.loads(path.read_text(encoding="utf-8")) == {"kept": True}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_write_atomic_takes_a_mode(tmp_path: Path) -> None:
    path = tmp_path / "shared.txt"
    write_atomic(path, "text\n", mode=0o640)
    assert path.read_text(encoding="utf-8") == "text\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
