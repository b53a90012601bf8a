"""Loading a config: OmegaConf reads the YAML, merges `a.b.c=value` overrides and resolves `${...}`; msgspec
then validates the plain dict against the schema; rules across sections come last. Every error names the full key
path, the bad value and what is allowed."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import msgspec

from rlstream.common.config.actor import ActorConfig
from rlstream.common.config.base import ConfigError
from rlstream.common.config.docs import allowed_values, struct_fields
from rlstream.common.config.masking import config_to_dict, register_secrets
from rlstream.common.config.schema import Config
from rlstream.common.config.distillation import check_distillation
from rlstream.common.config.judge import check_judge
from rlstream.common.config.scoring import check_scoring

__all__ = ["load_config", "load_config_dict"]

# Keys that moved into launcher.engine: a config written for the old place is told the new one.
MOVED_KEYS = {
    "launcher.slurm.engine": "launcher.engine.server", "launcher.ray.engine": "launcher.engine.server",
    "launcher.slurm.engine_python": "launcher.engine.python", "launcher.ray.engine_python": "launcher.engine.python",
    "launcher.slurm.engine_args": "launcher.engine.args", "launcher.ray.engine_args": "launcher.engine.args",
    "launcher.slurm.engine_tp": "launcher.engine.tp", "launcher.slurm.engine_pp": "launcher.engine.pp",
}


def _check_unknown_keys(data: Any, tp: Any, path: str) -> None:
    fields = struct_fields(tp)
    if fields is None or not isinstance(data, dict):
        return
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if full in MOVED_KEYS:
            raise ConfigError(f"config key '{full}' is now '{MOVED_KEYS[full]}' (one engine-server section for "
                              "`rlstream launch slurm` and `rlstream launch ray`)")
        if key not in fields:
            # An exact name one level down first: `lr` given at `actor.lr` means actor.optimizer.lr
            # (not the look-alike actor.lora); then a look-alike at this level.
            hint = [f"{name}.{key}" for name, sub in fields.items() if key in (struct_fields(sub) or {})][:1]
            if not hint:
                hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            suggestion = f"; did you mean '{(path + '.' if path else '') + hint[0]}'?" if hint else ""
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{full}'{suggestion} (allowed at this level: {allowed})")
        _check_unknown_keys(value, fields[key], full)


def _lookup(data: Any, dotted: str) -> Any:
    """The value at `a.b[2].c` in plain nested dicts/lists, or '<missing>'."""
    for part in dotted.split("."):
        name, _, rest = part.partition("[")
        if isinstance(data, dict) and name in data:
            data = data[name]
        else:
            return "<missing>"
        for idx in rest.replace("]", "").split("[") if rest else []:
            if isinstance(data, list) and idx.isdigit() and int(idx) < len(data):
                data = data[int(idx)]
            else:
                return "<missing>"
    return data


def _areal_batch_sizes(data: dict[str, Any]) -> None:
    """`train_dataset.batch_size` / `valid_dataset.batch_size` read as AReaL reads them (in the raw dict:
    whether consumer_batch_size / evaluator.concurrency were given is known only here)."""
    train = data.get("train_dataset")
    bs = train.get("batch_size") if isinstance(train, dict) else None
    if isinstance(bs, int) and not isinstance(bs, bool):
        rollout = data.setdefault("rollout", {})
        if isinstance(rollout, dict):
            given = rollout.get("consumer_batch_size")
            if given is None:
                rollout["consumer_batch_size"] = bs
            elif given != bs:
                raise ConfigError(
                    f"train_dataset.batch_size={bs} and rollout.consumer_batch_size={given} disagree: as in AReaL, "
                    f"train_dataset.batch_size is the prompts per train step, i.e. the groups (of gconfig.n_samples "
                    f"samples) the trainer consumes per step; set one of them, or both to the same value")
    valid = data.get("valid_dataset")
    vbs = valid.get("batch_size") if isinstance(valid, dict) else None
    if isinstance(vbs, int) and not isinstance(vbs, bool):
        ev = data.setdefault("evaluator", {})
        if isinstance(ev, dict) and ev.get("concurrency") is None:
            ev["concurrency"] = vbs


def _generated_reward(data: dict[str, Any]) -> None:
    """A generated train_dataset brings its own scorer: producer.reward_fn defaults to it when not given (in the raw
    dict: whether reward_fn was given is known only here)."""
    train = data.get("train_dataset")
    if isinstance(train, dict) and train.get("source") == "reasoning_gym":
        producer = data.setdefault("producer", {})
        if isinstance(producer, dict) and producer.get("reward_fn") is None:
            from rlstream.common.reasoning_gym_tasks import REWARD_FN

            producer["reward_fn"] = REWARD_FN
    if isinstance(train, dict) and train.get("source") == "verifiers":
        producer = data.setdefault("producer", {})
        if isinstance(producer, dict) and producer.get("workflow") is None:
            from rlstream.common.verifiers_envs import WORKFLOW

            producer["workflow"] = WORKFLOW


def _convert(data: dict[str, Any]) -> Config:
    _check_unknown_keys(data, Config, "")
    _areal_batch_sizes(data)
    _generated_reward(data)
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        path = ""
        if "- at `$." in msg:
            msg, _, at = msg.rpartition(" - at `$.")
            path = at.rstrip("`")
            # msgspec writes list indices as [i]; keep them.
        if not path:
            raise ConfigError(f"invalid config: {msg}") from None
        key = ".".join(p.split("[")[0] for p in path.split("."))  # schema path, without list indices
        value = _lookup(data, path)
        allowed = allowed_values(Config, key)
        raise ConfigError(f"config key '{path}': bad value {value!r}: {msg}; allowed: {allowed}") from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (optional), apply `a.b=c` overrides, resolve `${...}`, validate."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException


    where = f" ({path})" if path is not None else ""
    try:
        base = OmegaConf.create({})
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            try:
                base = OmegaConf.load(p)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ConfigError(f"cannot parse config file {p}{at}: {problem}") from None
            except OSError as exc:  # unreadable, or OmegaConf's IOError for a scalar at the top level
                raise ConfigError(f"cannot load config file {p}: {exc} (the top level must be a mapping of keys)") from None
            if not isinstance(base, DictConfig):
                raise ConfigError(f"config file {p}: the top level must be a mapping of keys, not a list")
        for ov in overrides or []:
            if "=" not in ov:
                raise ConfigError(f"override '{ov}' is not of the form key.path=value")
        for ov in overrides or []:
            try:
                base = OmegaConf.merge(base, OmegaConf.from_dotlist([ov]))
            except OmegaConfBaseException:
                raise
            except Exception as exc:  # noqa: BLE001 - PyYAML errors on the value, IndexError on keys like `a.`
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise ConfigError(f"cannot parse override {ov!r}: {first}") from None
        data = OmegaConf.to_container(base, resolve=True)
    except OmegaConfBaseException as exc:
        # Interpolation errors know which key they were resolving: name it.
        key = getattr(exc, "full_key", None)
        msg = str(exc).splitlines()[0]
        if key:
            raise ConfigError(f"config key '{key}'{where}: {msg}") from None
        raise ConfigError(f"cannot load config{where}: {msg}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config root must be a mapping{where}")
    return load_config_dict(data)


def load_config_dict(data: dict[str, Any]) -> Config:
    """Validate a plain nested dict (interpolations already resolved) as load_config does."""
    cfg = _convert(data)
    _normalise(cfg)
    _check(cfg)
    register_secrets(config_to_dict(cfg))
    return cfg


def _normalise(cfg: "Config") -> None:
    """AReaL spellings that mean the same as ours, folded into ours (so `config show` prints one form)."""
    for norm in (cfg.actor.adv_norm, cfg.actor.reward_norm):
        if norm is not None:
            norm.mean_level = norm.mean_level or "none"
            norm.std_level = norm.std_level or "none"
    for key, ds in (("train_dataset", cfg.train_dataset), ("valid_dataset", cfg.valid_dataset)):
        if ds is None:
            continue
        if ds.type == "rl":
            ds.type = "auto"
        if ds.max_length is not None:
            if ds.max_prompt_len is not None and ds.max_prompt_len != ds.max_length:
                raise ConfigError(f"{key}.max_length={ds.max_length} and {key}.max_prompt_len={ds.max_prompt_len} "
                                  f"disagree: max_length is AReaL's name for max_prompt_len; keep one")
            ds.max_prompt_len, ds.max_length = ds.max_length, None
    # Generated problems: train from the run's seed, held-out from another one unless given.
    if cfg.train_dataset.source == "reasoning_gym" and cfg.train_dataset.seed is None:
        cfg.train_dataset.seed = cfg.seed
    if cfg.valid_dataset is not None and cfg.valid_dataset.source == "reasoning_gym" and cfg.valid_dataset.seed is None:
        base = cfg.train_dataset.seed if cfg.train_dataset.seed is not None else cfg.seed
        cfg.valid_dataset.seed = base + cfg.train_dataset.size
    mnt = cfg.actor.max_new_tokens
    if mnt is not None and mnt != cfg.gconfig.max_new_tokens:
        raise ConfigError(f"actor.max_new_tokens={mnt} differs from gconfig.max_new_tokens={cfg.gconfig.max_new_tokens}: "
                          "in AReaL it is a copy of gconfig.max_new_tokens (${{gconfig.max_new_tokens}}); drop it or make them equal")


def _check(cfg: "Config") -> None:
    """Rules across sections, at load: every process refuses the same bad config at its start."""
    _check_correction(cfg.actor)
    _check_optimizers(cfg)
    _check_generated(cfg)
    _check_verifiers(cfg)
    if cfg.agent.environment.endswith("openenv_env:OpenEnvEnvironment") and not cfg.agent.openenv.url:
        raise ConfigError("agent.environment=OpenEnvEnvironment needs agent.openenv.url (the OpenEnv environment "
                          "server's base URL, e.g. http://127.0.0.1:8000)")
    check_distillation(cfg)
    check_scoring(cfg)
    if cfg.producer.dynamic_sampling_reward_fn and not cfg.producer.dynamic_sampling:
        raise ConfigError("producer.dynamic_sampling_reward_fn decides the dynamic-sampling filter, which is off: set "
                          "producer.dynamic_sampling=true or drop it")
    check_judge(cfg)
    _check_split(cfg)
    _check_fp8(cfg)
    if cfg.server.quantization != "none" and cfg.actor.weight_update_delta != "none":
        raise ConfigError(f"actor.weight_update_delta={cfg.actor.weight_update_delta} with server.quantization="
                          f"{cfg.server.quantization}: a delta cannot apply to quantized weights; set "
                          "actor.weight_update_delta=none (pushes send the full weights, quantized as they arrive)")
    interval, eta = cfg.actor.weight_update_interval, cfg.rollout.max_head_offpolicyness
    if eta < interval - 1:
        raise ConfigError(f"actor.weight_update_interval={interval} leaves the engines up to {interval - 1} versions "
                          f"behind, past rollout.max_head_offpolicyness={eta}: every rollout between pushes would be "
                          f"too stale to train; set max_head_offpolicyness >= {interval - 1} or push more often")
    if cfg.actor.loss_agg_norm_tokens is not None and cfg.actor.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(f"actor.loss_agg_norm_tokens={cfg.actor.loss_agg_norm_tokens} replaces each sequence's length "
                          f"in loss_agg_mode=seq-mean-token-mean, but actor.loss_agg_mode={cfg.actor.loss_agg_mode!r}: "
                          "set loss_agg_mode: seq-mean-token-mean or drop loss_agg_norm_tokens")
    if cfg.actor.log_agent_stats and not cfg.actor.log_agent_stats_keys:
        raise ConfigError("actor.log_agent_stats=true needs actor.log_agent_stats_keys (the trajectory metadata keys to "
                          "log, e.g. [turns, tool_calls])")
    if cfg.evaluator.enabled and (cfg.valid_dataset is None or not cfg.valid_dataset.has_rows):
        keys = [f"evaluator.{k}" for k in ("freq_steps", "freq_epochs", "freq_secs")
                if getattr(cfg.evaluator, k) is not None]
        raise ConfigError(f"{', '.join(keys)} asks for evaluation during training but valid_dataset.path is not set: "
                          "point valid_dataset.path at held-out prompts, or drop the evaluator frequency")


def _check_optimizers(cfg: "Config") -> None:
    """Loss-scale bounds in order; optimizer offload where it is implemented (whole, unsharded parameters)."""
    optimizers = {"actor.optimizer": cfg.actor.optimizer, "launcher.sft_optimizer": cfg.launcher.sft_optimizer,
                  "rw.optimizer": cfg.rw.optimizer,
                  "critic.optimizer": cfg.critic.optimizer if cfg.critic is not None else None}
    for key, opt in optimizers.items():
        if opt is not None and opt.min_loss_scale > opt.initial_loss_scale:
            raise ConfigError(f"{key}.min_loss_scale={opt.min_loss_scale} must be in (0, {key}.initial_loss_scale="
                              f"{opt.initial_loss_scale}]")
    if cfg.actor.parallel == "fsdp" and (cfg.actor.optimizer.offload or
                                         (cfg.critic is not None and cfg.critic.optimizer.offload)):
        raise ConfigError("actor.optimizer.offload=true with actor.parallel=fsdp: FSDP offloads its sharded optimizer "
                          "step itself, set actor.fsdp.offload_params=true instead (offload works with parallel=ddp)")


def _check_split(cfg: "Config") -> None:
    """actor.fsdp.tensor_parallel / context_parallel / expert_parallel / pipeline_parallel > 1 (the hf backend's 2-D
    FSDP2 + TP recipe, Ulysses over packed rows, experts over groups of ranks, layers in stages), each without what it
    does not split, in groups that divide the trainer ranks."""
    a = cfg.actor
    common = {"actor.compile=true": a.compile}
    lora = {"actor.lora": a.lora is not None, "critic.lora": cfg.critic is not None and cfg.critic.lora is not None}
    splits = {
        ("actor.fsdp.tensor_parallel", a.fsdp.tensor_parallel, "each data-parallel rank is a group of {n} tensor-parallel "
                                                               "ranks"): {
            **lora, "actor.fsdp.shard_size": a.fsdp.shard_size is not None,
            "actor.backend=megatron (its own actor.megatron.tensor_parallel)": a.backend == "megatron",
            "actor.parallel=ddp (tensor parallelism is FSDP2's 2-D recipe: set actor.parallel=fsdp)":
                a.parallel != "fsdp"},
        ("actor.context_parallel", a.context_parallel, "each data-parallel rank is a group of {n} ranks splitting its "
                                                       "sequences"): {
            "actor.fsdp.tensor_parallel": a.fsdp.tensor_parallel > 1, "actor.backend=megatron": a.backend == "megatron",
            "actor.mb_spec.packing=false": not a.mb_spec.packing},
        ("actor.expert_parallel", a.expert_parallel, "each group of {n} consecutive ranks divides the experts"): {
            "actor.fsdp.tensor_parallel": a.fsdp.tensor_parallel > 1, "actor.context_parallel": a.context_parallel > 1,
            "actor.backend=megatron": a.backend == "megatron", **lora,
            "actor.optimizer.offload (its host masters are whole tensors)": a.optimizer.offload},
        ("actor.fsdp.pipeline_parallel", a.fsdp.pipeline_parallel, "each data-parallel replica is {n} pipeline "
                                                                   "stages"): {
            "actor.fsdp.tensor_parallel": a.fsdp.tensor_parallel > 1, "actor.context_parallel": a.context_parallel > 1,
            "actor.expert_parallel": a.expert_parallel > 1, **lora,
            "actor.backend=megatron (its own actor.megatron.pipeline_parallel)": a.backend == "megatron",
            "actor.fsdp.shard_size": a.fsdp.shard_size is not None},
    }
    if a.fsdp.virtual_pipeline_stages > 1 and a.fsdp.pipeline_parallel == 1:
        raise ConfigError("actor.fsdp.virtual_pipeline_stages > 1 needs actor.fsdp.pipeline_parallel > 1 (chunks of "
                          "layers per pipeline stage)")
    if a.fsdp.sequence_parallel and a.fsdp.tensor_parallel == 1:
        raise ConfigError("actor.fsdp.sequence_parallel=true needs actor.fsdp.tensor_parallel > 1 (it splits the "
                          "positions between the tensor-parallel blocks over those ranks)")
    procs = cfg.launcher.n_trainer_procs
    for (key, n, groups), own in splits.items():
        if n == 1:
            continue
        clash = [name for name, on in (own | common).items() if on]
        if clash:
            raise ConfigError(f"{key}={n} does not go with {', '.join(clash)}")
        if procs > 1 and procs % n:  # (1: started by hand under torchrun, checked against WORLD_SIZE at start)
            raise ConfigError(f"{key}={n} must divide launcher.n_trainer_procs={procs} ({groups.format(n=n)})")


def _check_fp8(cfg: "Config") -> None:
    """actor.fp8 swaps the hf backend's linear layers for torchao's Float8Linear: not under what replaces them."""
    a = cfg.actor
    if a.fp8 is None:
        return
    clash = [name for name, on in {"actor.backend=megatron (FP8 there is Transformer Engine's)": a.backend == "megatron",
                                   "actor.lora": a.lora is not None,
                                   "actor.fsdp.tensor_parallel": a.fsdp.tensor_parallel > 1}.items() if on]
    if clash:
        raise ConfigError(f"actor.fp8 does not go with {', '.join(clash)}")


def _check_verifiers(cfg: "Config") -> None:
    """verifiers environments: named, and installed (found without importing them)."""
    from rlstream.common.verifiers_envs import check_environment

    for key, ds in (("train_dataset", cfg.train_dataset), ("valid_dataset", cfg.valid_dataset)):
        if ds is not None and ds.source == "verifiers":
            check_environment(ds.task, key=key)


def _check_generated(cfg: "Config") -> None:
    """reasoning-gym datasets: a known task with its own options; held-out problems not the training ones."""
    sets = [("train_dataset", cfg.train_dataset), ("valid_dataset", cfg.valid_dataset)]
    generated = [(key, ds) for key, ds in sets if ds is not None and ds.source == "reasoning_gym"]
    if not generated:
        return
    from rlstream.common.reasoning_gym_tasks import check_task

    for key, ds in generated:
        if not ds.task:
            raise ConfigError(f"{key}.source=reasoning_gym needs {key}.task (a reasoning-gym task name, e.g. chain_sum)")
        check_task(ds.task, ds.config, seed=ds.seed if ds.seed is not None else cfg.seed, size=ds.size, key=key)
    train, valid = cfg.train_dataset, cfg.valid_dataset
    # reasoning-gym draws problem i with Random(seed + i): overlapping seed ranges share problems.
    if len(generated) == 2 and (train.task, train.config) == (valid.task, valid.config) \
            and valid.seed < train.seed + train.size and train.seed < valid.seed + valid.size:
        raise ConfigError(f"valid_dataset.seed={valid.seed} (size {valid.size}) overlaps train_dataset.seed={train.seed} "
                          f"(size {train.size}): problem i is drawn with seed + i, so the held-out set would hold training "
                          f"problems; set valid_dataset.seed >= {train.seed + train.size} (or leave it unset)")


def _check_correction(a: ActorConfig) -> None:
    rs = a.rejection_sampling
    if a.policy_loss == "sapo" and a.use_decoupled_loss:
        raise ConfigError("actor.policy_loss=sapo gates the ratio to the old policy itself: set "
                          "actor.use_decoupled_loss=false (as AReaL requires for use_sapo_loss)")
    if rs is not None and a.behav_imp_weight_cap is not None:
        raise ConfigError("actor.behav_imp_weight_cap and actor.rejection_sampling are both set: behav_imp_weight_cap is "
                          "the old spelling of rejection_sampling {level: token, action: mask, metric: ratio, upper: cap}; keep one")
    if a.correction is not None and not (a.use_decoupled_loss or a.recompute_logprob):
        key = "actor.rejection_sampling" if rs is not None else "actor.behav_imp_weight_cap"
        raise ConfigError(f"{key} corrects π_prox/π_behav, which is 1 without a recomputed policy: "
                          "set actor.use_decoupled_loss=true or actor.recompute_logprob=true, or drop it")
    if a.aipo_rho is not None and a.policy_loss != "ppo":
        raise ConfigError(f"actor.aipo_rho replaces the PPO clip: it needs actor.policy_loss=ppo, got {a.policy_loss}")
    if a.reference_reset_interval is not None and (a.lora is not None or a.backend != "hf"):
        raise ConfigError("actor.reference_reset_interval copies the policy's weights into the reference model: it "
                          "needs actor.backend=hf without actor.lora (unset it, or train all weights)")
    if a.trainable_map and a.lora is not None and any(a.trainable_map.values()):
        raise ConfigError("actor.trainable_map with actor.lora may only freeze (false values): the adapter is what "
                          "trains")
    if rs is None:
        return
    if rs.lower is not None and rs.lower > rs.upper:
        raise ConfigError(f"actor.rejection_sampling.lower ({rs.lower}) is above upper ({rs.upper})")
    if rs.metric == "ratio":
        if rs.upper <= 1.0:
            raise ConfigError(f"actor.rejection_sampling.upper must be > 1 for metric=ratio (else every token that "
                              f"differs is dropped), got {rs.upper}")
        if rs.lower is not None and rs.lower <= 0:
            raise ConfigError(f"actor.rejection_sampling.lower must be > 0 for metric=ratio, got {rs.lower}")
    elif rs.metric in ("kl_k2", "kl_k3") and rs.upper <= 0:
        raise ConfigError(f"actor.rejection_sampling.upper must be > 0 for metric={rs.metric}, got {rs.upper}")
    if rs.action == "clamp" and rs.metric != "ratio":
        raise ConfigError(f"actor.rejection_sampling.action=clamp truncates the ratio itself: it needs metric=ratio, "
                          f"got {rs.metric} (use action=mask to filter on a KL estimate)")
    if rs.action == "clamp" and rs.weight == "none":
        raise ConfigError("actor.rejection_sampling.action=clamp with weight=none clamps nothing: use action=mask")
