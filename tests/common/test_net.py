"""`common/net.py`: free ports, the host of an address, loopback checks, and the address peers reach us at."""

from __future__ import annotations

import socket

import pytest

from rlstream.common.net import free_port, host_of, is_loopback, master_address_for


def test_free_port_can_be_bound():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("address,host", [
    ("10.0.0.1:8000", "10.0.0.1"), ("node-3:6379", "node-3"), ("[::1]:9000", "::1"),
    ("http://10.1.2.3:30000/", "10.1.2.3"), ("redis://host.example:6379", "host.example"), (" h:1 ", "h"),
])
def test_host_of(address, host):
    assert host_of(address) == host


def test_is_loopback():
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and is_loopback("127.8.9.1") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("node-3")


def test_master_address_is_loopback_for_local_peers_and_a_local_interface_otherwise():
    assert master_address_for(["127.0.0.1:1", "localhost:2", "[::1]:3"]) == "127.0.0.1"
    try:
        addr = master_address_for(["127.0.0.1:1", "192.0.2.10:8000"])  # TEST-NET-1: a route is picked, nothing sent
    except OSError as exc:
        pytest.skip(f"this machine has no route to a remote address: {exc}")
    with socket.socket() as s:
        s.bind((addr, 0))  # an address of this machine
    assert not is_loopback(addr)
