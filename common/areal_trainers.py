"""AReaL's supervised and reward-model experiment files -> `rlstream sft` / `rlstream rw` configs.

AReaL trains SFT and reward models with the same experiment shape as RL, minus the rollout: the trained
model is `model` (SFT, examples/math/gsm8k_sft.yaml) or `actor` with `is_critic: true` (RW,
examples/alignment/hhrlhf_rw.yaml), and `train_dataset.type` says which (`sft` or `rw`). In rlstream the
supervised run is the warm start of `actor.path` (`launcher.sft_*`, `rlstream sft`) and the reward model is
`rlstream rw` (`rw.*`, a Bradley–Terry scalar head like AReaL's RW trainer). Every key read is recorded in the
Translation (common/areal.py) as same, translated or dropped with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from rlstream.common.areal_sections import SCHEMA_KEYS, leaves
from rlstream.common.config import ConfigError

if TYPE_CHECKING:
    from rlstream.common.areal import Translation

__all__ = ["experiment_kind", "translate_sft_rw"]

Kind = Literal["sft", "rw"]
_OPTIMIZER_FIELDS = {k.removeprefix("actor.optimizer.") for k in SCHEMA_KEYS if k.startswith("actor.optimizer.")}
# Keys of the trained model's section each command decides itself, with the reason.
_MODEL_DROPPED = {
    "experiment_name": "rlstream reads experiment_name once, at the top level",
    "trial_name": "rlstream reads trial_name once, at the top level",
    "fileroot": "cluster.fileroot is the one file root",
    "attn_impl": "transformers' SDPA attention (torch picks the flash kernel on GPU)",
    "pad_to_maximum": "sequences are padded to the batch's longest (padding only shapes GPU memory)",
    "mb_spec": "each step is one forward over the step's sequences (no micro-batches)",
    "backend": "one process with transformers (no FSDP/Megatron sharding)",
    "grad_reduce_dtype": "one process: gradients are never reduced across ranks",
    "weight_update_mode": "the model is written to disk at the end; no engine receives weights",
    "scheduling_spec": "the command runs where it is started",
    "scheduling_strategy": "the command runs where it is started",
}
_LORA_KEYS = ("lora_rank", "lora_alpha", "target_modules", "peft_type")
# Sections of a long training run that a one-shot command does not have.
_RUN_SECTIONS = {
    "saver": "rlstream {kind} writes the model once, at the end (with its marker file)",
    "recover": "rlstream {kind} is one short process: rerun it (a finished one is a no-op by its marker file)",
    "evaluator": "rlstream {kind} evaluates once, at the end (sft: the RL run's evaluator; rw: held-out pair accuracy)",
    "stats_logger": "rlstream {kind} logs its loss to the console",
}
_RW_ONLY_DROPPED = {
    "dtype": "rlstream rw trains in float32 (a small scalar-head model)",
    "disable_dropout": "rlstream rw trains the model as loaded (its own dropout settings)",
    "gradient_checkpointing": "rlstream rw keeps the activations (a small scalar-head model)",
}


def experiment_kind(data: dict[str, Any]) -> Kind | None:
    """`sft` or `rw` for AReaL's supervised / reward-model experiment files, None for an RL one."""
    kind = (data.get("train_dataset") or {}).get("type") if isinstance(data.get("train_dataset"), dict) else None
    if kind in ("sft", "rw"):
        return kind
    model = data.get("model")
    if isinstance(model, dict):
        return "rw" if model.get("is_critic") else "sft"
    actor = data.get("actor")
    if isinstance(actor, dict) and actor.get("is_critic") and "train_dataset" in data and not data.keys() & {"rollout", "gconfig"}:
        return "rw"
    return None


def translate_sft_rw(t: Translation, data: dict[str, Any], kind: Kind, handled: set[str]) -> None:
    """The trained model's section and the dataset keys of an SFT/RW file; the rest is read as for RL."""
    section = "model" if isinstance(data.get("model"), dict) else "actor"
    model = data.get(section) or {}
    handled.add(section)
    t.notes.append(f"an AReaL {kind.upper()} experiment: run it with `rlstream {kind} --config <this file>`"
                   + (" (the warm start trains actor.path in place)" if kind == "sft" else ""))
    for key, value in leaves(model):
        if key:
            _model_key(t, f"{section}.{key}", key, value, kind, bool(model.get("use_lora")))
    opt = model.get("optimizer")
    if isinstance(opt, dict) and "weight_decay" not in opt:
        t.add(f"{'launcher.sft_optimizer' if kind == 'sft' else 'rw.optimizer'}.weight_decay", 0.01,
              "AReaL's default (rlstream's: 0)")
    if "allocation_mode" in data:
        t.dropped.append(("allocation_mode", f"rlstream {kind} trains in one process: no engines, no trainer ranks"))
    _datasets(t, data, kind, handled)
    _step_budget(t, data, kind, handled)
    for name, why in _RUN_SECTIONS.items():
        if isinstance(data.get(name), dict):
            handled.add(name)
            t.dropped += [(f"{name}.{k}", why.format(kind=kind)) for k, _ in leaves(data[name])]


def _model_key(t: Translation, src: str, key: str, value: Any, kind: Kind, use_lora: bool) -> None:
    optimizer = "launcher.sft_optimizer" if kind == "sft" else "rw.optimizer"
    if key == "use_lora" or (key in _LORA_KEYS and not use_lora):
        if use_lora:
            raise ConfigError(f"{src}=true: rlstream {kind} trains every weight (no LoRA {kind}); drop use_lora")
        t.dropped.append((src, "false: every weight is trained" if key == "use_lora" else "use_lora is not true"))
    elif key == "path":
        t.translate(src, {"actor.path" if kind == "sft" else "rw.path": value})
    elif key == "is_critic":
        if bool(value) != (kind == "rw"):
            raise ConfigError(f"{src}={value}: an AReaL {kind.upper()} experiment trains "
                              f"{'a scalar-head reward model (is_critic: true)' if kind == 'rw' else 'a causal LM (is_critic: false)'}")
        t.translated.append((src, f"`rlstream {kind}` ({'scalar head' if kind == 'rw' else 'causal LM'})"))
    elif key == "init_from_scratch":
        if value:
            raise ConfigError(f"{src}=true: rlstream {kind} starts from the weights at {src.rsplit('.', 1)[0]}.path")
        t.dropped.append((src, "false: the weights are loaded from path"))
    elif key.startswith("optimizer.") and key.removeprefix("optimizer.") in _OPTIMIZER_FIELDS:
        t.translate(src, {f"{optimizer}.{key.removeprefix('optimizer.')}": value})
    elif key.startswith("fsdp.") and kind == "sft":
        t.translate(src, {f"launcher.sft_fsdp.{key.removeprefix('fsdp.')}": value},
                    "the warm start's FSDP2 settings: one process, so checked against the model, nothing sharded")
    elif key.startswith("fsdp.") and kind == "rw":
        t.dropped.append((src, "rlstream rw trains in one process: no FSDP sharding"))
    elif kind == "sft" and key in ("dtype", "disable_dropout", "gradient_checkpointing"):
        t.translate(src, {f"actor.{key}": value}, "the warm start and the RL run after it train actor.path")
    elif kind == "rw" and key in _RW_ONLY_DROPPED:
        t.dropped.append((src, _RW_ONLY_DROPPED[key]))
    elif why := next((w for k, w in _MODEL_DROPPED.items() if key == k or key.startswith(k + ".")), None):
        t.dropped.append((src, why))
    else:
        t.dropped.append((src, "no rlstream key of that name or meaning"))


def _datasets(t: Translation, data: dict[str, Any], kind: Kind, handled: set[str]) -> None:
    train = data.get("train_dataset") if isinstance(data.get("train_dataset"), dict) else {}
    batch = "launcher.sft_batch_size" if kind == "sft" else "rw.batch_size"
    for key, value in train.items():
        src = f"train_dataset.{key}"
        if key == "type":
            t.translated.append((src, f"`rlstream {kind}`"))
        elif key == "batch_size":
            t.translate(src, {batch: value}, "sequences a step" if kind == "sft" else "pairs a step")
        elif key == "path" and kind == "rw":
            t.translate(src, {"rw.dataset": value}, "a JSONL of {prompt, chosen, rejected} pairs")
            if not str(value).endswith(".jsonl"):
                t.notes.append(f"rw.dataset {value!r}: rlstream rw reads a JSONL of {{prompt, chosen, rejected}} "
                               "pairs; write the dataset's pairs to one")
        elif key == "max_length" and kind == "rw" and value:
            t.translate(src, {"rw.max_seq_len": value})
        else:
            continue  # read as in an RL file (train_dataset.path, shuffle, ...)
        handled.add(src)
    if isinstance(data.get("valid_dataset"), dict):
        handled.add("valid_dataset")
        why = ("rlstream rw holds out rw.valid_fraction of rw.dataset instead" if kind == "rw" else
               "rlstream sft logs the training loss; the RL run after it evaluates on valid_dataset")
        t.dropped += [(f"valid_dataset.{k}", why) for k, _ in leaves(data["valid_dataset"])]


def _step_budget(t: Translation, data: dict[str, Any], kind: Kind, handled: set[str]) -> None:
    """total_train_steps -> the command's steps; total_train_epochs -> its epochs (steps win, as in AReaL)."""
    steps_key, epochs_key = ("launcher.sft_steps", "launcher.sft_epochs") if kind == "sft" else ("rw.steps", "rw.epochs")
    steps, epochs = data.get("total_train_steps"), data.get("total_train_epochs")
    handled.update(k for k in ("total_train_steps", "total_train_epochs") if k in data)
    if steps:
        t.translate("total_train_steps", {steps_key: steps})
    elif "total_train_steps" in data:
        t.dropped.append(("total_train_steps", "null: total_train_epochs decides"))
    if epochs and not steps:
        t.translate("total_train_epochs", {epochs_key: epochs}, "ceil(epochs x rows / batch size) steps")
    elif "total_train_epochs" in data:
        t.dropped.append(("total_train_epochs", "total_train_steps decides" if steps else "0: no epochs"))
