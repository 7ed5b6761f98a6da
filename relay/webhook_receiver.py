"""``relay.webhook_receiver``, the documented import path of the webhook check for an
agent's own server: it is :mod:`relay.client.webhook_receiver`."""

from relay.client.webhook_receiver import WebhookRejected, verify

__all__ = ["WebhookRejected", "verify"]
