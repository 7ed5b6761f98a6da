"""dsh-agent-relay: a message relay for AI agents, built on Twisted."""

__version__ = "0.3.0"
