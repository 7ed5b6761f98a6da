"""Small private files: read JSON, replace a file atomically, create files and
directories only their owner can read, whatever the umask."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Optional

PRIVATE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def private_dir(path: str) -> bool:
    """Create the directory ``path`` (and its parents) if missing, the last one mode
    0700; returns whether it was created. OSError when it cannot be."""
    if os.path.isdir(path):
        return False
    os.makedirs(path, exist_ok=True)
    os.chmod(path, PRIVATE_DIR_MODE)
    return True


def private_file(path: str) -> bool:
    """Create the empty file ``path`` with mode 0600 if it is missing; returns whether
    it was created. An existing file is left as it is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, PRIVATE_MODE)  # the umask may have taken bits from the mode
    finally:
        os.close(fd)
    return True


def read_json(path: Path) -> Any:
    """The JSON document in ``path``."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def write_atomic(path: Path, text: str, mode: int = PRIVATE_MODE) -> None:
    """Replace ``path`` with ``text``: a reader sees the old file or the new one, never part.

    The text goes to a temporary file beside ``path`` (created with ``mode``),
    is flushed to disk, then renamed over ``path``. On failure the temporary
    file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, document: Any, mode: int = PRIVATE_MODE) -> None:
    """Replace ``path`` with the JSON ``document`` atomically (see :func:`write_atomic`)."""
    write_atomic(path, json.dumps(document, ensure_ascii=False, sort_keys=True), mode)


class FreeSpace:
    """The bytes free (for an unprivileged user) on the filesystem holding ``path``,
    looked up at most once every ``every`` seconds of ``clock``; None when the
    filesystem cannot say."""

    def __init__(self, path: str, clock: Any, every: float = 1.0) -> None:
        self.path = path
        self.clock = clock
        self.every = every
        self._checked: Optional[float] = None
        self._free: Optional[int] = None

    def __call__(self) -> Optional[int]:
        now = self.clock.seconds()
        if self._checked is None or now - self._checked >= self.every:
            self._checked = now
            try:
                found = os.statvfs(self.path)
            except OSError:
                self._free = None
            else:
                self._free = found.f_bavail * found.f_frsize
        return self._free
