"""Expert parallelism (actor.expert_parallel): a tiny Qwen3-MoE's experts divided over two gloo ranks compute the
whole model's logits and gradients, push under HF names, and train the same weights as one process across a
resume; what it does not go with is refused in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlstream.common.config import ConfigError, load_config
from tests.trainer.test_parallel import CRITIC, _overrides, _write

torch.set_num_threads(1)
WORKER = Path(__file__).with_name("expert_parallel_worker.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    from rlstream.launcher.tiny import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny-moe") / "model")


def _torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_divided_experts_compute_the_whole_model(dispatcher, tiny_moe_path, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(_torchrun(str(WORKER), str(tiny_moe_path), dispatcher, str(out)), env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["blocks"] == 2 and r["local_experts"] == 2  # 4 experts per layer, 2 on each rank
    assert r["logits"] <= 1e-5  # each rank's tokens through experts held on both ranks
    assert r["dense_grad"] <= 1e-6  # router, attention, embeddings: this rank's own gradient, as in DDP before its average
    assert r["expert_grad"] <= 1e-6  # experts: the average of both ranks' losses' gradients ...
    assert r["expert_grad_vs_own"] > 1e-4  # ... which is not this rank's own
    assert r["grad_names"] and r["push_names"] and r["push"] == 0.0  # HF names, the loaded weights exactly


@pytest.mark.slow
@pytest.mark.parametrize("wrap,dispatcher,nproc,extra", [
    # every rank holding every expert: DDP must not wait for experts that a rank's tokens did not pick (each rank's
    # last micro-batch is the one-token pass of an empty bin: 8 sequences in 9 micro-batches)
    ("ddp", None, 2, ["actor.mb_spec.n_mbs=9"]),
    # whole decoder layers recomputed in backward: their token exchanges run again, in step on both ranks; a critic
    # (the MoE value model, its experts divided the same way)
    ("ddp", "alltoall", 2, ["actor.gradient_checkpointing=true", *CRITIC, "critic.optimizer.lr=2.0",
                            "critic.optimizer.gradient_clipping=0.5"]),
    # FSDP2 (HSDP) over everything but the experts, each sparse block (with its exchanges) recomputed in backward, and a KL
    # reference (whole on each rank) that takes the divided policy's weights after each step
    ("fsdp", "allgather", 2, ["actor.moe_layer_recompute=true", "actor.kl_ctl=0.1", "actor.reference_reset_interval=1",
                              "actor.fsdp.shard_size=1"]),  # (and FSDP2 as HSDP: 2 replicas of 1 shard)
    # 4 ranks: two groups of 2 divide the experts alike and average their gradients
    ("ddp", "alltoall", 4, [])])
def test_expert_parallel_ranks_match_one_process_across_a_resume(wrap, dispatcher, nproc, extra, tmp_path, redis_url,
                                                                 rclient, experiment, tiny_moe_path):
    """Expert-parallel ranks train one step with a clipping norm that binds (taken over divided and whole
    parameters), save a recover checkpoint, resume from it and train a second: the HF export equals one process's
    two steps, every expert under its own name."""
    from transformers import AutoModelForCausalLM

    from rlstream.trainer.main import train

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path).eval()
    one, ep = f"{experiment}one", f"{experiment}ep"
    _write(rclient, one, model.config.vocab_size, model)
    _write(rclient, ep, model.config.vocab_size, model)
    clip = ["actor.optimizer.gradient_clipping=0.5", "actor.optimizer.lr=2.0"]  # binds (norm ~1.2); experts move
    split = [f"actor.parallel={wrap}", "recover.freq_steps=1", *clip, *extra]
    if dispatcher is not None:
        split += ["actor.expert_parallel=2", f"actor.moe_token_dispatcher={dispatcher}"]
    logs = ""
    for steps in (1, 2):
        cmd = _torchrun("-m", "rlstream.launcher.cli", "train",
                        *_overrides(tmp_path, redis_url, ep, tiny_moe_path, *split, "recover.mode=auto",
                                    f"total_train_steps={steps}"), nproc=nproc)
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        logs += proc.stdout + proc.stderr
    assert "resumed from" in logs and "1 steps done, version 1" in logs, logs[-3000:]
    line = f"expert parallel: the experts of 2 layers divided over 2 ranks ({dispatcher} dispatcher), {nproc // 2} "
    assert (line in logs) == (dispatcher is not None), logs[-3000:]
    assert ("moe layer recompute: 2 sparse blocks run again in backward" in logs) == \
        ("actor.moe_layer_recompute=true" in extra)
    train(load_config(None, _overrides(tmp_path, redis_url, one, tiny_moe_path, *clip, *extra)))

    base = load_file(str(Path(tiny_moe_path) / "model.safetensors"))
    w_one = load_file(str(tmp_path / "runs" / one / "trial0" / "checkpoints" / "final" / "model.safetensors"))
    w_ep = load_file(str(tmp_path / "runs" / ep / "trial0" / "checkpoints" / "final" / "model.safetensors"))
    assert sorted(w_ep) == sorted(w_one) and "model.layers.1.mlp.experts.3.down_proj.weight" in w_ep
    moved = {k: float((w_one[k] - base[k]).abs().max()) for k in base}
    assert max(v for k, v in moved.items() if ".experts.3." in k) > 1e-5  # a rank-1 expert trained ...
    for k in base:  # ... as in one process, up to float summation order
        assert float((w_one[k] - w_ep[k]).abs().max()) <= 2e-6, k
    if any(o.startswith("critic.") for o in extra):  # the value model too, every expert under its name
        c_one, c_ep = (load_file(str(tmp_path / "runs" / e / "trial0" / "checkpoints" / "final-critic" /
                                     "model.safetensors")) for e in (one, ep))
        assert sorted(c_ep) == sorted(c_one) and "model.layers.1.mlp.experts.3.down_proj.weight" in c_ep
        assert max(float((c_one[k] - base[k]).abs().max()) for k in c_one if ".experts.3." in k) > 1e-5
        assert max(float((c_one[k] - c_ep[k]).abs().max()) for k in c_one) <= 2e-6


@pytest.mark.slow
def test_a_push_from_expert_parallel_ranks_serves_every_expert(tiny_moe_path, redis_url, experiment, keys, rclient,
                                                               tmp_path):
    """Both ranks call push; each stacked expert tensor is gathered and sent as one tensor per expert under its HF
    name, and the local engine serving the MoE model then answers with the pushed weights exactly."""
    from transformers import AutoModelForCausalLM

    from tests.trainer.test_weights import EngineProc, check_two_rank_push

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    engine = EngineProc(tiny_moe_path, tmp_path / "engine", ["server.register=false"]).wait_ready()
    try:
        check_two_rank_push(engine, tiny_moe_path, base, "ep", redis_url, experiment, keys, rclient, tmp_path)
    finally:
        engine.stop()


def test_moe_layer_recompute_keeps_no_block_activations_and_the_same_gradients(tiny_moe_path, tiny_model_path):
    """actor.moe_layer_recompute: each sparse block runs again in backward (its router twice per step), the tensors
    autograd keeps for backward shrink, and the gradients are the same bits."""
    from transformers import AutoModelForCausalLM

    from rlstream.trainer.expert_parallel import recompute_moe_blocks

    ids = torch.randint(0, 60, (1, 48), generator=torch.Generator().manual_seed(3))
    runs = {}
    for recompute in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
        if recompute:
            assert recompute_moe_blocks(model) == 2
        calls = []
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda *_: calls.append(1))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
        runs[recompute] = (len(calls), sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert runs[False][0] == 2 and runs[True][0] == 4  # two sparse layers, each run again in backward
    assert runs[True][1] < runs[False][1]
    assert all(torch.equal(runs[True][2][n], g) for n, g in runs[False][2].items())
    with pytest.raises(ConfigError, match="actor.moe_layer_recompute=true: LlamaForCausalLM has no mixture-of-experts"):
        recompute_moe_blocks(AutoModelForCausalLM.from_pretrained(tiny_model_path))


@pytest.mark.parametrize("extra,named", [
    (["actor.fsdp.tensor_parallel=2", "actor.parallel=fsdp"], "actor.fsdp.tensor_parallel"),
    (["actor.context_parallel=2"], "actor.context_parallel"),
    (["actor.lora.rank=4"], "actor.lora"),
    (["actor.backend=megatron"], "actor.backend=megatron"),
    (["launcher.n_trainer_procs=3"], "must divide launcher.n_trainer_procs=3"),
    (["actor.optimizer.offload=true"], "actor.optimizer.offload"),
])
def test_what_expert_parallel_does_not_go_with_is_named(extra, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.expert_parallel=2", "launcher.n_trainer_procs=2", *extra])
    msg = str(err.value)
    assert "actor.expert_parallel=2" in msg and named in msg and "\n" not in msg, msg


def test_a_dense_model_or_experts_the_ranks_do_not_divide_are_refused(tiny_model_path, tiny_moe_path):
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModelForCausalLM

    from rlstream.trainer.expert_parallel import install_expert_parallel

    class FakeMesh(DeviceMesh):  # install_expert_parallel checks the sizes before any collective
        def __init__(self, n):
            self.n = n

        def size(self, dim=None):
            return self.n

    with pytest.raises(ConfigError, match="actor.expert_parallel=2: LlamaForCausalLM has no mixture-of-experts"):
        install_expert_parallel(AutoModelForCausalLM.from_pretrained(tiny_model_path), FakeMesh(2))
    with pytest.raises(ConfigError, match="actor.expert_parallel=3 does not divide the model's 4 experts per layer"):
        install_expert_parallel(AutoModelForCausalLM.from_pretrained(tiny_moe_path), FakeMesh(3))
