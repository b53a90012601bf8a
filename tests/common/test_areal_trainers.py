"""AReaL's SFT and RW experiment files (common/areal_trainers.py) -> `rlstream sft` / `rlstream rw` configs."""

import pytest

from rlstream.common.areal import translate_areal
from rlstream.common.areal_trainers import experiment_kind
from rlstream.common.config import ConfigError, load_config_dict

OPTIMIZER = {"type": "adam", "lr": 2e-5, "weight_decay": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5,
             "lr_scheduler_type": "cosine", "gradient_clipping": 1.0}
RUN_SECTIONS = {"saver": {"freq_epochs": 1, "freq_steps": None}, "recover": {"mode": "disabled", "freq_secs": 3600},
                "evaluator": {"freq_epochs": 1}, "stats_logger": {"wandb": {"mode": "online"}}}


def sft_file() -> dict:
    """AReaL's examples/math/gsm8k_sft.yaml, interpolations resolved."""
    return {"experiment_name": "gsm8k-sft", "trial_name": "trial0", "seed": 1, "total_train_epochs": 2,
            "tokenizer_path": "/models/q", "cluster": {"n_nodes": 1, "fileroot": "/tmp/areal"},
            "model": {"experiment_name": "gsm8k-sft", "path": "/models/q", "init_from_scratch": False,
                      "gradient_checkpointing": True, "dtype": "bfloat16", "mb_spec": {"max_tokens_per_mb": 4096},
                      "optimizer": dict(OPTIMIZER), "backend": "fsdp"},
            "train_dataset": {"batch_size": 128, "shuffle": True, "num_workers": 4, "path": "/data/sft.jsonl",
                              "type": "sft"},
            "valid_dataset": {"batch_size": 128, "path": "/data/valid.jsonl", "type": "sft"}, **RUN_SECTIONS}


def rw_file() -> dict:
    """AReaL's examples/alignment/hhrlhf_rw.yaml: the trained model is `actor` with is_critic, no rollout."""
    optimizer = {k: v for k, v in OPTIMIZER.items() if k != "weight_decay"}
    return {"experiment_name": "hhrlhf-rw", "trial_name": "trial0", "seed": 1, "total_train_epochs": 1,
            "allocation_mode": "d8p1t1", "cluster": {"fileroot": "/tmp/areal"},
            "actor": {"path": "/models/q", "is_critic": True, "disable_dropout": True, "dtype": "bfloat16",
                      "mb_spec": {"max_tokens_per_mb": 4096, "granularity": 2}, "optimizer": optimizer,
                      "scheduling_spec": [{"task_type": "worker", "gpu": 1}]},
            "train_dataset": {"batch_size": 256, "path": "/data/pairs.jsonl", "type": "rw", "max_length": 512},
            "valid_dataset": {"batch_size": 256, "path": "/data/pairs.jsonl", "type": "rw"}, **RUN_SECTIONS}


def test_the_kind_comes_from_the_dataset_type_or_the_trained_section():
    assert experiment_kind(sft_file()) == "sft" and experiment_kind(rw_file()) == "rw"
    assert experiment_kind({"model": {"path": "/m"}}) == "sft"
    assert experiment_kind({"model": {"is_critic": True}}) == "rw"
    assert experiment_kind({"actor": {"is_critic": True}, "gconfig": {}}) is None  # an RL file's mistake
    assert experiment_kind({"actor": {"path": "/m"}, "train_dataset": {"type": "rl"}, "gconfig": {}}) is None


def test_an_sft_file_becomes_the_warm_start_with_its_optimizer_and_epochs():
    t = translate_areal(sft_file())
    cfg = load_config_dict(t.config)
    lc = cfg.launcher
    assert cfg.actor.path == "/models/q" and cfg.actor.dtype == "bfloat16" and cfg.actor.gradient_checkpointing
    assert lc.sft_optimizer is not None and lc.sft_optimizer.lr == 2e-5 and lc.sft_optimizer.beta2 == 0.95
    assert lc.sft_optimizer.lr_scheduler_type == "cosine" and lc.sft_optimizer.weight_decay == 0.05
    assert lc.sft_batch_size == 128 and lc.sft_epochs == 2 and lc.sft_steps == 0
    assert cfg.train_dataset.path == "/data/sft.jsonl"
    why = dict(t.dropped)
    assert why["model.backend"].startswith("one process") and "valid_dataset.path" in why
    assert why["saver.freq_epochs"].startswith("rlstream sft writes the model once")
    assert not t.added  # no RL defaults (advantage normalisation ...) in a supervised run
    assert any("rlstream sft --config" in n for n in t.notes)


def test_an_rw_file_becomes_rlstream_rw():
    t = translate_areal(rw_file())
    cfg = load_config_dict(t.config)
    rc = cfg.rw
    assert rc.path == "/models/q" and rc.dataset == "/data/pairs.jsonl" and rc.batch_size == 256
    assert rc.epochs == 1 and rc.max_seq_len == 512 and rc.optimizer.lr == 2e-5
    assert rc.optimizer.weight_decay == 0.01  # AReaL's default where the file has none
    assert cfg.launcher.n_engines == 1 and "rollout" not in t.config  # allocation_mode: no engines for rw
    why = dict(t.dropped)
    assert why["allocation_mode"].startswith("rlstream rw trains in one process")
    assert why["actor.dtype"].startswith("rlstream rw trains in float32")
    assert why["actor.scheduling_spec"] and why["valid_dataset.batch_size"].startswith("rlstream rw holds out")
    counted = set(t.same) | {s for s, _ in t.translated} | set(why)
    assert {"actor.path", "actor.is_critic", "actor.optimizer.lr", "train_dataset.type", "total_train_epochs"} <= counted


def test_steps_win_over_epochs_and_values_rlstream_cannot_honour_are_refused():
    data = sft_file()
    data["total_train_steps"] = 50
    t = translate_areal(data)
    assert t.config["launcher"]["sft_steps"] == 50 and "sft_epochs" not in t.config["launcher"]
    assert dict(t.dropped)["total_train_epochs"] == "total_train_steps decides"
    data["model"]["init_from_scratch"] = True
    with pytest.raises(ConfigError, match=r"model.init_from_scratch=true: rlstream sft starts from the weights"):
        translate_areal(data)
    data = rw_file()
    data["train_dataset"]["type"] = "sft"  # an SFT file whose model is a critic
    with pytest.raises(ConfigError, match=r"actor.is_critic=True: an AReaL SFT experiment trains a causal LM"):
        translate_areal(data)


def test_lora_keys_are_dropped_without_use_lora_and_refused_with_it():
    data = sft_file()
    data["model"].update(use_lora=False, lora_rank=8, target_modules=["q_proj"])
    why = dict(translate_areal(data).dropped)
    assert why["model.use_lora"] == "false: every weight is trained" and why["model.lora_rank"] == "use_lora is not true"
    data["model"]["use_lora"] = True
    with pytest.raises(ConfigError, match=r"model.use_lora=true: rlstream sft trains every weight"):
        translate_areal(data)


def test_loss_scaling_and_offload_of_model_optimizer_reach_the_warm_start():
    data = sft_file()
    data["model"]["optimizer"] |= {"initial_loss_scale": 65536.0, "min_loss_scale": 2.0, "loss_scale_window": 10,
                                   "hysteresis": 3, "offload": True}
    t = translate_areal(data)
    opt = load_config_dict(t.config).launcher.sft_optimizer
    assert (opt.initial_loss_scale, opt.min_loss_scale, opt.loss_scale_window, opt.hysteresis, opt.offload) == \
        (65536.0, 2.0, 10, 3, True)
    assert {src for src, _ in t.translated} >= {f"model.optimizer.{k}" for k in (
        "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "offload")}


def test_model_fsdp_becomes_the_warm_starts_fsdp_settings():
    data = sft_file()
    data["model"]["fsdp"] = {"wrap_policy": {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]},
                             "offload_params": True}
    t = translate_areal(data)
    fsdp = load_config_dict(t.config).launcher.sft_fsdp
    assert fsdp.wrap_policy.transformer_layer_cls_to_wrap == ["Qwen2DecoderLayer"] and fsdp.offload_params
    assert {"model.fsdp.wrap_policy.transformer_layer_cls_to_wrap", "model.fsdp.offload_params"} <= \
        {src for src, _ in t.translated}
    rw = rw_file()
    rw["actor"]["fsdp"] = {"offload_params": True}
    assert dict(translate_areal(rw).dropped)["actor.fsdp.offload_params"].startswith("rlstream rw trains in one")
