"""Small private files of the client side: read JSON, replace a file atomically."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

PRIVATE_MODE = 0o600


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
