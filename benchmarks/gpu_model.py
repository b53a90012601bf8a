"""The GPU benchmarks' model: a Llama with SmolLM2-135M's shape at random init, and the FLOPs a step does on it."""

from __future__ import annotations

from pathlib import Path

import torch

SMOL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=100000.0, tie_word_embeddings=True)
H100_SXM_BF16_DENSE = 989.4e12  # datasheet, dense (no sparsity)


def build_smol_shaped(path: Path, shape: dict = SMOL_SHAPE) -> Path:
    """A random-init Llama with SmolLM2-135M's shape plus a WordLevel tokenizer over the same vocabulary."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"t{i}" for i in range(len(specials), shape["vocab_size"])])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    cfg = LlamaConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def step_flops(hf_config, batch, n_matmul_params: int, passes: float) -> float:
    """FLOPs of `passes` forward-equivalents over the batch's real tokens (2·N per token + causal attention)."""
    L = hf_config.num_hidden_layers
    d_attn = hf_config.num_attention_heads * (getattr(hf_config, "head_dim", None)
                                             or hf_config.hidden_size // hf_config.num_attention_heads)
    lens = batch.seq_lens.double()
    attn = float((4 * d_attn * L * lens * (lens + 1) / 2).sum())  # QK^T and AV over the causal prefix
    return passes * (2 * n_matmul_params * batch.n_tokens + attn)


def matmul_params(module) -> int:
    """Weights of matrix products per token: every 2-D weight but the input embedding, plus the LM head."""
    n = sum(p.numel() for name, p in module.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    if getattr(module.config, "tie_word_embeddings", False):
        n += module.config.vocab_size * module.config.hidden_size
    return n
