"""`launcher/tiny.py`: the character-level tokenizer (fixed ids, the chat template with tool markup) and
the tiny Llama written as a local HF folder."""

from __future__ import annotations

import json

from rlstream.launcher.tiny import CHARS, CHAT_CHARS, SPECIAL_TOKENS, build_tiny_model, build_tokenizer


def test_tokenizer_is_one_token_per_character_with_fixed_special_ids():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS)
    ids = tok.encode("12+3=", add_special_tokens=False)
    assert len(ids) == 5 and tok.decode(ids) == "12+3="
    assert tok.encode("{", add_special_tokens=False) == [tok.unk_token_id]  # a chat character: not here
    assert tok.chat_template is None


def test_chat_tokenizer_keeps_the_ids_and_renders_tool_calls():
    plain, chat = build_tokenizer(), build_tokenizer(chat=True)
    assert len(chat) == len(plain) + len(CHAT_CHARS)
    assert chat.encode("12+3=", add_special_tokens=False) == plain.encode("12+3=", add_special_tokens=False)
    msgs = [{"role": "user", "content": "2*3"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"e": "2*3"}}}]},
            {"role": "tool", "content": "6"}]
    text = chat.apply_chat_template(msgs, tools=[{"name": "calc"}], tokenize=False, add_generation_prompt=True)
    assert text == ('tools: calc\nu:2*3\na:<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call></s>\n'
                    't:6\na:')


def test_build_tiny_model_writes_a_loadable_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "m", hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                            tie_word_embeddings=True, chat=True)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["tie_word_embeddings"]) == (16, 1, True)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok) and tok.chat_template
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    untied = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m2", hidden_size=16, num_layers=1,
                                                                   num_heads=2, intermediate_size=32))
    assert not untied.config.tie_word_embeddings
    twin = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m3", hidden_size=16, num_layers=1,
                                                                 num_heads=2, intermediate_size=32))
    for (name, a), b in zip(untied.state_dict().items(), twin.state_dict().values()):
        assert (a == b).all(), name  # the same seed, the same weights
