"""AReaL experiment files -> rlstream configs (`rlstream config import-areal FILE`).

Every leaf key of the AReaL file ends in exactly one of three lists:

- same: the key exists in rlstream with the same meaning and is copied;
- translated: it becomes other rlstream keys (the allocation strings `rollout.backend:
  sglang:d4p1t1`, `actor.backend: fsdp:d4p1t1` and the older `allocation_mode` -> engines,
  trainer processes, tensor/pipeline sizes; `weight_update_mode: xccl` -> distributed over
  NCCL; name resolve nfs/etcd3/ray -> redis/etcd; `sglang.*`/`vllm.*` of the chosen backend ->
  the engine server's command-line arguments; the removed `behave_imp_weight_*` keys ->
  `rejection_sampling`);
- dropped, each with the reason (no rlstream equivalent, or rlstream decides it elsewhere).

Key names follow AReaL's `areal/api/cli_args.py` (inclusionAI/AReaL); the result is validated
against rlstream's schema by the caller (`load_config_dict`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlstream.common.config import ConfigError, field_docs

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
    translated: list[tuple[str, str]] = field(default_factory=list)  # (AReaL key, what it became)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (AReaL key, reason)
    notes: list[str] = field(default_factory=list)

    def set(self, dotted: str, value: Any) -> None:
        node = self.config
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def summary(self) -> str:
        lines = [f"translated {len(self.translated)}, same {len(self.same)}, dropped {len(self.dropped)} "
                 f"(of {len(self.translated) + len(self.same) + len(self.dropped)} AReaL keys)"]
        lines += [f"  translated  {src} -> {dst}" for src, dst in self.translated]
        lines += [f"  dropped     {src}: {why}" for src, why in self.dropped]
        lines += [f"  note        {n}" for n in self.notes]
        return "\n".join(lines)


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        out = []
        for k, v in data.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, data)]


_SCHEMA = {key for key, _, _ in field_docs()}

# Keys rlstream takes from one place for the whole run (AReaL repeats them per section).
_PER_SECTION = {"experiment_name", "trial_name", "fileroot", "tokenizer_path"}
_SECTIONS_WITH_COPIES = ("actor", "ref", "saver", "recover", "evaluator", "stats_logger", "rollout", "perf_tracer")

# Whole sections or keys dropped, with the reason (longest prefix wins).
_DROPPED = {
    "enable_offload": "rlstream's trainer and engines are separate processes; nothing is offloaded between them",
    "scheduler": "how processes start is the command you run: `rlstream run` (one machine), `rlstream launch slurm`, docker compose",
    "launcher": "AReaL's launcher ports/CPU settings; rlstream's placement is launcher.* (n_engines, n_producers, slurm.*)",
    "perf_tracer": "no tracer; step phases are logged as time/* metrics and measured in benchmarks/",
    "cluster.name_resolve.nfs_record_root": "engines register in the run's Redis (or etcd); no shared folder",
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
    "recover.freq_epochs": "recover checkpoints every recover.freq_steps / freq_secs (steps are the unit of exact replay)",
}

_ENGINE_SKIP = {"model_path": "engines serve actor.path", "model": "engines serve actor.path"}


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
            t.dropped.append((src, "structured engine option: pass it in launcher.slurm.engine_args yourself"))
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
            t.translated.append((src, f"launcher.slurm.engine_args {' '.join(arg)}"))
    return args


def translate_areal(data: dict[str, Any]) -> Translation:
    """The rlstream config for an AReaL experiment file (already parsed, interpolations resolved)."""
    if not isinstance(data, dict):
        raise ConfigError("an AReaL experiment file is a mapping of keys")
    t = Translation()
    data = dict(data)
    engines = {s: data.pop(s) for s in ("sglang", "vllm") if s in data}
    handled: set[str] = set()
    actor = data.get("actor") if isinstance(data.get("actor"), dict) else {}
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    engine_alloc, trainer_alloc = _allocations(t, data, actor, rollout, handled)
    engine_kind = _engine_allocation(t, engine_alloc, handled) if engine_alloc is not None else None
    if trainer_alloc is not None:
        _trainer_allocation(t, trainer_alloc, handled)
    _translate_critic(t, data, handled)
    top_exp = data.get("experiment_name")
    for key, value in _leaves(data):
        if key not in handled and not key.startswith("allocation_mode"):
            _translate_leaf(t, data, key, value, top_exp)
    _translate_old_weight_cap(t, actor)
    _translate_engine_options(t, engines, engine_kind)
    _note_hub_names(t, data, actor)
    return t


def _allocations(t: Translation, data: dict[str, Any], actor: dict[str, Any], rollout: dict[str, Any],
                 handled: set[str]) -> tuple[Any, Any]:
    """The engines' and the trainer's (kind, d, p, t) from allocation_mode, then rollout/actor.backend."""
    engine_alloc = trainer_alloc = None
    if "allocation_mode" in data:
        spec = str(data["allocation_mode"])
        handled.add("allocation_mode")
        gen, _, train = spec.partition("+")
        engine_alloc, trainer_alloc = parse_allocation(gen), parse_allocation(train) if train else None
        t.translated.append(("allocation_mode", f"engines {gen}, trainer {train or '-'}"))
    if isinstance(rollout.get("backend"), str):
        engine_alloc = parse_allocation(rollout["backend"]) if ":" in rollout["backend"] else (rollout["backend"], 1, 1, 1)
        handled.add("rollout.backend")
    if isinstance(actor.get("backend"), str):
        trainer_alloc = parse_allocation(actor["backend"]) if ":" in actor["backend"] else (actor["backend"], 1, 1, 1)
        handled.add("actor.backend")
    return engine_alloc, trainer_alloc


def _engine_allocation(t: Translation, engine_alloc: tuple[Any, int, int, int], handled: set[str]) -> str:
    """The engine keys of an allocation; returns the engine kind (sglang or vllm)."""
    kind, d, p, tp = engine_alloc
    kind = kind or "sglang"
    if kind not in ("sglang", "vllm"):
        raise ConfigError(f"rollout.backend {kind!r}: rlstream's engines speak sglang or vllm")
    t.set("rollout.backend", kind)
    t.set("launcher.n_engines", d)
    t.set("launcher.slurm.engine", kind)
    t.set("launcher.slurm.engine_tp", tp)
    t.set("launcher.slurm.engine_pp", p)
    if "rollout.backend" in handled:
        t.translated.append(("rollout.backend", f"rollout.backend={kind}, launcher.n_engines={d}, "
                                                f"launcher.slurm.engine={kind}, engine_tp={tp}, engine_pp={p}"))
    return kind


def _trainer_allocation(t: Translation, trainer_alloc: tuple[Any, int, int, int], handled: set[str]) -> None:
    """The trainer keys of an allocation: backend, parallel sizes, processes."""
    kind, d, p, tp = trainer_alloc
    kind = kind or "fsdp"
    dst = []
    if kind in ("fsdp", "ddp"):
        t.set("actor.backend", "hf")
        t.set("actor.parallel", kind)
        dst = ["actor.backend=hf", f"actor.parallel={kind}"]
        if p > 1 or tp > 1:
            raise ConfigError(f"actor.backend {kind}:d{d}p{p}t{tp}: the hf backend is data parallel only; "
                              "use megatron:dDpPtT for tensor/pipeline parallelism")
    elif kind == "megatron":
        t.set("actor.backend", "megatron")
        t.set("actor.megatron.tensor_parallel", tp)
        t.set("actor.megatron.pipeline_parallel", p)
        dst = ["actor.backend=megatron", f"actor.megatron.tensor_parallel={tp}", f"pipeline_parallel={p}"]
    else:
        raise ConfigError(f"actor.backend {kind!r}: rlstream trains with fsdp/ddp (hf) or megatron")
    t.set("launcher.n_trainer_procs", d)
    dst.append(f"launcher.n_trainer_procs={d}")
    if "actor.backend" in handled:
        t.translated.append(("actor.backend", ", ".join(dst)))


def _translate_leaf(t: Translation, data: dict[str, Any], key: str, value: Any, top_exp: Any) -> None:
    """One leaf key of the AReaL file: translated, kept as is, or dropped with the reason."""
    if key == "cluster.name_resolve.type":
        _translate_name_resolve(t, data, key, value)
    elif key == "actor.weight_update_mode":
        _translate_weight_update_mode(t, key, value)
    elif key in ("actor.behave_imp_weight_cap", "actor.behave_imp_weight_mode"):
        pass  # together, in _translate_old_weight_cap
    elif key == "cluster.name_resolve.etcd3_addr":
        if ((data.get("cluster") or {}).get("name_resolve") or {}).get("type") not in ("etcd", "etcd3"):
            t.dropped.append((key, "name_resolve.type is not etcd3"))
    elif key in _SCHEMA:
        t.set(key, value)
        t.same.append(key)
    elif why := _drop_reason(key):
        if key.endswith("experiment_name") and value not in (None, top_exp):
            why += f" (this file sets {value!r} here, {top_exp!r} at the top)"
        t.dropped.append((key, why))
    else:
        t.dropped.append((key, "no rlstream key of that name or meaning"))


# critic.* keys (AReaL's PPOCriticConfig) rlstream decides elsewhere, with the reason; the rest of the
# engine keys (fsdp.*, attn_impl ...) are dropped by the fallback reason in _translate_critic.
_CRITIC_DROPPED = {
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


def _translate_critic(t: Translation, data: dict[str, Any], handled: set[str]) -> None:
    """AReaL's `critic` section (PPOCriticConfig) -> rlstream's `critic` section: the value model of PPO."""
    critic = data.get("critic")
    if not isinstance(critic, dict):
        return
    t.set("critic", {})
    lora = {"lora_rank": "rank", "lora_alpha": "alpha", "target_modules": "target_modules"}
    use_lora = bool(critic.get("use_lora"))
    for key, value in _leaves(critic):
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
        elif src in _SCHEMA and not isinstance(value, dict):
            t.set(src, value)
            t.same.append(src)
        elif why := next((w for k, w in _CRITIC_DROPPED.items() if key == k or key.startswith(k + ".")), None):
            t.dropped.append((src, why))
        else:
            t.dropped.append((src, "an engine setting of AReaL's critic without rlstream equivalent"))
    if _hub_like(critic.get("path")):
        t.notes.append(f"critic.path {critic['path']!r} is a hub id: rlstream resolves it offline from the local HF "
                       "cache (or a folder from `rlstream model get`), never downloads it")
    if use_lora and "target_modules" not in critic:
        t.notes.append("critic.use_lora without target_modules: critic.lora.target_modules keeps rlstream's default")


def _translate_name_resolve(t: Translation, data: dict[str, Any], key: str, value: Any) -> None:
    kind = {"nfs": "redis", "ray": "redis", "etcd3": "etcd", "etcd": "etcd"}.get(str(value))
    if kind is None:
        t.dropped.append((key, f"{value!r}: rlstream resolves names with redis, etcd or static"))
        return
    t.set(key, kind)
    why = "engines register in the run's Redis, which every process reaches" if kind == "redis" else "etcd v3"
    t.translated.append((key, f"cluster.name_resolve.type={kind} ({why})"))
    addr = ((data.get("cluster") or {}).get("name_resolve") or {}).get("etcd3_addr")
    if kind == "etcd" and addr:
        t.set("cluster.name_resolve.etcd_address", addr)
        t.translated.append(("cluster.name_resolve.etcd3_addr", "cluster.name_resolve.etcd_address"))


def _translate_weight_update_mode(t: Translation, key: str, value: Any) -> None:
    mode = {"xccl": ("distributed", "nccl"), "nccl": ("distributed", "nccl"), "disk": ("disk", None)}.get(str(value))
    if mode is None:
        t.dropped.append((key, f"{value!r}: rlstream pushes weights by distributed, disk or ipc"))
        return
    t.set(key, mode[0])
    dst = f"actor.weight_update_mode={mode[0]}"
    if mode[1]:
        t.set("actor.weight_update_backend", mode[1])
        dst += f", actor.weight_update_backend={mode[1]}"
    t.translated.append((key, dst))


def _translate_old_weight_cap(t: Translation, actor: dict[str, Any]) -> None:
    """AReaL's removed spelling of rejection sampling, as AReaL's own migration table maps it."""
    cap, mode = actor.get("behave_imp_weight_cap"), actor.get("behave_imp_weight_mode")
    if "behave_imp_weight_cap" not in actor and "behave_imp_weight_mode" not in actor:
        return
    src = "actor.behave_imp_weight_cap/mode"
    if mode == "disabled" or cap is None:
        t.translated.append((src, "no correction (rejection_sampling: null)"))
        return
    action = {"token_truncate": "clamp", "token_mask": "mask", None: "mask"}.get(mode)
    if action is None:
        t.dropped.append((src, f"behave_imp_weight_mode {mode!r}: use actor.rejection_sampling"))
    else:
        t.set("actor.rejection_sampling", {"level": "token", "action": action, "metric": "ratio", "upper": cap})
        t.translated.append((src, f"actor.rejection_sampling {{token, {action}, ratio, upper {cap}}}"))


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
            t.set("launcher.slurm.engine_args", args)


def _note_hub_names(t: Translation, data: dict[str, Any], actor: dict[str, Any]) -> None:
    """Notes for paths that look like hub names: rlstream reads local files only."""
    for section in ("train_dataset", "valid_dataset"):
        path = (data.get(section) or {}).get("path") if isinstance(data.get(section), dict) else None
        if _hub_like(path):
            t.notes.append(f"{section}.path {path!r} looks like a hub name: rlstream reads local files only; "
                           "point it at a JSONL/Parquet/CSV file or folder")
    if _hub_like(actor.get("path")):
        t.notes.append(f"actor.path {actor['path']!r} is a hub id: rlstream resolves it offline from the local HF cache "
                       "(or a folder from `rlstream model get`), never downloads it")


def _hub_like(path: Any) -> bool:
    return isinstance(path, str) and path.count("/") == 1 and not path.startswith((".", "/", "~")) \
        and "." not in path.split("/")[-1][-8:]
