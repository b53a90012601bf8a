"""On-policy distillation end to end: real Redis, a real policy engine, a real teacher engine (`rlstream serve --pool
teacher`), a real producer process, then a trainer step on the committed entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlstream.broker import Keys, namespace
from rlstream.broker.stream import Entry
from rlstream.common.config import load_config
from rlstream.common.wire import decode_group
from rlstream.producer.distillation import check_teacher_tokenizers, combine_teachers

from tests.helpers import EngineProcess, engine_overrides, producer_overrides, write_arith_dataset


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """The tiny model's architecture and tokenizer with other weights (seed 1): a teacher that disagrees."""
    from rlstream.launcher.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1)


def teachers(path, name: str = "teacher") -> str:
    return f"distillation.teachers=[{{name: {name}, pool: {{model_path: {path}}}}}]"


def direct_logprobs(model_path, seq: list[int], start: int) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
    return logp.gather(-1, torch.tensor(seq[1:])[:, None])[start - 1:, 0].numpy()


def test_teachers_combine_by_normalised_weight():
    a, b = np.array([-1.0, -2.0]), np.array([-3.0, -0.5])
    np.testing.assert_allclose(combine_teachers([a, b], [3.0, 1.0]), 0.75 * a + 0.25 * b, atol=1e-6)
    np.testing.assert_allclose(combine_teachers([a], [2.0]), a, atol=1e-6)


@pytest.mark.slow
def test_committed_teacher_logprobs_are_the_teachers_own_and_a_trainer_step_uses_them(
        engines, producers, tmp_path, tiny_model_path, teacher_path, redis_url, experiment, rclient):
    policy = engines(tiny_model_path, redis_url, experiment)
    teacher = EngineProcess(tmp_path / "teacher", ["--pool", "teacher", teachers(teacher_path),
                                                   *engine_overrides(teacher_path, redis_url, experiment)])
    try:
        teacher.start()
        data = write_arith_dataset(tmp_path / "arith.jsonl", n=20)
        p = producers(producer_overrides(
            tiny_model_path, redis_url, experiment, data, f"rollout.engine_addresses=[{policy.address}]",
            teachers(teacher_path), "producer.max_groups=2", "gconfig.n_samples=2", "rollout.consumer_batch_size=2",
            "rollout.max_head_offpolicyness=10"))
        assert p.wait(180) == 0, p.log()[-3000:]
    finally:
        teacher.stop()
    keys = Keys(namespace(experiment, "trial0"))
    raw = [(i.decode(), decode_group(f[b"d"])) for i, f in rclient.xrange(keys.traj)]
    assert len(raw) == 2 and rclient.xlen(keys.dead) == 0
    for _, g in raw:
        assert g.schema_version == 3 and g.metadata["teacher_latency"] > 0
        for t in g.trajectories:  # the teacher's logprob of every response token, computed directly
            want = direct_logprobs(teacher_path, t.input_ids_np.tolist(), t.prompt_len)
            np.testing.assert_allclose(t.teacher_logprobs_np, want, atol=1e-4)
    assert "teachers: 2 requests (4 sequences)" in p.log()

    from rlstream.trainer.batch import collate
    from rlstream.trainer.model import load_model
    from rlstream.trainer.optim import build_optimizer, build_scheduler
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.ppo import PPOActor

    cfg = load_config(None, [f"actor.path={tiny_model_path}", "actor.dtype=float32", "gconfig.n_samples=2",
                             "actor.kl_ctl=0.0", "actor.mb_spec.max_tokens_per_mb=512", teachers(teacher_path)])
    model = load_model(cfg.actor.path, cfg.actor, Parallel().device)
    opt = build_optimizer(model.parameters(), cfg.actor.optimizer)
    actor = PPOActor(cfg, model, opt, build_scheduler(opt, cfg.actor.optimizer, 2), Parallel())
    batch = collate([Entry(id=i, group=g, min_version=0) for i, g in raw])
    m = actor.train_step(batch, version=0)
    has = batch.loss_mask & ~torch.isnan(batch.teacher_logp)
    want = float((batch.behav_logp - batch.teacher_logp)[has].mean())
    assert int(has.sum()) == sum(t.output_len for _, g in raw for t in g.trajectories) == m["distill/teacher_tokens"]
    assert m["distill/reverse_kl"] == pytest.approx(want, abs=1e-5) and np.isfinite(m["loss/total"])


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_one_line_at_start(producers, tmp_path, tiny_model_path, redis_url,
                                                               experiment):
    from transformers import AutoTokenizer

    from rlstream.launcher.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "chat-teacher", chat=True)  # more tokens: ids no longer match
    cfg = load_config(None, [f"actor.path={tiny_model_path}", teachers(other)])
    with pytest.raises(ValueError, match=r"distillation.teachers\[0\].pool.model_path=.*tokenizer differs"):
        check_teacher_tokenizers(cfg, AutoTokenizer.from_pretrained(tiny_model_path))
    data = write_arith_dataset(tmp_path / "arith.jsonl", n=4)
    p = producers(producer_overrides(tiny_model_path, redis_url, experiment, data,
                                     "rollout.engine_addresses=[127.0.0.1:1]", teachers(other)), "bad-teacher")
    assert p.wait(120) == 1
    lines = [ln for ln in p.log().splitlines() if "tokenizer differs" in ln]
    assert len(lines) == 1 and "distillation.teachers[0].pool.model_path" in lines[0] and "Traceback" not in p.log()
