"""actor.backend=megatron on a CUDA GPU: megatron-core's own forward (no CPU redirection) against HF.

Marked `cuda`: skipped on CPU-only machines (CI); run on the lent GPU machine with
`python -m pytest -m cuda tests/trainer/test_megatron_cuda.py` (benchmarks/README.md, GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.cuda
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture
def cuda_megatron():
    """Tear down the one-process NCCL group and megatron's parallel state the backend creates."""
    yield torch.device("cuda", 0)
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_megatron_on_cuda_matches_hf_forward_and_ppo_step(cuda_megatron, tiny_model_path):
    from rlstream.broker.stream import Entry
    from rlstream.common.config import load_config
    from rlstream.trainer.batch import collate
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer.model import load_model
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.ppo import PPOActor

    dev = cuda_megatron
    base = [f"actor.path={tiny_model_path}", "actor.kl_ctl=0.0", "actor.ppo_n_minibatches=2", "actor.adv_norm=null",
            "actor.mb_spec.max_tokens_per_mb=64", "total_train_steps=10", "actor.weight_update_mode=none",
            "actor.dtype=float32"]
    hf_cfg = load_config(None, base)
    mg_cfg = load_config(None, [*base, "actor.backend=megatron"])
    hf = load_model(str(tiny_model_path), hf_cfg.actor, dev)
    mega = load_model(str(tiny_model_path), mg_cfg.actor, dev)
    groups = synthetic_groups(4, seed=1, vocab_size=hf.config.vocab_size, group_size=4, out_len=(3, 20))
    batch = collate([Entry(f"{i}-0", g, 0) for i, g in enumerate(groups)])
    actors = []
    for model, cfg in ((hf, hf_cfg), (mega, mg_cfg)):
        opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
        actors.append(PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, 10),
                               Parallel(device=dev)))
    lp_hf, lp_mg = (a.forward_logp(a.module, batch) for a in actors)
    torch.testing.assert_close(lp_mg, lp_hf, atol=1e-4, rtol=1e-4)
    ref, got = (a.train_step(batch, 0) for a in actors)
    assert got["loss/total"] == pytest.approx(ref["loss/total"], rel=1e-4)
    assert got["optim/grad_norm"] == pytest.approx(ref["optim/grad_norm"], rel=1e-4)
    updated = dict(mega.hf_named_tensors())
    for name, w in hf.state_dict().items():
        torch.testing.assert_close(updated[name], w, atol=1e-5, rtol=1e-4, msg=name)
