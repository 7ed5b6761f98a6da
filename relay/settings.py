"""Where and as whom a client talks to the broker: flags, environment, settings file.

Shared by the ``relay`` command and ``twistd relay-agent``. Each setting is
taken from the first level that has it: flags, then the environment
(``DSH_RELAY_BROKER_URL``, ``DSH_RELAY_AGENT``, ``DSH_RELAY_SECRET``,
``DSH_RELAY_SECRET_FILE``, ``DSH_RELAY_CA_FILE``, ``DSH_RELAY_CLIENT_CERT``,
``DSH_RELAY_CLIENT_KEY``), then ``~/.dsh-relay.json`` (``brokerUrl``,
``agent``, ``secret``, ``secretFile``, ``caFile``, ``clientCert``,
``clientKey``), then the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from relay.files import read_json

DEFAULT_BROKER_URL = "http://127.0.0.1:19121"
SETTINGS_FILE = ".dsh-relay.json"

ENV_BROKER = "DSH_RELAY_BROKER_URL"
ENV_AGENT = "DSH_RELAY_AGENT"
ENV_SECRET = "DSH_RELAY_SECRET"
ENV_SECRET_FILE = "DSH_RELAY_SECRET_FILE"
ENV_CA_FILE = "DSH_RELAY_CA_FILE"
ENV_CLIENT_CERT = "DSH_RELAY_CLIENT_CERT"
ENV_CLIENT_KEY = "DSH_RELAY_CLIENT_KEY"


class UsageError(Exception):
    """Flags or settings that cannot be used (the ``relay`` command exits with status 2)."""


@dataclass(frozen=True)
class Settings:
    """Where and as whom to talk to the broker."""

    broker_url: str
    agent: Optional[str]
    secret: Optional[str]
    ca_file: Optional[str] = None
    client_cert: Optional[str] = None
    client_key: Optional[str] = None


# Settings taken level by level: flag key, environment variable, settings-file key.
_SETTING_SOURCES: Tuple[Tuple[str, str, str], ...] = (
    ("broker", ENV_BROKER, "brokerUrl"),
    ("agent", ENV_AGENT, "agent"),
    ("secret", ENV_SECRET, "secret"),
    ("secret_file", ENV_SECRET_FILE, "secretFile"),
    ("ca_file", ENV_CA_FILE, "caFile"),
    ("client_cert", ENV_CLIENT_CERT, "clientCert"),
    ("client_key", ENV_CLIENT_KEY, "clientKey"),
)
FLAG_KEYS: Tuple[str, ...] = tuple(flag for flag, _, _ in _SETTING_SOURCES)


def _read_secret_file(path: str) -> str:
    """The secret a client signs with: the first line of the file (a broker's secret
    file holds several lines while a secret is rotated; the first is the current one)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot read secret file {path}: {error.strerror}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"secret file {path} is empty")
    return lines[0]


def resolve_settings(
    flags: Mapping[str, Optional[str]], env: Mapping[str, str], home: Path
) -> Settings:
    """Settings from flags, then environment, then ``~/.dsh-relay.json``, then defaults.

    ``flags`` may hold the keys of :data:`FLAG_KEYS` (``broker``, ``agent``,
    ``secret``, ``secret_file``, ``ca_file``, ``client_cert``, ``client_key``).
    At each level a secret beats a secret file. An unreadable settings or
    secret file, and a client key without a client certificate, are a
    :class:`UsageError`.
    """
    path = home / SETTINGS_FILE
    stored: Dict[str, Any] = {}
    if path.exists():
        try:
            loaded = read_json(path)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read {path}: {error}") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"{path} must hold a JSON object")
        stored = loaded

    def text(value: Any) -> Optional[str]:
        return value if isinstance(value, str) and value else None

    levels: List[Dict[str, Optional[str]]] = [
        {key: text(flags.get(key)) for key in FLAG_KEYS},
        {key: text(env.get(variable)) for key, variable, _ in _SETTING_SOURCES},
        {key: text(stored.get(name)) for key, _, name in _SETTING_SOURCES},
    ]

    def first(key: str) -> Optional[str]:
        for level in levels:
            if level[key]:
                return level[key]
        return None

    secret: Optional[str] = None
    for level in levels:
        if level["secret"]:
            secret = level["secret"]
            break
        if level["secret_file"]:
            secret = _read_secret_file(level["secret_file"] or "")
            break
    client_cert, client_key = first("client_cert"), first("client_key")
    if client_key and not client_cert:
        raise UsageError(
            f"a client key ({client_key}) was given without a client certificate: "
            f"pass --client-cert or set {ENV_CLIENT_CERT}"
        )
    return Settings(
        broker_url=first("broker") or DEFAULT_BROKER_URL,
        agent=first("agent"),
        secret=secret,
        ca_file=first("ca_file"),
        client_cert=client_cert,
        client_key=client_key,
    )
