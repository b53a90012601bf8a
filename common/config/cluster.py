"""Where the run lives: placement, engine discovery (name resolve) and the Redis broker."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rlstream.common.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section

__all__ = ["KEEPALIVES_PER_TTL", "NameResolveConfig", "ClusterConfig", "RedisConfig"]


# Name-resolve keepalives per lease_ttl (the default). 2 saves round trips at hundreds of engines with the same
# crash bound (ttl), but a live engine's keepalive may then be late by only ttl/2 instead of 2/3 ttl before it drops
# out until its next one: the default keeps the wider slack.
KEEPALIVES_PER_TTL = 3


class NameResolveConfig(Section):
    type: Literal["redis", "etcd", "static"] = "redis"
    """Where engines register: redis (default, nothing extra), etcd, or a static list."""
    etcd_address: str = "127.0.0.1:2379"
    """etcd endpoint host:port for type=etcd."""
    static_servers: list[str] = msgspec.field(default_factory=list)
    """Engine addresses host:port for type=static."""
    lease_ttl: PositiveInt = 10
    """Seconds an engine registration lives without a keepalive."""
    keepalives_per_ttl: Annotated[int, Meta(ge=2)] = KEEPALIVES_PER_TTL
    """Keepalives an engine sends per lease_ttl (every lease_ttl / this). A crashed engine drops out within lease_ttl
    whatever this is; a live one whose keepalive is late by more than lease_ttl - the period drops out until its next
    one."""


class ClusterConfig(Section):
    fileroot: str = "./runs"
    """Root folder for runs: logs, checkpoints, metrics go to {fileroot}/{experiment}/{trial}."""
    n_nodes: PositiveInt = 1
    """Nodes for a Slurm launch."""
    n_gpus_per_node: NonNegativeInt = 8
    """GPUs per node for a Slurm launch (0 = CPU-only)."""
    name_resolve: NameResolveConfig = msgspec.field(default_factory=NameResolveConfig)
    """Service discovery for inference engines."""


class RedisConfig(Section):
    url: str = ""
    """Redis URL: redis://host:port/db, rediss:// for TLS, unix:///path.sock, redis+sentinel://h:p,h:p/service,
    redis+cluster://h:p,h:p. Empty: `rlstream run` starts one."""
    username: str | None = None
    """ACL user name (overrides the URL's)."""
    password: str | None = None
    """Password (overrides the URL's); masked in logs and `config show`."""
    socket_timeout: PositiveFloat = 30.0
    """Seconds a single Redis command may take before it is retried."""
    connect_timeout: PositiveFloat = 5.0
    """Seconds to wait for a TCP/TLS connection."""
    retries: NonNegativeInt = 8
    """Reconnect attempts (exponential backoff) before an operation fails."""
    wait_replicas: NonNegativeInt = 0
    """Replicas that must confirm each commit (Redis WAIT) before it counts as done; closes the window in which a
    failover loses the newest commits (0 = off)."""
    outage_tolerance: NonNegativeFloat = 120.0
    """Seconds a component rides out an unreachable Redis (blocks, logs every ~10 s) before it exits with one line; 0:
    only redis.retries attempts."""
    ssl_ca_certs: str | None = None
    """CA bundle for rediss:// URLs."""
    ssl_certfile: str | None = None
    """Client certificate for rediss:// (mutual TLS)."""
    ssl_keyfile: str | None = None
    """Client key for rediss:// (mutual TLS)."""
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    """rediss://: verify the server certificate (none = accept any; only for tests)."""
    ssl_check_hostname: bool = True
    """rediss://: the server certificate must name the host in the URL."""
    stream_maxlen: NonNegativeInt = 0
    """Retention: trim acknowledged entries beyond this many (0 = keep all)."""
    appendonly: bool = True
    """When rlstream starts Redis itself: enable AOF persistence."""
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    """AOF fsync policy for a Redis started by rlstream."""
