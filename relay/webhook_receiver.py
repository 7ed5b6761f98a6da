"""Deprecated: ``relay.webhook_receiver`` moved to :mod:`relay.client.webhook_receiver`.

The old path is kept for one release and warns when imported."""

import warnings

from relay.client.webhook_receiver import WebhookRejected, verify

__all__ = ["WebhookRejected", "verify"]

warnings.warn("relay.webhook_receiver moved to relay.client.webhook_receiver: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
