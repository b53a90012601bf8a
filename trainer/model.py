"""The policy and reference models: HF causal LMs from a local folder (never downloaded).

`path` may also be a prepared model's name or a hub id already in the local HF cache
(`common/models.resolve_model_path`). Tied input/output embeddings (SmolLM2, Qwen2.5,
Llama-3.2) stay tied: one parameter, trained and pushed once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlstream.common.config import ActorConfig, ConfigError
from rlstream.common.models import check_model_folder, resolve_model_path

__all__ = ["DTYPES", "check_model_path", "load_causal_lm"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(path: str, key: str) -> Path:
    """A local HF model folder, or a one-line error naming the config key."""
    if not path:
        raise ConfigError(f"{key} is empty: set it to a local HF model folder")
    return check_model_folder(resolve_model_path(path, key), key, weights=False)


def load_causal_lm(path: str, actor: ActorConfig, *, key: str = "actor.path", trainable: bool = True,
                   init_from_scratch: bool = False, seed: int = 1) -> torch.nn.Module:
    """Load (or randomly initialise from its config) a causal LM on CPU in `actor.dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import transformers

    p = check_model_path(path, key)
    if not init_from_scratch:
        check_model_folder(p, key, weights=True)
    dtype = DTYPES[actor.dtype]
    # transformers 4.56 renamed `torch_dtype` to `dtype`.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dkw = {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}
    if init_from_scratch:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        # Same seed on every rank: identical initial weights without a broadcast.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, **dkw)
    else:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, **dkw)
    if trainable:
        if actor.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    return model
