"""The one error type every layer of the relay raises and every client sees."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from twisted.internet.defer import Deferred


class RelayError(Exception):
    """A protocol error: an HTTP status, a machine code (spec §6) and a human message.

    The message never carries message content: callers pass ids, field names and
    limits only. ``pending``, when set, is a Deferred the HTTP layer waits for
    before it answers the error (a refused request whose failure is being counted
    where brokers share their lockouts); it never fails.
    """

    pending: Optional[Deferred] = None

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code} ({status}): {message}")
        self.status = status
        self.code = code
        self.message = message

    def to_body(self) -> Dict[str, Any]:
        """The uniform error body of spec §6."""
        return {"error": {"code": self.code, "message": self.message}}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RelayError):
            return NotImplemented
        return (self.status, self.code, self.message) == (other.status, other.code, other.message)

    def __hash__(self) -> int:
        return hash((self.status, self.code, self.message))


class ConfigError(ValueError):
    """A configuration problem: the key and the reason, printed as one line."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key = key
        self.reason = reason


# sysexits.h EX_CONFIG, the exit status of ``twistd relay`` and ``twistd relay-agent``
# stopped by a ConfigError: a supervisor should not restart what will fail again.
EXIT_CONFIG_ERROR = 78


def bad_request(message: str) -> RelayError:
    return RelayError(400, "bad_request", message)


def unauthenticated(message: str) -> RelayError:
    return RelayError(401, "unauthenticated", message)


def unknown_agent(message: str = "agent is not configured") -> RelayError:
    return RelayError(401, "unknown_agent", message)


def unknown_key(message: str = "unknown relay key id") -> RelayError:
    """A v3 request naming a key its agent lacks, or a key past its ``notAfter``."""
    return RelayError(401, "unknown_key", message)


def locked(message: str = "agent is locked after repeated authentication failures") -> RelayError:
    return RelayError(403, "locked", message)


def forbidden(message: str) -> RelayError:
    return RelayError(403, "forbidden", message)


def no_such_agent(message: str) -> RelayError:
    return RelayError(404, "no_such_agent", message)


def no_such_message(message: str = "message id not found (expired or unknown)") -> RelayError:
    return RelayError(404, "no_such_message", message)


def not_found(message: str) -> RelayError:
    return RelayError(404, "not_found", message)


def not_leased(message: str = "message is not currently leased") -> RelayError:
    return RelayError(409, "not_leased", message)


def lease_mismatch(message: str = "leaseId does not match the current lease") -> RelayError:
    return RelayError(409, "lease_mismatch", message)


def wrong_state(message: str) -> RelayError:
    return RelayError(409, "wrong_state", message)


def rate_limited(message: str = "rate limit exceeded") -> RelayError:
    return RelayError(429, "rate_limited", message)


def inbox_full(message: str) -> RelayError:
    return RelayError(429, "inbox_full", message)


def busy(message: str = "internal broker error") -> RelayError:
    return RelayError(503, "busy", message)
