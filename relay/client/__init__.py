"""The client side of the wire: :class:`RelayClient`, a Twisted (treq) client of a
relay broker, and what programs built on it share.

- :mod:`relay.client.client`: :class:`RelayClient` (every endpoint, §5 retries on an
  injected clock, request/reply) and :class:`EventStream` (an agent's events, read
  with reconnection and resumption);
- :mod:`relay.client.trust`: https trust (the CA file, the client certificate) and
  the words for a failed TLS handshake;
- :mod:`relay.client.settings`: where and as whom a client talks to the broker
  (flags, environment, settings file);
- :mod:`relay.client.polling`: the one v1.0 poll loop and the inbox drain;
- :mod:`relay.client.sse`: reading ``text/event-stream`` records;
- :mod:`relay.client.webhook_receiver`: checking a webhook on an agent's own server.

The names below are the documented ones; the agent runtime is :mod:`relay.agent.runtime`.
"""

from relay.client.client import (
    EventStream,
    RelayClient,
    RequestFailed,
    RequestTimeout,
    answer_of,
    answers_request,
    broker_notice,
    question_body,
)
from relay.client.trust import ClientTLSPolicy, client_tls_policy, make_http_client
from relay.wire.errors import RelayError

__all__ = ["ClientTLSPolicy", "EventStream", "RelayClient", "RelayError", "RequestFailed",
           "RequestTimeout", "answer_of", "answers_request", "broker_notice", "client_tls_policy",
           "make_http_client", "question_body"]
