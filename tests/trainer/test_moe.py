"""Mixture-of-experts policies in the hf backend: a tiny Qwen3-MoE served by the local engine and trained by PPOActor.

The engine's behaviour logprobs must equal the trainer's packed recomputation (the router picks the same experts on
both sides), a train step must move the router and the experts it routed to, and a push of the trained weights by
their HF names must make the engine serve exactly the trained policy.
"""

import asyncio
import math

import pytest
import torch

from rlstream.engine.local import LocalEngine
from rlstream.trainer.weights.params import materialize, weight_entries
from tests.trainer.test_ppo import B, G, OUT, PROMPT, _actor, _batch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    from rlstream.launcher.tiny import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny-moe") / "model")


def _generate(engine: LocalEngine, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    async def run():
        sp = {"max_new_tokens": OUT, "temperature": 1.0, "ignore_eos": True}
        return await asyncio.gather(*(engine.generate(p.tolist(), sp) for p in prompts))

    results = asyncio.run(run())
    ids = torch.tensor([p.tolist() + r.output_ids for p, r in zip(prompts, results)])
    logps = torch.tensor([[lp for lp, _, _ in r.meta_info.output_token_logprobs] for r in results])
    return ids, logps


def test_an_moe_policy_is_served_trained_and_pushed(tiny_moe_path):
    actor = _actor(tiny_moe_path, "actor.ppo_n_minibatches=1")
    assert type(actor.model).__name__ == "Qwen3MoeForCausalLM"
    engine = LocalEngine(tiny_moe_path, device="cpu", max_batch_size=32, seed=0)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(4, actor.model.config.vocab_size, (B, PROMPT), generator=gen).repeat_interleave(G, 0)
        batch = _batch(*_generate(engine, prompts), version=0)
        recomputed = actor.forward_logp(actor.model, batch)
        assert (recomputed - batch.behav_logp)[batch.loss_mask].abs().max() < 1e-4

        before = {k: v.detach().clone() for k, v in actor.model.named_parameters()}
        stats = actor.train_step(batch, version=0)
        assert math.isfinite(stats["loss/total"]) and math.isfinite(stats["optim/grad_norm"])
        moved = {k for k, v in actor.model.named_parameters() if not torch.equal(v, before[k])}
        assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"} <= moved  # the routers
        assert any(".mlp.experts." in k for k in moved)

        entries = weight_entries(actor.model)
        engine.apply_weights(zip([e.name for e in entries], materialize(entries, torch.device("cpu"))), version=1)
        batch = _batch(*_generate(engine, prompts), version=1)
        served = actor.forward_logp(actor.model, batch)
        assert (served - batch.behav_logp)[batch.loss_mask].abs().max() < 1e-4
    finally:
        engine.close()
