"""Token ids of a conversation through the tokenizer's chat template, turn by turn.

Token-in, token-out: the model's generated ids are never decoded and re-tokenized. What
the template adds between two model turns is computed as a token delta:

1. `close_turn(generated)`: the template's end-of-turn tokens that the model did not
   generate itself (Qwen/SmolLM: the `\\n` after `<|im_end|>`), found by rendering a
   fixed two-message conversation with and without its assistant turn;
2. `observation(history, new)`: render the conversation with the new messages (and the
   next generation prompt) and without them; the delta is the suffix. Templates that
   re-render earlier turns (Qwen3 drops old `<think>` blocks, some number tool calls)
   break the prefix property; then the delta is taken against a fixed base
   conversation instead, which renders the new messages exactly as they would follow
   any assistant turn.

Tools are offered through `tools=` (the template renders their schemas). A run's own template
(`train_dataset.chat_template_path`) replaces the tokenizer's, and `chat_template_kwargs` are passed
to every rendering (`ChatTemplate.of_config`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from rlstream.common.config import Config, ConfigError, DatasetConfig

__all__ = ["ChatTemplate", "read_chat_template"]

_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def read_chat_template(cfg: DatasetConfig, key: str) -> str | None:
    """The Jinja text of `{key}.chat_template_path` (None when unset), read once per process."""
    if not cfg.chat_template_path:
        return None
    return _read_template(cfg.chat_template_path, f"{key}.chat_template_path")


@functools.lru_cache(maxsize=8)
def _read_template(path: str, key: str) -> str:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{key}={path!r}: cannot read the chat template file ({exc.strerror}); give a Jinja "
                          "template file, or unset it to use the tokenizer's") from None


class ChatTemplate:
    """A tokenizer's chat template (or a run's own, `template`) with a fixed tool list and extra template
    variables (`template_kwargs`, e.g. enable_thinking)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, *, template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        if not (template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template "
                             f"({getattr(tokenizer, 'name_or_path', '?')} has none; or set "
                             "train_dataset.chat_template_path)")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        if template:
            self.template_kwargs["chat_template"] = template
        self._base_ids = self.ids(_BASE, add_generation_prompt=False)
        gen = self.ids(_BASE[:1], add_generation_prompt=True)
        y = tokenizer.encode("y", add_special_tokens=False)
        rest = self._base_ids[len(gen):] if self._base_ids[:len(gen)] == gen else []
        # What the template writes after an assistant's content: end-of-turn token(s).
        self.turn_tail: list[int] = rest[len(y):] if rest[:len(y)] == y else []

    @classmethod
    def of_config(cls, cfg: Config, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> "ChatTemplate":
        """The run's chat template: train_dataset's chat_template_path and chat_template_kwargs."""
        return cls(tokenizer, tools, template=read_chat_template(cfg.train_dataset, "train_dataset"),
                   template_kwargs=cfg.train_dataset.chat_template_kwargs)

    def ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self.template_kwargs)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first model input: the conversation so far plus the generation prompt."""
        return self.ids(messages, add_generation_prompt=True)

    def close_turn(self, generated: list[int]) -> list[int]:
        """End-of-turn tokens still missing after the model's own tokens (it may have generated part of them)."""
        tail = self.turn_tail
        for k in range(min(len(tail), len(generated)), 0, -1):
            if generated[-k:] == tail[:k]:
                return tail[k:]
        return list(tail)

    def observation(self, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[int]:
        """Tokens the template puts after `history` (ending with an assistant turn) for the
        `new` messages, up to and including the next generation prompt."""
        full = self.ids(history + new, add_generation_prompt=True)
        prev = self.ids(history, add_generation_prompt=False)
        if full[:len(prev)] == prev:
            return full[len(prev):]
        full = self.ids(_BASE + new, add_generation_prompt=True)
        if full[:len(self._base_ids)] != self._base_ids:
            raise ValueError("the chat template renders an assistant turn differently when messages follow it; "
                             "cannot compute the observation's token delta")
        return full[len(self._base_ids):]

    def conversation(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a whole conversation built the way an episode builds it: the
        prompt (messages before the first assistant turn), each assistant turn as its text's
        tokens plus the stop token (mask 1), each observation as the template's delta (mask 0).
        Warm-start demonstrations so train on exactly the token layout RL will produce."""
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        ids = self.prompt(messages[:first])
        mask = [0] * len(ids)
        stop = self.turn_tail[0] if self.turn_tail else self.tokenizer.eos_token_id
        history = list(messages[:first])
        i = first
        while i < len(messages):
            turn = self.tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [stop]
            ids += turn
            mask += [1] * len(turn)
            history.append(messages[i])
            j = i + 1
            while j < len(messages) and messages[j].get("role") != "assistant":
                j += 1
            if j > i + 1 or j < len(messages):
                obs = self.close_turn(turn) + self.observation(history, messages[i + 1:j])
                ids += obs
                mask += [0] * len(obs)
                history += messages[i + 1:j]
            i = j
        return ids, mask
