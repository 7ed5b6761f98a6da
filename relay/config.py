"""Broker configuration: YAML in, a validated and frozen :class:`Config` out.

The file keeps the reference broker's keys (``broker:``, ``security:``,
``agents:``) so an existing ``config.yaml`` works unchanged, and adds
``broker.listen`` (Twisted endpoint strings), ``broker.secretFile``,
``broker.sync``, ``broker.sweepSeconds``, ``broker.accessLog``,
``broker.allowInsecureRemote`` and the ops listener (``broker.opsListen``,
``broker.opsToken``, ``broker.opsTokenFile``). A secret may be a list (or a
secret file several lines): every one of them verifies, the first signs.
Unknown keys, wrong types and out-of-range numbers are errors naming the key.

:func:`parse_config` is pure; :func:`load_config` reads the file and resolves
the secret file.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

import yaml

from relay.errors import ConfigError
from relay.protocol import MAX_LEASE_SECONDS, is_loopback_host, is_valid_agent_name

__all__ = ["AgentConfig", "Config", "ConfigError", "load_config", "parse_config"]

# The storage backends shipped with the relay; a dropin adds its own name (see
# relay.store.plugins.store_factories, which load_config's callers pass in).
BUILTIN_BACKENDS = ("memory", "sqlite", "jsonl", "postgres")
# A secret shorter than this is refused: HMAC is only as strong as its key.
MIN_SECRET_BYTES = 16
PLACEHOLDER_SECRETS = frozenset({"CHANGE_ME_RUN_SETUP_INIT", "CHANGE_ME"})
SYNC_LEVELS = ("off", "normal", "full")
_MISSING = object()


@dataclass(frozen=True)
class AgentConfig:
    """Per-agent settings: own secrets and a send whitelist (None = anyone).

    ``secrets`` are every secret that verifies the agent's requests (several
    while one is rotated); ``secret`` is the first, the one a client signs with.
    """

    secret: Optional[str] = None
    allowed_targets: Optional[Tuple[str, ...]] = None
    secrets: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.secret is not None and not self.secrets:
            object.__setattr__(self, "secrets", (self.secret,))


@dataclass(frozen=True)
class OpsConfig:
    """The ops listener: endpoint strings (none: no ops listener) and the bearer tokens
    it accepts (none: no token asked for; several while one is rotated)."""

    listen: Tuple[str, ...] = ()
    tokens: Tuple[str, ...] = ()
    token_file: Optional[str] = None


@dataclass(frozen=True)
class Config:
    """The broker's settings, validated. Paths are absolute."""

    secret: str
    listen: Tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 19121
    secret_file: Optional[str] = None
    rate_limit_loopback: int = 600
    rate_limit_remote: int = 120
    message_ttl_days: float = 7
    persist: bool = True
    storage: str = "sqlite"
    data_dir: str = "data"
    lease_seconds: float = 600
    max_attempts: int = 3
    max_deliveries: int = 10
    notify_failures: bool = True
    sync: str = "normal"
    sweep_seconds: float = 5.0
    request_read_seconds: float = 30.0
    access_log: bool = False
    allow_insecure_remote: bool = False
    allowed_hosts: Tuple[str, ...] = ()
    max_connections: int = 10_000
    max_connections_per_address: int = 256
    inbox_max_messages: int = 10_000
    inbox_max_bytes: int = 100 * 1024 * 1024
    min_free_disk_mb: int = 64
    max_agents: int = 10_000
    tls_client_ca: Optional[str] = None
    lock_after_failures: int = 5
    lock_minutes: float = 5
    require_nonce: bool = False
    # Seconds of self-exercise before listening (None: the interpreter's default,
    # relay.warmup.default_seconds).
    warmup_seconds: Optional[float] = None
    agents: Mapping[str, AgentConfig] = field(default_factory=dict)
    ignored_keys: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = ()
    backend_sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    base_dir: str = "."
    ops: OpsConfig = OpsConfig()
    # Every shared secret that verifies a request; ``secret`` is the first.
    secrets: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.secrets:
            object.__setattr__(self, "secrets", (self.secret,))

    @property
    def storage_backend(self) -> str:
        """The store plugin to open: ``memory`` when ``persist`` is false."""
        return self.storage if self.persist else "memory"

    @property
    def message_ttl_seconds(self) -> float:
        """Message lifetime in seconds. ``messageTtlDays: 0`` means what it means to the
        reference broker: every message is past its lifetime and is swept."""
        return self.message_ttl_days * 86400.0


# Keys the reference broker accepts for its own later protocol generations.
# They are read without error (so its config files load) and have no effect here.
_IGNORED_BROKER_KEYS = frozenset({"notifyFailedToSender"})
_IGNORED_SECURITY_KEYS = frozenset({"admin_agents"})
_IGNORED_AGENT_KEYS = frozenset(
    {"keys", "allowed_read_targets", "allowed_continue_targets", "allowed_write_targets"}
)

_BROKER_KEYS = frozenset(
    {
        "host",
        "port",
        "listen",
        "secret",
        "secretFile",
        "rateLimitLoopback",
        "rateLimitRemote",
        "messageTtlDays",
        "persist",
        "storage",
        "dataDir",
        "leaseSeconds",
        "maxAttempts",
        "maxDeliveries",
        "notifyFailures",
        "sync",
        "sweepSeconds",
        "requestReadSeconds",
        "accessLog",
        "allowInsecureRemote",
        "allowedHosts",
        "maxConnections",
        "maxConnectionsPerAddress",
        "inboxMaxMessages",
        "inboxMaxBytes",
        "minFreeDiskMB",
        "maxAgents",
        "tlsClientCA",
        "opsListen",
        "opsToken",
        "opsTokenFile",
        "warmupSeconds",
    }
)
_SECURITY_KEYS = frozenset({"lockAfterFailures", "lockMinutes", "requireNonce"})
_AGENT_KEYS = frozenset({"secret", "allowed_targets", "allowedTargets"})

# Endpoint-string options that name files; resolved against the config file.
_PATH_OPTIONS = frozenset({"privateKey", "certKey", "extraCertChain", "dhParameters", "caCertsDir"})


def _section(data: Mapping[str, Any], key: str) -> Dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, "must be a mapping")
    return value


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
            raise ConfigError(f"{prefix}.{key}", "unknown key")
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


def split_endpoint(description: str) -> List[str]:
    """Split an endpoint string on its unescaped colons, keeping the escapes."""
    parts, current, escaped = [], [], False
    for ch in description:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            current.append(ch)
            escaped = True
        elif ch == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def unescape_endpoint_value(value: str) -> str:
    """An endpoint-string value with its ``\\:`` and ``\\\\`` escapes undone."""
    return value.replace("\\:", ":").replace("\\\\", "\\")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(":", "\\:")


def resolve_endpoint_paths(description: str, base_dir: str) -> str:
    """Make the file options of an endpoint string absolute, relative to ``base_dir``."""
    parts = split_endpoint(description)
    out = [parts[0]]
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if sep and name in _PATH_OPTIONS and value:
            value = _escape(_resolve(base_dir, unescape_endpoint_value(value)))
            part = f"{name}={value}"
        out.append(part)
    return ":".join(out)


# Where the ``interface`` argument of each endpoint type sits among its positional ones.
_INTERFACE_POSITION = {"tcp": 2, "tcp6": 2, "ssl": 5}


def endpoint_kind(description: str) -> str:
    """The type of an endpoint string, as Twisted matches it (case-insensitively)."""
    return split_endpoint(description)[0].strip().lower()


def listen_interface(description: str) -> Optional[str]:
    """The interface a ``tcp``, ``tcp6`` or ``ssl`` endpoint string binds (``0.0.0.0``
    or ``::`` when it names none); None for any other endpoint type."""
    parts = split_endpoint(description)
    kind = endpoint_kind(description)
    position = _INTERFACE_POSITION.get(kind)
    if position is None:
        return None
    interface = None
    positional = 0
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if sep:
            if name == "interface":
                interface = unescape_endpoint_value(value)
        else:
            positional += 1
            if positional == position:
                interface = unescape_endpoint_value(part)
    if not interface:
        return "::" if kind == "tcp6" else "0.0.0.0"
    return interface


def _unix_path(description: str) -> Optional[str]:
    parts = split_endpoint(description)[1:]
    for part in parts:
        name, sep, value = part.partition("=")
        if sep and name == "address":
            return unescape_endpoint_value(value)
    positional = [p for p in parts if "=" not in p]
    return unescape_endpoint_value(positional[0]) if positional else None


def beyond_loopback(description: str) -> Optional[str]:
    """What an endpoint string exposes beyond this machine, or None when it is
    provably local: a ``tcp``/``tcp6``/``ssl`` endpoint on a loopback interface, or a
    ``unix`` socket at a filesystem path. The interface of any other TCP endpoint,
    and ``unknown <type>`` for every other endpoint type (``systemd``, plugins, an
    abstract unix socket), which counts as remote."""
    kind = endpoint_kind(description)
    if kind == "unix":
        path = _unix_path(description)
        if path and not path.startswith(("\0", "@")):  # not an abstract socket
            return None
        return "unknown unix address"
    interface = listen_interface(description)
    if interface is None:
        return f"unknown endpoint type {kind!r}"
    return None if is_loopback_host(interface) else interface


def plaintext_remote(description: str) -> Optional[str]:
    """What a plaintext endpoint exposes beyond loopback (see :func:`beyond_loopback`),
    or None: an ``ssl`` endpoint is never plaintext."""
    if endpoint_kind(description) == "ssl":
        return None
    return beyond_loopback(description)


def _allowed_hosts(broker: Mapping[str, Any]) -> Tuple[str, ...]:
    """``broker.allowedHosts``: host names a loopback listener may be reached by
    besides loopback's own (a local reverse proxy's name, say)."""
    raw = broker.get("allowedHosts")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(h, str) and h.strip() for h in raw):
        raise ConfigError("broker.allowedHosts", "must be a list of host names")
    return tuple(h.strip().lower() for h in raw)


def default_listen(host: str, port: int) -> str:
    """The endpoint string for the reference keys ``broker.host``/``broker.port``."""
    if ":" in host:
        return f"tcp6:{port}:interface={_escape(host)}"
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
                                   allowed_targets=targets, secrets=agent_secrets)
    with_secret = [n for n, a in agents.items() if a.secret]
    if with_secret and len(with_secret) != len(agents):
        missing = sorted(n for n, a in agents.items() if not a.secret)
        raise ConfigError(
            f"agents.{missing[0]}.secret",
            "per-agent authentication requires a secret for every configured agent",
        )
    return agents, skipped


def _ops(broker: Mapping[str, Any], base_dir: str, token_from_file: Optional[str],
         allow_insecure: bool) -> OpsConfig:
    """``broker.opsListen``, ``opsToken``, ``opsTokenFile``: off loopback the ops
    listener needs TLS (unless ``allowInsecureRemote``) and a token."""
    raw = broker.get("opsListen")
    if raw is None:
        listen: Tuple[str, ...] = ()
    else:
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list) or not all(isinstance(d, str) and d.strip() for d in raw):
            raise ConfigError("broker.opsListen", "must be a list of endpoint strings")
        listen = tuple(resolve_endpoint_paths(d.strip(), base_dir) for d in raw)
    token_file = read_str(broker, "opsTokenFile", "broker", None)
    if broker.get("opsToken") is not None and token_file is not None:
        raise ConfigError("broker.opsToken", "set either broker.opsToken or broker.opsTokenFile")
    tokens = read_secrets(broker, "opsToken", "broker") or ()
    if token_file is not None:
        token_file = _resolve(base_dir, token_file)
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
        if key not in ("broker", "security", "agents"):
            raise ConfigError(str(key), "unknown key")
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

    host = read_str(broker, "host", "broker", "127.0.0.1")
    port = read_int(broker, "port", "broker", 19121, 1, 65535)
    secret_file = read_str(broker, "secretFile", "broker", None)
    if secret_file is not None:
        secret_file = _resolve(base_dir, secret_file)
    if broker.get("secret") is not None and secret_file is not None:
        raise ConfigError("broker.secret", "set either broker.secret or broker.secretFile")
    shared = read_secrets(broker, "secret", "broker")
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
    warnings: List[str] = []
    if not any(a.secret for a in agents.values()) and any(
            a.allowed_targets is not None for a in agents.values()):
        warnings.append(
            "agents.*.allowed_targets is set but the agents share one secret: any agent can "
            "sign as any other, so the routing ACL protects nothing; give each agent its own "
            "agents.<name>.secret")

    listen_raw = broker.get("listen")
    if listen_raw is None:
        listen: Tuple[str, ...] = (default_listen(host, port),)
    else:
        if isinstance(listen_raw, str):
            listen_raw = [listen_raw]
        if (
            not isinstance(listen_raw, list)
            or not listen_raw
            or not all(isinstance(s, str) and s.strip() for s in listen_raw)
        ):
            raise ConfigError("broker.listen", "must be a non-empty list of endpoint strings")
        listen = tuple(resolve_endpoint_paths(s.strip(), base_dir) for s in listen_raw)

    allow_insecure = read_bool(broker, "allowInsecureRemote", "broker", False)
    if not allow_insecure:
        for description in listen:
            exposed = plaintext_remote(description)
            if exposed is not None:
                where = (exposed if exposed.startswith("unknown")
                         else f"interface {exposed}")
                raise ConfigError(
                    "broker.listen",
                    f"plaintext endpoint {description!r} may be reachable beyond loopback "
                    f"({where}); HMAC authenticates but does not encrypt, so "
                    "remote deployments must use an ssl: endpoint "
                    "(or set broker.allowInsecureRemote: true)",
                )

    storage = read_str(broker, "storage", "broker", "sqlite").lower()
    sync = read_str(broker, "sync", "broker", "normal").lower()
    if sync not in SYNC_LEVELS:
        raise ConfigError("broker.sync", f"must be one of {', '.join(SYNC_LEVELS)}")
    tls_client_ca = read_str(broker, "tlsClientCA", "broker", None)
    if tls_client_ca is not None:
        tls_client_ca = _resolve(base_dir, tls_client_ca)

    big = 2**31 - 1
    return Config(
        secret=shared[0],
        secrets=shared,
        listen=listen,
        host=host,
        port=port,
        secret_file=secret_file,
        rate_limit_loopback=read_int(broker, "rateLimitLoopback", "broker", 600, 1, big),
        rate_limit_remote=read_int(broker, "rateLimitRemote", "broker", 120, 1, big),
        message_ttl_days=read_number(broker, "messageTtlDays", "broker", 7, 0, 36500),
        persist=read_bool(broker, "persist", "broker", True),
        storage=storage,
        data_dir=_resolve(base_dir, read_str(broker, "dataDir", "broker", "./data")),
        lease_seconds=read_number(broker, "leaseSeconds", "broker", 600, 0.1, MAX_LEASE_SECONDS),
        max_attempts=read_int(broker, "maxAttempts", "broker", 3, 0, 1000),
        max_deliveries=read_int(broker, "maxDeliveries", "broker", 10, 0, 1000),
        notify_failures=read_bool(broker, "notifyFailures", "broker", True),
        sync=sync,
        sweep_seconds=read_number(broker, "sweepSeconds", "broker", 5, 0.05, 3600),
        request_read_seconds=read_number(broker, "requestReadSeconds", "broker", 30, 1, 3600),
        access_log=read_bool(broker, "accessLog", "broker", False),
        allow_insecure_remote=allow_insecure,
        allowed_hosts=_allowed_hosts(broker),
        max_connections=read_int(broker, "maxConnections", "broker", 10_000, 1, 10**6),
        max_connections_per_address=read_int(broker, "maxConnectionsPerAddress", "broker",
                                             256, 1, 10**6),
        inbox_max_messages=read_int(broker, "inboxMaxMessages", "broker", 10_000, 0, big),
        inbox_max_bytes=read_int(broker, "inboxMaxBytes", "broker", 100 * 1024 * 1024, 0,
                                 2**62),
        min_free_disk_mb=read_int(broker, "minFreeDiskMB", "broker", 64, 0, 2**40),
        max_agents=read_int(broker, "maxAgents", "broker", 10_000, 0, big),
        tls_client_ca=tls_client_ca,
        lock_after_failures=read_int(security, "lockAfterFailures", "security", 5, 1, 1000000),
        lock_minutes=read_number(security, "lockMinutes", "security", 5, 0.01, 525600),
        require_nonce=read_bool(security, "requireNonce", "security", False),
        warmup_seconds=(read_number(broker, "warmupSeconds", "broker", 0, 0, 60)
                        if broker.get("warmupSeconds") is not None else None),
        agents=agents,
        ignored_keys=tuple(skipped + skipped_agents),
        warnings=tuple(warnings),
        backend_sections=MappingProxyType(backend_sections),
        base_dir=base_dir,
        ops=_ops(broker, base_dir, token_from_file, allow_insecure),
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
