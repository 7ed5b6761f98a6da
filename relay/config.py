"""Broker configuration: YAML in, a validated and frozen :class:`Config` out.

The file keeps the reference broker's keys (``broker:``, ``security:``,
``agents:``) so an existing ``config.yaml`` works unchanged, and adds
``broker.listen`` (Twisted endpoint strings), ``broker.secretFile``,
``broker.sync``, ``broker.sweepSeconds``, ``broker.accessLog``,
``broker.allowInsecureRemote`` and the ops listener (``broker.opsListen``,
``broker.opsToken``, ``broker.opsTokenFile``). A secret may be a list (or a
secret file several lines): every one of them verifies, the first signs.
Unknown keys, wrong types and out-of-range numbers are errors naming the key.

Each key of ``broker`` and ``security`` is one row of :data:`SETTINGS` (its
section, kind, default, bounds and whether a change waits for a restart); the
parser, :class:`Config`'s fields and :data:`RESTART_KEYS` are made from it, and
a storage backend's section has a table of the same rows in its module.

:func:`parse_config` is pure; :func:`load_config` reads the file and resolves
the secret file.
"""

from __future__ import annotations

import difflib
import os
import secrets
from dataclasses import dataclass, make_dataclass, replace
from types import MappingProxyType
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from relay.endpoints import (  # noqa: F401 (endpoint helpers, named here too)
    beyond_loopback,
    endpoint_kind,
    escape_endpoint_value,
    listen_interface,
    plaintext_remote,
    resolve_endpoint_paths,
    split_endpoint,
    unescape_endpoint_value,
)
from relay.errors import ConfigError
from relay.protocol import MAX_LEASE_SECONDS, is_valid_agent_name

__all__ = ["AgentConfig", "Config", "ConfigError", "GroupConfig", "OpsConfig", "RESTART_KEYS",
           "RoleConfig", "SETTINGS", "Setting", "load_config", "parse_config", "read_settings"]

# The storage backends shipped with the relay; a dropin adds its own name (see
# relay.store.plugins.store_factories, which load_config's callers pass in).
BUILTIN_BACKENDS = ("memory", "sqlite", "jsonl", "postgres")


@dataclass(frozen=True)
class AgentConfig:
    """Per-agent settings: own secrets and a send whitelist (None = anyone).

    ``secrets`` are every secret that verifies the agent's requests (several
    while one is rotated); ``secret`` is the first, the one a client signs with.
    """

    secret: Optional[str] = None
    allowed_targets: Optional[Tuple[str, ...]] = None
    secrets: Tuple[str, ...] = ()
    # REACH §12: the operator's webhook URL for the agent (it wins over the agent's own)
    webhook: Optional[str] = None

    def __post_init__(self) -> None:
        if self.secret is not None and not self.secrets:
            object.__setattr__(self, "secrets", (self.secret,))


@dataclass(frozen=True)
class GroupConfig:
    """A group of REACH §13 (``groups.<name>``): a send to ``group:<name>`` stores a
    copy for each member but the sender."""

    members: Tuple[str, ...] = ()


@dataclass(frozen=True)
class RoleConfig:
    """A role of REACH §13 (``roles.<name>``): a send to ``role:<name>`` is one message
    that one of the members takes. ``self_join``: an agent may also join it through
    its card (``card.roles``)."""

    members: Tuple[str, ...] = ()
    self_join: bool = False


# -- the table of settings -----------------------------------------------------------
#
# Every key of the ``broker`` and ``security`` sections is one row of SETTINGS: the
# parser, the defaults, the unknown-key check, the restart list (RESTART_KEYS), the
# fields of Config and OpsConfig, and the check of docs/CONFIG.md all read it. A
# storage backend keeps the rows of its own section in its module (``SETTINGS``).

# What a setting holds, and the type of its Config field.
KIND_TYPES: Mapping[str, Any] = MappingProxyType({
    "int": int,                   # an integer lo..hi
    "number": float,              # an integer or fraction lo..hi
    "bool": bool,                 # true or false
    "text": str,                  # a non-empty string
    "name": str,                  # a non-empty string, read in lower case
    "choice": str,                # one of ``choices``, read in lower case
    "path": str,                  # a file or directory, relative to the config file
    "secrets": Tuple[str, ...],   # a secret, or a list of them while one is rotated
    "endpoints": Tuple[str, ...],  # Twisted endpoint strings (at least ``lo`` of them)
    "hosts": Tuple[str, ...],     # host names, read in lower case
    "prefixes": Tuple[str, ...],  # http:// or https:// URL prefixes, as written
})


@dataclass(frozen=True)
class Setting:
    """One key of the config file: its section, what it holds, its default and bounds,
    the field it fills, and whether a change waits for the next start.

    ``field`` is the attribute of :class:`Config` the key fills (``ops.<name>``: of its
    :class:`OpsConfig`). ``default`` is the value when the key is absent; None means
    "not set", and then ``null`` in the file means the same. ``default_from`` names
    instead the Config field whose value is the default (a backend section's ``sync``
    is ``broker.sync``'s). ``shown`` is the default as docs/CONFIG.md writes it when
    it is not the value itself (one worked out from other keys, say).

    ``restart``: a reload leaves the running value in place until the next start.
    ``compare`` is the Config attribute whose change tells that a restart is pending
    (``field`` when empty); a key whose attribute an earlier row names already is
    reported under that row's name. ``restart_part`` says what waits, when a reload
    applies the rest.
    """

    section: str
    key: str
    field: str
    kind: str
    default: Any = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: Tuple[str, ...] = ()
    restart: bool = False
    compare: str = ""
    restart_part: str = ""
    shown: Optional[str] = None
    default_from: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KIND_TYPES:
            raise ValueError(f"{self.name}: no kind {self.kind!r}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with the kind 'choice' and no other")
        if self.kind == "number" and self.default is not None:
            object.__setattr__(self, "default", float(self.default))

    @property
    def name(self) -> str:
        """The key in full, as errors and the docs name it: ``broker.leaseSeconds``."""
        return f"{self.section}.{self.key}"

    @property
    def field_type(self) -> Any:
        """The type of the field (Optional when the key may be left unset)."""
        kind = KIND_TYPES[self.kind]
        return Optional[kind] if self.default is None and not self.default_from else kind

    @property
    def documented_default(self) -> str:
        """The default as docs/CONFIG.md writes it in the key's row."""
        if self.shown is not None:
            return self.shown
        if self.default_from:
            (source,) = [s for s in SETTINGS if s.field == self.default_from]
            return f"`{source.name}`"
        value = self.default
        if value is None:
            return "—"
        if isinstance(value, bool):
            return "`true`" if value else "`false`"
        if isinstance(value, float):
            return f"`{value:g}`"
        if isinstance(value, tuple):
            return f"`[{', '.join(value)}]`"
        return f"`{value}`"

    def read(self, section: Mapping[str, Any], base_dir: str = ".",
             config: Optional[Config] = None) -> Any:
        """The value of this key in ``section`` (its default when absent), or a
        ConfigError naming the key and the reason. Paths are made absolute from
        ``base_dir``; ``config`` holds the value of ``default_from``."""
        default = getattr(config, self.default_from) if self.default_from else self.default
        if default is None and section.get(self.key) is None:
            return None
        kind, key, prefix = self.kind, self.key, self.section
        if kind == "int":
            return read_int(section, key, prefix, default, int(self.lo), int(self.hi))
        if kind == "number":
            return read_number(section, key, prefix, default, self.lo, self.hi)
        if kind == "bool":
            return read_bool(section, key, prefix, default)
        if kind == "secrets":
            return read_secrets(section, key, prefix)
        if kind == "endpoints":
            return read_endpoints(section, key, prefix, default, base_dir, int(self.lo or 0))
        if kind == "hosts":
            return read_hosts(section, key, prefix, default)
        if kind == "prefixes":
            return read_url_prefixes(section, key, prefix, default)
        value = read_str(section, key, prefix, default)
        if kind == "path":
            return _resolve(base_dir, value)
        if kind in ("name", "choice"):
            value = value.lower()
        if self.choices and value not in self.choices:
            raise ConfigError(self.name, f"must be one of {', '.join(self.choices)}")
        return value


def read_settings(settings: Sequence[Setting], section: Mapping[str, Any],
                  base_dir: str = ".", config: Optional[Config] = None) -> Dict[str, Any]:
    """The value of every setting of ``settings`` in ``section``, by field: defaults
    filled in (from ``config`` where a row says so), paths absolute. (Keys not in the
    table are :func:`check_keys`'s.)"""
    return {setting.field: setting.read(section, base_dir, config) for setting in settings}


def table_keys(settings: Sequence[Setting]) -> frozenset:
    """The keys of ``settings``, as written in their section."""
    return frozenset(setting.key for setting in settings)


# A secret shorter than this is refused: HMAC is only as strong as its key.
MIN_SECRET_BYTES = 16
PLACEHOLDER_SECRETS = frozenset({"CHANGE_ME_RUN_SETUP_INIT", "CHANGE_ME"})
SYNC_LEVELS = ("off", "normal", "full")
_INT32 = 2**31 - 1
URL_SCHEMES = ("http://", "https://")
# REACH §12: webhooks go to loopback receivers unless the operator allows more.
LOOPBACK_WEBHOOKS = ("http://127.0.0.1:", "http://localhost:", "http://[::1]:")


def _broker(key: str, field: str, kind: str, default: Any = None, lo: Optional[float] = None,
            hi: Optional[float] = None, **more: Any) -> Setting:
    return Setting("broker", key, field, kind, default, lo, hi, **more)


def _security(key: str, field: str, kind: str, default: Any = None, lo: Optional[float] = None,
              hi: Optional[float] = None, **more: Any) -> Setting:
    return Setting("security", key, field, kind, default, lo, hi, **more)


SETTINGS: Tuple[Setting, ...] = (
    # Where the broker listens. host and port make the one listener of a file
    # without broker.listen (the reference broker's keys).
    _broker("listen", "listen", "endpoints", None, 1, restart=True,
            shown="`tcp:PORT:interface=HOST`"),
    _broker("host", "host", "text", "127.0.0.1", restart=True, compare="listen"),
    _broker("port", "port", "int", 19121, 1, 65535, restart=True, compare="listen"),
    _broker("allowInsecureRemote", "allow_insecure_remote", "bool", False),
    _broker("allowedHosts", "allowed_hosts", "hosts", ()),
    _broker("tlsClientCA", "tls_client_ca", "path", None, restart=True),
    _broker("maxConnections", "max_connections", "int", 10_000, 1, 10**6, restart=True),
    _broker("maxConnectionsPerAddress", "max_connections_per_address", "int", 256, 1, 10**6),
    _broker("requestReadSeconds", "request_read_seconds", "number", 30, 1, 3600, restart=True),
    _broker("accessLog", "access_log", "bool", False),
    # The shared secret (required: inline or in its file; the two are exclusive).
    _broker("secret", "secrets", "secrets", None),
    _broker("secretFile", "secret_file", "path", None),
    # The ops listener.
    _broker("opsListen", "ops.listen", "endpoints", (), restart=True),
    _broker("opsToken", "ops.tokens", "secrets", None),
    _broker("opsTokenFile", "ops.token_file", "path", None),
    # The store. persist: false means the memory store, so both decide the backend.
    _broker("storage", "storage", "name", "sqlite", restart=True, compare="storage_backend"),
    _broker("persist", "persist", "bool", True, restart=True, compare="storage_backend"),
    _broker("dataDir", "data_dir", "path", "./data", restart=True),
    _broker("sync", "sync", "choice", "normal", choices=SYNC_LEVELS, restart=True),
    # Delivery policy.
    _broker("leaseSeconds", "lease_seconds", "number", 600, 0.1, MAX_LEASE_SECONDS),
    _broker("maxAttempts", "max_attempts", "int", 3, 0, 1000),
    _broker("maxDeliveries", "max_deliveries", "int", 10, 0, 1000),
    _broker("notifyFailures", "notify_failures", "bool", True),
    _broker("messageTtlDays", "message_ttl_days", "number", 7, 0, 36500, restart=True,
            restart_part="the sweep interval"),
    _broker("sweepSeconds", "sweep_seconds", "number", 5, 0.05, 3600, restart=True),
    _broker("rateLimitLoopback", "rate_limit_loopback", "int", 600, 1, _INT32),
    _broker("rateLimitRemote", "rate_limit_remote", "int", 120, 1, _INT32),
    _broker("inboxMaxMessages", "inbox_max_messages", "int", 10_000, 0, _INT32),
    _broker("inboxMaxBytes", "inbox_max_bytes", "int", 100 * 1024 * 1024, 0, 2**62),
    _broker("minFreeDiskMB", "min_free_disk_mb", "int", 64, 0, 2**40),
    _broker("maxAgents", "max_agents", "int", 10_000, 0, _INT32),
    # Events (REACH §11): how long they are kept, and the open streams allowed.
    _broker("eventRetentionSeconds", "event_retention_seconds", "int", 3600, 1, 30 * 86400),
    _broker("maxStreamsPerAgent", "max_streams_per_agent", "int", 4, 1, 1000),
    _broker("maxStreams", "max_streams", "int", 10_000, 1, 10**6),
    # Webhooks (REACH §12): where they may go, and how hard the broker tries.
    _broker("webhookAllow", "webhook_allow", "prefixes", LOOPBACK_WEBHOOKS),
    _broker("webhookMaxAttempts", "webhook_max_attempts", "int", 12, 1, 1000),
    _broker("webhookDisableAfter", "webhook_disable_after", "int", 100, 1, 10**6),
    _broker("webhookConcurrency", "webhook_concurrency", "int", 64, 1, 10_000, restart=True),
    # Seconds of self-exercise before listening; unset: the interpreter's default
    # (relay.warmup.default_seconds). Read at each start only, before anything runs.
    _broker("warmupSeconds", "warmup_seconds", "number", None, 0, 60,
            shown="`6` on PyPy, `0` on CPython"),
    # Authentication.
    _security("lockAfterFailures", "lock_after_failures", "int", 5, 1, 1_000_000),
    _security("lockMinutes", "lock_minutes", "number", 5, 0.01, 525600),
    _security("requireNonce", "require_nonce", "bool", False),
)

# The settings of each section, and the keys they make known.
BROKER_SETTINGS = tuple(s for s in SETTINGS if s.section == "broker")
SECURITY_SETTINGS = tuple(s for s in SETTINGS if s.section == "security")
_BROKER_KEYS = table_keys(BROKER_SETTINGS)
_SECURITY_KEYS = table_keys(SECURITY_SETTINGS)


def _restart_keys() -> Tuple[Tuple[str, str], ...]:
    keys: List[Tuple[str, str]] = []
    for setting in SETTINGS:
        path = setting.compare or setting.field
        if setting.restart and all(path != known for _, known in keys):
            part = f" ({setting.restart_part})" if setting.restart_part else ""
            keys.append((setting.name + part, path))
    # Every backend section is read at start, whole (each store module's SETTINGS).
    keys.append(("broker.<backend> sections", "backend_sections"))
    return tuple(keys)


# Keys read only at start, each with the Config attribute that tells whether the
# value a reload read differs from the one the broker started with.
RESTART_KEYS: Tuple[Tuple[str, str], ...] = _restart_keys()


def _settings_class(name: str, doc: str, prefix: str, extra: Sequence[Tuple[str, Any]],
                    namespace: Mapping[str, Any]) -> type:
    """A frozen dataclass with one field for each setting whose ``field`` is
    ``prefix`` + a name, then the ``extra`` fields."""
    fields = [(s.field[len(prefix):], s.field_type) for s in SETTINGS
              if s.field.startswith(prefix) and "." not in s.field[len(prefix):]]
    return make_dataclass(name, fields + list(extra), frozen=True,
                          namespace=dict(namespace, __doc__=doc, __module__=__name__))


OpsConfig = _settings_class(
    "OpsConfig",
    """The ops listener: endpoint strings (none: no ops listener) and the bearer tokens
    it accepts (none: no token asked for; several while one is rotated).""",
    "ops.", (), {})


def _secret(self: Any) -> str:
    """The shared secret clients sign with: the first of ``secrets``."""
    return self.secrets[0]


def _storage_backend(self: Any) -> str:
    """The store plugin to open: ``memory`` when ``persist`` is false."""
    return self.storage if self.persist else "memory"


def _message_ttl_seconds(self: Any) -> float:
    """Message lifetime in seconds. ``messageTtlDays: 0`` means what it means to the
    reference broker: every message is past its lifetime and is swept."""
    return self.message_ttl_days * 86400.0


Config = _settings_class(
    "Config",
    """The broker's settings, validated: one field per row of :data:`SETTINGS` (the
    ``ops.*`` rows make ``ops``), then the agents, the backend sections as written,
    what was ignored or warned about, and the config file's directory. Paths are
    absolute.""",
    "",
    (
        ("ops", OpsConfig),
        ("agents", Mapping[str, AgentConfig]),
        ("groups", Mapping[str, GroupConfig]),
        ("roles", Mapping[str, RoleConfig]),
        ("backend_sections", Mapping[str, Mapping[str, Any]]),
        ("ignored_keys", Tuple[str, ...]),
        ("warnings", Tuple[str, ...]),
        ("base_dir", str),
    ),
    {
        "secret": property(_secret),
        "storage_backend": property(_storage_backend),
        "message_ttl_seconds": property(_message_ttl_seconds),
    },
)


# Keys the reference broker accepts for its own later protocol generations.
# They are read without error (so its config files load) and have no effect here.
_IGNORED_BROKER_KEYS = frozenset({"notifyFailedToSender"})
_IGNORED_SECURITY_KEYS = frozenset({"admin_agents"})
_IGNORED_AGENT_KEYS = frozenset(
    {"keys", "allowed_read_targets", "allowed_continue_targets", "allowed_write_targets"}
)

# The top-level keys of the config file.
_SECTIONS = ("broker", "security", "agents", "groups", "roles")

_AGENT_KEYS = frozenset({"secret", "allowed_targets", "allowedTargets", "webhook"})


def _section(data: Mapping[str, Any], key: str) -> Dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, "must be a mapping")
    return value


def unknown_key(key: str, known: Collection[str]) -> str:
    """The reason of an unknown key: "unknown key", and the closest known one if any
    is close (``rateLimitLoopbak`` → ``did you mean rateLimitLoopback?``)."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    if not close:
        lowered = {name.lower(): name for name in known}
        close = [lowered[key.lower()]] if key.lower() in lowered else []
    return f"unknown key; did you mean {close[0]}?" if close else "unknown key"


def check_keys(
    section: Mapping[str, Any], prefix: str, known: frozenset, ignored: frozenset
) -> List[str]:
    """ConfigError for a key of ``section`` that is neither ``known`` nor ``ignored``;
    returns the ignored ones present, as ``prefix.key``."""
    skipped = []
    for key in section:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}.{key!r}", "keys must be strings")
        if key in ignored:
            skipped.append(f"{prefix}.{key}")
        elif key not in known:
            raise ConfigError(f"{prefix}.{key}", unknown_key(key, known))
    return skipped


def read_int(section: Mapping[str, Any], key: str, prefix: str, default: int, lo: int,
             hi: int) -> int:
    """``section[key]``, an integer ``lo..hi`` (``default`` when absent); else a
    ConfigError naming ``prefix.key``."""
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{prefix}.{key}", f"must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ConfigError(f"{prefix}.{key}", f"must be from {lo} to {hi}, not {value}")
    return value


def read_number(section: Mapping[str, Any], key: str, prefix: str, default: float, lo: float,
                hi: float) -> float:
    """A duration or other quantity that may be fractional (``lockMinutes: 0.5``)."""
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{prefix}.{key}", f"must be a number, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ConfigError(f"{prefix}.{key}", f"must be a number from {lo:g} to {hi:g}, not {value}")
    return float(value)


def read_bool(section: Mapping[str, Any], key: str, prefix: str, default: bool) -> bool:
    """``section[key]``, true or false."""
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{prefix}.{key}", "must be true or false")
    return value


def read_str(section: Mapping[str, Any], key: str, prefix: str, default: Any) -> Any:
    """``section[key]``, a non-empty string (``default``, whatever it is, when absent)."""
    value = section.get(key, default)
    if value is default:
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{prefix}.{key}", "must be a non-empty string")
    return value


def _resolve(base_dir: str, path: str) -> str:
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


def read_hosts(section: Mapping[str, Any], key: str, prefix: str,
               default: Tuple[str, ...]) -> Tuple[str, ...]:
    """``section[key]``, a list of host names (in lower case); ``default`` when absent."""
    raw = section.get(key)
    if raw is None:
        return default
    if not isinstance(raw, list) or not all(isinstance(h, str) and h.strip() for h in raw):
        raise ConfigError(f"{prefix}.{key}", "must be a list of host names")
    return tuple(h.strip().lower() for h in raw)


def read_url_prefixes(section: Mapping[str, Any], key: str, prefix: str,
                      default: Tuple[str, ...]) -> Tuple[str, ...]:
    """``section[key]``, a list of URL prefixes each starting with ``http://`` or
    ``https://`` (an empty list allows none); ``default`` when absent."""
    raw = section.get(key)
    if raw is None:
        return default
    if not isinstance(raw, list) or not all(
            isinstance(p, str) and p.startswith(URL_SCHEMES) and len(p) <= 2048 for p in raw):
        raise ConfigError(f"{prefix}.{key}",
                          "must be a list of URL prefixes starting with http:// or https://")
    return tuple(raw)


def read_endpoints(section: Mapping[str, Any], key: str, prefix: str, default: Any,
                   base_dir: str, fewest: int = 0) -> Any:
    """``section[key]``, one endpoint string or a list of at least ``fewest`` of them,
    their file options made absolute from ``base_dir``; ``default`` when absent."""
    raw = section.get(key)
    if raw is None:
        return default
    if isinstance(raw, str):
        raw = [raw]
    if (not isinstance(raw, list) or len(raw) < fewest
            or not all(isinstance(d, str) and d.strip() for d in raw)):
        what = "a non-empty list" if fewest else "a list"
        raise ConfigError(f"{prefix}.{key}", f"must be {what} of endpoint strings")
    return tuple(resolve_endpoint_paths(d.strip(), base_dir) for d in raw)


def default_listen(host: str, port: int) -> str:
    """The endpoint string for the reference keys ``broker.host``/``broker.port``."""
    if ":" in host:
        return f"tcp6:{port}:interface={escape_endpoint_value(host)}"
    return f"tcp:{port}:interface={host}"


def split_secrets(text: str) -> Tuple[str, ...]:
    """The secrets of a secret file: one per line, blank lines ignored."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def read_secrets(section: Mapping[str, Any], key: str, prefix: str) -> Optional[Tuple[str, ...]]:
    """``section[key]``: one secret, or a non-empty list of them (rotation); None when
    absent. Placeholders are refused."""
    value = section.get(key)
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{prefix}.{key}", "must be a non-empty string or a list of them")
    if any(v in PLACEHOLDER_SECRETS for v in values):
        raise ConfigError(f"{prefix}.{key}", "is a placeholder; make a real secret")
    return tuple(values)


def _agent_webhook(entry: Mapping[str, Any], prefix: str) -> Optional[str]:
    """``agents.<name>.webhook``: ``{url: ...}`` or the URL itself; None when absent."""
    raw = entry.get("webhook")
    if raw is None:
        return None
    if isinstance(raw, dict):
        extra = sorted(set(raw) - {"url"})
        if extra:
            raise ConfigError(f"{prefix}.webhook.{extra[0]}", "unknown key (only url)")
        raw = raw.get("url")
    if not isinstance(raw, str) or not raw.startswith(URL_SCHEMES) or len(raw) > 2048:
        raise ConfigError(f"{prefix}.webhook",
                          "must be an http:// or https:// URL of at most 2048 characters")
    return raw


def _agents(data: Mapping[str, Any]) -> Tuple[Dict[str, AgentConfig], List[str]]:
    raw = _section(data, "agents")
    agents: Dict[str, AgentConfig] = {}
    skipped: List[str] = []
    for name, entry in raw.items():
        prefix = f"agents.{name}"
        if not isinstance(name, str) or not is_valid_agent_name(name):
            raise ConfigError(prefix, "agent names are 1-64 of A-Z a-z 0-9 _ . -")
        if entry is None:
            entry = {}
        if not isinstance(entry, dict):
            raise ConfigError(prefix, "must be a mapping")
        skipped += check_keys(entry, prefix, _AGENT_KEYS, _IGNORED_AGENT_KEYS)
        agent_secrets = read_secrets(entry, "secret", prefix) or ()
        for secret in agent_secrets:
            check_secret_strength(f"{prefix}.secret", secret)
        key = "allowed_targets" if "allowed_targets" in entry else "allowedTargets"
        targets = entry.get(key)
        if targets is not None:
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ConfigError(f"{prefix}.{key}", "must be a list of agent names")
            targets = tuple(targets)
        agents[name] = AgentConfig(secret=agent_secrets[0] if agent_secrets else None,
                                   allowed_targets=targets, secrets=agent_secrets,
                                   webhook=_agent_webhook(entry, prefix))
    with_secret = [n for n, a in agents.items() if a.secret]
    if with_secret and len(with_secret) != len(agents):
        missing = sorted(n for n, a in agents.items() if not a.secret)
        raise ConfigError(
            f"agents.{missing[0]}.secret",
            "per-agent authentication requires a secret for every configured agent",
        )
    return agents, skipped


# The keys of an entry of ``groups:`` and of ``roles:``.
_GROUP_KEYS = frozenset({"members"})
_ROLE_KEYS = frozenset({"members", "selfJoin"})


def _members(entry: Mapping[str, Any], prefix: str, agents: Mapping[str, AgentConfig]
             ) -> Tuple[str, ...]:
    """``<prefix>.members``: a list of distinct agents configured under ``agents:``."""
    raw = entry.get("members")
    if raw is None:
        raise ConfigError(f"{prefix}.members", "is required: a list of agent names")
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise ConfigError(f"{prefix}.members", "must be a list of agent names")
    seen = set()
    for member in raw:
        if member in seen:
            raise ConfigError(f"{prefix}.members", f"lists {member!r} twice")
        seen.add(member)
        if not is_valid_agent_name(member):
            raise ConfigError(f"{prefix}.members",
                              f"{member[:80]!r} is not an agent name "
                              "(1-64 of A-Z a-z 0-9 _ . -)")
        if member not in agents:
            raise ConfigError(f"{prefix}.members",
                              f"{member!r} is not an agent of agents: (list it there; "
                              f"'{member}: {{}}' is enough when the agents share the secret)")
    return tuple(raw)


def _teams(data: Mapping[str, Any], agents: Mapping[str, AgentConfig]
           ) -> Tuple[Dict[str, GroupConfig], Dict[str, RoleConfig]]:
    """The ``groups:`` and ``roles:`` sections (REACH §13): names like agent names,
    members configured agents, and a role's ``selfJoin`` (false by default)."""
    groups: Dict[str, GroupConfig] = {}
    roles: Dict[str, RoleConfig] = {}
    for section, keys in (("groups", _GROUP_KEYS), ("roles", _ROLE_KEYS)):
        for name, entry in _section(data, section).items():
            prefix = f"{section}.{name}"
            if not isinstance(name, str) or not is_valid_agent_name(name):
                raise ConfigError(prefix, f"{section[:-1]} names are 1-64 of A-Z a-z 0-9 _ . -")
            if not isinstance(entry, dict):
                raise ConfigError(prefix, "must be a mapping with members")
            check_keys(entry, prefix, keys, frozenset())
            members = _members(entry, prefix, agents)
            if section == "groups":
                groups[name] = GroupConfig(members=members)
            else:
                roles[name] = RoleConfig(
                    members=members, self_join=read_bool(entry, "selfJoin", prefix, False))
    return groups, roles


def _ops(values: Mapping[str, Any], token_from_file: Optional[str],
         allow_insecure: bool) -> Any:
    """The OpsConfig of ``broker.opsListen``, ``opsToken`` and ``opsTokenFile`` (read
    into ``values``): off loopback the ops listener needs TLS (unless
    ``allowInsecureRemote``) and a token."""
    listen = values["ops.listen"]
    token_file = values["ops.token_file"]
    tokens = values["ops.tokens"]
    if tokens is not None and token_file is not None:
        raise ConfigError("broker.opsToken", "set either broker.opsToken or broker.opsTokenFile")
    tokens = tokens or ()
    if token_file is not None:
        tokens = split_secrets(token_from_file or "")
        if not tokens:
            raise ConfigError("broker.opsTokenFile", f"{token_file} holds no token")
    for token in tokens:
        check_secret_strength("broker.opsTokenFile" if token_file else "broker.opsToken", token)
    for description in listen:
        exposed = beyond_loopback(description)
        if exposed is None:
            continue
        if endpoint_kind(description) != "ssl" and not allow_insecure:
            raise ConfigError(
                "broker.opsListen",
                f"{description!r} is reachable beyond loopback (interface {exposed}); the ops "
                "listener must then use an ssl: endpoint",
            )
        if not tokens:
            raise ConfigError(
                "broker.opsListen",
                f"{description!r} is reachable beyond loopback (interface {exposed}); set "
                "broker.opsToken or broker.opsTokenFile",
            )
    return OpsConfig(listen=listen, tokens=tokens, token_file=token_file)


def _shared_secrets(values: Mapping[str, Any], secret_from_file: Optional[str]
                    ) -> Tuple[str, ...]:
    """``broker.secret``, or the secrets of ``broker.secretFile`` (one per line)."""
    secret_file = values["secret_file"]
    shared = values["secrets"]
    if shared is not None and secret_file is not None:
        raise ConfigError("broker.secret", "set either broker.secret or broker.secretFile")
    if shared is None and secret_from_file is not None:
        shared = split_secrets(secret_from_file)
        if any(s in PLACEHOLDER_SECRETS for s in shared):
            shared = ()
    if not shared:
        raise ConfigError(
            "broker.secret", "is not set (set broker.secret, or broker.secretFile to have one made)"
        )
    for secret in shared:
        check_secret_strength(
            "broker.secretFile" if secret_file is not None else "broker.secret", secret)
    return shared


def _check_plaintext(listen: Sequence[str]) -> None:
    """ConfigError when a plaintext endpoint of ``listen`` may be reachable beyond
    loopback."""
    for description in listen:
        exposed = plaintext_remote(description)
        if exposed is not None:
            where = exposed if exposed.startswith("unknown") else f"interface {exposed}"
            raise ConfigError(
                "broker.listen",
                f"plaintext endpoint {description!r} may be reachable beyond loopback "
                f"({where}); HMAC authenticates but does not encrypt, so "
                "remote deployments must use an ssl: endpoint "
                "(or set broker.allowInsecureRemote: true)",
            )


def parse_config(
    data: Any, base_dir: str, secret_from_file: Optional[str] = None,
    backends: Collection[str] = BUILTIN_BACKENDS, token_from_file: Optional[str] = None,
) -> Config:
    """Validate a parsed YAML document; relative paths are taken from ``base_dir``.

    ``secret_from_file`` is the content of ``broker.secretFile`` when the
    caller has read it (one secret per line), ``token_from_file`` that of
    ``broker.opsTokenFile``. ``backends`` names the storage backends whose own
    section ``broker.<name>`` may appear; each section is kept as written, for
    its backend's factory to validate.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "the config file must hold a mapping")
    for key in data:
        if key not in _SECTIONS:
            raise ConfigError(str(key), unknown_key(str(key), _SECTIONS))
    broker = _section(data, "broker")
    security = _section(data, "security")
    backend_sections: Dict[str, Mapping[str, Any]] = {}
    for name in backends:
        if name in broker and name not in _BROKER_KEYS:
            section = broker[name]
            if section is None:
                section = {}
            if not isinstance(section, dict):
                raise ConfigError(f"broker.{name}", "must be a mapping")
            backend_sections[name] = MappingProxyType(dict(section))
    scalar = {key: value for key, value in broker.items() if key not in backend_sections}
    skipped = check_keys(scalar, "broker", _BROKER_KEYS, _IGNORED_BROKER_KEYS)
    skipped += check_keys(security, "security", _SECURITY_KEYS, _IGNORED_SECURITY_KEYS)
    agents, skipped_agents = _agents(data)
    groups, roles = _teams(data, agents)
    values = read_settings(BROKER_SETTINGS, scalar, base_dir)
    values.update(read_settings(SECURITY_SETTINGS, security, base_dir))

    values["secrets"] = _shared_secrets(values, secret_from_file)
    warnings: List[str] = []
    if not any(a.secret for a in agents.values()) and any(
            a.allowed_targets is not None for a in agents.values()):
        warnings.append(
            "agents.*.allowed_targets is set but the agents share one secret: any agent can "
            "sign as any other, so the routing ACL protects nothing; give each agent its own "
            "agents.<name>.secret")
    if values["listen"] is None:
        values["listen"] = (default_listen(values["host"], values["port"]),)
    if not values["allow_insecure_remote"]:
        _check_plaintext(values["listen"])
    ops = _ops(values, token_from_file, values["allow_insecure_remote"])
    return Config(
        **{name: value for name, value in values.items() if "." not in name},
        ops=ops,
        agents=agents,
        groups=MappingProxyType(groups),
        roles=MappingProxyType(roles),
        backend_sections=MappingProxyType(backend_sections),
        ignored_keys=tuple(skipped + skipped_agents),
        warnings=tuple(warnings),
        base_dir=base_dir,
    )


def check_secret_strength(key: str, secret: str) -> None:
    """ConfigError naming ``key`` when ``secret`` is shorter than ``MIN_SECRET_BYTES``
    (the secret itself is never shown)."""
    size = len(secret.encode("utf-8"))
    if size < MIN_SECRET_BYTES:
        raise ConfigError(key, f"is {size} byte{'' if size == 1 else 's'} long; a secret "
                               f"must be at least {MIN_SECRET_BYTES} bytes "
                               "(for example: openssl rand -hex 32)")


def read_or_create_secret(path: str, key: str = "broker.secretFile") -> Tuple[str, bool]:
    """The secret kept in ``path``; made (32 random bytes, hex, mode 0600) if absent.

    Returns the file's text (stripped) and whether the file was created; errors
    name ``key``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None
    else:
        if not secret:
            raise ConfigError(key, f"{path} is empty")
        return secret, False
    secret = secrets.token_hex(32)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_or_create_secret(path, key)
    except OSError as e:
        raise ConfigError(key, f"cannot create {path}: {e.strerror}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret, True


def load_yaml(path: str) -> Any:
    """The YAML document in ``path``, or a ConfigError saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError("", f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("", f"{path} is not valid YAML{where}") from None


def load_config(path: str, overrides: Optional[Dict[str, Any]] = None,
                backends: Collection[str] = BUILTIN_BACKENDS) -> Tuple[Config, Tuple[str, ...]]:
    """Load and validate the config file; creates the secret and token files when needed.

    ``overrides`` are ``broker.*`` values from the command line (``listen``,
    ``dataDir``); relative paths in them are taken from the working directory.
    ``backends`` as for :func:`parse_config`. Returns the config and the keys
    (``broker.secretFile``, ``broker.opsTokenFile``) whose file was created.
    """
    path = os.path.abspath(path)
    data = load_yaml(path)
    if data is None:
        data = {}
    if isinstance(data, dict) and overrides:
        broker = dict(data.get("broker") or {}) if isinstance(data.get("broker"), dict) else {}
        for key, value in overrides.items():
            if key == "dataDir":
                value = os.path.abspath(value)
            broker[key] = value
        data = dict(data, broker=broker)
    base_dir = os.path.dirname(path)
    created: List[str] = []
    exposed: List[str] = []
    broker = data.get("broker") if isinstance(data, dict) else None
    broker = broker if isinstance(broker, dict) else {}

    def from_file(name: str, inline: str) -> Optional[str]:
        if not isinstance(broker.get(name), str) or broker.get(inline) is not None:
            return None
        key = f"broker.{name}"
        secret_path = _resolve(base_dir, broker[name])
        text, made = read_or_create_secret(secret_path, key)
        if made:
            created.append(key)
        elif os.stat(secret_path).st_mode & 0o077:
            exposed.append(f"{secret_path} ({key}) is readable by other users: chmod 600 it")
        return text

    secret_from_file = from_file("secretFile", "secret")
    token_from_file = from_file("opsTokenFile", "opsToken")
    config = parse_config(data, base_dir, secret_from_file, backends, token_from_file)
    if _holds_secrets(data) and os.stat(path).st_mode & 0o077:
        exposed.append(f"{path} holds secrets and is readable by other users: chmod 600 it, "
                       "or keep the secret in broker.secretFile")
    if exposed:
        config = replace(config, warnings=config.warnings + tuple(exposed))
    return config, tuple(created)


def _holds_secrets(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    broker = data.get("broker")
    agents = data.get("agents")
    return (isinstance(broker, dict) and broker.get("secret") is not None) or (
        isinstance(agents, dict)
        and any(isinstance(a, dict) and a.get("secret") for a in agents.values()))
