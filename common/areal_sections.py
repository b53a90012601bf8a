"""Translators of single AReaL sections and keys for `common/areal.py`: the critic, name resolve, weight
update mode, asynchronous training, the reference model's temperature, and notes for hub names.

Each takes the `Translation` being built (common/areal.py) and records every key it reads in exactly one of
its lists (same, translated, dropped), or raises ConfigError for a value rlstream cannot honour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlstream.common.config import ConfigError, field_docs

if TYPE_CHECKING:
    from rlstream.common.areal import Translation

__all__ = ["SCHEMA_KEYS", "leaves", "hub_like", "note_hub_names", "translate_critic", "translate_async_training",
           "translate_ref_temperature", "translate_name_resolve", "translate_weight_update_mode"]


def leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        out = []
        for k, v in data.items():
            out += leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, data)]


SCHEMA_KEYS = {key for key, _, _ in field_docs()}

# critic.* keys (AReaL's PPOCriticConfig) rlstream decides elsewhere, with the reason; the rest of the
# engine keys (fsdp.*, attn_impl ...) are dropped by the fallback reason in translate_critic.
CRITIC_DROPPED = {
    "backend": "the critic runs in the trainer process, with the actor's backend",
    "dtype": "the critic uses actor.dtype",
    "disable_dropout": "the critic follows actor.disable_dropout",
    "gradient_checkpointing": "the critic follows actor.gradient_checkpointing",
    "mask_no_eos_with_zero": "the critic trains on the actor's loss mask (actor.mask_no_eos_with_zero)",
    "weight_update_mode": "the critic's weights are never pushed to engines",
    "scheduling_strategy": "the critic lives in the trainer process, colocated with the actor",
    "scheduling_spec": "the critic lives in the trainer process, colocated with the actor",
    "mb_spec.packing_algorithm": "micro-batches are balanced by rlstream's own splitter (trainer/microbatch.py)",
    "peft_type": "LoRA is the one adapter type (critic.lora)",
    "experiment_name": "rlstream reads experiment_name once, at the top level",
    "trial_name": "rlstream reads trial_name once, at the top level",
    "fileroot": "cluster.fileroot is the one file root",
}


def translate_critic(t: Translation, data: dict[str, Any], handled: set[str]) -> None:
    """AReaL's `critic` section (PPOCriticConfig) -> rlstream's `critic` section: the value model of PPO."""
    critic = data.get("critic")
    if not isinstance(critic, dict):
        return
    t.set("critic", {})
    lora = {"lora_rank": "rank", "lora_alpha": "alpha", "target_modules": "target_modules"}
    use_lora = bool(critic.get("use_lora"))
    for key, value in leaves(critic):
        src = f"critic.{key}"
        handled.add(src)
        if key == "is_critic":
            t.translated.append((src, "a critic section (the value model: backbone + scalar head)") if value
                                else (src, "ignored: a critic section always holds a value model"))
        elif key == "use_lora":
            t.translated.append((src, "critic.lora (from lora_rank, lora_alpha, target_modules)" if value
                                 else "critic.lora: null (full fine-tuning)"))
        elif key in lora:
            if use_lora:
                t.set(f"critic.lora.{lora[key]}", value)
                t.translated.append((src, f"critic.lora.{lora[key]}"))
            else:
                t.dropped.append((src, "critic.use_lora is false"))
        elif key == "path" and not value:
            t.translated.append((src, "critic.path: null (actor.path)"))
        elif src in SCHEMA_KEYS and not isinstance(value, dict):
            t.set(src, value)
            t.same.append(src)
        elif why := next((w for k, w in CRITIC_DROPPED.items() if key == k or key.startswith(k + ".")), None):
            t.dropped.append((src, why))
        else:
            t.dropped.append((src, "an engine setting of AReaL's critic without rlstream equivalent"))
    if hub_like(critic.get("path")):
        t.notes.append(f"critic.path {critic['path']!r} is a hub id: rlstream resolves it offline from the local HF "
                       "cache (or a folder from `rlstream model get`), never downloads it")
    if use_lora and "target_modules" not in critic:
        t.notes.append("critic.use_lora without target_modules: critic.lora.target_modules keeps rlstream's default")


def translate_async_training(t: Translation, data: dict[str, Any], key: str, value: Any) -> None:
    """Synchronous training is the asynchronous loop with no staleness: each step's groups from the current weights."""
    if value is not False:
        t.dropped.append((key, "rlstream is asynchronous; rollout.max_head_offpolicyness bounds how far"))
        return
    eta = (data.get("rollout") or {}).get("max_head_offpolicyness")
    if eta not in (None, 0):
        raise ConfigError(f"async_training=false with rollout.max_head_offpolicyness={eta}: synchronous training is "
                          "max_head_offpolicyness=0; drop one of the two")
    t.translate(key, {"rollout.max_head_offpolicyness": 0}, "synchronous: every group from the current weights")


def translate_ref_temperature(t: Translation, data: dict[str, Any], key: str, value: Any) -> None:
    """rlstream computes the reference logprobs at actor.temperature, as it computes the policy's."""
    actor_t = (data.get("actor") or {}).get("temperature", 1.0)
    if value is None or float(value) == float(actor_t if actor_t is not None else 1.0):
        t.dropped.append((key, "the reference logprobs use actor.temperature (the same value)"))
        return
    raise ConfigError(f"ref.temperature={value} differs from actor.temperature={actor_t}: rlstream computes the "
                      "reference logprobs at actor.temperature; set both equal")


def translate_name_resolve(t: Translation, data: dict[str, Any], key: str, value: Any) -> None:
    kind = {"nfs": "redis", "ray": "redis", "etcd3": "etcd", "etcd": "etcd"}.get(str(value))
    if kind is None:
        t.dropped.append((key, f"{value!r}: rlstream resolves names with redis, etcd or static"))
        return
    why = "engines register in the run's Redis, which every process reaches" if kind == "redis" else "etcd v3"
    t.translate(key, {key: kind}, why)
    addr = ((data.get("cluster") or {}).get("name_resolve") or {}).get("etcd3_addr")
    if kind == "etcd" and addr:
        t.translate("cluster.name_resolve.etcd3_addr", {"cluster.name_resolve.etcd_address": addr})


def translate_weight_update_mode(t: Translation, key: str, value: Any) -> None:
    mode = {"xccl": ("distributed", "nccl"), "nccl": ("distributed", "nccl"), "disk": ("disk", None)}.get(str(value))
    if mode is None:
        t.dropped.append((key, f"{value!r}: rlstream pushes weights by distributed, disk or ipc"))
        return
    t.translate(key, {key: mode[0]} | ({"actor.weight_update_backend": mode[1]} if mode[1] else {}))


def note_hub_names(t: Translation, data: dict[str, Any], actor: dict[str, Any]) -> None:
    """Notes for paths that look like hub names: rlstream reads them from the local HF caches, never downloads."""
    for section in ("train_dataset", "valid_dataset"):
        path = (data.get(section) or {}).get("path") if isinstance(data.get(section), dict) else None
        if hub_like(path):
            t.notes.append(f"{section}.path {path!r} is a hub name: rlstream reads it from the local HF datasets cache "
                           "(never downloads; set {section}.subset/split as needed)".replace("{section}", section))
    if hub_like(actor.get("path")):
        t.notes.append(f"actor.path {actor['path']!r} is a hub id: rlstream resolves it offline from the local HF cache "
                       "(or a folder from `rlstream model get`), never downloads it")


def hub_like(path: Any) -> bool:
    return isinstance(path, str) and path.count("/") == 1 and not path.startswith((".", "/", "~")) \
        and "." not in path.split("/")[-1][-8:]
