"""What the direct tests of :mod:`relay.wire.protocol` share: how a refusal is checked."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from relay.wire.errors import RelayError

# A value no refusal may repeat back: an error names the field, never what was sent.
CONTENT = "SECRET-CONTENT-7f3a"


def refusal(call: Callable[..., Any], *args: Any, field: str) -> RelayError:
    """The error ``call(*args)`` raises: ``400 bad_request`` naming ``field`` and
    holding none of :data:`CONTENT`."""
    with pytest.raises(RelayError) as info:
        call(*args)
    error = info.value
    assert (error.status, error.code) == (400, "bad_request"), error
    assert field in error.message, error.message
    assert CONTENT not in error.message and CONTENT not in str(error), error.message
    assert error.to_body() == {"error": {"code": "bad_request", "message": error.message}}
    return error
