"""``relay mcp``: the relay as Model Context Protocol tools, for one agent identity.

A coding agent (an MCP client) starts ``relay mcp`` and calls its tools over
stdio; each tool is one relay operation done by :class:`relay.client.client.RelayClient`
as the agent the command's settings name. The modules:

- :mod:`relay.mcp.tools`: :class:`~relay.mcp.tools.RelayTools`, the session and
  every tool's work, on the Twisted reactor (no MCP SDK needed, tested with a
  clock);
- :mod:`relay.mcp.bridge`: the one place where the SDK's asyncio loop and the
  Twisted reactor meet;
- :mod:`relay.mcp.server`: the MCP server itself (the SDK's ``MCPServer``), the
  tools' names, argument schemas and descriptions; it needs the ``mcp`` extra
  and Python 3.10 or later.
"""

from __future__ import annotations

import sys
from typing import Optional

# The package is not on the index: name the SDK itself (the mcp extra).
INSTALL_HINT = "pip install 'mcp>=2.0,<3' in the relay's environment"


def unavailable() -> Optional[str]:
    """Why the MCP server cannot run here, in one line; None when it can."""
    if sys.version_info < (3, 10):
        implementation = sys.implementation.name
        version = ".".join(str(part) for part in sys.version_info[:3])
        return (
            f"relay mcp needs Python 3.10 or later (the MCP SDK does); this is "
            f"{implementation} {version}: run it from a CPython 3.10+ install with {INSTALL_HINT}"
        )
    try:
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        return f"relay mcp needs the MCP SDK 2.x (package mcp), not installed here: {INSTALL_HINT}"
    return None
