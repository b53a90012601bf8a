"""`producer/chat.py`: token ids of a conversation through the tokenizer's chat template, turn by turn
(the end-of-turn tokens the model did not generate, the observation deltas), on the tiny chat tokenizer
(`launcher/tiny.py`) and on a template that re-renders earlier turns."""

from __future__ import annotations

import re

import pytest

from rlstream.launcher.tiny import build_tokenizer
from rlstream.producer.chat import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(chat=True)


def _text(tok, ids: list[int]) -> str:
    return "".join(tok.decode([i]) for i in ids)


def test_a_tokenizer_without_a_template_is_refused():
    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        ChatTemplate(build_tokenizer(chat=False))


def test_prompt_and_turn_tail(tok):
    chat = ChatTemplate(tok, TOOLS)
    assert _text(tok, chat.prompt([{"role": "user", "content": "1+2"}])) == "tools: calc\nu:1+2\na:"
    assert _text(tok, chat.turn_tail) == "</s>\n"  # what the template writes after an assistant's content
    no_tools = ChatTemplate(tok).prompt([{"role": "user", "content": "x"}])
    assert no_tools == tok.encode("u:x\na:", add_special_tokens=False)


def test_close_turn_adds_only_what_the_model_did_not_generate(tok):
    chat = ChatTemplate(tok)
    eos, nl = tok.eos_token_id, tok.convert_tokens_to_ids("\n")
    some = tok.encode("42", add_special_tokens=False)
    assert chat.close_turn(some) == [eos, nl]
    assert chat.close_turn(some + [eos]) == [nl]
    assert chat.close_turn(some + [eos, nl]) == []
    assert chat.close_turn([]) == [eos, nl]


def test_observation_is_the_template_delta_up_to_the_next_generation_prompt(tok):
    chat = ChatTemplate(tok, TOOLS)
    history = [{"role": "user", "content": "3*4"}, {"role": "assistant", "content": "calling"}]
    obs = chat.observation(history, [{"role": "tool", "content": "12"}])
    assert _text(tok, obs) == "t:12\na:"
    # prompt + the model's turn + close + observation is what the template renders for the whole conversation
    turn = tok.encode("calling", add_special_tokens=False)
    ids = chat.prompt(history[:1]) + turn + chat.close_turn(turn) + obs
    assert ids == chat.ids(history + [{"role": "tool", "content": "12"}], add_generation_prompt=True)


class RerenderingTokenizer:
    """The tiny tokenizer under a template that re-renders an assistant turn once messages follow it:
    `#...#` (a thought, as Qwen3's <think>) is dropped before a later user turn; `mark` appends `!` to
    every assistant turn that anything follows (no delta can be computed then)."""

    chat_template = "rerendering"
    name_or_path = "rerendering"

    def __init__(self, tok, mark: bool = False) -> None:
        self.tok, self.mark = tok, mark
        self.eos_token_id = tok.eos_token_id

    def encode(self, text, add_special_tokens=False):
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=False):
        text = ""
        for i, m in enumerate(messages):
            content, later = m["content"], messages[i + 1:]
            if m["role"] == "assistant":
                if any(n["role"] == "user" for n in later):
                    content = re.sub("#.*?#", "", content)
                if self.mark and later:
                    content += "!"
                text += f"a:{content}</s>\n"
            else:
                text += f"{m['role'][0]}:{content}\n"
        return self.tok.encode(text + ("a:" if add_generation_prompt else ""), add_special_tokens=False)


def test_a_template_that_rerenders_history_takes_the_delta_against_the_fixed_base(tok):
    chat = ChatTemplate(RerenderingTokenizer(tok))
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#think#a1"}]
    obs = chat.observation(history, [{"role": "user", "content": "again"}])
    assert _text(tok, obs) == "u:again\na:"
    with pytest.raises(ValueError, match="renders an assistant turn differently"):
        ChatTemplate(RerenderingTokenizer(tok, mark=True)).observation(history, [{"role": "tool", "content": "1"}])


def test_conversation_masks_the_assistant_turns_only(tok):
    chat = ChatTemplate(tok, TOOLS)
    msgs = [{"role": "user", "content": "3*4"}, {"role": "assistant", "content": "go"},
            {"role": "tool", "content": "12"}, {"role": "assistant", "content": "12"}]
    ids, mask = chat.conversation(msgs)
    assert len(ids) == len(mask)
    assert _text(tok, [i for i, m in zip(ids, mask) if m]) == "go</s>12</s>"
    assert _text(tok, ids) == "tools: calc\nu:3*4\na:go</s>\nt:12\na:12</s>"


def test_the_runs_template_file_and_kwargs_render_every_turn(tok, tmp_path):
    """ChatTemplate.of_config: train_dataset.chat_template_path instead of the tokenizer's template, and
    chat_template_kwargs as template variables (enable_thinking renders differently)."""
    from rlstream.common.config import ConfigError, load_config

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }};{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'a=' if enable_thinking | default(true) else 'a=;' }}"
                        "{% endif %}")
    msgs = [{"role": "user", "content": "1+2"}]

    def render(*overrides):
        cfg = load_config(None, [f"train_dataset.chat_template_path={template}", *overrides])
        return _text(tok, ChatTemplate.of_config(cfg, tok).prompt(msgs))

    assert render() == "u=1+2;a="
    assert render("train_dataset.chat_template_kwargs={enable_thinking: false}") == "u=1+2;a=;"
    assert _text(tok, ChatTemplate.of_config(load_config(None, []), tok).prompt(msgs)) == "u:1+2\na:"
    with pytest.raises(ConfigError, match="train_dataset.chat_template_path='/nowhere.jinja': cannot read"):
        ChatTemplate.of_config(load_config(None, ["train_dataset.chat_template_path=/nowhere.jinja"]), tok)
