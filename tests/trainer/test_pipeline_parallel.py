"""Pipeline stages (actor.fsdp.pipeline_parallel): each rank holds consecutive layers, and the stages together compute
exactly what the whole model computes — logits, gradients, the gradient norm — and train, checkpoint, resume and
export the weights one process trains."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rlstream.broker import Keys, StepLog, namespace
from rlstream.common.config import ConfigError, load_config
from rlstream.trainer.pipeline_parallel import Pipeline, stage_layers
from tests.trainer.test_parallel import CRITIC, NPROC, _overrides, _write

torch.set_num_threads(1)


def test_stage_layers_are_consecutive_and_cover_every_layer():
    assert stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in stage_layers(30, 4)] == [8, 8, 7, 7]


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def _stage_worker(rank: int, world: int, tie: bool, chunks: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        whole, model = _llama(tie), _llama(tie)
        pipe = Pipeline(stages=world, stage=rank, ranks=list(range(world)), device=torch.device("cpu"),
                        group=dist.group.WORLD, tie_group=dist.new_group([0, world - 1]), chunks=chunks)
        pipe.split(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        whole.train()
        ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
        pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]])  # two sequences packed in the first row
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        expected = whole(input_ids=ids, position_ids=pos, use_cache=False).logits
        logits.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        pipe.sum_tied_grads(model)
        named = dict(whole.named_parameters())  # a tied head is the embeddings there
        grad_diff = max(float((p.grad - named.get(n, named["model.embed_tokens.weight"]).grad).abs().max())
                        for n, p in model.named_parameters())
        squares = pipe.norm_squares(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()), model)
        out[rank] = {"logits": float((logits - expected).abs().max()), "grads": grad_diff,
                     "norm": (squares ** 0.5, sum(float(p.grad.double().pow(2).sum()) for p in whole.parameters()) ** 0.5),
                     "params": sum(p.numel() for p in model.parameters()),
                     "whole": sum(p.numel() for p in whole.parameters())}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stages,tie,chunks", [(3, False, 1), (2, True, 1), (2, True, 2)],
                         ids=["3-stages", "2-stages-tied", "2-stages-2-virtual"])
def test_stages_compute_the_whole_models_logits_gradients_and_norm(stages, tie, chunks):
    """Gradient checkpointing on (a stage's transfers must not run again when its layers recompute); packed rows.
    Virtual stages: 5 layers in 4 chunks, stage 0 holding layers 0-1 and 3, stage 1 layers 2 and 4."""
    out = mp.Manager().dict()
    mp.spawn(_stage_worker, args=(stages, tie, chunks, _free_port(), out), nprocs=stages)
    for rank in range(stages):
        r = out[rank]
        assert r["logits"] == 0.0 and r["grads"] == 0.0, r
        assert abs(r["norm"][0] - r["norm"][1]) <= 1e-6 * r["norm"][1], r
        assert r["params"] < 0.75 * r["whole"], r  # each stage holds a part


def test_a_model_with_fewer_layers_than_stages_or_another_kind_is_one_line(tiny_model_path):
    from transformers import AutoModelForCausalLM

    pipe = Pipeline(stages=3, stage=0, ranks=[0, 1, 2], device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="has 2 decoder layers, fewer than stages"):
        pipe.split(AutoModelForCausalLM.from_pretrained(tiny_model_path))
    with pytest.raises(ConfigError, match="not a decoder of the Llama kind"):
        pipe.split(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="actor.fsdp.pipeline_parallel=2 does not go with actor.lora"):
        load_config(None, ["actor.fsdp.pipeline_parallel=2", "actor.lora.rank=4", "launcher.n_trainer_procs=2"])


# a critic (GAE's value model) split into the same stages, its clipping binding: a model without tied embeddings
VARIANTS = {"tied-reference": ["actor.kl_ctl=0.1", "actor.use_kl_loss=true", "actor.reference_reset_interval=1"],
            "critic": CRITIC}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_stages_train_like_one_process_across_a_resume(variant, tmp_path, redis_url, rclient, experiment,
                                                           tiny_model_path, tiny_tied_model_path):
    """(By hand: RLSTREAM_TEST_NPROC=4, RLSTREAM_TEST_PARALLEL=ddp|fsdp, two replicas of the two stages;
    RLSTREAM_TEST_PP_MODEL=FOLDER, another model.) Two stages with gradient checkpointing and a clipping norm that
    binds (taken over both stages), and either a model with tied embeddings (their gradients summed between the
    first and the last stage) with a KL term against a reference split the same way and reset to the policy every
    step, or a critic split the same way; a recover checkpoint after step 1 gathered from both stages, the restarted
    stages resume from it and train step 2: the HF exports equal one process's two steps."""
    from rlstream.trainer.main import train
    from transformers import AutoModelForCausalLM

    default = tiny_tied_model_path if variant == "tied-reference" else tiny_model_path
    model_path = Path(os.environ.get("RLSTREAM_TEST_PP_MODEL", default))  # by hand: a real model
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    one, pp = f"{experiment}one", f"{experiment}pp"
    _write(rclient, one, model.config.vocab_size, model)
    _write(rclient, pp, model.config.vocab_size, model)
    common = ["actor.optimizer.gradient_clipping=0.05", "actor.gradient_checkpointing=true", *VARIANTS[variant]]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    logs = ""
    for steps in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
               "-m", "rlstream.launcher.cli", "train",
               *_overrides(tmp_path, redis_url, pp, model_path, *common, "actor.fsdp.pipeline_parallel=2",
                           f"actor.parallel={os.environ.get('RLSTREAM_TEST_PARALLEL', 'ddp')}",
                           "recover.mode=auto", "recover.freq_steps=1", f"total_train_steps={steps}")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        logs += proc.stdout + proc.stderr
    assert "resumed from" in logs and "1 steps done, version 1" in logs, logs[-3000:]
    first, second = stage_layers(model.config.num_hidden_layers, 2)
    heads = ["lm_head"] + ["score"] * (variant == "critic")
    lines = [f"pipeline stage 0 of 2: decoder layers {first.start}-{first.stop - 1}, the embeddings"] + \
        [f"pipeline stage 1 of 2: decoder layers {second.start}-{second.stop - 1}, the final norm and {h}" for h in heads]
    for line in lines:
        assert line in logs, logs[-3000:]
    train(load_config(None, _overrides(tmp_path, redis_url, one, model_path, *common)))

    recs = StepLog(rclient, Keys(namespace(pp, "trial0"))).all()  # one data-parallel rank read each step's groups
    assert sorted((r.step, r.rank) for r in recs) == [(step, rank) for step in (0, 1) for rank in range(NPROC // 2)]
    start = load_file(str(Path(model_path) / "model.safetensors"))
    for final in ["final"] + ["final-critic"] * (variant == "critic"):
        w_one, w_pp = (load_file(str(tmp_path / "runs" / e / "trial0" / "checkpoints" / final / "model.safetensors"))
                       for e in (one, pp))
        assert w_one.keys() == w_pp.keys()
        for k in w_one:
            assert float((w_one[k] - w_pp[k]).abs().max()) <= 2e-6, (final, k)
        assert max(float((w_pp[k] - start[k]).abs().max()) for k in start if k in w_pp) > 25 * 2e-6, final
