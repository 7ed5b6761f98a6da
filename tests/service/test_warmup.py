"""The start-up warm-up: it exercises the request path on a scratch store and leaves
nothing behind."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from relay.broker import warmup
from relay.rules.config import parse_config
from relay.testing import SECRET
from relay.wire.errors import ConfigError


def config(tmp_path: Path, **broker):
    values = {"secret": SECRET, "dataDir": str(tmp_path / "data")}
    values.update(broker)
    return parse_config({"broker": values}, str(tmp_path))


def ticking(step: float):
    """A timer that moves ``step`` seconds each time it is read."""
    counter = itertools.count()
    return lambda: next(counter) * step


@pytest.mark.parametrize("storage", ["memory", "sqlite", "jsonl"])
def test_exercise_serves_the_request_path_and_leaves_the_data_directory_alone(
        tmp_path: Path, storage: str) -> None:
    cfg = config(tmp_path, storage=storage)
    served = warmup.exercise(cfg, 1.0, timer=ticking(0.3))
    # Three rounds of ten sends, a poll, a pull, ten acks, a long poll woken by an
    # eleventh send and its ack, a register and a peers list.
    assert served == 3 * 27
    assert not (tmp_path / "data").exists()


def test_a_backend_outside_this_process_is_exercised_on_memory(tmp_path: Path) -> None:
    # No server listens at this address: the scratch broker never connects to it.
    cfg = config(tmp_path, storage="postgres",
                 postgres={"dsn": "postgresql://nobody@127.0.0.1:9/none"})
    assert warmup.exercise(cfg, 1.0, timer=ticking(0.6)) == 27


def test_no_seconds_no_warm_up(tmp_path: Path) -> None:
    assert warmup.exercise(config(tmp_path), 0) == 0
    assert warmup.warm_up(config(tmp_path), 0) == 0


def test_default_is_the_environment_override_then_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("RELAY_WARMUP_SECONDS", "2.5")
    assert warmup.default_seconds() == 2.5
    monkeypatch.setenv("RELAY_WARMUP_SECONDS", "1000")
    assert warmup.default_seconds() == 60.0
    monkeypatch.delenv("RELAY_WARMUP_SECONDS")
    monkeypatch.setattr(warmup.platform, "python_implementation", lambda: "PyPy")
    assert warmup.default_seconds() == warmup.PYPY_DEFAULT_SECONDS
    monkeypatch.setattr(warmup.platform, "python_implementation", lambda: "CPython")
    assert warmup.default_seconds() == 0.0


def test_a_failing_warm_up_does_not_stop_the_start(tmp_path: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("scratch store unavailable")

    monkeypatch.setattr(warmup, "exercise", broken)
    assert warmup.warm_up(config(tmp_path), 1.0) == 0


def test_warmup_seconds_is_validated(tmp_path: Path) -> None:
    assert config(tmp_path).warmup_seconds is None
    assert config(tmp_path, warmupSeconds=3).warmup_seconds == 3.0
    with pytest.raises(ConfigError, match="broker.warmupSeconds"):
        config(tmp_path, warmupSeconds=61)
    with pytest.raises(ConfigError, match="broker.warmupSeconds"):
        config(tmp_path, warmupSeconds="3")


def test_the_environment_of_the_tests_turns_it_off() -> None:
    assert os.environ["RELAY_WARMUP_SECONDS"] == "0"
