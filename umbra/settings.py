"""Runtime configuration: one frozen object, built once from the environment.

This module is the only reader of ``os.environ`` for configuration. Every field
says its unit, default and why; a bad value fails at start and names the variable,
because a service that starts with a silently defaulted lease length is worse than
one that refuses to start.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import psycopg
from psycopg import conninfo


class SettingsError(ValueError):
    """A configuration variable is present but unusable."""


#: The longest duration in seconds a variable may give (ten years): far past any lease, delay, timeout or
#: silence an operator means, and every moment counted from now by it stays one that Python's datetime and
#: PostgreSQL's timestamptz can hold.
MAX_DURATION_SECONDS = 10 * 365 * 86_400


def _default_data_dir() -> Path:
    # As root the embedded server chmods every ancestor of its data dir o+rx: under /var/lib that opens
    # nothing private (those of its binaries, in .venv, are opened too: see umbra.embedded, trap 3).
    if os.geteuid() == 0:
        return Path("/var/lib/umbra")
    # XDG's location on every POSIX system, macOS included: platformdirs' macOS answer,
    # ~/Library/Application Support, has a space, and the embedded server cannot start there.
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "umbra"


@dataclass(frozen=True, kw_only=True)
class Settings:
    #: ``UMBRA_DATABASE_URL``. A libpq URL or conninfo string. Unset means "start
    #: (or reuse) the embedded PostgreSQL under ``data_dir``". Out of the settings'
    #: ``repr``, as the metrics token is: it may hold a password.
    database_url: str | None = field(default=None, repr=False)
    #: ``UMBRA_DATA_DIR``. Where the embedded database lives (``<data_dir>/pg``).
    #: Default ``/var/lib/umbra`` as root, else ``~/.local/share/umbra``.
    data_dir: Path = field(default_factory=_default_data_dir)
    #: ``UMBRA_HOST`` / ``UMBRA_PORT``. Listen address of ``umbra serve``: an IP address (``0.0.0.0`` or ``::``
    #: for every interface) or a host name, resolved when the server starts (:func:`listen_host`).
    host: str = "127.0.0.1"
    port: int = 8080
    #: ``UMBRA_POOL_SIZE``. Connections in the request pool. Long-polls hold none
    #: while they wait, so this bounds concurrent *transactions*, not agents.
    pool_size: int = 10
    #: ``UMBRA_LEASE_SECONDS``. Lease granted by a claim and by each renew. Only has
    #: to exceed the agent's renew interval plus slack; it is not a work timeout.
    lease_seconds: int = 60
    #: ``UMBRA_MODEL_AFFINITY_SECONDS``. 0 (the default): each node claims in queue order. Above 0, a node
    #: takes a job whose models are resident on it before an older job of the same priority that would make
    #: it load one, unless that job has been queued this long (``umbra.domain.placement.defers``), and leaves
    #: such a job to another node that holds its models until then (``umbra.domain.placement.passes_over``).
    model_affinity_seconds: int = 0
    #: ``UMBRA_HEARTBEAT_INTERVAL_SECONDS``. Interval agents are told to heartbeat at.
    heartbeat_interval_seconds: int = 10
    #: ``UMBRA_HEARTBEAT_STALE_SECONDS``. A stored ``online`` node silent this long
    #: reads as ``offline``: three missed 10 s beats, so one lost report is harmless.
    heartbeat_stale_seconds: int = 45
    #: ``UMBRA_HEARTBEAT_EVENT_SECONDS``. An unchanged heartbeat is recorded in the
    #: log at most this often per node, so 1,000 nodes beating every 10 s do not
    #: flood the log; any change (devices, models, status) is recorded at once.
    heartbeat_event_seconds: int = 300
    #: ``UMBRA_SWEEP_INTERVAL_SECONDS``. How often the sweeper looks for expired
    #: leases, stale nodes and blocked jobs past their schedule timeout.
    sweep_interval_seconds: float = 1.0
    #: ``UMBRA_LEASE_EXPIRED_DELAY_SECONDS``. ``not_before`` delay after a lease
    #: expires, so a job that crashes its holder does not bounce straight back.
    lease_expired_delay_seconds: int = 2
    #: ``UMBRA_BLOCKED_TIMEOUT_SECONDS``. A job blocked longer than this fails with
    #: its blocking reason, so parents still settle. Default 24 h.
    blocked_timeout_seconds: int = 86_400
    #: ``UMBRA_POLL_FALLBACK_SECONDS``. Waiting long-polls re-check at least this
    #: often even without a notification, covering lost NOTIFYs.
    poll_fallback_seconds: float = 1.0
    #: ``UMBRA_MAX_STREAMS_PER_ORGANIZATION``. Event and view streams (SSE) one
    #: organization may hold open on this process; past it a new one is refused
    #: 429. Each re-reads at every move of its organization's log, so one
    #: organization's thousand forgotten dashboards would otherwise take the
    #: streams' share of the pool from every other organization's.
    max_streams_per_organization: int = 100
    #: ``UMBRA_TRUSTED_PROXIES``. Comma-separated addresses/networks whose
    #: ``X-Forwarded-For`` is believed. Empty: the TCP peer is the client.
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    #: ``UMBRA_RATE_LIMIT_IPV6_PREFIX``. An IPv6 client is counted by the network of
    #: this many leading bits around its address, not by the address: a client holds
    #: a /64 at least (often a /56 or /48) and can take a fresh address for each
    #: request. 48..128; 128 counts each address alone. An IPv4 client is its address.
    rate_limit_ipv6_prefix: int = 64
    #: ``UMBRA_METRICS_TOKEN``. If set, ``GET /metrics`` answers only ``Authorization:
    #: Bearer <it>``. The scrape includes database-wide aggregates (queue depth by
    #: status, the log's head) over every organization: unset, keep the endpoint on
    #: a network only the monitoring system reaches.
    metrics_token: str | None = field(default=None, repr=False)
    #: ``UMBRA_LOG_LEVEL``. Python logging level name for the service's loggers.
    log_level: str = "INFO"
    #: ``UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS``. How long a migration (``umbra migrate``, and ``umbra serve`` at
    #: start) waits for a lock another session holds before it lets go and tries again (``umbra.migrate``).
    #: A migration's lock request queues ahead of every writer of its table, so the service's writes wait
    #: as long as it does: 2 s stays under their own bound (``umbra.db.LOCK_WAIT_SECONDS``, 5 s, past which
    #: they are answered 503). At most an hour.
    migrate_lock_timeout_seconds: float = 2.0

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pg"


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SettingsError(f"{name} must be <= {maximum}, got {value}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):  # nan passes every comparison, and inf never comes round
        raise SettingsError(f"{name} must be a finite number, got {raw!r}")
    if value <= minimum:
        raise SettingsError(f"{name} must be > {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SettingsError(f"{name} must be <= {maximum}, got {value}")
    return value


#: A host name's label: letters, digits, hyphens (not first or last) and underscores (container and service
#: names have them, and resolvers answer for them).
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def listen_host(text: str) -> str:
    """``text`` as an address to listen on: an IP address (an IPv6 one with or without brackets, ``[::]``) or a
    host name (``localhost``, ``api.internal``), returned as the socket layer takes it (without brackets).

    Refused with a :class:`ValueError` saying why: text that is no host name at all (``not a host``), and
    numbers that are no IPv4 address (``999.1.1.1``, ``10.1``: the resolver reads the second as 10.0.0.1, no
    operator means it). Whether a name resolves, and to an address of this machine, is a question for the
    moment the server starts (``umbra.listen``): a client on another machine reads these settings too.
    """
    host = text.strip()
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return bare
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if bare != host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"must be an IP address (0.0.0.0 or :: for every interface) or a host name, got {text!r}")
    if labels[-1].isdigit():  # no top-level domain is a number: meant as an IPv4 address
        raise ValueError(f"is not an IPv4 address (four numbers from 0 to 255, such as 127.0.0.1), got {text!r}")
    return host


def _host(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name, "").strip()
    if not raw:  # empty is unset, as for every other variable: "" would listen on every interface
        return default
    try:
        return listen_host(raw)
    except ValueError as exc:
        raise SettingsError(f"{name} {exc}") from None


def _networks(env: Mapping[str, str], name: str):
    raw = env.get(name, "").strip()
    if not raw:
        return ()
    out = []
    for part in raw.split(","):
        try:
            out.append(ipaddress.ip_network(part.strip(), strict=False))
        except ValueError:
            raise SettingsError(f"{name} has an invalid address or network: {part.strip()!r}") from None
    return tuple(out)


#: Set to ``1``, the process hashes secrets with argon2id at its smallest cost (``umbra.security``).
#: For a test suite only (its conftest sets it; the ~55 ms of each hash was most of its CPU), never for
#: a deployment: ``umbra serve`` warns when it is set. Any other value, or none, is the real profile.
#: Not a :class:`Settings` field: every process hashes, the CLI and the agent included, from import on.
CHEAP_HASHING_VARIABLE = "UMBRA_INSECURE_CHEAP_HASHING_FOR_TESTS"


def cheap_hashing(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(CHEAP_HASHING_VARIABLE) == "1"


def server_url(env: Mapping[str, str] | None = None) -> str:
    """Where the command-line clients find the service: ``UMBRA_SERVER``, else the server this machine's settings start.

    So ``umbra events tail`` next to ``UMBRA_PORT=9000 umbra serve`` finds it
    without being told twice. A wildcard listen address is reached on the
    loopback.
    """
    env = os.environ if env is None else env
    if env.get("UMBRA_SERVER"):
        return env["UMBRA_SERVER"].rstrip("/")
    host = _host(env, "UMBRA_HOST", "127.0.0.1")
    if host in {"0.0.0.0", "::"}:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{_int(env, 'UMBRA_PORT', 8080, minimum=1, maximum=65535)}"


def _database_url(env: Mapping[str, str]) -> str | None:
    """``UMBRA_DATABASE_URL``, parsed (not connected) so a mistyped one stops the process naming the variable.

    libpq's own complaint quotes the whole string, password and all, which would
    land on stderr and in whatever collects it: it is never repeated.
    """
    url = env.get("UMBRA_DATABASE_URL", "").strip() or None
    if url is not None:
        try:
            parsed = conninfo.conninfo_to_dict(url)
        except psycopg.Error:
            raise SettingsError("UMBRA_DATABASE_URL is not a PostgreSQL URL (postgresql://user:password@host:port/dbname)"
                                " or a conninfo string (host=... dbname=...)") from None  # fmt: skip
        if _raw_at_misread(url, parsed):
            raise SettingsError("UMBRA_DATABASE_URL has an @ where PostgreSQL reads a host, a port or a database name: "
                                "percent-encode each @, /, ? or # of its user name or password (@ is %40, / is %2F)")  # fmt: skip
    return url


def _raw_at_misread(url: str, parsed: Mapping[str, str]) -> bool:
    """Whether a password (or user name) written with a raw ``@`` or ``/`` was parsed into the host, port or
    database name: libpq ends the user information at the first ``@`` or ``/``, so ``user:p@ss@db`` connects
    to the host ``ss@db``, and the failure to resolve it printed the password's tail. A host name never
    holds an ``@`` (a socket directory, starting with ``/``, may), nor does a URL's path but percent-encoded."""
    hosts = [host for host in str(parsed.get("host") or "").split(",") if host and not host.startswith("/")]
    if any("@" in host for host in hosts):
        return True
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("postgres", "postgresql"):
        return False
    authority, _, path = rest.split("?", 1)[0].partition("/")
    return authority.count("@") > 1 or "@" in path


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    level = env.get("UMBRA_LOG_LEVEL", "").strip().upper() or "INFO"  # empty is unset, as for every other variable
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise SettingsError(f"UMBRA_LOG_LEVEL must be a logging level name, got {level!r}")
    data_dir = env.get("UMBRA_DATA_DIR")
    kwargs = {}
    if data_dir:
        kwargs["data_dir"] = Path(data_dir).expanduser().resolve()
    interval = _int(env, "UMBRA_HEARTBEAT_INTERVAL_SECONDS", 10, minimum=1)
    stale = _int(env, "UMBRA_HEARTBEAT_STALE_SECONDS", 45, minimum=1, maximum=MAX_DURATION_SECONDS)
    if stale <= interval:
        # Every healthy node would read offline between its beats, and take no work then.
        raise SettingsError(f"UMBRA_HEARTBEAT_STALE_SECONDS ({stale}) must be longer than "
                            f"UMBRA_HEARTBEAT_INTERVAL_SECONDS ({interval}); three intervals or more is usual")  # fmt: skip
    return Settings(
        database_url=_database_url(env),
        host=_host(env, "UMBRA_HOST", "127.0.0.1"),
        port=_int(env, "UMBRA_PORT", 8080, minimum=0, maximum=65535),
        pool_size=_int(env, "UMBRA_POOL_SIZE", 10, minimum=2),
        lease_seconds=_int(env, "UMBRA_LEASE_SECONDS", 60, minimum=1, maximum=MAX_DURATION_SECONDS),
        model_affinity_seconds=_int(env, "UMBRA_MODEL_AFFINITY_SECONDS", 0, minimum=0, maximum=3600),
        heartbeat_interval_seconds=interval,
        heartbeat_stale_seconds=stale,
        heartbeat_event_seconds=_int(env, "UMBRA_HEARTBEAT_EVENT_SECONDS", 300, minimum=0, maximum=MAX_DURATION_SECONDS),
        sweep_interval_seconds=_float(env, "UMBRA_SWEEP_INTERVAL_SECONDS", 1.0, maximum=MAX_DURATION_SECONDS),
        lease_expired_delay_seconds=_int(env, "UMBRA_LEASE_EXPIRED_DELAY_SECONDS", 2, minimum=0, maximum=MAX_DURATION_SECONDS),
        blocked_timeout_seconds=_int(env, "UMBRA_BLOCKED_TIMEOUT_SECONDS", 86_400, minimum=1, maximum=MAX_DURATION_SECONDS),
        poll_fallback_seconds=_float(env, "UMBRA_POLL_FALLBACK_SECONDS", 1.0, maximum=MAX_DURATION_SECONDS),
        max_streams_per_organization=_int(env, "UMBRA_MAX_STREAMS_PER_ORGANIZATION", 100, minimum=1),
        trusted_proxies=_networks(env, "UMBRA_TRUSTED_PROXIES"),
        rate_limit_ipv6_prefix=_int(env, "UMBRA_RATE_LIMIT_IPV6_PREFIX", 64, minimum=48, maximum=128),
        metrics_token=env.get("UMBRA_METRICS_TOKEN", "").strip() or None,
        log_level=level,
        migrate_lock_timeout_seconds=_float(env, "UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS", 2.0, maximum=3600),
        **kwargs,
    )
