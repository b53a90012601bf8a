"""`actor.backend: megatron` (EXPERIMENTAL): a megatron-core GPTModel behind the HF causal-LM call.

The trainer's PPO code calls `model(input_ids=..., position_ids=..., attention_mask=...,
use_cache=False).logits`; `MegatronCausalLM` answers that call with megatron-core's
GPTModel, so losses, advantages, micro-batching and the optimizer are the same code
as the HF path and one PPO step can be compared number for number.

What runs: one rank, TP = PP = CP = 1, megatron-core's local layer spec (no
TransformerEngine), on CUDA (megatron-core's forward hard-codes CUDA). Packed rows
get an explicit block-diagonal causal mask built from the restarting position ids
(megatron's local attention has no THD/cu_seqlens path; RoPE is relative, so
positions that keep counting across sequences of one row give the same scores).
Weights enter from an HF folder and leave under HF names (`hf_named_tensors`, used by
the weight push and `save_pretrained`) through `convert.py`; tensor-parallel sharding
of the conversion is tested on CPU, training with TP/PP/CP > 1 is not wired yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlstream.common.config import ActorConfig, ConfigError
from rlstream.common.net import free_port
from rlstream.trainer.megatron.convert import (Arch, arch_from_hf, gpt_model_kwargs, hf_to_mcore, mcore_to_hf,
                                               transformer_config_kwargs)

__all__ = ["MegatronCausalLM", "build_megatron_lm", "load_megatron_lm", "check_megatron_config",
           "init_model_parallel"]


class _Output:
    """The one field of an HF `CausalLMOutput` the trainer reads."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def check_megatron_config(actor: ActorConfig, world_size: int = 1) -> None:
    """What the experimental backend runs today; each error names its key."""
    m = actor.megatron
    for key, n in (("tensor_parallel", m.tensor_parallel), ("pipeline_parallel", m.pipeline_parallel),
                   ("context_parallel", m.context_parallel)):
        if n != 1:
            raise ConfigError(f"actor.megatron.{key}={n}: the experimental megatron backend trains with "
                              "tensor/pipeline/context parallel size 1 so far (the conversion shards for TP)")
    if world_size != 1:
        raise ConfigError(f"actor.backend=megatron runs on one trainer rank so far, got {world_size} ranks")
    if actor.gradient_checkpointing:
        raise ConfigError("actor.gradient_checkpointing=true is not wired for actor.backend=megatron")
    if actor.lora is not None:
        raise ConfigError("actor.lora is set but actor.backend=megatron trains full weights only; "
                          "use actor.backend=hf for LoRA")


def init_model_parallel(device: torch.device, tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1) -> None:
    """megatron's parallel state; a one-process group first when the trainer is not under torchrun."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                **({"device_id": device} if device.type == "cuda" else {}))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def _causal_mask(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
    """megatron's boolean mask `[b, 1, s, s]`, True = may NOT attend, from the HF-style inputs.

    - 4-D additive mask (packed rows on old transformers): masked where negative;
    - 2-D padding mask `[b, s]` (1 = real token): causal over real keys;
    - position ids restarting at 0 (packed rows): causal within each sequence.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask < 0
    b, s = input_ids.shape
    allowed = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()[None].expand(b, s, s)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    elif position_ids is not None:
        seg = (position_ids == 0).cumsum(-1)
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])
    return ~allowed[:, None]


class MegatronCausalLM(torch.nn.Module):
    """megatron-core GPTModel with the slice of the HF causal-LM interface the trainer uses."""

    def __init__(self, gpt: torch.nn.Module, hf_config: Any, arch: Arch) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = hf_config
        self.arch = arch

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False, **_: Any) -> _Output:
        mask = _causal_mask(input_ids, position_ids, attention_mask)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        return _Output(self.gpt(input_ids, pos, mask))  # [b, s, vocab]

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.gpt.embedding.word_embeddings

    def hf_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight under its HF name, read from the live parameters (detached; q/k/v and gate/up
        split out of the fused tensors, copies where a split is not contiguous); a tied head appears once."""
        live = {k: v for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        return list(mcore_to_hf(live, self.arch).items())

    def save_pretrained(self, path: str | os.PathLike, state_dict: Any = None, safe_serialization: bool = True,
                        **_: Any) -> None:
        """An HF folder (config.json + model.safetensors) of the live weights; `state_dict` is ignored (one rank)."""
        from safetensors.torch import save_file

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.hf_named_tensors()}
        save_file(tensors, str(p / "model.safetensors"), metadata={"format": "pt"})
        self.config.save_pretrained(p)
        (p / "rlstream_backend.json").write_text(json.dumps({"backend": "megatron", "saved_from": "megatron-core"}))


def build_megatron_lm(hf_model: torch.nn.Module, dtype: torch.dtype) -> MegatronCausalLM:
    """A megatron GPTModel (local spec, built on CPU) holding `hf_model`'s weights; needs `init_model_parallel` first."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = arch_from_hf(hf_model.config)
    cfg = TransformerConfig(**transformer_config_kwargs(arch, dtype, cpu_init=True))
    # Norm weights are created in fp32 whatever params_dtype says; megatron's Float16Module casts
    # the whole module, as does this (HF's bf16 models keep bf16 norms too).
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), **gpt_model_kwargs(arch)).to(dtype)
    sd = {k: v.to(dtype) for k, v in hf_to_mcore(hf_model.state_dict(), arch).items()}
    gpt.load_state_dict(sd, strict=True)
    return MegatronCausalLM(gpt, hf_model.config, arch)


def load_megatron_lm(path: str, actor: ActorConfig, device: torch.device, *, key: str = "actor.path",
                     trainable: bool = True, init_from_scratch: bool = False, seed: int = 1) -> MegatronCausalLM:
    """The trainer's entry: HF folder -> megatron GPTModel on `device` in `actor.dtype`."""
    from rlstream.trainer.model import DTYPES, load_causal_lm

    if device.type != "cuda":
        raise ConfigError(f"actor.backend=megatron needs a CUDA device (megatron-core's forward hard-codes CUDA); "
                          f"actor.device resolved to {device.type!r}")
    check_megatron_config(actor)
    m = actor.megatron
    init_model_parallel(device, m.tensor_parallel, m.pipeline_parallel, m.context_parallel, seed)
    hf = load_causal_lm(path, actor, key=key, trainable=False, init_from_scratch=init_from_scratch, seed=seed)
    model = build_megatron_lm(hf, DTYPES[actor.dtype]).to(device)
    del hf
    if trainable:
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    return model
