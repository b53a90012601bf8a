"""Held-out accuracy of a checkpoint: greedy through an in-process local engine, scored by the run's reward.

Multi-turn workflows (`AgentWorkflow`) are evaluated by running their episodes, greedy
and one per prompt, against an in-process local engine (`evaluate_episodes`): the same
environment, tools, template deltas and reward as training, plus the tool-call rate
and turns per episode.

Used by `rlstream run` before RL (on `actor.path`) and after it (on the final
checkpoint). Prompts are tokenized by the producer's `PromptDataset` and completions
decoded the way the producer decodes them (up to EOS, special tokens skipped), then
scored with `producer.reward_fn`; accuracy is the fraction scoring > 0.5. Generation stops
at the run's stop tokens (`common/models.stop_token_ids`: the tokenizer's EOS plus the
model's generation_config eos ids plus `gconfig.stop_token_ids`), the same set the
producer and the engines use. The examples kept for the log show the question (the last
user message of a chat prompt), not the whole templated prompt.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.common.config import Config
from rlstream.producer.rewards import import_by_path

__all__ = ["EvalResult", "evaluate_accuracy", "evaluate_episodes"]


@dataclass
class EvalResult:
    accuracy: float
    n: int
    mean_reward: float
    examples: list[tuple[str, str, str]]  # (question, completion, answer), a few for the log
    episode_stats: dict[str, float] = field(default_factory=dict)  # multi-turn: tool_call_rate, turns
    # image prompts: (the prompt's first image, completion, answer) of the first few, for the before/after picture
    image_examples: list[tuple[bytes, str, str]] = field(default_factory=list)


def question_of(row: dict, prompt_key: str, text: str, image_key: str = "images") -> str:
    """What to show of a prompt: the last user message of a chat, else the prompt text; a row's image files
    named before it."""
    value = row.get(prompt_key)
    images = row.get(image_key)
    if isinstance(value, str) and images:
        names = [v for v in (images if isinstance(images, list) else [images]) if isinstance(v, str)]
        return f"[{', '.join(names) or 'image'}] {value}"
    if isinstance(value, list):
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return text


def answer_text(answer: Any) -> str:
    """The reference answer as text (a generated row's answer is its recipe, with the answer in it)."""
    return str(answer["answer"]) if isinstance(answer, dict) and "answer" in answer else str(answer)


def evaluate_accuracy(cfg: Config, model_path: str | Path, n: int | None = None, batch_size: int = 64) -> EvalResult:
    """Greedy accuracy of the model at `model_path` on the first `n` held-out prompts."""
    import torch
    from transformers import AutoTokenizer

    from rlstream.producer.dataset import PromptDataset

    if cfg.valid_dataset is None or not cfg.valid_dataset.has_rows:
        raise ValueError("valid_dataset.path is empty: nothing to evaluate on (or set launcher.eval_n=0)")
    n = cfg.launcher.eval_n if n is None else n
    from rlstream.producer.agent import AgentWorkflow

    workflow = import_by_path(cfg.producer.workflow, "producer.workflow")
    if isinstance(workflow, type) and issubclass(workflow, AgentWorkflow):
        return evaluate_episodes(cfg, model_path, n)
    from rlstream.common.models import stop_token_ids
    from rlstream.engine.local import LocalEngine

    # `rlstream run` evaluates before the children start and after they stopped: the cores are ours.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    from rlstream.common.vision import actor_vision

    ds = PromptDataset(cfg.valid_dataset, tokenizer, seed=cfg.seed, key="valid_dataset", vision=actor_vision(cfg),
                       image_limits=cfg.images)
    reward_fn = import_by_path(cfg.producer.reward_fn)
    stops = stop_token_ids(tokenizer, model_path, cfg.gconfig.stop_token_ids)
    items = [ds.items[i] for i in range(min(n, len(ds)))]  # file order: the same prompts before and after
    images = [list(ds.images[i]) or None for i in range(len(items))]
    # Greedy through the local engine (continuous batching, the engine the run samples with): the
    # same tokens `model.generate` picks, several times faster on CPU for chat-length prompts.
    engine = LocalEngine(model_path, tokenizer_path=cfg.tokenizer, device=cfg.server.device,
                         max_batch_size=batch_size, seed=cfg.seed)
    params = {"max_new_tokens": cfg.gconfig.max_new_tokens, "temperature": 0.0, "stop_token_ids": list(stops)}

    async def run_all() -> list[Any]:
        return await asyncio.gather(*(engine.generate(list(ids), params, images=im)
                                      for (_, _, _, ids, _), im in zip(items, images)))

    try:
        outs = asyncio.run(run_all())
    finally:
        engine.close()
    rewards: list[float] = []
    examples = []
    pictured = []
    for out, (_, text, answer, _, row), im in zip(outs, items, images):
        gen = list(out.output_ids)
        cut = next((i for i, t in enumerate(gen) if t in stops), len(gen))
        completion = tokenizer.decode(gen[:cut], skip_special_tokens=True)
        rewards.append(float(reward_fn(text, completion, answer)))
        if len(examples) < 5:
            examples.append((question_of(row, cfg.valid_dataset.prompt_key, text, cfg.valid_dataset.image_key),
                             completion, answer_text(answer)))
        if im and len(pictured) < 8:
            pictured.append((im[0], completion, answer_text(answer)))
    if not rewards:
        return EvalResult(0.0, 0, 0.0, [])
    acc = sum(r > 0.5 for r in rewards) / len(rewards)
    return EvalResult(acc, len(rewards), sum(rewards) / len(rewards), examples, image_examples=pictured)


class _InProcessEngine:
    """`RolloutEngine`'s `agenerate` on a `LocalEngine` in this process (greedy evaluation)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def agenerate(self, req: Any) -> Any:
        from rlstream.producer.workflow import Generation

        resp = await self.engine.generate(req.input_ids, {
            "max_new_tokens": req.max_new_tokens, "min_new_tokens": req.min_new_tokens,
            "temperature": req.effective_temperature, "top_p": req.top_p, "stop_token_ids": list(req.stop_token_ids)})
        meta = resp.meta_info
        return Generation(input_ids=list(req.input_ids), output_ids=list(resp.output_ids),
                          output_logprobs=[lp for lp, _, _ in meta.output_token_logprobs],
                          output_versions=list(meta.output_token_versions or [0] * len(resp.output_ids)),
                          finish_reason=meta.finish_reason.type)


def evaluate_episodes(cfg: Config, model_path: str | Path, n: int) -> EvalResult:
    """Greedy multi-turn episodes on the first `n` held-out prompts: accuracy (reward > 0.5),
    tool-call rate (episodes with at least one tool call) and mean turns."""
    import msgspec
    import torch
    from transformers import AutoTokenizer

    from rlstream.engine.local import LocalEngine
    from rlstream.producer.agent import AgentWorkflow
    from rlstream.producer.dataset import PromptDataset
    from rlstream.producer.rewards import RewardResult

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    ds = PromptDataset(cfg.valid_dataset, tokenizer, seed=cfg.seed, key="valid_dataset")
    reward_fn = import_by_path(cfg.producer.reward_fn)

    async def reward(prompt: str, completion: str, answer: Any, **kw: Any) -> RewardResult:
        return RewardResult(float(reward_fn(prompt, completion, answer)))

    greedy = msgspec.structs.replace(cfg.gconfig, n_samples=1, greedy=True, temperature=0.0)
    ecfg = msgspec.structs.replace(cfg, gconfig=greedy)
    wf = AgentWorkflow(cfg=ecfg, tokenizer=tokenizer, reward=reward)
    engine = LocalEngine(model_path, tokenizer_path=cfg.tokenizer, device=cfg.server.device, max_batch_size=256,
                         seed=cfg.seed)
    items = [ds.at(i) for i in range(min(n, len(ds)))]

    async def run_all() -> list[Any]:
        eng = _InProcessEngine(engine)
        return await asyncio.gather(*(wf.run_episode(eng, item) for item in items))

    try:
        episodes = asyncio.run(run_all())
    finally:
        engine.close()
    if not episodes:
        return EvalResult(0.0, 0, 0.0, [])
    rewards = [e.reward if e.failed is None else 0.0 for e in episodes]
    examples = []
    for e, item in list(zip(episodes, items))[:5]:
        text = tokenizer.decode(e.ids[len(e.prompt_ids):], skip_special_tokens=True)
        examples.append((question_of(item.row, cfg.valid_dataset.prompt_key, item.prompt), text, answer_text(item.answer)))
    stats = {"tool_call_rate": sum(e.metadata.get("tool_calls", 0) > 0 for e in episodes) / len(episodes),
             "turns": sum(e.n_turns for e in episodes) / len(episodes)}
    return EvalResult(sum(r > 0.5 for r in rewards) / len(rewards), len(rewards), sum(rewards) / len(rewards),
                      examples, stats)
