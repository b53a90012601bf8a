"""verifiers environments inside the producer, against a real local engine: single-turn, multi-turn and
tool-using episodes token-in/token-out, the rubric as the reward, a raising environment, and groups a
`rlstream produce` process commits to Redis."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("verifiers")

from rlstream.api.workflow import Generation  # noqa: E402
from rlstream.common.config import load_config  # noqa: E402
from rlstream.common.wire import decode_group, encode_group  # noqa: E402
from rlstream.producer.dataset import PromptDataset  # noqa: E402
from rlstream.producer.verifiers_env import VerifiersWorkflow  # noqa: E402

from tests.helpers import RecordingEngine  # noqa: E402
from tests.producer.verifiers_arith import HINT  # noqa: E402

ENV = "tests.producer.verifiers_arith"



class ScriptedModel:
    """A model that says the given texts in turn (for the tool path: the tiny random model never writes a tool
    call), each as the tokenizer's ids plus the turn-end token, version 0."""

    def __init__(self, tokenizer, texts, stop_id):
        self.tokenizer, self.texts, self.stop_id = tokenizer, list(texts), stop_id
        self.calls: list[list[int]] = []

    async def agenerate(self, req):
        self.calls.append(list(req.input_ids))
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False) + [self.stop_id]
        return Generation(input_ids=list(req.input_ids), output_ids=ids, output_logprobs=[-1.0] * len(ids),
                          output_versions=[0] * len(ids), finish_reason="stop")



def _overrides(model, redis_url, exp, address, kind, *extra):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    # Every non-special id stops a turn once min_new_tokens are out: short, finished turns from a random model.
    return [f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={exp}",
            f"rollout.engine_addresses=[{address}]", "rollout.health_check_interval=0.5", "gconfig.n_samples=2",
            "gconfig.min_new_tokens=3", "gconfig.max_new_tokens=12",
            f"gconfig.stop_token_ids=[{','.join(map(str, range(4, vocab)))}]", "producer.producer_id=vf-test",
            "train_dataset.source=verifiers", f"train_dataset.task={ENV}", f"train_dataset.config={{kind: {kind}}}",
            *extra]


async def _run(cfg, redis_url, exp, engine=None, position=0):
    from transformers import AutoTokenizer

    from rlstream.broker import AsyncVersionRegistry, Keys, connect_async, namespace
    from rlstream.broker.registry import make_engine_resolver
    from rlstream.common.engine_client import ServerPool
    from rlstream.producer.workflow import RolloutEngine

    tok = AutoTokenizer.from_pretrained(cfg.actor.path)
    ds = PromptDataset(cfg.train_dataset, tok, seed=cfg.seed)
    item = ds.at(position)
    wf = VerifiersWorkflow(cfg=cfg, tokenizer=tok)
    if engine is not None:
        return tok, item, engine, await asyncio.wait_for(wf.arun_episode(engine, item), 120)
    client = await connect_async(redis_url)
    pool = await ServerPool(cfg, make_engine_resolver(cfg)).start()
    try:
        await pool.wait_for_servers(1, 60)
        engine = RecordingEngine(RolloutEngine(pool, AsyncVersionRegistry(client, Keys(namespace(exp, "trial0"))),
                                        resume_wait=60))
        group = await asyncio.wait_for(wf.arun_episode(engine, item), 120)
    finally:
        await pool.close()
        await client.aclose()
    return tok, item, engine, group


def _model_runs(t):
    """(start, end) of each run of model tokens."""
    m = t.loss_mask_np.astype(int)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
    return list(zip(edges[0::2], edges[1::2]))


def test_config_of_a_verifiers_source_defaults_the_workflow_and_reads_the_environments_rows(chat_model):
    from transformers import AutoTokenizer

    cfg = load_config(None, ["train_dataset.source=verifiers", f"train_dataset.task={ENV}",
                             "train_dataset.config={kind: single, n: 5}", f"actor.path={chat_model}"])
    assert cfg.producer.workflow == "rlstream.producer.verifiers_env:VerifiersWorkflow"
    ds = PromptDataset(cfg.train_dataset, AutoTokenizer.from_pretrained(chat_model), seed=1)
    assert len(ds) == 5
    item = next(ds.at(p) for p in range(5) if ds.at(p).index == 2)
    assert item.answer == "5"
    assert item.row["prompt"] == [{"role": "system", "content": "Answer with the number only."},
                                  {"role": "user", "content": "2+3=?"}]


async def test_single_turn_group_is_the_engines_tokens_scored_by_the_rubric(engine_proc, chat_model, redis_url):
    exp, proc = engine_proc
    cfg = load_config(None, _overrides(chat_model, redis_url, exp, proc.address, "single"))
    tok, item, engine, group = await _run(cfg, redis_url, exp)
    g = decode_group(encode_group(group))
    assert len(g.trajectories) == 2 and len(engine.calls) == 2
    prompt = tok.apply_chat_template(item.row["prompt"], tokenize=True, add_generation_prompt=True)
    for t in g.trajectories:
        ids = t.input_ids_np.tolist()
        (req, out), = [(r, o) for r, o in engine.calls if ids == r + o]
        assert req == prompt and t.prompt_len == len(prompt)
        assert t.loss_mask_np[len(prompt):].all() and (t.versions_np[len(prompt):] == 0).all()
        exact = float(tok.decode(out, skip_special_tokens=True).strip() == item.answer)
        assert t.metadata["vf/exact"] == exact and t.metadata["vf/length_bonus"] == 1.0
        assert t.reward == pytest.approx(exact + 0.5)  # the rubric's weights: exact 1.0, length_bonus 0.5
        assert t.metadata["turns"] == 1 and "env_error" not in t.metadata


async def test_multi_turn_tokens_are_the_engines_plus_the_templates_observation_tokens(engine_proc, chat_model,
                                                                                      redis_url):
    exp, proc = engine_proc
    cfg = load_config(None, _overrides(chat_model, redis_url, exp, proc.address, "multi"))
    tok, item, engine, group = await _run(cfg, redis_url, exp)
    g = decode_group(encode_group(group))
    assert len(engine.calls) == 2 * 3
    prompt = tok.apply_chat_template(item.row["prompt"], tokenize=True, add_generation_prompt=True)
    for t in g.trajectories:
        ids = t.input_ids_np.tolist()
        mine = [(r, o) for r, o in engine.calls if ids[:len(r)] == r and ids[len(r):len(r) + len(o)] == o]
        assert len(mine) == 3 and mine[0][0] == prompt
        runs = _model_runs(t)
        assert [(a, b) for a, b in runs] == [(len(r), len(r) + len(o)) for r, o in mine]
        for k in range(2):  # between two turns: exactly the template's rendering of the environment's hint
            end = len(mine[k][0]) + len(mine[k][1])
            assert tok.decode(ids[end:len(mine[k + 1][0])]) == f"</s>\nu:{HINT} {k + 1}\na:"
        assert ids == mine[2][0] + mine[2][1]
        assert ((t.versions_np >= 0) == (t.loss_mask_np == 1)).all()
        assert t.metadata["turns"] == 3 and t.metadata["vf/length_bonus"] == 3.0
        assert t.reward == pytest.approx(t.metadata["vf/exact"] + 1.5)


async def test_tool_calls_run_the_environments_tools(engine_proc, chat_model, redis_url):
    from transformers import AutoTokenizer

    exp, proc = engine_proc
    cfg = load_config(None, _overrides(chat_model, redis_url, exp, proc.address, "tools", "gconfig.n_samples=1"))
    tok = AutoTokenizer.from_pretrained(chat_model)
    stop = tok.convert_tokens_to_ids("</s>")
    call = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
    model = ScriptedModel(tok, [call, "42"], stop)
    tok, item, _, group = await _run(cfg, redis_url, exp, engine=model)
    (t,) = decode_group(encode_group(group)).trajectories
    ids = t.input_ids_np.tolist()
    assert tok.decode(ids[: t.prompt_len]).startswith("tools: add\n")  # the environment's tools, by the template
    first_end = len(model.calls[0]) + len(tok.encode(call, add_special_tokens=False)) + 1
    assert tok.decode(ids[first_end:len(model.calls[1])]) == "\nt:42\na:"  # the tool's result, as a tool message
    assert t.metadata["tool_calls"] == 1 and t.metadata["turns"] == 2
    assert t.metadata["vf/add_calls"] == 1.0  # ToolEnv's own tool metric
    assert t.reward == pytest.approx(float(item.answer == "42") + 1.0)


async def test_an_environment_that_raises_fails_the_sample_or_the_group(engine_proc, chat_model, redis_url):
    exp, proc = engine_proc
    cfg = load_config(None, _overrides(chat_model, redis_url, exp, proc.address, "raising"))
    _, _, _, group = await _run(cfg, redis_url, exp)
    for t in decode_group(encode_group(group)).trajectories:
        assert t.reward == 0.0 and "the verifiers environment broke" in t.metadata["env_error"]
        assert t.metadata["turns"] == 1 and t.loss_mask_np.sum() > 0
    cfg = load_config(None, _overrides(chat_model, redis_url, exp, proc.address, "raising",
                                       "agent.on_env_error=reject_group"))
    _, _, _, group = await _run(cfg, redis_url, exp)
    assert group is None


@pytest.mark.slow
def test_rlstream_produce_commits_verifiers_groups(engine_proc, chat_model, producers, redis_url, experiment,
                                                   rclient):
    """`rlstream produce` with only the source named: the environment's rows, its multi-turn episodes, committed."""
    from rlstream.broker import Keys, namespace

    _, proc = engine_proc
    overrides = _overrides(chat_model, redis_url, experiment, proc.address, "multi", "producer.max_groups=2",
                           "rollout.consumer_batch_size=2", "rollout.max_head_offpolicyness=10",
                           "cluster.name_resolve.lease_ttl=2")
    p = producers(overrides, "vf")
    assert p.wait(240) == 0, p.log()[-3000:]
    groups = [decode_group(f[b"d"]) for _, f in rclient.xrange(Keys(namespace(experiment, "trial0")).traj)]
    assert len(groups) == 2
    for g in groups:
        assert g.schema_version == 2 and len(g.trajectories) == 2
        for t in g.trajectories:
            assert len(_model_runs(t)) == 3 and t.metadata["turns"] == 3
            assert t.reward == pytest.approx(t.metadata["vf/exact"] + 1.5)
