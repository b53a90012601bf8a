"""A tiny Llama model and character-level tokenizer built on the spot (no hub).

Used by the CPU demo, the tests and the benchmarks. The tokenizer is a real
`tokenizers` WordLevel model over characters wrapped as a `PreTrainedTokenizerFast`,
saved with the model so `AutoTokenizer` / `AutoModelForCausalLM` load both from a
local folder like any HF checkpoint.
"""

from __future__ import annotations

import string
from pathlib import Path

from rlstream.common.models import dtype_kwargs

__all__ = ["CHARS", "CHAT_CHARS", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "build_tiny_model",
           "build_tiny_moe_model"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.digits + string.ascii_lowercase + " +-*/=?:.,()[]<>#")
# With `chat=True`: the characters of chat turns and Hermes tool calls (`<tool_call>{"name": ...}`),
# appended so the ids of CHARS stay the same.
CHAT_CHARS = list('_{}"\'\n;!')

# A compact chat template with tools (one character per token, so every byte counts): the tool
# names on a first line, `u:`/`a:`/`t:`/`s:` turns, an assistant turn ends with EOS then a newline,
# tool calls in the Hermes/Qwen markup `<tool_call>{json}</tool_call>`.
CHAT_TEMPLATE = (  # newlines as expressions: HF renders templates with trim_blocks
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name if t.function is defined else t.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}s:{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'user' %}u:{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'assistant' %}a:{{ m.content }}"
    "{%- if m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}</s>{{ '\\n' }}"
    "{%- elif m.role == 'tool' %}t:{{ m.content }}{{ '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}a:{% endif %}"
)


def build_tokenizer(chat: bool = False):
    """A character-level fast tokenizer: pad=0, bos=1, eos=2, unk=3; `chat`: + CHAT_CHARS and CHAT_TEMPLATE."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + (CHAT_CHARS if chat else []))}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int = 256, max_position_embeddings: int = 512, seed: int = 0,
                     tie_word_embeddings: bool = False, chat: bool = False) -> Path:
    """Write a randomly initialised tiny LlamaForCausalLM + tokenizer to `path`.

    `tie_word_embeddings=True` shares `lm_head.weight` with `embed_tokens.weight`, as most
    small real chat models do (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B): the checkpoint then
    holds one tensor for both, and a weight push sends it once. `chat=True` adds the chat
    template with tool markup (and its characters) to the tokenizer.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(chat=chat)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **dtype_kwargs("float32"),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_moe_model(path: str | Path, *, num_experts: int = 4, experts_per_token: int = 2, seed: int = 0,
                         hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Write a randomly initialised tiny mixture-of-experts Qwen3MoeForCausalLM (every layer sparse, a router choosing
    `experts_per_token` of `num_experts` MLPs per token) + the character tokenizer to `path`."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        head_dim=hidden_size // 4, num_experts=num_experts,
        num_experts_per_tok=experts_per_token, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, **dtype_kwargs("float32"))
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
