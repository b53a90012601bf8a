"""The agent `rlstream chaos --agent` runs against `rlstream gateway`: the OpenAI tool loop, for ever.

    python -m rlstream.launcher.chaos_agent --addr-file RUN/engines/gateway.addr --dataset train.jsonl \
        --group-size 8 --groups 2

Per dataset row (`{"prompt", "answer"}`, the tool demo's) it opens `--group-size` sessions named as one group and
runs each as an episode with the `openai` SDK: chat completions with the `calculator` tool offered, the tool's
answers sent back, at most `--max-turns` calls, then the exact-match reward. `--groups` groups run at a time. The
gateway's address is read from `--addr-file` before each group (a restarted gateway binds a new port). Whatever
fails (the gateway killed or restarting, 502/503, Redis down) ends that episode: its session is abandoned (or
left to the gateway's session timeout), counted, and the agent goes on — it only stops on SIGTERM/SIGINT.
Counts are logged every `--report-every` episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
from pathlib import Path
from typing import Any

import httpx

from rlstream.common.logging import get_logger
from rlstream.producer.tools import Calculator, ToolError

__all__ = ["Agent", "main"]

log = get_logger(__name__)

RETRY_S = 1.0  # pause after a failed episode: a gateway that is down is not hammered


class Agent:
    """Drives the gateway at the address in `addr_file` with episodes of `rows`; `counts` say how they ended."""

    def __init__(self, addr_file: Path, rows: list[dict[str, str]], group_size: int, max_turns: int = 3,
                 seed: int = 0, timeout: float = 60.0) -> None:
        self.addr_file, self.rows, self.group_size, self.max_turns = addr_file, rows, group_size, max_turns
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.tool = Calculator()
        # episodes_failed: opened, then cut short (their sessions abandoned); unreachable: the gateway did not answer
        # the group's first session (down or restarting), retried after RETRY_S.
        self.counts = {"episodes_rewarded": 0, "episodes_failed": 0, "gateway_unreachable": 0, "tool_calls": 0}
        self.last_error = ""
        self._group_seq = 0

    def gateway(self) -> str | None:
        try:
            addr = self.addr_file.read_text().strip()
        except OSError:
            return None
        return f"http://{addr}" if addr else None

    async def episode(self, http: httpx.AsyncClient, base: str, group: str, row: dict[str, str]) -> None:
        from openai import AsyncOpenAI

        session = (await http.post(f"{base}/sessions", json={"group": group, "group_size": self.group_size})).json()
        sid = session["session_id"]
        try:
            client = AsyncOpenAI(base_url=session["base_url"], api_key="unused", max_retries=0, timeout=self.timeout)
            messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
            msg = None
            for _ in range(self.max_turns):
                out = await client.chat.completions.create(model="policy", messages=messages,
                                                           tools=[self.tool.schema])
                msg = out.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    self.counts["tool_calls"] += 1
                    try:
                        result = await self.tool.run(json.loads(call.function.arguments or "{}"))
                    except (ToolError, ValueError) as exc:
                        result = f"error: {exc}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reward = float(msg is not None and (msg.content or "").strip() == row["answer"])
            r = await http.post(f"{base}/sessions/{sid}/reward", json={"reward": reward})
            r.raise_for_status()
        except BaseException:
            # Leave the group at once instead of holding its lease until the session timeout (best effort: the
            # gateway may be the thing that failed).
            try:
                await http.delete(f"{base}/sessions/{sid}")
            except Exception:  # noqa: BLE001
                pass
            raise
        self.counts["episodes_rewarded"] += 1

    async def group(self, http: httpx.AsyncClient) -> None:
        base = self.gateway()
        if base is None:
            await asyncio.sleep(RETRY_S)
            return
        try:
            (await http.get(f"{base}/health")).raise_for_status()
        except httpx.HTTPError as exc:
            self.counts["gateway_unreachable"] += 1
            self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            await asyncio.sleep(RETRY_S)
            return
        row = self.rng.choice(self.rows)
        self._group_seq += 1
        name = f"chaos-agent-{self._group_seq}"
        results = await asyncio.gather(*(self.episode(http, base, name, row) for _ in range(self.group_size)),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self.counts["episodes_failed"] += len(failed)
            self.last_error = f"{type(failed[0]).__name__}: {str(failed[0])[:200]}"
            await asyncio.sleep(RETRY_S)

    async def run(self, groups: int, stop: asyncio.Event, report_every: int = 64) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            async def lane() -> None:
                while not stop.is_set():
                    await self.group(http)

            lanes = [asyncio.create_task(lane()) for _ in range(groups)]
            done = 0
            while not stop.is_set():
                await asyncio.sleep(1.0)
                n = self.counts["episodes_rewarded"] + self.counts["episodes_failed"]
                if n - done >= report_every:
                    done = n
                    log.info("agent: %s; last error: %s", self.counts, self.last_error or "none")
            for t in lanes:
                t.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
        log.info("agent stopped: %s", self.counts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr-file", type=Path, required=True, help="where the gateway writes host:port")
    ap.add_argument("--dataset", type=Path, required=True, help="JSONL rows {prompt, answer}")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2, help="groups in flight at a time")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-every", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per gateway request")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in args.dataset.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"--dataset {args.dataset}: no rows")
    agent = Agent(args.addr_file, rows, args.group_size, args.max_turns, args.seed, args.timeout)

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await agent.run(args.groups, stop, args.report_every)

    asyncio.run(go())


if __name__ == "__main__":
    main()
