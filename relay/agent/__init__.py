"""The agent runtime: one agent that leases requests, runs a handler, replies and acks.

- :mod:`relay.agent.runtime`: :class:`AgentService`, and what a handler may raise
  (:class:`Retry`, :class:`Release`, :class:`Reject`);
- :mod:`relay.agent.exec_handler`: :class:`ExecHandler`, the ``--exec`` handler
  (a shell command per request);
- :mod:`relay.agent.receipts`: the receipts of completed requests, so none is
  handled twice;
- :mod:`relay.agent.tap`: ``twistd relay-agent``.
"""

from relay.agent.exec_handler import ExecFailed, ExecHandler
from relay.agent.receipts import ReceiptStore
from relay.agent.runtime import AgentService, HandlerOutcome, Reject, Release, Retry, card_of

__all__ = ["AgentService", "ExecFailed", "ExecHandler", "HandlerOutcome", "ReceiptStore",
           "Reject", "Release", "Retry", "card_of"]
