"""`rlstream gateway` driven by the real `openai` SDK, against a real `rlstream serve` and Redis.

The tiny chat model is first fitted (a few seconds) to one tool-using conversation, so
greedy decoding makes a real Hermes tool call and then answers: the agent below is the
ordinary OpenAI tool loop. What landed in Redis is checked token by token against the
engine's own answers.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import numpy as np
import pytest

from rlstream.broker import AdmissionController, TrajectoryStream

from tests.helpers import EngineProcess, GatewayProcess, VllmServer, engine_overrides, vllm_python_or_skip

openai = pytest.importorskip("openai", reason="the openai package is a test dependency (pip install -e .[test])")

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
QUESTION = "12*34=?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
BATCH = 4  # admission budget (η 0, version 0): 4 groups


def _fit_tool_conversation(model_dir) -> None:
    """A few hundred Adam steps on one conversation: user asks, the model calls the calculator, answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.producer.chat import ChatTemplate

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, mask = ChatTemplate(tok, TOOLS).conversation([
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    x = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: threads only contend on a shared machine
    try:
        for step in range(400):
            out = model(input_ids=x, labels=labels)
            # Greedy decoding reproduces the conversation once every target token is the argmax, with margin
            # (checked on the weights that are saved, before any further step).
            if out.loss.item() < 0.02 and (out.logits[0, :-1].argmax(-1) == x[0, 1:])[labels[0, 1:] >= 0].all():
                break
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(model_dir, safe_serialization=True)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from rlstream.launcher.tiny import build_tiny_model

    # num_heads=2 -> head_dim 32: vLLM's CPU attention kernel has no head_dim 16 (the default).
    path = build_tiny_model(tmp_path_factory.mktemp("gw-model") / "model", chat=True, num_heads=2)
    _fit_tool_conversation(path)
    return path


@pytest.fixture(scope="module")
def engine(redis_server, tool_model, tmp_path_factory):
    p = EngineProcess(tmp_path_factory.mktemp("gw-engine"),
                      engine_overrides(tool_model, redis_server.url, "gwengine", "server.register=false"))
    p.start()
    try:
        yield p
    finally:
        p.stop()


def _gateway_overrides(model, redis_url, exp, engine, *extra):
    return [f"actor.path={model}", f"redis.url={redis_url}", f"experiment_name={exp}",
            f"rollout.engine_addresses=[{engine.address}]", "rollout.health_check_interval=0.5",
            f"rollout.consumer_batch_size={BATCH}", "rollout.max_head_offpolicyness=0", "gconfig.greedy=true",
            "gconfig.max_new_tokens=96", "gconfig.n_samples=2", *extra]


@pytest.fixture(scope="module")
def gateway(redis_server, tool_model, engine, tmp_path_factory):
    exp = f"gw{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("gwruns")
    p = GatewayProcess(tmp_path_factory.mktemp("gw"), _gateway_overrides(
        tool_model, redis_server.url, exp, engine, f"cluster.fileroot={root}", "perf_tracer.session_tracer.enabled=true",
        "perf_tracer.session_tracer.flush_threshold=1"))
    p.run_dir = root / exp / "trial0"
    p.start()
    try:
        yield exp, p
    finally:
        p.stop()


def _session(gw: GatewayProcess, **body) -> tuple[str, str]:
    r = httpx.post(f"{gw.url}/sessions", json=body, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["session_id"], r.json()["base_url"]


def _client(base_url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _agent(base_url: str) -> list:
    """The plain OpenAI tool loop an agent framework runs: call, run the tool, send the result back."""
    client = _client(base_url)
    messages: list = [{"role": "user", "content": QUESTION}]
    responses = []
    for _ in range(4):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                           extra_body={"return_token_ids": True})
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg)  # the SDK's own message object, as agents append it
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            expr = json.loads(call.function.arguments)["expression"]
            a, b = expr.split("*")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) * int(b))})
    return responses


def _entries(redis_url, exp):
    from rlstream.broker import Keys, connect, namespace

    c = connect(redis_url)
    try:
        keys = Keys(namespace(exp, "trial0"))
        ids = [i.decode() for i, _ in c.xrange(keys.traj)]
        return [e.group for e in TrajectoryStream(c, keys).read_ids(ids)], AdmissionController(
            c, keys, max_head_offpolicyness=0, consumer_batch_size=BATCH, max_concurrent_rollouts=BATCH).snapshot()
    finally:
        c.close()


@pytest.mark.slow
def test_openai_agent_episodes_land_token_in_token_out(gateway, engine, redis_url, tool_model):
    from transformers import AutoTokenizer

    exp, gw = gateway
    tok = AutoTokenizer.from_pretrained(tool_model)
    runs = _two_episodes(gw)
    first, second = runs[0]
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*34"}
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "408"
    group = _check_group(redis_url, exp, tok, runs)
    direct = httpx.Client(base_url=engine.url, timeout=120)
    for traj, (r1, r2) in zip(group.trajectories, runs):
        p1, o1 = r1.model_extra["prompt_token_ids"], r1.choices[0].model_extra["token_ids"]
        p2, o2 = r2.model_extra["prompt_token_ids"], r2.choices[0].model_extra["token_ids"]
        # What the engine itself generates for those inputs (greedy): the same ids and logprobs.
        lps = traj.logprobs_np
        for prompt, out in ((p1, o1), (p2, o2)):
            g = direct.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
                "temperature": 0, "max_new_tokens": 96, "stop_token_ids": [tok.eos_token_id]}}).json()
            assert g["output_ids"] == out
            got = lps[len(prompt): len(prompt) + len(out)]
            np.testing.assert_allclose(got, [row[0] for row in g["meta_info"]["output_token_logprobs"]], atol=1e-5)


def _two_episodes(gw) -> list:
    runs = []
    for _ in range(2):  # two episodes of one prompt: one group (gconfig.n_samples=2)
        sid, base = _session(gw)
        runs.append(_agent(base))
        r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1.0 if len(runs) == 1 else 0.0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == ("pending" if len(runs) == 1 else "committed"), r.json()
    return runs


def _check_group(redis_url, exp, tok, runs):
    """The one committed group: each trajectory is exactly the calls' prompt and generated ids."""
    from rlstream.producer.chat import ChatTemplate

    (group,), adm = _entries(redis_url, exp)
    assert (adm.running, adm.accepted) == (0, 1)
    assert len(group.trajectories) == 2 and group.metadata["source"] == "gateway"
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
    chat = ChatTemplate(tok, TOOLS)
    for traj, (r1, r2) in zip(group.trajectories, runs):
        p1, o1 = r1.model_extra["prompt_token_ids"], r1.choices[0].model_extra["token_ids"]
        p2, o2 = r2.model_extra["prompt_token_ids"], r2.choices[0].model_extra["token_ids"]
        assert p1 == chat.prompt([{"role": "user", "content": QUESTION}])
        assert tok.decode(o1, skip_special_tokens=True) == CALL
        # The second call's input is the first call's ids, unchanged, then exactly the template's
        # tokens for the tool message: the model's turn was never re-tokenized from its text.
        obs = chat.close_turn(o1) + chat.observation(
            [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL}],
            [{"role": "tool", "tool_call_id": "x", "content": "408"}])
        assert p2 == p1 + o1 + obs
        ids = traj.input_ids_np.tolist()
        assert ids == p2 + o2 and traj.prompt_len == len(p1)
        model_pos = list(range(len(p1), len(p1) + len(o1))) + list(range(len(p2), len(p2) + len(o2)))
        mask = np.zeros(len(ids), dtype=bool)
        mask[model_pos] = True
        assert traj.loss_mask_np.astype(bool).tolist() == mask.tolist()
        assert (traj.versions_np[mask] == 0).all() and (traj.versions_np[~mask] == -1).all()
        assert (traj.logprobs_np[mask] <= 0).all() and (traj.logprobs_np[~mask] == 0).all()
    return group


def test_streaming_n_and_completions_are_recorded_as_branches(gateway, redis_url):
    exp, gw = gateway
    sid, base = _session(gw, group="streams", group_size=1)
    client = _client(base)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                                 tools=TOOLS, stream=True))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])] if chunks else []
    assert [c.function.name for c in calls] == ["calculator"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    two = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1=?"}], n=2,
                                         max_tokens=5)
    assert len(two.choices) == 2
    comp = client.completions.create(model="tiny", prompt="u:12*34=?\n", max_tokens=4, stop=["a"])
    assert comp.choices[0].finish_reason in ("stop", "length")
    info = httpx.get(f"{gw.url}/sessions/{sid}", timeout=30).json()
    assert info["branches"] == 4 and info["calls"] == 3 and info["status"] == "open"
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 0.5}, timeout=60)
    assert r.json()["status"] == "committed" and r.json()["trajectories"] == 4, r.text
    after = httpx.get(f"{gw.url}/sessions/{sid}", timeout=30)  # still answers once the reward is in
    assert after.status_code == 200, after.text
    done = after.json()
    assert done["status"] == "finished" and done["reward"] == 0.5 and done["group_status"] == "committed"
    assert done["branches"] == 4 and done["calls"] == 3 and done["group_id"] == r.json()["group_id"]
    # the session tracer's record of this session: its engine requests, outcome and group
    from rlstream.common.tracing import read_sessions

    (rec,) = [x for x in read_sessions(gw.run_dir / "sessions.jsonl") if x["session"] == sid]
    assert rec["source"] == "gateway" and rec["outcome"] == "committed" and rec["group_id"] == done["group_id"]
    assert rec["submit"] <= rec["admitted"] <= rec["end"] and rec["calls"] == 3 and rec["reward"] == 0.5
    assert len(rec["requests"]) >= 4 and all(q["engine"] and q["out_tokens"] > 0 for q in rec["requests"])
    groups, _ = _entries(redis_url, exp)
    g = next(g for g in groups if g.prompt_id == "streams")
    assert len(g.trajectories) == 4 and all(t.reward == 0.5 for t in g.trajectories)
    assert all(int(t.loss_mask_np.sum()) > 0 for t in g.trajectories)


def test_bad_requests_are_clear_4xx(gateway, tool_model, engine):
    _, gw = gateway
    with pytest.raises(openai.NotFoundError, match="unknown session 'nope'"):
        _client(f"{gw.url}/sessions/nope/v1").chat.completions.create(model="t", messages=[{"role": "user", "content": "x"}])
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 400 and "X-Session-Id" in r.json()["error"]["message"]
    sid, base = _session(gw, group_size=1)
    client = _client(base)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="t", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="the model.s context is 512"):
        client.chat.completions.create(model="t", messages=[{"role": "user", "content": "1" * 5000}])
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1}, timeout=30)
    assert r.status_code == 400 and "no recorded call" in r.json()["error"]["message"]
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": "high"}, timeout=30)
    assert r.status_code == 400 and "reward" in r.json()["error"]["message"]
    for field, value, allowed in (("frequency_penalty", 3, "<= 2.0"), ("presence_penalty", -2.5, ">= -2.0")):
        with pytest.raises(openai.BadRequestError, match=f"{field}: expected `float` {allowed}"):
            client.chat.completions.create(model="t", messages=[{"role": "user", "content": QUESTION}],
                                           **{field: value})
    _stop_string_ends_generation_in_the_engine(client, engine, tool_model)
    assert httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1}, timeout=30).status_code == 200
    with pytest.raises(openai.ConflictError, match="finished"):
        client.chat.completions.create(model="t", messages=[{"role": "user", "content": QUESTION}])


def test_the_chaos_agent_runs_its_episodes_through_the_gateway(gateway, redis_url):
    """`rlstream chaos --agent`'s agent (launcher/chaos_agent.py): one group of two tool-using episodes, each one
    trajectory (the agent sends back the assistant messages it got, so the gateway continues the branch)."""
    import asyncio

    from rlstream.launcher.chaos_agent import Agent

    exp, gw = gateway
    agent = Agent(gw.addr_file, [{"prompt": QUESTION, "answer": "408"}], group_size=2, timeout=120)
    asyncio.run(_agent_group(agent))
    assert agent.counts == {"episodes_rewarded": 2, "episodes_failed": 0, "gateway_unreachable": 0, "tool_calls": 2}, \
        agent.last_error
    groups, _ = _entries(redis_url, exp)
    (g,) = [g for g in groups if g.prompt_id == "chaos-agent-1"]
    assert len(g.trajectories) == 2 and all(t.reward == 1.0 for t in g.trajectories)
    for t in g.trajectories:  # two model turns (the call, the answer) with the tool's observation between
        mask = t.loss_mask_np.astype(int).tolist()
        assert sum(1 for a, b in zip([0, *mask], mask) if (a, b) == (0, 1)) == 2


async def _agent_group(agent) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        await agent.group(http)


def _stop_string_ends_generation_in_the_engine(client, engine, tool_model) -> None:
    """A request's `stop` reaches the engine: it generates up to the token completing the string and no further
    (its token count grows by exactly the answer's tokens), the content ends before it, the ids keep it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    stop = '"calculator"'  # inside the fitted model's tool call (CALL)
    before = httpx.get(f"{engine.url}/health", timeout=30).json()["total_tokens"]
    r = client.chat.completions.create(model="t", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                       stop=[stop], extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert httpx.get(f"{engine.url}/health", timeout=30).json()["total_tokens"] - before == len(ids)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == CALL[:CALL.index(stop)]
    assert tok.decode(ids, skip_special_tokens=True).endswith(stop)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)


@pytest.mark.slow
def test_an_abandoned_session_releases_its_lease(redis_server, tool_model, engine, tmp_path):
    exp = f"gwa{uuid.uuid4().hex[:8]}"
    gw = GatewayProcess(tmp_path / "gw", _gateway_overrides(tool_model, redis_server.url, exp, engine,
                                                            "gateway.session_timeout=1"))
    gw.start()
    try:
        sid, base = _session(gw)  # a group of 2 of which this is the only member
        _client(base).chat.completions.create(model="t", messages=[{"role": "user", "content": QUESTION}], max_tokens=3)
        deadline = time.monotonic() + 60
        while httpx.get(f"{gw.url}/sessions/{sid}", timeout=30).status_code != 410 or \
                _entries(redis_server.url, exp)[1].running != 0:
            assert time.monotonic() < deadline, gw.log_path.read_text()[-2000:]
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError, match="abandoned") as exc:
            _client(base).chat.completions.create(model="t", messages=[{"role": "user", "content": QUESTION}])
        assert exc.value.status_code == 410
        groups, adm = _entries(redis_server.url, exp)
        assert groups == [] and (adm.running, adm.accepted) == (0, 0)
    finally:
        gw.stop()


@pytest.mark.slow
def test_the_same_agent_against_vllm(redis_server, tool_model, tmp_path):
    """rollout.backend=vllm: the gateway in front of real vLLM (CPU), same agent, same checks."""
    from transformers import AutoTokenizer

    vllm_python_or_skip()
    server = VllmServer(tool_model, tmp_path / "vllm.log", [
        "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--seed", "0", "--disable-log-stats"])
    server.start()
    exp = f"gwv{uuid.uuid4().hex[:8]}"

    class _Addr:
        address = server.url.split("//")[-1]

    gw = GatewayProcess(tmp_path / "gw", _gateway_overrides(tool_model, redis_server.url, exp, _Addr,
                                                            "rollout.backend=vllm"))
    try:
        gw.start()
        runs = _two_episodes(gw)
        first, second = runs[0]
        assert first.choices[0].finish_reason == "tool_calls", first
        assert json.loads(first.choices[0].message.tool_calls[0].function.arguments) == {"expression": "12*34"}
        assert second.choices[0].message.content == "408"
        _check_group(redis_server.url, exp, AutoTokenizer.from_pretrained(tool_model), runs)
    finally:
        gw.stop()
        server.stop()
