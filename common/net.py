"""Network helpers shared by every process: free ports, host names of addresses, the trainer's reachable address."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["free_port", "host_of", "is_loopback", "master_address_for"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" = every interface: a port remote peers will connect to)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_of(address: str) -> str:
    """The host of `host:port`, `[v6]:port` or a URL."""
    rest = address.strip().rstrip("/").split("://", 1)[-1]
    if rest.startswith("["):  # [v6]:port
        return rest[1:rest.index("]")]
    return rest.rsplit(":", 1)[0]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def master_address_for(addresses: list[str]) -> str:
    """The address peers at `addresses` can reach this process at: loopback when they are
    all local, else the local IP of the interface that routes to the first remote one."""
    hosts = [host_of(a) for a in addresses]
    if all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    remote = next(h for h in hosts if not is_loopback(h))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]
