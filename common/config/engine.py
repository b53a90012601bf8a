"""The local CPU/GPU engine (`rlstream serve`) and its simulated-GPU mode."""

from __future__ import annotations

from typing import Literal

import msgspec

from rlstream.common.config.base import NonNegativeFloat, NonNegativeInt, Port, PositiveFloat, PositiveInt, Section

__all__ = ["SimulateConfig", "ServerConfig"]


class SimulateConfig(Section):
    enabled: bool = False
    """Serve a simulated GPU engine: the same HTTP protocol, no model loaded, times from the timing model of
    configs/cluster_sim.yaml (sim/engine.py)."""
    hardware: Literal["H100", "H200"] = "H100"
    """Simulated GPU (configs/cluster_sim.yaml)."""
    model: Literal["qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b"] = "qwen2.5-1.5b"
    """Simulated model size (configs/cluster_sim.yaml)."""
    accel: PositiveFloat = 1.0
    """Modeled time runs this many times faster than the wall clock."""
    output_median: PositiveFloat = 1024.0
    """Median output length of the lognormal length model (capped at max_new_tokens)."""
    output_sigma: NonNegativeFloat = 1.0
    """Shape (sigma) of the lognormal output lengths: larger = longer tail."""
    seed: int = 0
    """Seed of the output-length draws."""


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Bind address of the local engine (127.0.0.1 unless told otherwise)."""
    port: Port = 0
    """Port of the local engine (0 = pick a free one)."""
    model_path: str | None = None
    """Model served (None = actor.path)."""
    device: str = "auto"
    """auto, cpu or cuda (bf16 on CUDA ran on an H100, benchmarks/README.md GPU)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Serving dtype."""
    max_batch_size: PositiveInt = 64
    """Sequences decoded together (continuous batching)."""
    max_seq_len: PositiveInt = 4096
    """Longest prompt + output the engine accepts."""
    admission_hold_ms: NonNegativeFloat = 50.0
    """Local engine: hold new requests up to this long while more are expected (recent finishes not yet re-sent, rows at
    their length cap), so they join the batch in one prefill; 0 = admit at once."""
    prefill_chunk_tokens: NonNegativeInt = 0
    """Local engine: padded prompt tokens (rows x columns) one engine step prefills, between decode steps of the running
    rows, so a long prompt does not stall them (chunked prefill; 256 cut SmolLM2's longest decode stall 4.5x on CPU and
    cost ~5% of tokens per CPU-second on short prompts, docs/local_engine.md); 0 = each admitted prompt whole at once."""
    prefix_cache_tokens: NonNegativeInt = 16384
    """Tokens of finished requests' KV the local engine keeps to prefill later prompts that extend them (multi-turn;
    like SGLang's radix cache); 0 = off."""
    quantization: Literal["none", "fp8"] = "none"
    """Local engine: serve the decoder's linear layers quantized (cosmos-rl rollout.quantization; vLLM/SGLang get
    `--quantization fp8` in launcher.engine.args). fp8: weights stored as float8 e4m3 with a per-tensor scale and each
    layer's input quantized per token (W8A8, vLLM's online fp8), cast back for the matmul on CPU (its numerics at half
    bf16's weight memory, not its speed); the LM head and embeddings stay. Pushed weights are quantized as they arrive;
    the behaviour logprobs are the quantized policy's, which decoupled PPO corrects for. Not with
    actor.weight_update_delta (a delta cannot apply to quantized weights)."""
    api_key: str | None = None
    """Require this bearer token on every route; masked in logs."""
    frontend: Literal["inline", "process"] = "inline"
    """Where `rlstream serve`'s HTTP server runs: inline (on the engine process's event loop, sharing the GIL with the
    decode thread) or process (a front-end process of its own that forwards /generate over a Unix socket, as SGLang's
    tokenizer manager does; engine/frontend.py)."""
    register: bool = True
    """Register with name resolve so producers find this engine."""
    simulate: SimulateConfig = msgspec.field(default_factory=SimulateConfig)
    """A simulated GPU engine instead of the model (`rlstream serve --simulate`)."""
