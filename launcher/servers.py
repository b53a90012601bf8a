"""The command lines of the inference servers rlstream starts besides its own `rlstream serve`: SGLang
(`python -m sglang.launch_server`) and vLLM (engine/vllm_server.py: vLLM's OpenAI server with rlstream's weight
routes). Slurm (launcher/slurm.py) and Ray (launcher/ray.py) start the same ones; neither server registers with
name resolve, so the launcher gives producers and the trainer their addresses (`rollout.engine_addresses`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["VLLM_SERVER", "engines_healthy", "server_args"]

VLLM_SERVER = Path(__file__).resolve().parents[1] / "engine" / "vllm_server.py"


def server_args(engine: str, model: str, host: str, port: str, tp: int = 1, pp: int = 1) -> list[str]:
    """What follows the server's Python on its command line (`engine`: sglang or vllm)."""
    if engine == "sglang":
        return ["-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", port,
                "--tp-size", str(tp), "--pp-size", str(pp)]
    if engine == "vllm":
        return [str(VLLM_SERVER), "--model", model, "--host", host, "--port", port,
                "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    raise ValueError(f"no server command for engine {engine!r} (allowed: sglang, vllm)")


def engines_healthy(backend: str, addresses: list[str], api_key: str | None = None, timeout: float = 2.0) -> bool:
    """Whether every engine at `addresses` answers its health route now (the engine client's, one probe each), for a
    launcher waiting on the servers it started."""
    import asyncio

    import aiohttp

    from rlstream.common.engine_client import make_engine_client

    async def probe() -> bool:
        async with aiohttp.ClientSession() as session:
            clients = [make_engine_client(backend, session, a, api_key) for a in addresses]
            return all(await asyncio.gather(*(c.health(timeout=timeout) for c in clients)))

    return asyncio.run(probe())
