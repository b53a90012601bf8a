"""`producer/evaluator.py`: when an evaluation during training is due (`freq_steps`, `freq_epochs`,
`freq_secs`), its sampling (`eval_gconfig`), and one evaluation end to end: a local engine in this process,
the claim and the record in the real Redis."""

from __future__ import annotations

import pytest

from rlstream.broker import connect_async
from rlstream.broker.evals import AsyncEvalLog, EvalLog, EvalRecord
from rlstream.common.config import DatasetConfig, load_config
from rlstream.producer.evaluator import Evaluator, eval_gconfig
from rlstream.producer.rewards import RewardResult, exact_match_reward
from tests.helpers import write_arith_dataset


def _cfg(tiny_model_path, data, *extra: str):
    return load_config(None, [f"actor.path={tiny_model_path}", f"valid_dataset.path={data}",
                              "valid_dataset.prompt_key=question", "valid_dataset.answer_key=solution",
                              "gconfig.max_new_tokens=3", "gconfig.n_samples=4",
                              "gconfig.temperature=0.9", "evaluator.max_prompts=3", *extra])


async def _reward(prompt, completion, answer, **kw):
    return RewardResult(float(exact_match_reward(prompt, completion, answer)))


@pytest.fixture
def dataset(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    from rlstream.producer.dataset import PromptDataset

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    path = write_arith_dataset(tmp_path / "valid.jsonl", n=6)
    dcfg = DatasetConfig(path=str(path), prompt_key="question", answer_key="solution", shuffle=False)
    return PromptDataset(dcfg, tok), tok, path


def _evaluator(cfg, dataset, engine=None, evals=None, steps_per_epoch=None) -> Evaluator:
    ds, tok, _ = dataset
    return Evaluator(cfg, dataset=ds, tokenizer=tok, engine=engine, reward=_reward, versions=None, evals=evals,
                     stop_ids=[tok.eos_token_id], owner="p1", steps_per_epoch=steps_per_epoch)


def test_eval_gconfig_is_greedy_one_sample_unless_configured(tiny_model_path, tmp_path):
    data = tmp_path / "valid.jsonl"
    g = eval_gconfig(_cfg(tiny_model_path, data))
    assert (g.n_samples, g.greedy, g.temperature, g.max_new_tokens) == (1, True, 0.0, 3)
    own = eval_gconfig(_cfg(tiny_model_path, data, "eval_gconfig.n_samples=2", "eval_gconfig.max_new_tokens=5"))
    assert (own.n_samples, own.max_new_tokens) == (2, 5)


def test_due_follows_steps_epochs_and_seconds(tiny_model_path, dataset):
    last = EvalRecord(version=4, n_prompts=3, finished_at=1000.0)
    data = dataset[2]
    ev = _evaluator(_cfg(tiny_model_path, data, "evaluator.freq_steps=2"), dataset)
    assert len(ev.items) == 3  # evaluator.max_prompts
    assert ev.due(0, None, 0.0)  # nothing evaluated yet: the base model
    assert not ev.due(4, last, 1e9) and not ev.due(5, last, 1e9) and ev.due(6, last, 0.0)
    ev = _evaluator(_cfg(tiny_model_path, data, "evaluator.freq_epochs=1"), dataset, steps_per_epoch=3)
    assert not ev.due(6, last, 1e9) and ev.due(7, last, 0.0)
    ev = _evaluator(_cfg(tiny_model_path, data, "evaluator.freq_secs=60"), dataset)
    assert not ev.due(5, last, 1059.0) and ev.due(5, last, 1060.0)


async def test_an_evaluation_writes_one_record_per_version_and_respects_the_claim(tiny_model_path, dataset,
                                                                                  redis_url, rclient, keys):
    from rlstream.engine.local import LocalEngine
    from rlstream.launcher.evaluate import _InProcessEngine

    cfg = _cfg(tiny_model_path, dataset[2], "evaluator.freq_steps=1")
    engine = LocalEngine(tiny_model_path, device="cpu", max_batch_size=8, seed=0)
    aclient = await connect_async(redis_url)
    try:
        ev = _evaluator(cfg, dataset, engine=_InProcessEngine(engine), evals=AsyncEvalLog(aclient, keys))
        record = await ev.maybe_evaluate(0)
        assert record is not None and EvalLog(rclient, keys).last() == record
        assert (record.version, record.n_prompts, record.n_samples, record.greedy) == (0, 3, 1, True)
        assert 0.0 <= record.accuracy <= 1.0 and record.pass_at_k is None and 0 < record.mean_output_len <= 3
        assert record.offversion_frac == 0.0 and record.owner == "p1"
        assert rclient.get(keys.eval_claim) is None  # given back
        assert await ev.maybe_evaluate(0) is None  # not due again
        assert EvalLog(rclient, keys).claim(1, "p2", ttl_s=60)
        assert await ev.maybe_evaluate(1) is None  # another producer evaluates version 1
        assert len(EvalLog(rclient, keys).since()) == 1 and ev.done == 1
    finally:
        await aclient.aclose()
        engine.close()
