"""OpenEnv environments through AgentWorkflow, against a real OpenEnv server (started here on 127.0.0.1, stopped
by its PID) and a real local engine: token-in/token-out equality, per-step rewards, a server-side error, an
unreachable server and the config check."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("openenv.core")

from rlstream.common.config import ConfigError, load_config  # noqa: E402
from rlstream.common.net import free_port  # noqa: E402
from rlstream.common.wire import decode_group, encode_group  # noqa: E402
from rlstream.producer.dataset import DatasetItem  # noqa: E402
from rlstream.producer.toolcalls import parse_hermes  # noqa: E402

from tests.helpers import RecordingEngine, child_env, stop_process, wait_for_port  # noqa: E402
from tests.producer.openenv_echo import RAISING_SEED, STEPS  # noqa: E402

ENV = "agent.environment=rlstream.producer.openenv_env:OpenEnvEnvironment"



@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("openenv") / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.producer.openenv_echo:app", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=child_env())
    try:
        wait_for_port("127.0.0.1", port, 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 10)
        log.close()



def _cfg(model, redis_url, exp, address, url, *extra):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    return load_config(None, [
        f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={exp}",
        f"rollout.engine_addresses=[{address}]", "rollout.health_check_interval=0.5", "gconfig.n_samples=2",
        "gconfig.min_new_tokens=3", "gconfig.max_new_tokens=12", f"gconfig.stop_token_ids=[{','.join(map(str, range(4, vocab)))}]",
        "producer.producer_id=openenv-test", "producer.workflow=rlstream.producer.agent:AgentWorkflow", ENV,
        f"agent.openenv.url={url}", "agent.openenv.observation_field=echoed", "agent.max_turns=6", *extra])


async def _run(cfg, redis_url, exp, seed=7):
    from transformers import AutoTokenizer

    from rlstream.broker import AsyncVersionRegistry, Keys, connect_async, namespace
    from rlstream.broker.registry import make_engine_resolver
    from rlstream.common.engine_client import ServerPool
    from rlstream.producer.agent import AgentWorkflow
    from rlstream.producer.workflow import RolloutEngine

    tok = AutoTokenizer.from_pretrained(cfg.actor.path)
    item = DatasetItem(index=0, epoch=0, position=0, prompt_id="p0", prompt="echo me", answer=None,
                       input_ids=tok("echo me")["input_ids"], row={"question": "echo me", "seed": seed})
    client = await connect_async(redis_url)
    pool = await ServerPool(cfg, make_engine_resolver(cfg)).start()
    try:
        await pool.wait_for_servers(1, 60)
        engine = RecordingEngine(RolloutEngine(pool, AsyncVersionRegistry(client, Keys(namespace(exp, "trial0"))),
                                        resume_wait=60))
        group = await asyncio.wait_for(AgentWorkflow(cfg=cfg, tokenizer=tok, reward=None).arun_episode(engine, item),
                                       120)
    finally:
        await pool.close()
        await client.aclose()
    return tok, engine, group


async def test_openenv_episode_is_the_engines_tokens_plus_the_servers_observations(engine_proc, chat_model, redis_url,
                                                                                  openenv_server):
    exp, proc = engine_proc
    cfg = _cfg(chat_model, redis_url, exp, proc.address, openenv_server)
    tok, engine, group = await _run(cfg, redis_url, exp)
    g = decode_group(encode_group(group))
    assert len(g.trajectories) == 2 and len(engine.calls) == 2 * STEPS
    prompt = tok.apply_chat_template([{"role": "user", "content": "echo me\nready 7"}], tools=None, tokenize=True,
                                     add_generation_prompt=True)
    for t in g.trajectories:
        ids = t.input_ids_np.tolist()
        assert ids[: t.prompt_len] == prompt  # the dataset prompt, then the reset observation
        mine = [(r, o) for r, o in engine.calls if ids[:len(r)] == r and ids[len(r):len(r) + len(o)] == o]
        assert len(mine) == STEPS and mine[0][0] == prompt
        said = [parse_hermes(tok.decode(o, skip_special_tokens=True)).content for _, o in mine]
        for k in range(STEPS - 1):  # between turns: exactly the template's rendering of the server's echo
            end = len(mine[k][0]) + len(mine[k][1])
            assert tok.decode(ids[end:len(mine[k + 1][0])]) == f"</s>\nu:{said[k]}\na:"
        assert ids == mine[-1][0] + mine[-1][1]
        assert t.turn_rewards == pytest.approx([len(s) / 100 for s in said])  # the server's per-step rewards
        assert t.reward == pytest.approx(sum(len(s) / 100 for s in said))
        assert t.metadata["env_steps"] == STEPS and t.metadata["turns"] == STEPS


async def test_a_server_error_fails_the_sample_or_the_group(engine_proc, chat_model, redis_url, openenv_server):
    exp, proc = engine_proc
    cfg = _cfg(chat_model, redis_url, exp, proc.address, openenv_server)
    _, _, group = await _run(cfg, redis_url, exp, seed=RAISING_SEED)
    for t in decode_group(encode_group(group)).trajectories:
        assert t.reward == 0.0 and "the echo environment broke" in t.metadata["env_error"]
        assert t.metadata["turns"] == 2
    cfg = _cfg(chat_model, redis_url, exp, proc.address, openenv_server, "agent.on_env_error=reject_group")
    _, _, group = await _run(cfg, redis_url, exp, seed=RAISING_SEED)
    assert group is None


async def test_an_unreachable_server_fails_the_sample_with_the_reason(engine_proc, chat_model, redis_url):
    exp, proc = engine_proc
    cfg = _cfg(chat_model, redis_url, exp, proc.address, f"http://127.0.0.1:{free_port()}")
    _, engine, group = await _run(cfg, redis_url, exp)
    assert engine.calls == []
    for t in decode_group(encode_group(group)).trajectories:
        assert t.metadata["env_error"].startswith("reset raised ConnectionError: Failed to connect")


def test_openenv_environment_without_a_url_is_one_line():
    with pytest.raises(ConfigError, match=r"agent.openenv.url"):
        load_config(None, [ENV])
