"""`rlstream serve --simulate`: a `SimulatedEngine` behind the real engine HTTP server.

The launcher hands `SimulatedServing.from_config` to `engine.server.serve` in place of the local
engine, so the routes, registration, pause/continue and weight-update routes are the real ones.
"""

from __future__ import annotations

import time
from typing import Any

from rlstream.common.engine_api import KEEPS_RUNNING, FinishReason, GenerateResponse
from rlstream.sim.engine import LengthModel, SimClock, SimulatedEngine, load_timing

__all__ = ["SimulatedServing"]


class _Device:
    """What the server and the weight routes read of a device: its type (a simulated engine has no GPU here)."""

    type = "cpu"

    def __str__(self) -> str:
        return "simulated"


class SimulatedServing:
    """A `SimulatedEngine` behind `rlstream serve` (`server.simulate.enabled`): the attributes and
    methods `engine/server.py` and `engine/weights.py` use of `LocalEngine`, so the HTTP routes,
    registration, pause/continue and the weight-update routes are the real ones. Prompts must be
    token ids (no tokenizer); output tokens are placeholder ids with logprob -1 and the version
    that "produced" them; a weight update takes the modeled push time and serves the new version."""

    VOCAB = 151936  # Qwen2.5's vocabulary size

    def __init__(self, sim: SimulatedEngine, *, max_seq_len: int, label: str) -> None:
        self.sim = sim
        self.model_path = label
        self.tokenizer_path = None
        self.tokenizer = self._no_tokenizer
        self.vocab_size = self.VOCAB
        self.max_seq_len = max_seq_len
        self.max_batch_size = sim.max_running
        self.device = _Device()
        self.dtype = "bfloat16"
        self.eos_ids: frozenset[int] = frozenset()
        self.pad_id = 0

    @classmethod
    def from_config(cls, cfg: Any) -> "SimulatedServing":
        s, sim = cfg.server, cfg.server.simulate
        timing = load_timing(sim.hardware, sim.model)
        engine = SimulatedEngine(timing, SimClock(sim.accel), LengthModel(sim.output_median, sim.output_sigma,
                                                                          s.max_seq_len),
                                 seed=sim.seed, max_running=s.max_batch_size, name="sim")
        return cls(engine, max_seq_len=s.max_seq_len, label=f"simulated:{sim.model}@{sim.hardware}")

    @staticmethod
    def _no_tokenizer(text: Any) -> Any:
        raise ValueError("a simulated engine has no tokenizer: send input_ids")

    @property
    def version(self) -> int:
        return self.sim.version

    @version.setter
    def version(self, value: int) -> None:
        self.sim.version = int(value)

    @property
    def paused(self) -> bool:
        return self.sim.paused

    def start(self) -> None:
        self.sim.start()

    def close(self, timeout: float = 30.0) -> None:
        """Called from a worker thread at shutdown: answer what is left with `abort`."""
        for s in self.sim.sequences():
            if not s.future.done():
                s.future.get_loop().call_soon_threadsafe(
                    lambda f=s.future: f.done() or f.set_result(FinishReason(type="abort", message="engine stopped")))

    def validate_prompt(self, input_ids: Any) -> list[int]:
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise ValueError("a simulated engine takes input_ids (a non-empty list of token ids); it has no tokenizer")
        if len(input_ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(input_ids)} tokens leaves no room under max_seq_len={self.max_seq_len}")
        return list(input_ids)

    async def generate(self, input_ids: list[int], sampling_params: Any = None) -> GenerateResponse:
        from rlstream.engine.sampling import resolve

        params = resolve(sampling_params)
        limit = min(params.max_new_tokens, self.max_seq_len - len(input_ids))
        target = min(limit, max(params.min_new_tokens, self.sim.draw_length(limit)))  # min_new_tokens honoured
        return await self.sim.generate(len(input_ids), limit, target=target)

    async def pause(self, mode: str = "abort") -> None:
        await self.sim.pause("in_place" if mode in KEEPS_RUNNING else mode)  # type: ignore[arg-type]

    async def resume(self) -> None:
        await self.sim.resume()

    def _modeled_push(self, version: int | None) -> None:
        time.sleep(self.sim.timing.push_s() / self.sim.clock.accel)  # a worker thread: the weight routes run it so
        if version is not None:
            self.sim.version = int(version)

    def apply_weights(self, named_tensors: Any, version: int | None = None, lora_scaling: float | None = None) -> int:
        """Tensors pushed over torch.distributed are received (the route does that) and dropped."""
        n = sum(1 for _ in named_tensors)
        self._modeled_push(version)
        return n

    def load_weights_from_disk(self, path: Any, version: int | None = None) -> int:
        self._modeled_push(version)
        return 0

    def flush_cache(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        st = self.sim.stats()
        return {"running": st["running"], "waiting": st["waiting"], "paused": st["paused"],
                "total_tokens": st["total_tokens"], "total_requests": st["total_requests"], "total_steps": 0,
                "peak_running": st["running"], "weight_version": st["weight_version"],
                "busy_seconds": round(st["busy_seconds"], 6), "prefill_tokens": 0, "cached_prompt_tokens": 0,
                "prefix_cache_entries": 0, "prefix_cache_used_tokens": 0}
