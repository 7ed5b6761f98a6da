"""``relay.receipts``, the documented import path of the agent's receipts: they are
:mod:`relay.agent.receipts`'."""

from relay.agent.receipts import ReceiptStore

__all__ = ["ReceiptStore"]
