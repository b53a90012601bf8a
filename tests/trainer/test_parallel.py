"""Two-rank DDP, FSDP2 and tensor parallelism (gloo, under torchrun) give the same weights as one process on the same
batches; FSDP2's units are the model's decoder layers or the classes actor.fsdp.wrap_policy names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlstream.broker import Keys, StepLog, TrajectoryStream, namespace
from rlstream.common.config import load_config
from rlstream.consumer.synthetic import synthetic_groups

torch.set_num_threads(1)


def _overrides(tmp_path, redis_url, experiment, model_path, *extra):
    return [
        f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={model_path}",
        f"cluster.fileroot={tmp_path / 'runs'}", "total_train_steps=2", "rollout.consumer_batch_size=4",
        "gconfig.n_samples=4", "actor.weight_update_mode=none", "actor.kl_ctl=0.0", "actor.parallel=ddp",
        # SGD without clipping: the update is the gradient itself, so any error in how ranks
        # scale and average their gradients shows (Adam would normalise it away).
        "actor.optimizer.type=sgd", "actor.optimizer.gradient_clipping=0", "actor.optimizer.lr=0.05",
        "actor.optimizer.warmup_steps_proportion=0", "actor.ppo_n_minibatches=1",
        # a small token budget: several micro-batches, a different number on each rank
        "actor.mb_spec.max_tokens_per_mb=48", "actor.use_decoupled_loss=true", "actor.recompute_logprob=true",
        "actor.reward_norm.mean_level=group", "actor.reward_norm.std_level=group",  # adv_norm: batch level
        "rollout.max_head_offpolicyness=4", "recover.mode=disabled", "stats_logger.tensorboard.enabled=false", *extra,
    ]


def _write(rclient, experiment, vocab, model):
    stream = TrajectoryStream(rclient, Keys(namespace(experiment, "trial0")))
    for g in synthetic_groups(8, seed=5, vocab_size=vocab, model=model, out_len=(3, 20)):
        stream.append(g)


# a critic (GAE's value model) trained by SGD beside the actor, its clipping norm binding (without the dropout
# before its head: random masks need not match one process's)
CRITIC = ["actor.disable_dropout=true", "critic.optimizer.type=sgd", "critic.optimizer.lr=0.05", "critic.optimizer.gradient_clipping=0.05",
          "critic.optimizer.warmup_steps_proportion=0", "critic.ppo_n_minibatches=1", "critic.mb_spec.max_tokens_per_mb=48"]

# The seeds' options that normalise over the whole minibatch keep ranks and one process equal too (an
# early-stop threshold that never binds still registers its counter on both ranks).
NPROC = int(os.environ.get("RLSTREAM_TEST_NPROC", "2"))  # trainer ranks; 4 by hand: HSDP of 2 replicas of 2 shards
OPTIONS = {"plain": [], "seed_options": ["actor.mu_iterations=2", "actor.positive_nll_coef=0.1",
                                         "actor.early_stop_imp_ratio=100"],
           # gradients averaged in bfloat16 (torch's compress hook): equal to bf16 precision, and visibly not exact
           "bf16_reduce": ["actor.grad_reduce_dtype=bfloat16"],
           # FSDP2 sharding the attention and MLP blocks (not whole decoder layers) as its units: the same weights
           "fsdp_units": ["actor.parallel=fsdp",
                          "actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap=[LlamaAttention, LlamaMLP]"],
           # HSDP on a 2-D mesh: 2 replicas of NPROC/2 shards, gradients reduce-scattered in a replica, then
           # all-reduced across the two
           "hsdp": ["actor.parallel=fsdp", f"actor.fsdp.shard_size={NPROC // 2}"],
           # Ulysses: each packed row split over 2 ranks (NPROC=4: 2 data-parallel ranks of 2), FSDP2 over all, with
           # a clipping norm that binds (DDP's average: test_context_parallel.py; tensor parallelism: the resume test),
           # a critic split the same way, and FSDP2 as HSDP (NPROC / 2 shards)
           "cp": ["actor.context_parallel=2", "actor.parallel=fsdp", "actor.optimizer.gradient_clipping=0.05", *CRITIC,
                  f"actor.fsdp.shard_size={NPROC // 2}"],
           # Ulysses under LoRA adapters, FSDP2 sharding them (and a critic's): the merged export (and the critic's
           # adapter) equal one process's
           "cp_lora": ["actor.context_parallel=2", "actor.parallel=fsdp", "actor.lora.rank=4", "actor.lora.alpha=8",
                       "actor.optimizer.lr=0.5", *CRITIC, "critic.lora.rank=4", "critic.lora.alpha=8",
                       "critic.optimizer.lr=0.5"]}
TP = {"cp": 2, "cp_lora": 2}  # ranks that train the same groups (1: data parallel only)


@pytest.mark.slow
@pytest.mark.parametrize("options", list(OPTIONS))
def test_two_rank_ddp_matches_one_process(options, tmp_path, redis_url, rclient, experiment, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from rlstream.trainer.main import train

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    vocab = model.config.vocab_size
    one, ddp = f"{experiment}one", f"{experiment}ddp"
    _write(rclient, one, vocab, model)
    _write(rclient, ddp, vocab, model)

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           "-m", "rlstream.launcher.cli", "train",
           *_overrides(tmp_path, redis_url, ddp, tiny_model_path, *OPTIONS[options])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if options == "fsdp_units":  # each layer's two blocks (the tiny model has 2 layers)
        assert "FSDP2 units: 4 (LlamaAttention, LlamaMLP) + the model" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    if options in ("hsdp", "cp"):
        assert f"HSDP: 2 replicas of {NPROC // 2} shards" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    tp = TP.get(options, 1)
    if tp > 1:
        line = f"context parallel (Ulysses): each sequence split over {tp} ranks, {NPROC // tp} data-parallel rank(s)"
        assert line in proc.stdout + proc.stderr, proc.stderr[-3000:]

    alone = [o for o in OPTIONS[options] if not o.startswith("actor.context_parallel=")]  # one process: whole
    train(load_config(None, _overrides(tmp_path, redis_url, one, tiny_model_path, *alone)))

    # Each data-parallel rank read its share of each step's groups through the consumer group (once per
    # tensor-parallel group: its other ranks load the same entries by id).
    recs = StepLog(rclient, Keys(namespace(ddp, "trial0"))).all()
    dp = NPROC // tp
    assert sorted((r.step, r.rank) for r in recs) == [(step, rank) for step in (0, 1) for rank in range(dp)]
    assert all(len(r.entry_ids) == 4 // dp for r in recs)

    base = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    w_one = load_file(str(tmp_path / "runs" / one / "trial0" / "checkpoints" / "final" / "model.safetensors"))
    w_ddp = load_file(str(tmp_path / "runs" / ddp / "trial0" / "checkpoints" / "final" / "model.safetensors"))
    moved = max(float((w_one[k] - base[k]).abs().max()) for k in base)
    assert moved > 1e-4  # two SGD steps moved the weights ...
    diff = {k: float((w_one[k] - w_ddp[k]).abs().max()) for k in base}
    if options == "bf16_reduce":  # one SGD step moves a weight by lr x grad; bf16 keeps 8 bits of the grad
        assert 2e-6 < max(diff.values()) < moved / 50, (moved, diff)
        return
    for k in base:  # ... identically, up to float summation order
        assert diff[k] <= 2e-6, (k, diff[k])
    if any(o.startswith("critic.") for o in OPTIONS[options]):  # the value model too (a LoRA critic's export is its adapter)
        name = "adapter_model" if "critic.lora.rank=4" in OPTIONS[options] else "model"
        c_one, c_ddp = (load_file(str(tmp_path / "runs" / e / "trial0" / "checkpoints" / "final-critic" /
                                      f"{name}.safetensors")) for e in (one, ddp))
        start = {k: torch.zeros_like(v) if "lora_B" in k else base.get(k, v) for k, v in c_one.items()}
        assert c_one.keys() == c_ddp.keys() and max(float((c_one[k] - start[k]).abs().max()) for k in c_one) > 1e-4
        c_diff = {k: float((c_one[k] - c_ddp[k]).abs().max()) for k in c_one}
        assert max(c_diff.values()) <= 2e-6, sorted(c_diff.items(), key=lambda kv: -kv[1])[:6]


def test_fsdp_units_default_to_the_decoder_layers_and_a_bad_class_name_is_one_line(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from rlstream.common.config import ConfigError, FSDPConfig, FSDPWrapPolicy
    from rlstream.trainer.parallel import Parallel, fsdp_units

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert [type(u).__name__ for u in fsdp_units(model, FSDPConfig())] == ["LlamaDecoderLayer"] * 2
    named = FSDPConfig(wrap_policy=FSDPWrapPolicy(transformer_layer_cls_to_wrap=["LlamaMLP", "LlamaDecoderLayer"]))
    kinds = [type(u).__name__ for u in fsdp_units(model, named)]
    assert kinds == ["LlamaMLP", "LlamaDecoderLayer"] * 2  # each block before the layer holding it
    bad = FSDPConfig(wrap_policy=FSDPWrapPolicy(transformer_layer_cls_to_wrap=["QwenBlock"]))
    with pytest.raises(ConfigError, match=r"transformer_layer_cls_to_wrap=\['QwenBlock'\]: no submodule .* LlamaMLP"):
        Parallel(mode="fsdp").wrap(model, fsdp=bad)  # refused before any process group is needed


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel,critic", [(False, []), (True, CRITIC)], ids=["tensor", "sequence-critic"])
def test_tensor_parallel_ranks_match_one_process_across_a_resume(tmp_path, redis_url, rclient, experiment,
                                                                 tiny_model_path, sequence_parallel, critic):
    """Two tensor-parallel ranks (each layer's projections split; RLSTREAM_TEST_NPROC=4: FSDP2 over 2 such pairs)
    train one step with a clipping norm that binds, taken over split and whole parameters together, and save a
    recover checkpoint of split (DTensor) parameters; restarted, they resume from it and train the second step: the
    same weights as one process's two steps. With sequence parallelism the norms between the split blocks run on
    each rank's half of the positions (their gradients partial sums of the ranks'); a critic (GAE) is split the same
    way, and trains the same value model as one process's."""
    from rlstream.trainer.main import train

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    vocab = model.config.vocab_size
    one, tp = f"{experiment}one", f"{experiment}tp"
    _write(rclient, one, vocab, model)
    _write(rclient, tp, vocab, model)
    clip = ["actor.optimizer.gradient_clipping=0.05", *critic]
    split = ["actor.parallel=fsdp", "actor.fsdp.tensor_parallel=2", "recover.freq_steps=1", *clip,
             f"actor.fsdp.sequence_parallel={str(sequence_parallel).lower()}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    logs = ""
    for steps in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
               "-m", "rlstream.launcher.cli", "train",
               *_overrides(tmp_path, redis_url, tp, tiny_model_path, *split, "recover.mode=auto",
                           f"total_train_steps={steps}")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        logs += proc.stdout + proc.stderr
    assert "resumed from" in logs and "1 steps done, version 1" in logs, logs[-3000:]
    sp = " (and the positions between them: sequence parallel)" if sequence_parallel else ""
    assert f"tensor parallel: 14 projections split over 2 ranks{sp}, {NPROC // 2} data-parallel rank(s)" in logs
    train(load_config(None, _overrides(tmp_path, redis_url, one, tiny_model_path, *clip)))

    # each data-parallel rank read its share once (its tensor-parallel peer loaded the same entries by id)
    recs = StepLog(rclient, Keys(namespace(tp, "trial0"))).all()
    assert sorted((r.step, r.rank) for r in recs) == [(step, rank) for step in (0, 1) for rank in range(NPROC // 2)]
    assert all(len(r.entry_ids) == 4 // (NPROC // 2) for r in recs)
    for final in ["final"] + ["final-critic"] * bool(critic):
        w_one = load_file(str(tmp_path / "runs" / one / "trial0" / "checkpoints" / final / "model.safetensors"))
        w_tp = load_file(str(tmp_path / "runs" / tp / "trial0" / "checkpoints" / final / "model.safetensors"))
        assert w_one.keys() == w_tp.keys()
        for k in w_one:
            assert float((w_one[k] - w_tp[k]).abs().max()) <= 2e-6, (final, k)
        start = load_file(str(tiny_model_path / "model.safetensors"))  # each model trained away from its start
        moved = max(float((w_tp[k] - start[k]).abs().max()) for k in start if k in w_tp)
        assert moved > 25 * 2e-6, (final, moved)  # (2e-4 here: the equality above is 100x tighter)
