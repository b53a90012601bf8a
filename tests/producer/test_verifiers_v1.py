"""verifiers 0.4 environments (tests/producer/verifiers_v1_arith.py, in verifiers' taskset + harness format)
driven by `python -m rlstream.producer.verifiers_v1` in the verifiers 0.4 venv against a real `rlstream
gateway`, `rlstream serve` and Redis: the committed groups are the engine's greedy tokens plus the chat
template's observation tokens, rewarded by the task's own weighted rewards; a harness that raises fails the
sample with the reason, or drops the group."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from rlstream.producer.verifiers_v1 import VENV_ENV, venv_python

from tests.helpers import GatewayProcess, venv_python_or_skip

HERE = Path(__file__).resolve().parent
REQUIRE_ENV = "RLSTREAM_REQUIRE_VERIFIERS_V1"
FOLLOW_UP = "check your sum and answer again."  # verifiers_v1_arith.FOLLOW_UP (that module needs verifiers 0.4)
N = 2


def _python() -> Path:
    return venv_python_or_skip(venv_python(), "verifiers 0.4", "scripts/setup_verifiers_v1_venv.sh", VENV_ENV,
                               REQUIRE_ENV)


@pytest.fixture(scope="module")
def gateway(redis_server, chat_model, engine_proc, tmp_path_factory):
    from transformers import AutoTokenizer

    _python()
    _, engine = engine_proc
    vocab = len(AutoTokenizer.from_pretrained(chat_model))
    exp = f"vf1{uuid.uuid4().hex[:8]}"
    # Greedy, and every non-special id stops a turn once min_new_tokens are out: short, finished turns.
    p = GatewayProcess(tmp_path_factory.mktemp("vf1gw"), [
        f"actor.path={chat_model}", f"redis.url={redis_server.url}", f"experiment_name={exp}",
        f"rollout.engine_addresses=[{engine.address}]", "rollout.health_check_interval=0.5",
        "rollout.consumer_batch_size=4", "rollout.max_head_offpolicyness=0", "gconfig.greedy=true",
        "gconfig.min_new_tokens=3", "gconfig.max_new_tokens=12", f"gconfig.n_samples={N}",
        f"gconfig.stop_token_ids=[{','.join(map(str, range(4, vocab)))}]"])
    p.start()
    try:
        yield exp, p
    finally:
        p.stop()


def _drive(gw, *args: str) -> list:
    import rlstream

    # Only the rlstream package (a link to it) and the environment's module go on the venv's path: the main
    # environment's site-packages would shadow the venv's own pins.
    site = gw.workdir / "vf1-site"
    if not site.exists():
        site.mkdir()
        (site / "rlstream").symlink_to(Path(rlstream.__file__).parent)
    path = os.pathsep.join([str(site), str(HERE)])
    out = subprocess.run([str(_python()), "-m", "rlstream.producer.verifiers_v1", "--gateway", gw.url,
                          "--taskset", "verifiers_v1_arith", "--n", str(N), *args],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _groups(redis_url, exp):
    from rlstream.broker import Keys, TrajectoryStream, connect, namespace

    c = connect(redis_url)
    try:
        keys = Keys(namespace(exp, "trial0"))
        return [e.group for e in TrajectoryStream(c, keys).read_ids([i.decode() for i, _ in c.xrange(keys.traj)])]
    finally:
        c.close()


def _model_runs(t):
    """(start, end) of each run of model tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], t.loss_mask_np.astype(int), [0]])))
    return list(zip(edges[0::2], edges[1::2]))


@pytest.mark.slow
def test_verifiers_v1_episodes_commit_the_engines_tokens_and_the_tasks_rewards(gateway, engine_proc, chat_model,
                                                                                  redis_url):
    from transformers import AutoTokenizer

    exp, gw = gateway
    tok = AutoTokenizer.from_pretrained(chat_model)
    answers = _drive(gw, "--taskset-config", '{"size": 2}')
    assert len(answers) == 2 and all(a[-1]["status"] == "committed" for a in answers), answers
    groups = _groups(redis_url, exp)
    assert len(groups) == 2
    direct = httpx.Client(base_url=engine_proc[1].url, timeout=120)
    stop = list(range(4, len(tok)))
    prompts = {i: tok.apply_chat_template([{"role": "system", "content": "Answer with the number only."},
                                           {"role": "user", "content": f"{i}+{i + 1}=?"}],
                                          tokenize=True, add_generation_prompt=True) for i in range(2)}
    asked = []
    for g in groups:
        assert len(g.trajectories) == N and g.metadata["source"] == "gateway"
        for t in g.trajectories:
            ids = t.input_ids_np.tolist()
            runs = _model_runs(t)
            assert len(runs) == 2  # the harness's two turns
            (i,) = [i for i, p in prompts.items() if ids[: t.prompt_len] == p]  # the task's system + question
            asked.append(i)
            # Between the turns: exactly the template's rendering of the harness's follow-up user message.
            assert tok.decode(ids[runs[0][1]: runs[1][0]]) == f"</s>\nu:{FOLLOW_UP}\na:"
            for a, b in runs:  # each model turn is what the engine generates greedily for that prefix
                gen = direct.post("/generate", json={"input_ids": ids[:a], "sampling_params": {
                    "temperature": 0, "min_new_tokens": 3, "max_new_tokens": 12, "stop_token_ids": stop}}).json()
                assert gen["output_ids"] == ids[a:b]
            reply = tok.decode(ids[runs[1][0]: runs[1][1]], skip_special_tokens=True).strip()
            assert t.metadata["vf/exact"] == float(reply == str(2 * i + 1)) and t.metadata["vf/turns"] == 2.0
            assert t.reward == pytest.approx(t.metadata["vf/exact"] + 0.5 * 2)  # the task's weights: 1.0, 0.5
    assert sorted(asked) == [0] * N + [1] * N  # each task once, as one group of N episodes


@pytest.mark.slow
def test_a_verifiers_v1_harness_that_raises_fails_the_sample_or_drops_the_group(gateway, redis_url):
    exp, gw = gateway
    before = len(_groups(redis_url, exp))
    (answers,) = _drive(gw, "--taskset-config", '{"size": 1, "broken": true}')
    assert answers[-1]["status"] == "committed", answers
    (g,) = _groups(redis_url, exp)[before:]
    for t in g.trajectories:
        assert t.reward == 0.0 and "the verifiers harness broke" in t.metadata["env_error"]
        assert len(_model_runs(t)) == 1  # the turn before the harness raised
    (answers,) = _drive(gw, "--taskset-config", '{"size": 1, "broken": true}', "--on-env-error", "reject_group")
    assert [a["status"] for a in answers] == ["abandoned"] * N
    assert len(_groups(redis_url, exp)) == before + 1
