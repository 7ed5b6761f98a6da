"""The HTTP layer under the Klein app: bounded request bodies and a quiet site.

A request body over 1 MiB is counted but not kept: the app answers
``400 bad_request`` once the request is complete, so memory stays bounded
whatever ``Content-Length`` or chunked upload a client sends.
"""

from __future__ import annotations

from io import BytesIO
from typing import Optional

from twisted.web import http, server

from relay.protocol import MAX_BODY_BYTES


class RelayRequest(server.Request):
    """A request that keeps at most ``MAX_BODY_BYTES`` of its body in memory."""

    # Never parse form or multipart bodies into request.args: bodies are JSON.
    _parsePOSTFormSubmission = False

    body_limit = MAX_BODY_BYTES
    body_too_large = False
    _received = 0

    def gotLength(self, length: Optional[int]) -> None:
        self.content = BytesIO()
        self._received = 0
        self.body_too_large = length is not None and length > self.body_limit

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self.body_limit:
            self.body_too_large = True
        if not self.body_too_large:
            self.content.write(data)

    def raw_body(self) -> bytes:
        """The request body as received (empty when it was too large)."""
        return b"" if self.body_too_large else self.content.getvalue()


class RelaySite(server.Site):
    """A Site that builds :class:`RelayRequest` and writes no access log by default."""

    requestFactory = RelayRequest
    noisy = False

    def __init__(self, resource, access_log: bool = False, timeout: float = 60.0) -> None:
        super().__init__(resource, timeout=timeout)
        self.access_log = access_log

    def log(self, request: http.Request) -> None:
        if self.access_log:
            super().log(request)
