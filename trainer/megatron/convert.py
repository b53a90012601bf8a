"""HF Llama / Qwen2 <-> megatron-core GPTModel: config and state-dict conversion.

Pure tensor bookkeeping (no megatron import), so it is tested on CPU against
megatron-core's real module structure (tests/trainer/test_megatron_convert.py).

Layouts (megatron-core 0.16, `megatron/core/transformer/attention.py` and `mlp.py`):

- `self_attention.linear_qkv` fuses q, k and v *per query group*: its output rows are
  `[q_g (heads_per_group * head_dim), k_g (head_dim), v_g (head_dim)]` for g = 0..groups-1,
  the layout `SelfAttention.get_query_key_value_tensors` splits again. A tensor-parallel
  rank holds a contiguous run of whole groups.
- `mlp.linear_fc1` fuses gate and up as `[gate; up]` (megatron's GLU chunks the output
  in two and applies the activation to the first half). A tensor-parallel rank holds
  `[gate_r; up_r]`, so gate and up are sharded separately.
- Norms: the local (non-TransformerEngine) spec has `input_layernorm` and
  `pre_mlp_layernorm` modules; the TransformerEngine spec fuses them into the next
  linear as `linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`.
- Tied embeddings: `output_layer.weight` is absent (`share_embeddings_and_output_weights`),
  as `lm_head.weight` is in HF when `tie_word_embeddings`.

Tensor parallelism: column-parallel weights (qkv, fc1, vocab embedding and output
layer) split rows, row-parallel weights (linear_proj, linear_fc2) split columns, norms
are replicated. `shard_tp` / `merge_tp` move between the merged (TP=1) state dict and
one rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Arch", "arch_from_hf", "transformer_config_kwargs", "gpt_model_kwargs", "hf_to_mcore", "mcore_to_hf",
           "shard_tp", "merge_tp", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
Spec = Literal["local", "te"]


@dataclass(frozen=True)
class Arch:
    """The architecture numbers both sides agree on."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope(hf: Any) -> tuple[float, str]:
    """(theta, rope type) from a transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`) config."""
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if theta is None:
        raise ValueError("the HF config names no rope_theta")
    return float(theta), str(rope_type)


def arch_from_hf(hf: Any) -> Arch:
    """An `Arch` from an HF `PretrainedConfig`; a clear error for what the converter does not cover."""
    mt = getattr(hf, "model_type", "")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"megatron conversion supports model_type {SUPPORTED_MODEL_TYPES}, got {mt!r}")
    theta, rope_type = _rope(hf)
    if rope_type != "default":
        raise ValueError(f"megatron conversion supports plain RoPE only, got rope type {rope_type!r}")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("megatron conversion does not cover mlp_bias=true")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("megatron conversion does not cover sliding-window attention")
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    qkv_bias = True if mt == "qwen2" else bool(getattr(hf, "attention_bias", False))
    return Arch(model_type=mt, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=heads,
                num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=float(hf.rms_norm_eps),
                rope_theta=theta, tied=bool(getattr(hf, "tie_word_embeddings", False)), qkv_bias=qkv_bias)


def transformer_config_kwargs(arch: Arch, params_dtype: torch.dtype = torch.float32, *, tp: int = 1, pp: int = 1,
                              cp: int = 1, cpu_init: bool = False) -> dict[str, Any]:
    """Keyword arguments for `megatron.core.transformer.TransformerConfig` matching the HF model's math."""
    return dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        # No fused kernels that need apex / TransformerEngine; fp32 softmax like HF's eager/SDPA paths.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        use_cpu_initialization=cpu_init,
    )


def gpt_model_kwargs(arch: Arch) -> dict[str, Any]:
    """Keyword arguments for `megatron.core.models.gpt.GPTModel` besides config and layer spec."""
    return dict(vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                share_embeddings_and_output_weights=arch.tied, position_embedding_type="rope",
                rotary_percent=1.0, rotary_base=arch.rope_theta)


# ---------------------------------------------------------------------- names


def _norm_names(spec: Spec, i: int) -> tuple[str, str]:
    p = f"decoder.layers.{i}."
    if spec == "te":
        return p + "self_attention.linear_qkv.layer_norm_weight", p + "mlp.linear_fc1.layer_norm_weight"
    if spec == "local":
        return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"
    raise ValueError(f"spec must be 'local' or 'te', got {spec!r}")


def _fuse_qkv(a: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = a.num_kv_heads, a.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(g, a.heads_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(g * (a.heads_per_group + 2) * d, *tail)


def _split_qkv(a: Arch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = a.num_kv_heads, a.head_dim
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (a.heads_per_group + 2) * d, *tail).split([a.heads_per_group * d, d, d], dim=1)
    return (q.reshape(a.num_heads * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail))


def hf_to_mcore(hf_sd: dict[str, torch.Tensor], arch: Arch, spec: Spec = "local") -> dict[str, torch.Tensor]:
    """The merged (TP=1) megatron state dict of an HF Llama/Qwen2 state dict (new tensors; inputs untouched)."""
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"]}
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        ln_attn, ln_mlp = _norm_names(spec, i)
        out[ln_attn] = hf_sd[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            arch, *(hf_sd[h + f"self_attn.{x}_proj.weight"] for x in "qkv"))
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                arch, *(hf_sd[h + f"self_attn.{x}_proj.bias"] for x in "qkv"))
        out[m + "self_attention.linear_proj.weight"] = hf_sd[h + "self_attn.o_proj.weight"]
        out[ln_mlp] = hf_sd[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf_sd[h + "mlp.gate_proj.weight"],
                                                      hf_sd[h + "mlp.up_proj.weight"]], dim=0)
        out[m + "mlp.linear_fc2.weight"] = hf_sd[h + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
    if not arch.tied:
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    return {k: v.clone() for k, v in out.items()}


def mcore_to_hf(mc_sd: dict[str, torch.Tensor], arch: Arch, spec: Spec = "local", *,
                with_tied_head: bool = False) -> dict[str, torch.Tensor]:
    """HF names of a merged megatron state dict; tensors are views of the inputs where possible.

    `with_tied_head` also lists `lm_head.weight` (the embedding) for a tied model, as
    engines that load every name may want; HF's own state dict has it too.
    """
    out = {"model.embed_tokens.weight": mc_sd["embedding.word_embeddings.weight"]}
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        ln_attn, ln_mlp = _norm_names(spec, i)
        out[h + "input_layernorm.weight"] = mc_sd[ln_attn]
        for x, t in zip("qkv", _split_qkv(arch, mc_sd[m + "self_attention.linear_qkv.weight"])):
            out[h + f"self_attn.{x}_proj.weight"] = t
        if arch.qkv_bias:
            for x, t in zip("qkv", _split_qkv(arch, mc_sd[m + "self_attention.linear_qkv.bias"])):
                out[h + f"self_attn.{x}_proj.bias"] = t
        out[h + "self_attn.o_proj.weight"] = mc_sd[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = mc_sd[ln_mlp]
        gate, up = mc_sd[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = mc_sd[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mc_sd["decoder.final_layernorm.weight"]
    if not arch.tied:
        out["lm_head.weight"] = mc_sd["output_layer.weight"]
    elif with_tied_head:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---------------------------------------------------------------------- tensor parallelism

_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "embedding.word_embeddings.weight",
           "output_layer.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_GLU = "mlp.linear_fc1.weight"


def _check_tp(arch: Arch, tp: int) -> None:
    for what, n in (("num_key_value_heads", arch.num_kv_heads), ("intermediate_size", arch.ffn_hidden_size),
                    ("vocab_size", arch.vocab_size), ("num_attention_heads", arch.num_heads)):
        if n % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {what}={n}")


def shard_tp(mc_sd: dict[str, torch.Tensor], arch: Arch, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of a merged megatron state dict under `tp`-way tensor parallelism."""
    _check_tp(arch, tp)
    out = {}
    for k, v in mc_sd.items():
        if k.endswith(_GLU):
            gate, up = v.chunk(2, dim=0)
            out[k] = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
        elif k.endswith(_COLUMN):
            out[k] = v.chunk(tp, dim=0)[rank]
        elif k.endswith(_ROW):
            out[k] = v.chunk(tp, dim=1)[rank]
        else:
            out[k] = v
    return {k: v.clone() for k, v in out.items()}


def merge_tp(shards: list[dict[str, torch.Tensor]], arch: Arch) -> dict[str, torch.Tensor]:
    """The merged state dict of every tensor-parallel rank's share (in rank order)."""
    _check_tp(arch, len(shards))
    out = {}
    for k, v in shards[0].items():
        parts = [s[k] for s in shards]
        if k.endswith(_GLU):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[k] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif k.endswith(_COLUMN):
            out[k] = torch.cat(parts, dim=0)
        elif k.endswith(_ROW):
            out[k] = torch.cat(parts, dim=1)
        else:
            out[k] = v
    return out
