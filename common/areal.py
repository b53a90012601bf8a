"""AReaL experiment files -> rlstream configs (`rlstream config import-areal FILE`).

Every leaf key of the AReaL file ends in exactly one of three lists:

- same: the key exists in rlstream with the same meaning and is copied;
- translated: it becomes other rlstream keys (the allocation strings `rollout.backend:
  sglang:d4p1t1`, `actor.backend: fsdp:d4p1t1` and the older `allocation_mode` -> engines,
  trainer processes, tensor/pipeline sizes; `weight_update_mode: xccl` -> distributed over
  NCCL; name resolve nfs/etcd3/ray -> redis/etcd; `sglang.*`/`vllm.*` of the chosen backend ->
  the engine server's command-line arguments; `use_lora`/`lora_*` -> `actor.lora`;
  `use_sapo_loss` -> `policy_loss: sapo`; the removed `behave_imp_weight_*` keys ->
  `rejection_sampling`; `agent_run_args.max_turns` -> `agent.max_turns`);
- dropped, each with the reason (no rlstream equivalent, or rlstream decides it elsewhere).

A fourth list, added, names the rlstream keys written for AReaL defaults that rlstream does not
share (a decoupled loss without rejection sampling weighs nothing; no advantage normalisation;
LoRA rank/alpha), so the summary names every key the output holds.

Key names follow AReaL's `areal/api/cli_args.py` (inclusionAI/AReaL); the result is validated
against rlstream's schema by the caller (`load_config_dict`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlstream.common.areal_sections import (SCHEMA_KEYS, leaves, note_hub_names, translate_async_training,
                                            translate_critic, translate_name_resolve, translate_ref_temperature,
                                            translate_weight_update_mode)
from rlstream.common.areal_trainers import experiment_kind, translate_sft_rw
from rlstream.common.config import ConfigError

__all__ = ["Translation", "translate_areal", "parse_allocation"]

_ALLOC = re.compile(r"^(?:(?P<backend>[a-z]+)[:.])?d(?P<d>\d+)(?:p(?P<p>\d+))?(?:t(?P<t>\d+))?(?:c(?P<c>\d+))?$")


def parse_allocation(spec: str) -> tuple[str | None, int, int, int]:
    """`sglang:d4p1t1` / `fsdp:d4p1t1` / `d4p1t1` -> (backend, data, pipeline, tensor) parallel sizes."""
    m = _ALLOC.match(spec.strip())
    if not m:
        raise ConfigError(f"cannot read the AReaL allocation {spec!r} (expected e.g. sglang:d4p1t1 or fsdp:d8p1t1)")
    return m["backend"], int(m["d"]), int(m["p"] or 1), int(m["t"] or 1)


@dataclass
class Translation:
    config: dict[str, Any] = field(default_factory=dict)  # nested rlstream config
    same: list[str] = field(default_factory=list)
    translated: list[tuple[str, str]] = field(default_factory=list)  # (AReaL key, the rlstream keys it became)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (AReaL key, reason)
    added: list[tuple[str, str]] = field(default_factory=list)  # (rlstream key=value, why) for AReaL defaults
    notes: list[str] = field(default_factory=list)

    def set(self, dotted: str, value: Any) -> None:
        node = self.config
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def translate(self, src: str, values: dict[str, Any], why: str = "") -> None:
        """AReaL key `src` becomes the rlstream keys `values` (each named in the summary)."""
        for dst, value in values.items():
            self.set(dst, value)
        dst = ", ".join(f"{k}={_show(v)}" for k, v in values.items()) or "nothing"
        self.translated.append((src, dst + (f" ({why})" if why else "")))

    def add(self, dst: str, value: Any, why: str) -> None:
        """An rlstream key no AReaL key of the file names: AReaL's default, where rlstream's differs."""
        self.set(dst, value)
        self.added.append((f"{dst}={_show(value)}", why))

    def summary(self) -> str:
        lines = [f"translated {len(self.translated)}, same {len(self.same)}, dropped {len(self.dropped)} "
                 f"(of {len(self.translated) + len(self.same) + len(self.dropped)} AReaL keys); "
                 f"added {len(self.added)} (AReaL defaults rlstream does not share)"]
        lines += [f"  translated  {src} -> {dst}" for src, dst in self.translated]
        lines += [f"  added       {dst}: {why}" for dst, why in self.added]
        lines += [f"  same        {line}" for line in _wrap(self.same)]
        lines += [f"  dropped     {src}: {why}" for src, why in self.dropped]
        lines += [f"  note        {n}" for n in self.notes]
        return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _wrap(keys: list[str], width: int = 100) -> list[str]:
    lines, line = [], ""
    for k in keys:
        if line and len(line) + len(k) + 2 > width:
            lines.append(line + ",")
            line = ""
        line = f"{line}, {k}" if line else k
    return lines + ([line] if line else [])


# Keys rlstream takes from one place for the whole run (AReaL repeats them per section).
_PER_SECTION = {"experiment_name", "trial_name", "fileroot", "tokenizer_path"}
_SECTIONS_WITH_COPIES = ("actor", "ref", "saver", "recover", "evaluator", "stats_logger", "rollout", "perf_tracer")

# Whole sections or keys dropped, with the reason (longest prefix wins).
_DROPPED = {
    "enable_offload": "rlstream's trainer and engines are separate processes; nothing is offloaded between them",
    "scheduler": "how processes start is the command you run: `rlstream run` (one machine), `rlstream launch slurm`, "
                 "`rlstream launch ray`, docker compose",
    "launcher": "AReaL's launcher ports/CPU settings; rlstream's placement is launcher.* (n_engines, n_producers, slurm.*)",
    "cluster.name_resolve.nfs_record_root": "engines register in the run's Redis (or etcd); no shared folder",
    "cluster.name_resolve.ray_actor_name": "name_resolve type ray becomes redis: engines register in the run's Redis, "
                                           "which every node of `rlstream launch ray` reaches; no Ray KV-store actor",
    "cluster.cluster_name": "AReaL picks environment presets of its own clusters by this name; rlstream's per-node "
                            "environment is launcher.slurm.setup (Slurm) or the Ray nodes' own",
    "rollout.scheduling_spec": "process placement is decided by rlstream run / launch slurm / compose",
    "rollout.enable_rollout_tracing": "every group stays in the Redis stream; `rlstream inspect` shows them",
    "rollout.dump_to_file": "every group stays in the Redis stream (durable, AOF); `rlstream inspect` reads it",
    "rollout.fileroot": "cluster.fileroot is the one file root",
    "actor.scheduling_spec": "process placement is decided by rlstream run / launch slurm / compose",
    "actor.mb_spec.packing_algorithm": "micro-batches are balanced by rlstream's own splitter (trainer/microbatch.py)",
    "ref.backend": "the reference model runs in the trainer with the actor's backend",
    "ref.init_from_scratch": "the reference model is always loaded from ref.path",
    "ref.disable_dropout": "the reference model runs in eval mode: no dropout",
    "ref.dtype": "the reference model uses actor.dtype",
    "ref.mb_spec": "the reference model uses actor.mb_spec",
    "ref.optimizer": "the reference model is not trained",
    "ref.scheduling_strategy": "the reference model lives in the trainer process (colocated with the actor)",
    "ref.scheduling_spec": "the reference model lives in the trainer process",
    "train_dataset.pin_memory": "producers read prompts themselves; no DataLoader",
    "train_dataset.num_workers": "producers read prompts themselves; no DataLoader",
    "train_dataset.drop_last": "producers read prompts one at a time; no DataLoader batches",
    "valid_dataset.pin_memory": "evaluation reads prompts itself; no DataLoader",
    "valid_dataset.num_workers": "evaluation reads prompts itself; no DataLoader",
    "valid_dataset.drop_last": "evaluation reads prompts itself; no DataLoader",
    "valid_dataset.shuffle": "evaluation uses the file order (the first evaluator.max_prompts)",
    "dynamic_bs": "a train step always takes rollout.consumer_batch_size accepted groups: a rejected group is replaced "
                  "(producer.dynamic_sampling drops the all-equal-reward ones), the batch never shrinks",
    "gconfig.lora_name": "rlstream pushes the LoRA adapter and its engines merge it into the served weights: no adapter "
                         "name to request",
    "recover.freq_epochs": "recover checkpoints every recover.freq_steps / freq_secs (steps are the unit of exact replay)",
}

# AReaL's `ref` is a whole PPOActorConfig, but its engine only computes logprobs (no optimizer step, no
# advantages, no rollouts): the actor's training settings repeated there change nothing.
_REF_TRAINING_ONLY = ("is_critic", "pad_to_maximum", "gradient_checkpointing", "grad_reduce_dtype", "weight_update_mode",
                      "fsdp", "use_lora", "lora_rank", "lora_alpha", "target_modules", "peft_type", "group_size",
                      "ppo_n_minibatches", "eps_clip", "eps_clip_higher", "c_clip", "reward_norm", "reward_scaling",
                      "reward_bias", "reward_clip", "overlong_reward_penalty", "overlong_tokens",
                      "overlong_penalty_factor", "mask_no_eos_with_zero", "discount", "gae_lambda", "adv_norm",
                      "kl_ctl", "kl_estimator", "recompute_logprob", "use_decoupled_loss", "behav_imp_weight_cap",
                      "dynamic_sampling", "log_agent_stats", "log_agent_stats_keys", "max_new_tokens")
_DROPPED.update({f"ref.{k}": "the reference model only computes logprobs: a training setting has no effect there"
                 for k in _REF_TRAINING_ONLY})

_DROPPED.update({
    "actor.mb_spec.granularity": "advantages are computed on the whole batch before it is split, so micro-batches "
                                 "need not keep a group's sequences together",
    "actor.pad_to_maximum": "micro-batches are packed without padding (the loss is the same; padding only shapes "
                            "memory on GPU)",
    "actor.attn_impl": "the trainer uses transformers' SDPA attention (torch picks the flash kernel on GPU)",
    "ref.attn_impl": "the reference model uses transformers' SDPA attention, as the actor",
})

# Keys rlstream names differently, same meaning.
_RENAMED = {"stats_logger.wandb.wandb_api_key": "stats_logger.wandb.api_key",
            "stats_logger.wandb.wandb_base_url": "stats_logger.wandb.base_url"}

_LORA_SERVING = ("rlstream pushes the LoRA adapter and its engines merge it into the served weights: "
                 "no adapter serving to switch on")
_ENGINE_SKIP = {"model_path": "engines serve actor.path", "model": "engines serve actor.path",
                "enable_lora": _LORA_SERVING, "max_lora_rank": _LORA_SERVING, "lora_paths": _LORA_SERVING}


def _drop_reason(key: str) -> str | None:
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        why = _DROPPED.get(".".join(parts[:n]))
        if why:
            return why
    if len(parts) == 2 and parts[0] in _SECTIONS_WITH_COPIES and parts[1] in _PER_SECTION:
        return f"rlstream reads {parts[1]} once, at the top level" if parts[1] != "fileroot" else "cluster.fileroot is the one file root"
    return None


def _cli_args(section: str, values: dict[str, Any], t: Translation) -> list[str]:
    args = []
    for k, v in values.items():
        src = f"{section}.{k}"
        if k in _ENGINE_SKIP:
            t.dropped.append((src, _ENGINE_SKIP[k]))
        elif v is None:
            t.dropped.append((src, "null: the engine's default"))
        elif isinstance(v, (dict, list)):
            t.dropped.append((src, "structured engine option: pass it in launcher.engine.args yourself"))
        else:
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                arg = [flag] if v else []
                if not v:
                    t.dropped.append((src, f"false: the engine's default (no {flag})"))
                    continue
            else:
                arg = [flag, str(v)]
            args += arg
            t.translated.append((src, f"launcher.engine.args {' '.join(arg)}"))
    return args


# Top-level keys of AReaL's experiment dataclasses (BaseExperimentConfig, PPOConfig/GRPOConfig in
# areal/api/cli_args.py) and of its multi-turn example's MultiTurnGRPOConfig.
_AREAL_TOP = {"experiment_name", "trial_name", "cluster", "allocation_mode", "seed", "enable_offload",
              "total_train_epochs", "total_train_steps", "total_train_n_seqs", "tokenizer_path", "train_dataset",
              "valid_dataset", "saver", "evaluator", "stats_logger", "perf_tracer", "memory_profiler", "recover",
              "sglang", "vllm", "scheduler", "launcher", "gconfig", "eval_gconfig", "rollout", "actor", "ref", "critic",
              "teacher", "dynamic_bs", "agent_run_args", "export_style", "async_training", "model"}
# Top-level keys that name another system's config file.
_OTHER_SYSTEMS = {"ROLL": {"actor_train", "actor_infer", "pretrain", "reward_pretrain"},
                  "RLinf": {"runner", "algorithm"}, "cosmos-rl": {"policy", "train", "rollout_parallelism"},
                  "verl": {"actor_rollout_ref", "algorithm", "trainer"}}


def check_areal(data: Any) -> None:
    """Refuse, in one line, a file that is not an AReaL experiment config (another system's, or none)."""
    if not isinstance(data, dict):
        raise ConfigError(f"is not an AReaL experiment file (a YAML mapping with actor, rollout and gconfig sections; "
                          f"this one is a {type(data).__name__})")
    keys = set(map(str, data))
    for system, marks in _OTHER_SYSTEMS.items():
        if len(keys & marks) >= 2 or (keys & marks and not keys & {"gconfig", "allocation_mode"}):
            raise ConfigError(f"looks like a {system} config (top-level {', '.join(sorted(keys & marks))}), not an "
                              "AReaL experiment file: import-areal reads AReaL's YAML (e.g. examples/math/gsm8k_grpo.yaml)")
    unknown = sorted(keys - _AREAL_TOP)
    if not keys & {"actor", "model", "rollout", "gconfig", "allocation_mode"} or len(unknown) > len(keys & _AREAL_TOP):
        raise ConfigError(f"is not an AReaL experiment file (top-level keys {', '.join(sorted(keys)[:8]) or 'none'}; "
                          "AReaL's have actor, rollout, gconfig, ...): give an AReaL YAML such as "
                          "examples/math/gsm8k_grpo.yaml")


def translate_areal(data: dict[str, Any]) -> Translation:
    """The rlstream config for an AReaL experiment file (already parsed, interpolations resolved)."""
    check_areal(data)
    t = Translation()
    data = dict(data)
    engines = {s: data.pop(s) for s in ("sglang", "vllm") if s in data}
    handled: set[str] = set()
    if kind := experiment_kind(data):
        translate_sft_rw(t, data, kind, handled)
        for section in ("model" if isinstance(data.get("model"), dict) else "actor", "allocation_mode"):
            data.pop(section, None)
    actor = data.get("actor") if isinstance(data.get("actor"), dict) else {}
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    engine_alloc, trainer_alloc = _allocations(t, data, actor, rollout, handled)
    engine_keys = _engine_allocation(engine_alloc) if engine_alloc is not None else {}
    trainer_keys = _trainer_allocation(trainer_alloc) if trainer_alloc is not None else {}
    engine_kind = engine_keys.get("rollout.backend")
    for src in ("rollout.backend", "actor.backend"):
        if src in handled:
            t.translate(src, engine_keys if src == "rollout.backend" else trainer_keys)
    from_mode = {**({} if "rollout.backend" in handled else engine_keys),
                 **({} if "actor.backend" in handled else trainer_keys)}
    if "allocation_mode" in handled:
        t.translate("allocation_mode", from_mode)
    if kind is None:
        _translate_algorithm(t, data, actor, handled)
    translate_critic(t, data, handled)
    _translate_reward_model(t, data, handled)
    top_exp = data.get("experiment_name")
    for key, value in leaves(data):
        if not _covered(key, handled):
            _translate_leaf(t, data, key, value, top_exp)
    _translate_engine_options(t, engines, engine_kind)
    note_hub_names(t, data, actor)
    return t


def _translate_reward_model(t: Translation, data: dict[str, Any], handled: set[str]) -> None:
    """AReaL's `scheduler.reward_model_path` / `reward_model_service_url` -> the `reward_model` scoring pool."""
    sched = data.get("scheduler") if isinstance(data.get("scheduler"), dict) else {}
    path, url = sched.get("reward_model_path"), sched.get("reward_model_service_url")
    handled.update(f"scheduler.{k}" for k in ("reward_model_path", "reward_model_service_url") if k in sched)
    t.dropped += [(f"scheduler.{k}", "empty: no reward model (set, it becomes the reward_model scoring pool)")
                  for k in ("reward_model_path", "reward_model_service_url") if k in sched and not sched[k]]
    if path:
        t.translate("scheduler.reward_model_path", {"reward_model.pool.model_path": path})
    if url:  # http://host:port/classify: a running service; rlstream scores through its /classify
        t.translate("scheduler.reward_model_service_url", {"reward_model.pool.addresses": [
            str(url).split("://", 1)[-1].split("/", 1)[0]], "reward_model.pool.engines": 0})
    if path or url:
        t.notes.append("reward_model: a sample's reward = reward_model.weight x model score + reward_model.rule_weight"
                       " x producer.reward_fn (defaults 1 and 0): set them to your mix")


def _covered(key: str, handled: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:n]) in handled for n in range(1, len(parts) + 1))


def _allocations(t: Translation, data: dict[str, Any], actor: dict[str, Any], rollout: dict[str, Any],
                 handled: set[str]) -> tuple[Any, Any]:
    """The engines' and the trainer's (kind, d, p, t) from allocation_mode, then rollout/actor.backend."""
    engine_alloc = trainer_alloc = None
    if "allocation_mode" in data:
        spec = str(data["allocation_mode"])
        handled.add("allocation_mode")
        gen, _, train = spec.partition("+")
        engine_alloc, trainer_alloc = parse_allocation(gen), parse_allocation(train) if train else None
    if isinstance(rollout.get("backend"), str):
        engine_alloc = parse_allocation(rollout["backend"]) if ":" in rollout["backend"] else (rollout["backend"], 1, 1, 1)
        handled.add("rollout.backend")
    if isinstance(actor.get("backend"), str):
        trainer_alloc = parse_allocation(actor["backend"]) if ":" in actor["backend"] else (actor["backend"], 1, 1, 1)
        handled.add("actor.backend")
    return engine_alloc, trainer_alloc


def _engine_allocation(engine_alloc: tuple[Any, int, int, int]) -> dict[str, Any]:
    """The engine keys of an allocation (sglang or vllm engines)."""
    kind, d, p, tp = engine_alloc
    kind = kind or "sglang"
    if kind not in ("sglang", "vllm"):
        raise ConfigError(f"rollout.backend {kind!r}: rlstream's engines speak sglang or vllm")
    return {"rollout.backend": kind, "launcher.n_engines": d, "launcher.engine.server": kind,
            "launcher.engine.tp": tp, "launcher.engine.pp": p, "launcher.ray.engine_gpus": tp * p}


def _trainer_allocation(trainer_alloc: tuple[Any, int, int, int]) -> dict[str, Any]:
    """The trainer keys of an allocation: backend, parallel sizes, processes."""
    kind, d, p, tp = trainer_alloc
    kind = kind or "fsdp"
    if kind in ("fsdp", "ddp"):
        if p > 1 or (tp > 1 and kind == "ddp"):
            raise ConfigError(f"actor.backend {kind}:d{d}p{p}t{tp}: the hf backend has no pipeline stages, and tensor "
                              "parallelism only under fsdp (fsdp:dDtT); use megatron:dDpPtT for pipeline parallelism")
        keys: dict[str, Any] = {"actor.backend": "hf", "actor.parallel": kind}
        if tp > 1:  # AReaL's FSDP engine splits layers with DTensor plans as the hf backend does
            keys["actor.fsdp.tensor_parallel"] = tp
        return keys | {"launcher.n_trainer_procs": d * tp}
    elif kind == "megatron":
        keys = {"actor.backend": "megatron", "actor.megatron.tensor_parallel": tp, "actor.megatron.pipeline_parallel": p}
    else:
        raise ConfigError(f"actor.backend {kind!r}: rlstream trains with fsdp/ddp (hf) or megatron")
    return keys | {"launcher.n_trainer_procs": d}


def _translate_leaf(t: Translation, data: dict[str, Any], key: str, value: Any, top_exp: Any) -> None:
    """One leaf key of the AReaL file: translated, kept as is, or dropped with the reason."""
    if key == "cluster.name_resolve.type":
        translate_name_resolve(t, data, key, value)
    elif key == "actor.weight_update_mode":
        translate_weight_update_mode(t, key, value)
    elif key in ("perf_tracer.save_interval", "perf_tracer.session_tracer.flush_threshold") and \
            isinstance(value, int) and value <= 0:
        t.translate(key, {key: 1}, "AReaL reads values <= 0 as 1")
    elif key == "cluster.name_resolve.etcd3_addr":
        if ((data.get("cluster") or {}).get("name_resolve") or {}).get("type") not in ("etcd", "etcd3"):
            t.dropped.append((key, "name_resolve.type is not etcd3"))
    elif key == "async_training":
        translate_async_training(t, data, key, value)
    elif key == "actor.dynamic_sampling":
        t.set("producer.dynamic_sampling", bool(value))
        t.translated.append((key, "producer.dynamic_sampling (all-equal-reward groups are dropped and replaced, "
                                  "so the batch keeps its size)"))
    elif key == "actor.is_critic":
        if value:
            raise ConfigError("actor.is_critic=true: the actor is the policy; a value model is the critic section")
        t.dropped.append((key, "false: the actor is the policy (the critic section holds the value model)"))
    elif key == "ref.temperature":
        translate_ref_temperature(t, data, key, value)
    elif key in _RENAMED:
        if value is None:
            t.dropped.append((key, f"null: {_RENAMED[key]} unset"))
        else:
            t.translate(key, {_RENAMED[key]: value})
    elif key in SCHEMA_KEYS:
        t.set(key, value)
        t.same.append(key)
    elif why := _drop_reason(key):
        if key.endswith("experiment_name") and value not in (None, top_exp):
            why += f" (this file sets {value!r} here, {top_exp!r} at the top)"
        t.dropped.append((key, why))
    else:
        t.dropped.append((key, "no rlstream key of that name or meaning"))


# rejection_sampling that keeps every token and weighs none: AReaL's decoupled loss without rejection
# sampling (ppo_actor_loss_fn applies no behaviour weight then). A ratio above 1e30 (log-ratio > 69) is
# the one thing it would still mask; an engine does not sample such a token.
NO_BEHAVIOUR_WEIGHT = {"weight": "none", "upper": 1e30}
_NO_WEIGHT_WHY = ("AReaL applies no behaviour weight without rejection sampling; rlstream's null would weigh "
                  "the loss by exp(prox - behav)")
# AReaL's removed behave_imp_weight_mode -> (level, action), as its migration table and the sequence
# modes' geometric-mean semantics (areal/api/cli_args.py RejectionSamplingConfig) read them.
_LEGACY_MODES = {"token_mask": ("token", "mask"), "token_truncate": ("token", "clamp"),
                 "sequence_mask": ("sequence", "mask"), "sequence_truncate": ("sequence", "clamp")}


def _translate_algorithm(t: Translation, data: dict[str, Any], actor: dict[str, Any], handled: set[str]) -> None:
    """The actor keys whose meaning depends on other keys or on AReaL's defaults."""
    _translate_lora(t, data, actor, handled)
    _translate_correction(t, actor, handled)
    _translate_group_sizes(t, data, actor, handled)
    _translate_agent(t, data, handled)
    if "use_sapo_loss" in actor:
        handled.add("actor.use_sapo_loss")
        if actor["use_sapo_loss"]:
            t.translate("actor.use_sapo_loss", {"actor.policy_loss": "sapo"})
        else:
            t.dropped.append(("actor.use_sapo_loss", "false: the PPO clip, rlstream's default actor.policy_loss=ppo"))
    if "queue_size" in (data.get("rollout") or {}):
        handled.add("rollout.queue_size")
        t.dropped.append(("rollout.queue_size", "a finished group is written to Redis at once: no producer queue to size"))
    if "adv_norm" not in actor:
        t.add("actor.adv_norm", None, "AReaL's default: no advantage normalisation (rlstream's: batch mean/std)")
    opt = actor.get("optimizer")
    if isinstance(opt, dict) and "weight_decay" not in opt:
        t.add("actor.optimizer.weight_decay", 0.01, "AReaL's default (rlstream's: 0)")


def _translate_lora(t: Translation, data: dict[str, Any], actor: dict[str, Any], handled: set[str]) -> None:
    """actor.use_lora/peft_type/lora_rank/lora_alpha/target_modules -> actor.lora (AReaL's defaults where absent)."""
    for k in ("use_lora", "lora_name"):
        if k in (data.get("rollout") or {}):
            handled.add(f"rollout.{k}")
            t.dropped.append((f"rollout.{k}", _LORA_SERVING + " (actor.use_lora decides LoRA training)"))
    present = [k for k in ("use_lora", "peft_type", "lora_rank", "lora_alpha", "target_modules") if k in actor]
    handled.update(f"actor.{k}" for k in present)
    if not actor.get("use_lora"):
        t.dropped += [(f"actor.{k}", "actor.use_lora is not true: full fine-tuning (no actor.lora)") for k in present]
        return
    if actor.get("peft_type", "lora") != "lora":
        raise ConfigError(f"actor.peft_type {actor['peft_type']!r}: rlstream trains LoRA adapters only; "
                          "set peft_type: lora, or use_lora: false for full fine-tuning")
    targets = list(actor.get("target_modules") or []) or ["all-linear"]  # AReaL: empty = all-linear
    lora = {"rank": int(actor.get("lora_rank", 32)), "alpha": float(actor.get("lora_alpha", 16)),
            "target_modules": targets}
    t.translate("actor.use_lora", {"actor.lora": {}}, "LoRA training instead of full fine-tuning")
    for src, dst, default in (("lora_rank", "rank", 32), ("lora_alpha", "alpha", 16), ("target_modules",
                                                                                       "target_modules", None)):
        if src in actor:
            t.translate(f"actor.{src}", {f"actor.lora.{dst}": lora[dst]},
                        "AReaL's empty list" if dst == "target_modules" and not actor[src] else "")
        else:
            t.add(f"actor.lora.{dst}", lora[dst], f"AReaL's default {src}" + (f" ({default})" if default else ""))
    if "peft_type" in actor:
        t.dropped.append(("actor.peft_type", "lora is the one adapter type (actor.lora)"))


def _translate_correction(t: Translation, actor: dict[str, Any], handled: set[str]) -> None:
    """rejection_sampling (and its removed behave_imp_weight_* spelling), as AReaL applies it: only with the
    decoupled loss, and no behaviour weight at all without it."""
    legacy = [k for k in ("behave_imp_weight_cap", "behave_imp_weight_mode") if k in actor]
    has_rs = "rejection_sampling" in actor
    handled.update(f"actor.{k}" for k in legacy + (["rejection_sampling"] if has_rs else []))
    rs = actor.get("rejection_sampling")
    if not actor.get("use_decoupled_loss"):
        why = ("AReaL applies it only with use_decoupled_loss: true (it warns and ignores it); rlstream would "
               "weigh the loss by it")
        t.dropped += [(key, why) for key, _ in (leaves(rs, "actor.rejection_sampling") if has_rs else [])]
        t.dropped += [(f"actor.{k}", why) for k in legacy]
        return
    if rs is not None and legacy:
        raise ConfigError("actor.rejection_sampling and the removed actor.behave_imp_weight_cap/mode are both set: "
                          "keep rejection_sampling")
    if isinstance(rs, dict):
        for key, value in leaves(rs, "actor.rejection_sampling"):
            t.set(key, value)
            t.same.append(key)
    elif legacy:
        _translate_legacy_correction(t, actor, legacy)
    elif has_rs:
        t.translate("actor.rejection_sampling", {"actor.rejection_sampling": NO_BEHAVIOUR_WEIGHT}, _NO_WEIGHT_WHY)
    else:
        t.add("actor.rejection_sampling", NO_BEHAVIOUR_WEIGHT, _NO_WEIGHT_WHY)


def _translate_legacy_correction(t: Translation, actor: dict[str, Any], legacy: list[str]) -> None:
    """behave_imp_weight_cap (default 5.0) and behave_imp_weight_mode (default token_mask), removed from AReaL."""
    mode, cap = actor.get("behave_imp_weight_mode", "token_mask"), actor.get("behave_imp_weight_cap", 5.0)
    if mode == "disabled":
        rs, why = NO_BEHAVIOUR_WEIGHT, "disabled: " + _NO_WEIGHT_WHY
    elif mode in _LEGACY_MODES:
        level, action = _LEGACY_MODES[mode]
        rs = {"level": level, "action": "mask" if cap is None else action, "metric": "ratio"}
        rs |= ({"agg": "mean"} if level == "sequence" else {}) | {"upper": 1e30 if cap is None else cap}
        # no cap: the old code applied the weight (token ratio or sequence geometric mean) unbounded
        why = f"AReaL's migration of {mode}" + (", no cap: the weight unbounded" if cap is None else "")
    else:
        raise ConfigError(f"actor.behave_imp_weight_mode {mode!r}: expected disabled, "
                          f"{', '.join(_LEGACY_MODES)} (or use actor.rejection_sampling)")
    t.translate(f"actor.{legacy[0]}", {"actor.rejection_sampling": rs}, why)
    if len(legacy) > 1:
        t.translated.append((f"actor.{legacy[1]}", f"actor.rejection_sampling, with actor.{legacy[0]} above"))


def _translate_group_sizes(t: Translation, data: dict[str, Any], actor: dict[str, Any], handled: set[str]) -> None:
    """reward_norm/adv_norm.group_size: rlstream's group is always a prompt's n_samples samples."""
    samples = (data.get("gconfig") or {}).get("n_samples", 1)
    for norm in ("reward_norm", "adv_norm"):
        cfg = actor.get(norm)
        if not isinstance(cfg, dict) or "group_size" not in cfg:
            continue
        key, size = f"actor.{norm}.group_size", cfg["group_size"]
        handled.add(key)
        if "group" not in (cfg.get("mean_level"), cfg.get("std_level")):
            t.dropped.append((key, "no group-level statistic in this section (mean_level/std_level are not group)"))
        elif size == samples:
            t.dropped.append((key, f"rlstream's groups are each prompt's gconfig.n_samples ({samples}) samples, "
                                   "the group_size given"))
        else:
            raise ConfigError(f"{key} {size} differs from gconfig.n_samples {samples}: rlstream normalises over each "
                              f"prompt's whole group; set group_size to {samples}")


def _translate_agent(t: Translation, data: dict[str, Any], handled: set[str]) -> None:
    """The multi-turn example's agent_run_args and export_style (MultiTurnGRPOConfig)."""
    args = data.get("agent_run_args")
    if "agent_run_args" in data:
        handled.add("agent_run_args")
        for key, value in leaves(args, "agent_run_args") if args else []:
            if key == "agent_run_args.max_turns":
                t.translate(key, {"agent.max_turns": value})
            else:
                t.dropped.append((key, "no rlstream agent option of that name (rlstream config docs agent)"))
        t.notes.append("AReaL's multi-turn workflow is the example's own Python; rlstream runs multi-turn episodes "
                       "with producer.workflow=rlstream.producer.agent:AgentWorkflow (agent.*)")
    if "export_style" in data:
        handled.add("export_style")
        if data["export_style"] != "concat":
            raise ConfigError(f"export_style {data['export_style']!r}: rlstream trains an episode as one sequence "
                              "(AReaL's concat); set export_style: concat")
        t.dropped.append(("export_style", "rlstream trains an episode as one sequence, its turns end to end (concat)"))


def _translate_engine_options(t: Translation, engines: dict[str, Any], engine_kind: str | None) -> None:
    """The options of the chosen engine backend become its command line; the other backend's are dropped."""
    for name, values in engines.items():
        if not isinstance(values, dict):
            t.dropped.append((name, "not a mapping"))
            continue
        if name != engine_kind:
            for k in values:
                t.dropped.append((f"{name}.{k}", f"rollout.backend is {engine_kind}: {name}.* unused (as in AReaL)"))
            continue
        args = _cli_args(name, values, t)
        if args:
            t.set("launcher.engine.args", args)


