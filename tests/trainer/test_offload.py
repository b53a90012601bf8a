"""Optimizer offload (`trainer.offload`): the host-stepped optimizer takes the same steps as the plain one, from
state that is its own host memory, and survives a recover checkpoint."""

from __future__ import annotations

import pytest
import torch

from rlstream.common.config import ConfigError, OptimizerConfig
from rlstream.trainer.checkpoint import Checkpointer, RankState, TrainState
from rlstream.trainer.offload import HostOffloadOptimizer
from rlstream.trainer.optim import build_optimizer, build_scheduler
from rlstream.trainer.parallel import Parallel

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(input_ids=IDS, labels=IDS).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


CFG = dict(lr=1e-2, weight_decay=0.01, warmup_steps_proportion=0.2, lr_scheduler_type="cosine")


def test_the_offloaded_step_equals_the_plain_step_over_several_steps(tiny_model_path):
    plain_model, host_model = _model(tiny_model_path), _model(tiny_model_path)
    plain = build_optimizer(plain_model.parameters(), OptimizerConfig(**CFG))
    host = build_optimizer(host_model.parameters(), OptimizerConfig(**CFG, offload=True))
    assert isinstance(host, HostOffloadOptimizer) and not isinstance(plain, HostOffloadOptimizer)
    _train(plain_model, plain, build_scheduler(plain, OptimizerConfig(**CFG), 5), 5)
    _train(host_model, host, build_scheduler(host, OptimizerConfig(**CFG), 5), 5)
    for (name, p), h in zip(plain_model.named_parameters(), host_model.parameters()):
        assert not torch.equal(p, _model(tiny_model_path).get_parameter(name)), name  # it trained
        torch.testing.assert_close(h, p, rtol=0, atol=1e-6, msg=name)

    params = {p.untyped_storage().data_ptr() for p in host_model.parameters()}
    for p, master in zip(host_model.parameters(), host.inner.param_groups[0]["params"], strict=True):
        state = host.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for t in (state["exp_avg"], state["exp_avg_sq"], master):
            assert t.device.type == "cpu" and t.dtype == torch.float32
            assert t.untyped_storage().data_ptr() not in params  # its own memory, not the model's
        assert torch.equal(master, p)


def test_an_offloaded_optimizer_resumes_from_a_recover_checkpoint(tiny_model_path, tmp_path):
    cfg = OptimizerConfig(**CFG, offload=True)
    model = _model(tiny_model_path)
    opt = build_optimizer(model.parameters(), cfg)
    sched = build_scheduler(opt, cfg, 6)
    _train(model, opt, sched, 2)
    ckpt = Checkpointer(tmp_path, Parallel())
    path = ckpt.save_recover(model, opt, sched, TrainState(step=2), RankState(rank=0, consumer="c"))

    fresh = _model(tiny_model_path)
    opt2 = build_optimizer(fresh.parameters(), cfg)
    sched2 = build_scheduler(opt2, cfg, 6)
    ckpt.load_recover(path, fresh, opt2, sched2)
    _train(model, opt, sched, 2)
    _train(fresh, opt2, sched2, 2)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=name)


def test_offload_with_fsdp_is_refused_in_one_line():
    from rlstream.common.config import load_config

    with pytest.raises(ConfigError, match="actor.optimizer.offload=true with actor.parallel=fsdp: .*offload_params"):
        load_config(None, ["actor.optimizer.offload=true", "actor.parallel=fsdp"])
