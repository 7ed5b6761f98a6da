"""Inbox quotas, the agent cap and forgetting agents (relay.testing.QuotaContract)
against every backend."""

from relay.testing import QuotaContract


class TestQuotaContract(QuotaContract):
    pass
