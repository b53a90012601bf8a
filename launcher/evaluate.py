"""Held-out accuracy of a checkpoint: greedy, batched `generate`, scored by the run's reward.

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

import os
from dataclasses import dataclass
from pathlib import Path

from rlstream.common.config import Config

__all__ = ["EvalResult", "evaluate_accuracy"]


@dataclass
class EvalResult:
    accuracy: float
    n: int
    mean_reward: float
    examples: list[tuple[str, str, str]]  # (question, completion, answer), a few for the log


def question_of(row: dict, prompt_key: str, text: str) -> str:
    """What to show of a prompt: the last user message of a chat, else the prompt text."""
    value = row.get(prompt_key)
    if isinstance(value, list):
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return text


def evaluate_accuracy(cfg: Config, model_path: str | Path, n: int | None = None, batch_size: int = 64) -> EvalResult:
    """Greedy accuracy of the model at `model_path` on the first `n` held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.producer.dataset import PromptDataset
    from rlstream.producer.rewards import import_by_path

    if cfg.valid_dataset is None or not cfg.valid_dataset.path:
        raise ValueError("valid_dataset.path is empty: nothing to evaluate on (or set launcher.eval_n=0)")
    n = cfg.launcher.eval_n if n is None else n
    from rlstream.common.models import stop_token_ids

    # `rlstream run` evaluates before the children start and after they stopped: the cores are ours.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    ds = PromptDataset(cfg.valid_dataset, tokenizer, seed=cfg.seed, key="valid_dataset")
    reward_fn = import_by_path(cfg.producer.reward_fn)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    model.eval()
    stops = stop_token_ids(tokenizer, model_path, cfg.gconfig.stop_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    items = [ds.items[i] for i in range(min(n, len(ds)))]  # file order: the same prompts before and after
    rewards: list[float] = []
    examples = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        width = max(len(ids) for _, _, _, ids, _ in chunk)
        # Left padding: every row's next token is at the same position.
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (_, _, _, ids, _) in enumerate(chunk):
            input_ids[r, width - len(ids) :] = torch.tensor(ids)
            attn[r, width - len(ids) :] = 1
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attn, do_sample=False,
                                 max_new_tokens=cfg.gconfig.max_new_tokens, eos_token_id=stops, pad_token_id=pad)
        for r, (_, text, answer, _, row) in enumerate(chunk):
            gen = out[r, width:].tolist()
            cut = next((i for i, t in enumerate(gen) if t in stops), len(gen))
            completion = tokenizer.decode(gen[:cut], skip_special_tokens=True)
            rewards.append(float(reward_fn(text, completion, answer)))
            if len(examples) < 5:
                examples.append((question_of(row, cfg.valid_dataset.prompt_key, text), completion, str(answer)))
    if not rewards:
        return EvalResult(0.0, 0, 0.0, [])
    acc = sum(r > 0.5 for r in rewards) / len(rewards)
    return EvalResult(acc, len(rewards), sum(rewards) / len(rewards), examples)
