"""Multi-turn episodes against real local engines: token-in/token-out equality, a weight update
mid-episode, bad tool calls and failing environments."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from rlstream.broker import AsyncVersionRegistry, connect_async
from rlstream.common.config import load_config
from rlstream.common.wire import decode_group, encode_group
from rlstream.producer.dataset import DatasetItem
from rlstream.producer.environment import Action, Reset, StepResult, ToolEnvironment
from rlstream.producer.toolcalls import parse_hermes

from tests.helpers import RecordingEngine

N_TURNS = 3


class ScriptedEnv:
    """Whatever the (random) model says, turns 1 and 2 get a tool observation; turn 3 ends with reward 1
    and a turn reward on each turn. Plugged in by import path like a user's environment."""

    def __init__(self, **_):
        self.turn = 0

    def reset(self, item):
        return Reset([{"role": "user", "content": item.prompt}])

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn >= N_TURNS:
            return StepResult(done=True, reward=1.0, turn_reward=0.5)
        return StepResult(observation=[{"role": "tool", "name": "calculator", "content": f"obs {self.turn}"}],
                          turn_reward=0.25 * self.turn)


class RaisingEnv(ScriptedEnv):
    async def step(self, action):
        if self.turn == 1:
            raise RuntimeError("the environment broke")
        return await super().step(action)




def _cfg(model, redis_url, exp, address, *extra):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    # Every non-special id stops a turn once min_new_tokens are out: short, finished ("stop") turns
    # from a random model, so episodes go the full N_TURNS.
    return load_config(None, [
        f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={exp}",
        f"rollout.engine_addresses=[{address}]", "rollout.health_check_interval=0.5", "gconfig.n_samples=2",
        "gconfig.min_new_tokens=3", "gconfig.max_new_tokens=12", f"gconfig.stop_token_ids=[{','.join(map(str, range(4, vocab)))}]",
        "producer.producer_id=agent-test", "producer.workflow=rlstream.producer.agent:AgentWorkflow",
        "agent.environment=tests.producer.test_agent:ScriptedEnv", "agent.max_turns=5", *extra])


def _item(tokenizer, text="12*34=?"):
    return DatasetItem(index=0, epoch=0, position=0, prompt_id="p0", prompt=text, answer="408",
                       input_ids=tokenizer(text)["input_ids"], row={"question": text})


async def _run(cfg, redis_url, exp, item=None, env=None):
    from transformers import AutoTokenizer

    from rlstream.broker import Keys, namespace
    from rlstream.producer.agent import AgentWorkflow
    from rlstream.broker.registry import make_engine_resolver
    from rlstream.common.engine_client import ServerPool
    from rlstream.producer.workflow import RolloutEngine

    tok = AutoTokenizer.from_pretrained(cfg.actor.path)
    client = await connect_async(redis_url)
    pool = await ServerPool(cfg, make_engine_resolver(cfg)).start()
    try:
        await pool.wait_for_servers(1, 60)
        engine = RecordingEngine(RolloutEngine(pool, AsyncVersionRegistry(client, Keys(namespace(exp, "trial0"))), resume_wait=60))
        wf = AgentWorkflow(cfg=cfg, tokenizer=tok, reward=None)
        group = await asyncio.wait_for(wf.arun_episode(engine, item or _item(tok)), 120)
    finally:
        await pool.close()
        await client.aclose()
    return tok, wf, engine, group


async def test_trained_ids_are_the_engine_ids_plus_template_observation_tokens(engine_proc, chat_model, redis_url):
    exp, proc = engine_proc
    cfg = _cfg(chat_model, redis_url, exp, proc.url.split("//")[-1])
    tok, wf, engine, group = await _run(cfg, redis_url, exp)
    g = decode_group(encode_group(group))
    assert g.schema_version == 2 and len(g.trajectories) == 2 and len(engine.calls) == 2 * N_TURNS

    prompt = tok.apply_chat_template([{"role": "user", "content": "12*34=?"}], tools=wf.schemas, tokenize=True,
                                     add_generation_prompt=True)
    assert tok.decode(prompt).startswith("tools: calculator\nu:12*34=?\na:")
    for t in g.trajectories:
        ids, vers, mask = t.input_ids_np.tolist(), t.versions_np, t.loss_mask_np
        assert ids[: t.prompt_len] == prompt
        # Rebuild the sequence from what the engine was asked and answered: each request is
        # exactly the trajectory so far, each answer is appended unchanged, and between two
        # turns come exactly the template's tokens for the observation.
        mine = [(req, out) for req, out in engine.calls if ids[: len(req)] == req and ids[len(req): len(req) + len(out)] == out]
        assert len(mine) == N_TURNS
        expect = list(prompt)
        model_pos = []
        for k, (req, out) in enumerate(mine):
            assert req == expect  # the model saw exactly the trained prefix
            model_pos += range(len(expect), len(expect) + len(out))
            expect += out
            if k < N_TURNS - 1:
                # the template's own rendering: the end of the assistant turn the model did not
                # generate (it stopped on another stop id) and the tool message + generation prompt
                obs_text = tok.decode(ids[len(expect): len(mine[k + 1][0])])
                assert obs_text == f"</s>\nt:obs {k + 1}\na:"
                expect = list(mine[k + 1][0])
        assert ids == expect
        want_mask = np.zeros(len(ids), dtype=np.uint8)
        want_mask[model_pos] = 1
        assert np.array_equal(mask, want_mask)
        assert ((vers >= 0) == (mask == 1)).all() and (vers[mask == 1] == 0).all()
        assert t.reward == 1.0 and t.turn_rewards == [0.25, 0.5, 0.5] and t.finish_reason == "stop"
        assert t.metadata["turns"] == N_TURNS


async def test_environment_that_raises_fails_the_sample_or_the_group(engine_proc, chat_model, redis_url):
    exp, proc = engine_proc
    addr = proc.url.split("//")[-1]
    cfg = _cfg(chat_model, redis_url, exp, addr, "agent.environment=tests.producer.test_agent:RaisingEnv")
    _, _, _, group = await _run(cfg, redis_url, exp)
    g = decode_group(encode_group(group))
    for t in g.trajectories:
        assert t.reward == 0.0 and "step raised RuntimeError: the environment broke" in t.metadata["env_error"]
        assert t.metadata["turns"] == 2 and t.loss_mask_np.sum() > 0
    cfg = _cfg(chat_model, redis_url, exp, addr, "agent.environment=tests.producer.test_agent:RaisingEnv",
               "agent.on_env_error=reject_group")
    _, _, _, group = await _run(cfg, redis_url, exp)
    assert group is None


async def test_weight_update_mid_episode_continues_on_the_new_version(chat_model, redis_url, experiment):
    """The engine pauses for a weight update in the middle of a turn: that turn carries versions 0 then 1,
    later turns 1, and the group's staleness counts from its oldest model token."""
    import redis
    import torch
    from aiohttp import web

    from rlstream.broker import Keys, VersionRegistry, namespace
    from rlstream.engine.local import LocalEngine
    from rlstream.engine.server import build_app

    torch.set_num_threads(1)
    eng = LocalEngine(chat_model, device="cpu", max_batch_size=8, seed=0)
    runner = web.AppRunner(build_app(eng))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    cfg = _cfg(chat_model, redis_url, experiment, f"127.0.0.1:{port}", "gconfig.n_samples=1",
               "gconfig.min_new_tokens=60", "gconfig.max_new_tokens=80", "agent.max_total_tokens=400")
    sync_versions = VersionRegistry(redis.Redis.from_url(redis_url), Keys(namespace(experiment, "trial0")))
    try:
        task = asyncio.create_task(_run(cfg, redis_url, experiment))
        deadline = time.monotonic() + 120
        while eng.total_tokens < 61 + 20:  # into the second turn
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.005)
        await eng.pause()
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting for the new version
        new = {n: p.detach() * 0.5 for n, p in eng.model.named_parameters()}
        await asyncio.to_thread(eng.apply_weights, new.items(), 1)
        sync_versions.set(1)
        await eng.resume()
        _, _, engine, group = await asyncio.wait_for(task, 120)
    finally:
        await runner.cleanup()
        eng.close()
    g = decode_group(encode_group(group))
    (t,) = g.trajectories
    vers, mask = t.versions_np, t.loss_mask_np
    assert t.metadata["interruptions"] == 1 and t.metadata["turns"] == N_TURNS
    runs = np.flatnonzero(np.diff(np.concatenate([[0], (vers >= 0).astype(int), [0]])))
    turns = [vers[a:b] for a, b in zip(runs[0::2], runs[1::2])]
    assert len(turns) == N_TURNS
    assert (turns[0] == 0).all()
    assert (turns[1][:1] == 0).all() and (turns[1][-1:] == 1).all() and set(turns[1].tolist()) == {0, 1}
    assert (turns[2] == 1).all()
    assert ((vers >= 0) == (mask == 1)).all()
    assert g.min_version() == 0 and g.max_version() == 1
    # the interrupted turn is one turn: it was continued, not restarted
    assert len(engine.calls) == N_TURNS


# ---------------------------------------------------------------------- tool calls and bad input


@pytest.mark.slow
async def test_bad_tool_calls_become_error_observations_and_the_episode_goes_on():
    from rlstream.producer.tools import load_tools

    cfg = load_config(None, ["agent.tools=[rlstream.producer.tools:calculator,rlstream.producer.tools:python]",
                             "agent.tool_timeout=10", "agent.sandbox.wall_timeout=30"])
    env = ToolEnvironment(cfg=cfg, reward=None, tools=load_tools(cfg))
    env.reset(_item(__import__("rlstream.launcher.tiny", fromlist=["x"]).build_tokenizer()))
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>'
            '<tool_call>{"name": "browser", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "import time; time.sleep(600)"}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "raise SystemExit(3)"}}</tool_call>'
            '<tool_call>{"name": calculator}</tool_call>')
    p = parse_hermes(text)
    res = await env.step(Action(text, p.content, p.tool_calls, p.errors))
    assert not res.done
    out = [m["content"] for m in res.observation]
    assert out[0].startswith("error: tool call 5: malformed JSON")
    assert out[1] == "5535"
    assert out[2].startswith("error: unsupported syntax")
    assert out[3] == "error: unknown tool 'browser' (available: calculator, python)"
    # The timeout has room for a sandboxed python to start and exit on a loaded machine (the next call must finish).
    assert re.fullmatch(r"error: tool 'python' timed out after 1\ds", out[4]), out[4]  # 10 s, more if the loop ran late
    assert out[5].startswith("error: exited with status 3")
    assert env.stats() == {"tool_calls": 5, "tool_errors": 5}


def test_warm_start_conversations_use_the_episode_token_layout():
    """A demonstration is tokenized as an episode would be: assistant turns = text + stop (mask 1),
    tool results = the template delta (mask 0)."""
    from rlstream.launcher.demo import multiply_demonstration
    from rlstream.launcher.tiny import build_tokenizer
    from rlstream.producer.chat import ChatTemplate
    from rlstream.producer.tools import Calculator

    tok = build_tokenizer(chat=True)
    chat = ChatTemplate(tok, [Calculator.schema])
    msgs = multiply_demonstration({"prompt": "347*29=?", "answer": "10063"}, use_tool=True)
    ids, mask = chat.conversation(msgs)
    full = tok.apply_chat_template(msgs, tools=[Calculator.schema], tokenize=True)
    assert ids == full[: len(ids)] and tok.decode(full[len(ids):]) == "\n"  # the template's newline after the last EOS
    trained = "".join(tok.decode([i]) for i, m in zip(ids, mask) if m)
    assert trained == '<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}</tool_call></s>10063</s>'
    first = msgs[:2]
    prompt = chat.prompt(first[:1])
    turn = tok.encode(first[1]["content"], add_special_tokens=False) + [tok.eos_token_id]
    obs = chat.close_turn(turn) + chat.observation(first, msgs[2:3])
    assert ids[: len(prompt) + len(turn) + len(obs)] == prompt + turn + obs
