"""The canonical JSON of the v2/v3 wire (PROTOCOL-V2 §4).

A client serializes the body it sends exactly so, signs those bytes and sends
those bytes; the broker verifies the bytes it received. The definition is
Python's ``json.dumps(payload, ensure_ascii=False, separators=(",", ":"),
sort_keys=True)`` encoded as UTF-8, which is what produced the reference's
golden vectors: keys sorted (by code point, which is UTF-8 byte order) at every
depth, no spaces, non-ASCII characters as raw UTF-8, ``"`` ``\\`` and control
characters escaped (``\\b \\t \\n \\f \\r``, others as ``\\u00XX``), integral floats
as ``N.0``.

Two refusals the reference's definition leaves open: NaN and the infinities are
not JSON, and a lone surrogate has no UTF-8 form; both are a ``ValueError``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["canonical_body", "canonical_text"]

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                            allow_nan=False)


def canonical_text(payload: Any) -> str:
    """The canonical JSON text of ``payload`` (a JSON value: dicts with string keys,
    lists, strings, numbers, booleans, None). ValueError for NaN or an infinity,
    TypeError for a value JSON cannot hold."""
    return _ENCODER.encode(payload)


def canonical_body(payload: Any) -> bytes:
    """The bytes a v2/v3 client signs and sends for ``payload``: its canonical JSON
    in UTF-8. ValueError as :func:`canonical_text`, and for a lone surrogate."""
    try:
        return canonical_text(payload).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string of the payload holds a lone surrogate, which has no "
                         "UTF-8 form") from None
