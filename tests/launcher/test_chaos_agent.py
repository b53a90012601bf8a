"""`launcher/chaos_agent.py`: the agent `rlstream chaos --agent` runs rides out a gateway that is down (no address
yet, or nothing listening at it: every episode of the group fails, is counted, and the agent goes on). Its episodes
against a live gateway, under faults, run in the chaos soak (benchmarks/chaos.py --parts gateway)."""

from __future__ import annotations

import asyncio
import socket

import httpx

from rlstream.launcher.chaos_agent import Agent

ROWS = [{"prompt": "12*34=?", "answer": "408"}]


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gateway_without_an_address_file_is_waited_for(tmp_path):
    agent = Agent(tmp_path / "gateway.addr", ROWS, group_size=2)
    assert agent.gateway() is None
    asyncio.run(_one_group(agent))
    assert agent.counts == {"episodes_rewarded": 0, "episodes_failed": 0, "gateway_unreachable": 0, "tool_calls": 0}


def test_a_dead_gateway_is_counted_as_unreachable_and_retried(tmp_path):
    addr = tmp_path / "gateway.addr"
    addr.write_text(f"127.0.0.1:{_closed_port()}\n")
    agent = Agent(addr, ROWS, group_size=3, timeout=5.0)
    assert agent.gateway() == addr.read_text().strip().join(["http://", ""])
    asyncio.run(_one_group(agent))
    assert agent.counts["gateway_unreachable"] == 1 and agent.counts["episodes_failed"] == 0
    assert agent.last_error.startswith("ConnectError")


async def _one_group(agent: Agent) -> None:
    async with httpx.AsyncClient(timeout=5.0) as http:
        await agent.group(http)
