"""Deprecated: ``relay.receipts`` moved to :mod:`relay.agent.receipts`.

The old path is kept for one release and warns when imported."""

import warnings

from relay.agent.receipts import ReceiptStore

__all__ = ["ReceiptStore"]

warnings.warn("relay.receipts moved to relay.agent.receipts: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
