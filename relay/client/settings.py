"""Where and as whom a client talks to the broker: flags, environment, settings file.

Shared by the ``relay`` command and ``twistd relay-agent``. Each setting is
taken from the first level that has it: flags, then the environment
(``DSH_RELAY_BROKER_URL``, ``DSH_RELAY_AGENT``, ``DSH_RELAY_SECRET``,
``DSH_RELAY_SECRET_FILE``, ``DSH_RELAY_CA_FILE``, ``DSH_RELAY_CLIENT_CERT``,
``DSH_RELAY_CLIENT_KEY``), then ``~/.dsh-relay.json`` (``brokerUrl``,
``agent``, ``secret``, ``secretFile``, ``caFile``, ``clientCert``,
``clientKey``), then the defaults.

The settings file is as strict as the broker's config: an unknown key or a
value that is not a string is an error naming the key, and a relative path
in it (``secretFile``, ``caFile``, ``clientCert``, ``clientKey``) is relative
to the file's own directory, not to wherever the command runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from relay.files.private import read_json

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
    """Flags or settings that cannot be used (the ``relay`` command exits with status 2).

    :param usage: the usage line of the command, when the command line was at fault.
    """

    def __init__(self, message: str, usage: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage

    def lines(self) -> str:
        """What to print: the usage line (if any), then ``error: MESSAGE``."""
        head = f"{self.usage}\n" if self.usage else ""
        return f"{head}error: {self.message}\n"


@dataclass(frozen=True)
class Settings:
    """Where and as whom to talk to the broker."""

    broker_url: str
    agent: Optional[str]
    secret: Optional[str]
    ca_file: Optional[str] = None
    client_cert: Optional[str] = None
    client_key: Optional[str] = None
    # The file the secret was read from (None: it was given itself).
    secret_file: Optional[str] = None


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
FILE_KEYS: Tuple[str, ...] = tuple(name for _, _, name in _SETTING_SOURCES)
# The settings-file keys that name files: relative ones are relative to the settings file.
_PATH_KEYS = frozenset({"secretFile", "caFile", "clientCert", "clientKey"})


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


def read_settings_file(path: Path) -> Dict[str, str]:
    """The settings in ``path`` (``{}`` when there is no such file), paths made absolute.

    A file that cannot be read or parsed, that does not hold a JSON object,
    or that has an unknown key or a value other than a string is a
    :class:`UsageError` naming the file and the key.
    """
    if not path.exists():
        return {}
    try:
        loaded = read_json(path)
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{path}: must hold a JSON object")
    stored: Dict[str, str] = {}
    for key, value in loaded.items():
        if key not in FILE_KEYS:
            raise UsageError(
                f"{path}: unknown key {key!r} (known keys: {', '.join(sorted(FILE_KEYS))})"
            )
        if value is None:
            continue
        if not isinstance(value, str):
            raise UsageError(f"{path}: {key}: must be a string")
        if key in _PATH_KEYS and value:
            value = str(path.parent / Path(value).expanduser())
        stored[key] = value
    return stored


def resolve_settings(
    flags: Mapping[str, Optional[str]], env: Mapping[str, str], home: Path
) -> Settings:
    """Settings from flags, then environment, then ``~/.dsh-relay.json``, then defaults.

    ``flags`` may hold the keys of :data:`FLAG_KEYS` (``broker``, ``agent``,
    ``secret``, ``secret_file``, ``ca_file``, ``client_cert``, ``client_key``).
    At each level a secret beats a secret file. A bad settings file (see
    :func:`read_settings_file`), an unreadable or empty secret file, and a
    client key without a client certificate are a :class:`UsageError`.
    """
    stored = read_settings_file(home / SETTINGS_FILE)

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
    secret_file: Optional[str] = None
    for level in levels:
        if level["secret"]:
            secret = level["secret"]
            break
        if level["secret_file"]:
            secret_file = level["secret_file"] or ""
            secret = _read_secret_file(secret_file)
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
        secret_file=secret_file,
    )
