"""The policy and reference models: HF causal LMs from a local folder (never downloaded).

`load_model` is the one place the model backend is chosen (`actor.backend`): `hf` (a
transformers model, wrapped in DDP/FSDP2 by `trainer.parallel`) or `megatron` (a
megatron-core GPTModel behind the same call, `trainer/megatron/`; EXPERIMENTAL).

`path` may also be a prepared model's name or a hub id already in the local HF cache
(`common/models.resolve_model_path`). Tied input/output embeddings (SmolLM2, Qwen2.5,
Llama-3.2) stay tied: one parameter, trained and pushed once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlstream.common.config import ActorConfig, ConfigError, LoRAConfig
from rlstream.common.models import check_model_folder, resolve_model_path
from rlstream.common.vision import is_vision_config

__all__ = ["DTYPES", "check_model_path", "load_causal_lm", "load_model", "disable_dropout", "apply_lora", "is_lora",
           "apply_trainable_map"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(path: str, key: str) -> Path:
    """A local HF model folder, or a one-line error naming the config key."""
    if not path:
        raise ConfigError(f"{key} is empty: set it to a local HF model folder")
    return check_model_folder(resolve_model_path(path, key), key, weights=False)


def load_causal_lm(path: str, actor: ActorConfig, *, key: str = "actor.path", trainable: bool = True,
                   init_from_scratch: bool = False, seed: int = 1) -> torch.nn.Module:
    """Load (or randomly initialise from its config) a causal LM, or a vision-language model of the Qwen2-VL
    family, on CPU in `actor.dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    import transformers

    p = check_model_path(path, key)
    if not init_from_scratch:
        check_model_folder(p, key, weights=True)
    dtype = DTYPES[actor.dtype]
    # transformers 4.56 renamed `torch_dtype` to `dtype`.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dkw = {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}
    config = AutoConfig.from_pretrained(p, local_files_only=True)
    # A vision-language model takes its images with the batch (trainer/vision.py).
    model_class = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    if init_from_scratch:
        # Same seed on every rank: identical initial weights without a broadcast.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = model_class.from_config(config, **dkw)
    else:
        model = model_class.from_pretrained(p, local_files_only=True, **dkw)
    if actor.disable_dropout:
        disable_dropout(model)
    if trainable and actor.lora is not None:
        model = apply_lora(model, actor.lora, seed=seed)
    if trainable and actor.trainable_map:
        apply_trainable_map(model, actor.trainable_map)
    if trainable:
        if actor.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of the model to 0 (AReaL's actor.disable_dropout): nn.Dropout modules, and the
    attention dropout HF attention modules read from an attribute at each call, and the config."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    cfg = getattr(model, "config", None)
    for name in list(vars(cfg)) if cfg is not None else []:
        if "dropout" in name and isinstance(getattr(cfg, name), float):
            setattr(cfg, name, 0.0)


def load_model(path: str, actor: ActorConfig, device: torch.device, *, key: str = "actor.path",
               trainable: bool = True, init_from_scratch: bool = False, seed: int = 1,
               pipeline: Any = None) -> torch.nn.Module:
    """The policy (or reference) model of `actor.backend` on `device`; with a `pipeline`
    (trainer/pipeline_parallel.py) only this rank's stage of it moves there."""
    if actor.backend == "megatron":
        from rlstream.trainer.megatron.backend import load_megatron_lm

        return load_megatron_lm(path, actor, device, key=key, trainable=trainable,
                                init_from_scratch=init_from_scratch, seed=seed)
    model = load_causal_lm(path, actor, key=key, trainable=trainable, init_from_scratch=init_from_scratch, seed=seed)
    if pipeline is not None:
        pipeline.split(model)
    return model.to(device)


def is_lora(model: torch.nn.Module) -> bool:
    """A peft model (maybe inside a DDP wrapper): only its adapter trains and is pushed."""
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


def apply_lora(model: torch.nn.Module, lora: LoRAConfig, *, key: str = "actor.lora",
               task_type: str = "CAUSAL_LM", seed: int = 1) -> torch.nn.Module:
    """Wrap `model` with a peft LoRA adapter: only the adapter's A/B matrices require grad, and the modules of
    `modules_to_save` (and, for peft's TOKEN_CLS task of a value model, the scalar head), which peft trains in full.

    A target, a modules_to_save name or a rank/alpha pattern that matches no module is a ConfigError
    naming the ones there are (peft matches a name against the end of each module's dotted path). The A matrices'
    random init draws from `seed`: the same on every rank (FSDP2 keeps each rank's shard of it, broadcasting none).
    """
    from peft import LoraConfig, get_peft_model

    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
    targets = list(lora.target_modules)
    if not targets:
        raise ConfigError(f"{key}.target_modules is empty; linear modules of this model: {', '.join(leaves)}")
    if targets != ["all-linear"]:
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
        if missing:
            raise ConfigError(f"{key}.target_modules {missing} match no module of the model; its linear "
                              f"modules are: {', '.join(leaves)} (or use 'all-linear')")
    _check_lora_extras(model, lora, key, linear)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_rslora=lora.use_rslora,
                        target_modules=targets[0] if targets == ["all-linear"] else targets, bias="none",
                        task_type=task_type, rank_pattern=dict(lora.rank_pattern),
                        alpha_pattern=dict(lora.alpha_pattern), modules_to_save=list(lora.modules_to_save) or None,
                        init_lora_weights=lora.init_lora_weights)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def _check_lora_extras(model: torch.nn.Module, lora: LoRAConfig, key: str, linear: list[str]) -> None:
    """Patterns are regexes peft matches as `(.*\\.)?(pattern)$` against module paths (peft's get_pattern_key);
    modules_to_save names match the end of a path, and may not be one half of tied embeddings (the engines' copy
    is tied, so training one half there would move the other)."""
    import re

    for field in ("rank_pattern", "alpha_pattern"):
        for pattern in getattr(lora, field):
            try:
                rx = re.compile(rf"(.*\.)?({pattern})$")
            except re.error as exc:
                raise ConfigError(f"{key}.{field}: {pattern!r} is not a regular expression ({exc})") from None
            if not any(rx.match(n) for n in linear):
                raise ConfigError(f"{key}.{field}: {pattern!r} matches no linear module of the model (e.g. "
                                  f"{', '.join(linear[:3])})")
    modules = [n for n, _ in model.named_modules() if n]
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    embeddings = {id(model.get_input_embeddings()), id(model.get_output_embeddings())} if tied else set()
    by_name = dict(model.named_modules())
    for name in lora.modules_to_save:
        found = [n for n in modules if n == name or n.endswith("." + name)]
        if not found:
            raise ConfigError(f"{key}.modules_to_save: {name!r} matches no module of the model (e.g. "
                              f"{', '.join(n for n in modules if '.' not in n)})")
        if any(id(by_name[n]) in embeddings for n in found):
            raise ConfigError(f"{key}.modules_to_save: {name!r} is one of the model's tied input/output embeddings; "
                              "train it with full fine-tuning (actor.lora unset) or untie it in the model folder")


def apply_trainable_map(model: torch.nn.Module, trainable_map: dict[str, bool], *,
                        key: str = "actor.trainable_map") -> None:
    """cosmos-rl's `apply_trainable` (cosmos_rl/policy/model/base.py): in the map's order, each name (a parameter's,
    or a module's path: all its parameters) gets requires_grad = its flag; the optimizer then skips the frozen ones.
    A name that is neither is a ConfigError naming a few there are."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    modules.pop("", None)
    for name, flag in trainable_map.items():
        if name in params:
            params[name].requires_grad_(flag)
        elif name in modules:
            modules[name].requires_grad_(flag)
        else:
            close = sorted(n for n in modules if n.split(".")[-1] == name.split(".")[-1])[:5] or sorted(modules)[:5]
            raise ConfigError(f"{key}: {name!r} is neither a parameter nor a module of the model "
                              f"(e.g. {', '.join(close)})")
