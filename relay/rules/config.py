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

import datetime
import difflib
import math
import os
import secrets
from dataclasses import dataclass, field, make_dataclass, replace
from types import MappingProxyType
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from relay.rules.endpoints import (  # noqa: F401 (endpoint helpers, named here too)
    beyond_loopback,
    endpoint_kind,
    escape_endpoint_value,
    listen_interface,
    plaintext_remote,
    resolve_endpoint_paths,
    split_endpoint,
    unescape_endpoint_value,
)
from relay.wire.errors import ConfigError
from relay.wire.protocol import MAX_LEASE_SECONDS, is_valid_agent_name
from relay.wire.v2.signing import KEY_ID, LEGACY_KEY_ID, SigningKey

__all__ = ["AgentConfig", "Config", "ConfigError", "EXECUTION_MODES", "GroupConfig",
           "OpsConfig", "RESTART_KEYS", "RoleConfig", "SETTINGS", "Setting", "load_config",
           "may_send", "parse_config", "read_settings"]

# The storage backends shipped with the relay; a dropin adds its own name (see
# relay.store.plugins.store_factories, which load_config's callers pass in).
BUILTIN_BACKENDS = ("memory", "sqlite", "jsonl", "postgres")


# The execution modes of a v2/v3 request, each with its own send whitelist (PROTOCOL-V2 §5.1).
EXECUTION_MODES = ("read", "continue", "write")


@dataclass(frozen=True)
class AgentConfig:
    """Per-agent settings: own secrets and keyring, send whitelists (None = anyone).

    ``secrets`` are every secret of ``secret`` (several while one is rotated);
    ``secret`` is the one the broker signs the agent's webhooks with: the first of
    ``secrets``, or the first key's when the agent has only ``keys``.

    ``keys`` is the agent's keyring (WIRE-V2 §4), by key id, on every wire: the
    ``legacy`` key holds ``secrets`` (made from them when not given), the others come
    from ``agents.<name>.keys``. A request verifies with a key not past its
    ``not_after``.

    ``allowed_targets`` is the seed wire's whitelist, as written. The per-mode
    whitelists of v2/v3 requests hold names in lower case; read and continue
    default to ``allowed_targets`` (so None, anyone, when it is unset), write to
    none: write is closed unless granted (:meth:`may_send`).
    """

    secret: Optional[str] = None
    allowed_targets: Optional[Tuple[str, ...]] = None
    secrets: Tuple[str, ...] = ()
    # REACH §12: the operator's webhook URL for the agent (it wins over the agent's own)
    webhook: Optional[str] = None
    keys: Mapping[str, SigningKey] = field(default_factory=dict)
    allowed_read_targets: Optional[Tuple[str, ...]] = None
    allowed_continue_targets: Optional[Tuple[str, ...]] = None
    allowed_write_targets: Tuple[str, ...] = ()
    # REACH §15: a person, who reads and answers through the /inbox/ page
    human: bool = False

    def __post_init__(self) -> None:
        if self.secret is not None and not self.secrets:
            object.__setattr__(self, "secrets", (self.secret,))
        keys = dict(self.keys)
        if self.secrets:
            legacy = keys.get(LEGACY_KEY_ID)
            keys[LEGACY_KEY_ID] = SigningKey(
                self.secrets, legacy.not_after if legacy is not None else None)
            keys = {LEGACY_KEY_ID: keys.pop(LEGACY_KEY_ID), **keys}
        object.__setattr__(self, "keys", MappingProxyType(keys))
        if self.secret is None and keys:
            object.__setattr__(self, "secret", next(iter(keys.values())).secrets[0])
        default = (None if self.allowed_targets is None
                   else tuple(t.strip().lower() for t in self.allowed_targets))
        for mode in ("read", "continue"):
            if getattr(self, f"allowed_{mode}_targets") is None:
                object.__setattr__(self, f"allowed_{mode}_targets", default)

    def targets_for(self, mode: str) -> Optional[Tuple[str, ...]]:
        """The whitelist of a v2/v3 request of ``mode`` (``read``, ``continue`` or
        ``write``): None means anyone."""
        if mode not in EXECUTION_MODES:
            raise ValueError(f"no execution mode {mode!r}")
        return getattr(self, f"allowed_{mode}_targets")

    def may_send(self, target: str, mode: str) -> bool:
        """True when a v2/v3 request of ``mode`` may go to ``target`` (a lower-case name)."""
        targets = self.targets_for(mode)
        return targets is None or target in targets


def may_send(agents: Mapping[str, AgentConfig], origin: str, target: str, mode: str) -> bool:
    """The per-mode ACL of a v2/v3 request (PROTOCOL-V2 §5.1): an agent with an entry in
    ``agents`` sends as :meth:`AgentConfig.may_send` says; one without may send read and
    continue requests to anyone, and write requests to no one."""
    entry = agents.get(origin)
    if entry is None:
        if mode not in EXECUTION_MODES:
            raise ValueError(f"no execution mode {mode!r}")
        return mode != "write"
    return entry.may_send(target, mode)


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
    "names": Tuple[str, ...],     # agent names, read in lower case
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
        if kind == "names":
            return read_names(section, key, prefix, default)
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
    # The reference's switch of the undelivered replies to v2/v3 senders (WIRE-V2 §3).
    _broker("notifyFailedToSender", "notify_failed_to_sender", "bool", True),
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
    # (relay.broker.warmup.default_seconds). Read at each start only, before anything runs.
    _broker("warmupSeconds", "warmup_seconds", "number", None, 0, 60,
            shown="`6` on PyPy, `0` on CPython"),
    # Authentication.
    _security("lockAfterFailures", "lock_after_failures", "int", 5, 1, 1_000_000),
    _security("lockMinutes", "lock_minutes", "number", 5, 0.01, 525600),
    _security("requireNonce", "require_nonce", "bool", False),
    # The reference's operators: v2 agents that may requeue or cancel any message.
    _security("admin_agents", "admin_agents", "names", ()),
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


# Keys read without error and with no effect (none at present: every key of the
# reference broker's config means here what it means there).
_IGNORED_BROKER_KEYS: frozenset = frozenset()
_IGNORED_SECURITY_KEYS: frozenset = frozenset()
_IGNORED_AGENT_KEYS: frozenset = frozenset()

# The top-level keys of the config file.
_SECTIONS = ("broker", "security", "agents", "groups", "roles")

# The send whitelists of an agent: the seed wire's, then one per v2/v3 execution mode,
# each in the reference's spelling and in camelCase.
_TARGET_KEYS = (("allowed_targets", "allowedTargets"),
                ("allowed_read_targets", "allowedReadTargets"),
                ("allowed_continue_targets", "allowedContinueTargets"),
                ("allowed_write_targets", "allowedWriteTargets"))
_AGENT_KEYS = frozenset({"secret", "webhook", "keys", "human"}
                        | {k for pair in _TARGET_KEYS for k in pair})
# The keys of one key of a keyring; notAfter is also spelled not_after (the reference's).
_KEY_KEYS = frozenset({"secret", "secretFile", "notAfter", "not_after"})


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


def read_names(section: Mapping[str, Any], key: str, prefix: str,
               default: Tuple[str, ...]) -> Tuple[str, ...]:
    """``section[key]``, a list of agent names (read in lower case); ``default`` when
    absent."""
    raw = section.get(key)
    if raw is None:
        return default
    if not isinstance(raw, list) or not all(
            isinstance(n, str) and is_valid_agent_name(n.strip()) for n in raw):
        raise ConfigError(f"{prefix}.{key}", "must be a list of agent names")
    return tuple(n.strip().lower() for n in raw)


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


def _targets(entry: Mapping[str, Any], prefix: str, spellings: Tuple[str, str]
             ) -> Optional[Tuple[str, ...]]:
    """A whitelist of ``entry`` under either spelling, as written; None when absent."""
    present = [k for k in spellings if entry.get(k) is not None]
    if len(present) > 1:
        raise ConfigError(f"{prefix}.{present[1]}", f"set either {present[0]} or {present[1]}")
    if not present:
        return None
    key = present[0]
    targets = entry[key]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{prefix}.{key}", "must be a list of agent names")
    return tuple(targets)


def _lower(targets: Optional[Tuple[str, ...]]) -> Optional[Tuple[str, ...]]:
    return None if targets is None else tuple(t.strip().lower() for t in targets)


def _not_after(spec: Mapping[str, Any], prefix: str) -> Optional[float]:
    """``notAfter`` (or ``not_after``) of a key: epoch seconds, from a number or an ISO
    8601 date and time; None when absent."""
    present = [k for k in ("notAfter", "not_after") if spec.get(k) is not None]
    if len(present) > 1:
        raise ConfigError(f"{prefix}.not_after", "set either notAfter or not_after")
    if not present:
        return None
    key = f"{prefix}.{present[0]}"
    value = spec[present[0]]
    reason = ("must be a time: epoch seconds (1798761600) or an ISO 8601 date and time "
              "(2027-01-01T00:00:00Z)")
    when: Optional[float] = None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            if "T" in text.upper() or " " in text:
                try:
                    value = datetime.datetime.fromisoformat(
                        text[:-1] + "+00:00" if text.upper().endswith("Z") else text)
                except ValueError:
                    raise ConfigError(key, reason) from None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # YAML reads a time without a zone as UTC
            value = value.replace(tzinfo=datetime.timezone.utc)
        when = value.timestamp()
    elif isinstance(value, datetime.date):
        raise ConfigError(key, reason + "; a date alone is ambiguous, give the time too")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        when = float(value)
    if when is None or not math.isfinite(when) or when <= 0:
        raise ConfigError(key, reason)
    return when


def _key_secret(spec: Mapping[str, Any], prefix: str, base_dir: str,
                key_files: Mapping[str, str]) -> Optional[str]:
    """The secret of one key of a keyring: ``secret``, or the one line of ``secretFile``
    (its text is in ``key_files``, by absolute path); None when neither is set."""
    inline, path = spec.get("secret"), spec.get("secretFile")
    if inline is not None and path is not None:
        raise ConfigError(f"{prefix}.secret", "set either secret or secretFile")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{prefix}.secretFile", "must be a non-empty string")
        full = _resolve(base_dir, path)
        text = key_files.get(full)
        if text is None:
            raise ConfigError(f"{prefix}.secretFile", f"cannot read {full}")
        lines = split_secrets(text)
        if len(lines) != 1:
            raise ConfigError(f"{prefix}.secretFile", f"{full} is empty" if not lines else
                              f"{full} holds {len(lines)} lines; a key has one secret "
                              "(rotate by adding a key with another id)")
        inline, where = lines[0], f"{prefix}.secretFile"
    elif inline is not None:
        where = f"{prefix}.secret"
        if not isinstance(inline, str) or not inline:
            raise ConfigError(where, "must be a non-empty string")
    else:
        return None
    if inline in PLACEHOLDER_SECRETS:
        raise ConfigError(where, "is a placeholder; make a real secret")
    check_secret_strength(where, inline)
    return inline


def _keyring(entry: Mapping[str, Any], prefix: str, agent_secrets: Tuple[str, ...],
             base_dir: str, key_files: Mapping[str, str]) -> Dict[str, SigningKey]:
    """``agents.<name>.keys``: ``{key id: {secret | secretFile, notAfter?}}``. The key
    ``legacy`` is the agent's ``secret``: it may be listed without a secret (to give it
    a ``notAfter``), or with the same one."""
    raw = entry.get("keys")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{prefix}.keys", "must be a non-empty mapping of key id to "
                                            "{secret | secretFile, notAfter}")
    ring: Dict[str, SigningKey] = {}
    for key_id, spec in raw.items():
        where = f"{prefix}.keys.{key_id}"
        if not isinstance(key_id, str) or not KEY_ID.match(key_id):
            raise ConfigError(where, "a key id is 1-64 of A-Z a-z 0-9 . _ -, starting with a "
                                     "letter or digit")
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise ConfigError(where, "must be a mapping: {secret | secretFile, notAfter}")
        check_keys(spec, where, _KEY_KEYS, frozenset())
        secret = _key_secret(spec, where, base_dir, key_files)
        not_after = _not_after(spec, where)
        if key_id == LEGACY_KEY_ID and agent_secrets:
            if secret is not None and secret not in agent_secrets:
                raise ConfigError(f"{where}.secret", f"differs from {prefix}.secret; the legacy "
                                                     "key is that secret (leave this one out)")
            ring[key_id] = SigningKey(agent_secrets, not_after)
        elif secret is None:
            raise ConfigError(f"{where}.secret", "is not set (set secret or secretFile"
                              + (", or the agent's secret" if key_id == LEGACY_KEY_ID else "")
                              + ")")
        else:
            ring[key_id] = SigningKey((secret,), not_after)
    return ring


def _agents(data: Mapping[str, Any], base_dir: str = ".",
            key_files: Optional[Mapping[str, str]] = None
            ) -> Tuple[Dict[str, AgentConfig], List[str]]:
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
        targets, read, cont, write = (_targets(entry, prefix, pair) for pair in _TARGET_KEYS)
        keys = _keyring(entry, prefix, agent_secrets, base_dir, key_files or {})
        human = read_bool(entry, "human", prefix, False)
        if human and not agent_secrets and not keys:
            raise ConfigError(f"{prefix}.secret",
                              "a human agent signs in with its own secret: set one")
        agents[name] = AgentConfig(
            secret=agent_secrets[0] if agent_secrets else None, allowed_targets=targets,
            secrets=agent_secrets, webhook=_agent_webhook(entry, prefix), keys=keys,
            allowed_read_targets=_lower(read), allowed_continue_targets=_lower(cont),
            allowed_write_targets=_lower(write) or (), human=human)
    with_keys = [n for n, a in agents.items() if a.keys]
    if with_keys and len(with_keys) != len(agents):
        missing = sorted(n for n, a in agents.items() if not a.keys)
        raise ConfigError(
            f"agents.{missing[0]}.secret",
            "per-agent authentication requires a secret (or keys) for every configured agent",
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
    key_files: Optional[Mapping[str, str]] = None,
) -> Config:
    """Validate a parsed YAML document; relative paths are taken from ``base_dir``.

    ``secret_from_file`` is the content of ``broker.secretFile`` when the
    caller has read it (one secret per line), ``token_from_file`` that of
    ``broker.opsTokenFile``, ``key_files`` the content of each ``secretFile`` of an
    agent's keyring, by absolute path. ``backends`` names the storage backends whose own
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
    agents, skipped_agents = _agents(data, base_dir, key_files)
    groups, roles = _teams(data, agents)
    values = read_settings(BROKER_SETTINGS, scalar, base_dir)
    values.update(read_settings(SECURITY_SETTINGS, security, base_dir))

    values["secrets"] = _shared_secrets(values, secret_from_file)
    warnings: List[str] = []
    if not any(a.keys for a in agents.values()) and any(
            a.allowed_targets is not None or a.allowed_write_targets
            or a.allowed_read_targets is not None or a.allowed_continue_targets is not None
            for a in agents.values()):
        warnings.append(
            "agents.*.allowed_targets (or a per-mode list) is set but the agents share one "
            "secret: any agent can "
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
    key_files: Dict[str, str] = {}
    for key, key_path in _key_files(data, base_dir):
        try:
            with open(key_path, encoding="utf-8") as f:
                key_files[key_path] = f.read()
        except OSError as e:
            raise ConfigError(key, f"cannot read {key_path}: {e.strerror}") from None
        if os.stat(key_path).st_mode & 0o077:
            exposed.append(f"{key_path} ({key}) is readable by other users: chmod 600 it")
    config = parse_config(data, base_dir, secret_from_file, backends, token_from_file,
                          key_files)
    if _holds_secrets(data) and os.stat(path).st_mode & 0o077:
        exposed.append(f"{path} holds secrets and is readable by other users: chmod 600 it, "
                       "or keep the secret in broker.secretFile")
    if exposed:
        config = replace(config, warnings=config.warnings + tuple(exposed))
    return config, tuple(created)


def _key_files(data: Any, base_dir: str) -> List[Tuple[str, str]]:
    """``(key, absolute path)`` of every ``agents.<name>.keys.<id>.secretFile`` of ``data``
    (the ones well formed enough to name a file; :func:`parse_config` judges the rest)."""
    agents = data.get("agents") if isinstance(data, dict) else None
    found = []
    for name, entry in (agents.items() if isinstance(agents, dict) else ()):
        keys = entry.get("keys") if isinstance(entry, dict) else None
        for key_id, spec in (keys.items() if isinstance(keys, dict) else ()):
            path = spec.get("secretFile") if isinstance(spec, dict) else None
            if isinstance(path, str) and path:
                found.append((f"agents.{name}.keys.{key_id}.secretFile",
                              _resolve(base_dir, path)))
    return found


def _holds_secrets(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    broker = data.get("broker")
    agents = data.get("agents")
    return (isinstance(broker, dict) and broker.get("secret") is not None) or (
        isinstance(agents, dict)
        and any(isinstance(a, dict) and (a.get("secret") or _inline_keys(a.get("keys")))
                for a in agents.values()))


def _inline_keys(keys: Any) -> bool:
    return isinstance(keys, dict) and any(
        isinstance(k, dict) and k.get("secret") for k in keys.values())
