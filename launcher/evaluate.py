"""Held-out accuracy of a checkpoint: greedy, batched `generate`, scored by the run's reward.

Used by `rlstream run` before RL (on `actor.path`) and after it (on the final
checkpoint). Prompts are tokenized by the producer's `PromptDataset` and completions
decoded the way the producer decodes them (up to EOS, special tokens skipped), then
scored with `producer.reward_fn`; accuracy is the fraction scoring > 0.5.
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
    examples: list[tuple[str, str, str]]  # (prompt, completion, answer), a few for the log


def evaluate_accuracy(cfg: Config, model_path: str | Path, n: int | None = None, batch_size: int = 64) -> EvalResult:
    """Greedy accuracy of the model at `model_path` on the first `n` held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.producer.dataset import PromptDataset
    from rlstream.producer.rewards import import_by_path

    if cfg.valid_dataset is None or not cfg.valid_dataset.path:
        raise ValueError("valid_dataset.path is empty: nothing to evaluate on (or set launcher.eval_n=0)")
    n = cfg.launcher.eval_n if n is None else n
    # One thread: with several processes on 2 cores, OpenMP spinning in more threads costs 10-50x.
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    ds = PromptDataset(cfg.valid_dataset, tokenizer, seed=cfg.seed, key="valid_dataset")
    reward_fn = import_by_path(cfg.producer.reward_fn)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    model.eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
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
                                 max_new_tokens=cfg.gconfig.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        for r, (_, text, answer, _, _) in enumerate(chunk):
            gen = out[r, width:].tolist()
            if eos in gen:
                gen = gen[: gen.index(eos)]
            completion = tokenizer.decode(gen, skip_special_tokens=True)
            rewards.append(float(reward_fn(text, completion, answer)))
            if len(examples) < 5:
                examples.append((text, completion, str(answer)))
    if not rewards:
        return EvalResult(0.0, 0, 0.0, [])
    acc = sum(r > 0.5 for r in rewards) / len(rewards)
    return EvalResult(acc, len(rewards), sum(rewards) / len(rewards), examples)
