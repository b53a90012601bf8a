"""The engines of a run, as the weight broadcaster sees them: who they are, and one call to each.

Engines come from `rollout.engine_addresses`, else name resolve (the same discovery the
producers follow). Every call goes through the producer's `SGLangClient` (one HTTP
client for both ends' engine traffic) with a struct of `common/engine_api.py`: the
local engine, SGLang and rlstream's vLLM server all answer SGLang's control and
weight-update routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import msgspec

from rlstream.broker.registry import make_name_resolver
from rlstream.common import engine_api as api
from rlstream.common.config import Config
from rlstream.common.engine_api import ENGINES_SERVICE, EngineError, Route, base_url
from rlstream.common.engine_client import SGLangClient

__all__ = ["EngineFleet", "HEALTH_TIMEOUT"]

HEALTH_TIMEOUT = 5.0


class EngineFleet:
    """Discovery plus one SGLang-protocol client per engine.

    Lives on the broadcaster's event loop (created there: aiohttp and the async name
    resolver bind to the loop that made them).
    """

    def __init__(self, cfg: Config) -> None:
        self.static = list(cfg.rollout.engine_addresses)
        self.resolver = None if self.static else make_name_resolver(cfg)
        self.api_key = cfg.rollout.api_key
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._clients: dict[str, SGLangClient] = {}
        self._ranks: dict[str, int] = {}

    def client(self, address: str) -> SGLangClient:
        if address not in self._clients:
            self._clients[address] = SGLangClient(self.session, address, self.api_key)
        return self._clients[address]

    async def discover(self) -> list[str]:
        if self.static:
            return sorted(dict.fromkeys(self.static))
        return sorted(await self.resolver.list(ENGINES_SERVICE))

    async def call(self, address: str, route: Route, body: msgspec.Struct | None = None, *, timeout: float) -> Any:
        """One call; EngineError (naming the URL) unless the engine answered with success."""
        reply = await self.client(address).call(route, body, timeout=timeout)
        if getattr(reply, "success", None) is False:
            raise EngineError(f"{base_url(address)}{route.path}: {reply.message}", answered=True)
        return reply

    async def is_healthy(self, address: str, timeout: float = HEALTH_TIMEOUT) -> bool:
        try:
            await self.call(address, api.HEALTH, timeout=timeout)
            return True
        except EngineError:
            return False

    async def healthy(self, addresses: list[str], timeout: float = HEALTH_TIMEOUT) -> list[str]:
        ok = await asyncio.gather(*(self.is_healthy(a, timeout) for a in addresses))
        return [a for a, good in zip(addresses, ok) if good]

    async def weight_version(self, address: str, timeout: float = HEALTH_TIMEOUT) -> int | None:
        """The version the engine reports serving (None: it does not say, or did not answer)."""
        try:
            info = await self.call(address, api.MODEL_INFO, timeout=timeout)
        except EngineError:
            return None
        return api.as_int(info.weight_version) if info is not None else None

    async def ranks(self, address: str, timeout: float) -> int:
        """Ranks the engine takes in a weight group: tp_size * pp_size (1 when it does not say)."""
        if address not in self._ranks:
            try:
                info = await self.call(address, api.SERVER_INFO, timeout=timeout)
            except EngineError:
                info = None
            self._ranks[address] = info.weight_sync_ranks() if info is not None else 1
        return self._ranks[address]

    async def forget(self, address: str) -> None:
        """Out of producers' rotation: unregister from name resolve (a live engine's keepalive re-adds it)."""
        self._ranks.pop(address, None)
        if self.resolver is not None:
            with contextlib.suppress(Exception):
                await self.resolver.unregister(ENGINES_SERVICE, address)

    async def close(self) -> None:
        await self.session.close()
        if self.resolver is not None:
            with contextlib.suppress(Exception):
                await self.resolver.close()
