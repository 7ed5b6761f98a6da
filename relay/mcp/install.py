"""``relay mcp install``: the change to a coding agent's MCP config that runs
``relay mcp`` as one agent, computed as text (pure: no I/O here).

The config names the secret file, never the secret: Claude Code's and Codex's
config files are read by other tools and often copied or committed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence

SERVER_NAME = "relay"
# Codex gives a server 10 s to start unless told; the SDK's imports can take longer.
CODEX_STARTUP_SECONDS = 30


def server_arguments(broker_url: str, agent: str, secret_file: str,
                     description: Optional[str], skills: Sequence[str]) -> List[str]:
    """The arguments of ``relay`` that serve MCP as ``agent`` (a file for the secret)."""
    args = ["mcp", "--broker", broker_url, "--agent", agent, "--secret-file", secret_file]
    if description:
        args += ["--description", description]
    for skill in skills:
        args += ["--skill", skill]
    return args


def claude_config(text: Optional[str], command: str, args: Sequence[str]) -> str:
    """A Claude Code config (``~/.claude.json`` or a project's ``.mcp.json``; ``text``
    None when it does not exist) with the server ``relay`` set; every other key kept.
    A file that is not a JSON object is a ValueError saying so."""
    data: Dict[str, Any] = {}
    if text is not None and text.strip():
        loaded = json.loads(text)
        if not isinstance(loaded, dict):
            raise ValueError("it is not a JSON object")
        data = loaded
    servers = data.get("mcpServers")
    if servers is None:
        servers = data["mcpServers"] = {}
    if not isinstance(servers, dict):
        raise ValueError("its mcpServers is not a JSON object")
    servers[SERVER_NAME] = {"type": "stdio", "command": command, "args": list(args), "env": {}}
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


# A table header line ([a.b] or [[a.b]]), not a line of a multi-line array.
_TABLE = re.compile(r"""^\s*\[\[?\s*[A-Za-z0-9_."' -]+\s*\]\]?\s*(#.*)?$""")
_OURS = re.compile(r"^\s*\[\s*mcp_servers\s*\.\s*(\"relay\"|relay)\s*(\.|\])")


def codex_config(text: Optional[str], command: str, args: Sequence[str]) -> str:
    """Codex's ``config.toml`` (``text`` None when it does not exist) with the table
    ``[mcp_servers.relay]`` (and its subtables) replaced by one that runs ``relay mcp``;
    every other line kept as it was."""
    kept: List[str] = []
    skipping = False
    for line in (text or "").splitlines():
        if _TABLE.match(line):
            skipping = bool(_OURS.match(line))
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    block = [
        f"[mcp_servers.{SERVER_NAME}]",
        f"command = {json.dumps(command, ensure_ascii=False)}",
        f"args = [{', '.join(json.dumps(a, ensure_ascii=False) for a in args)}]",
        f"startup_timeout_sec = {CODEX_STARTUP_SECONDS}",
    ]
    return "\n".join(kept + ([""] if kept else []) + block) + "\n"
