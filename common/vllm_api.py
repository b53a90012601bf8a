"""vLLM's OpenAI-compatible subset of the engine HTTP contract (`common/engine_api.py` holds its routes).

`/v1/completions` with a token-id prompt, `/v1/models` and `/is_paused`, as vLLM speaks
them: plain msgspec Structs (every field is sent), unlike the SGLang bodies, which omit
fields at their default.
"""

from __future__ import annotations

import msgspec

__all__ = ["CompletionRequest", "CompletionLogprobs", "CompletionChoice", "CompletionResponse", "ModelCard",
           "ModelList", "PausedReply", "PromptLogprobsRequest", "PromptLogprob", "PromptLogprobsChoice",
           "PromptLogprobsResponse"]


class CompletionRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/completions` with a token-id prompt; every returned token is `token_id:N`."""

    model: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    logprobs: int = 0  # the sampled token's logprob only
    return_tokens_as_token_ids: bool = True
    skip_special_tokens: bool = False
    stream: bool = False
    top_k: int | msgspec.UnsetType = msgspec.UNSET
    min_tokens: int | msgspec.UnsetType = msgspec.UNSET
    stop_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    # Stop strings: the text ends before one (include_stop_str_in_output false), the token ids keep its last token.
    stop: list[str] | msgspec.UnsetType = msgspec.UNSET
    frequency_penalty: float | msgspec.UnsetType = msgspec.UNSET  # OpenAI, [-2, 2]
    presence_penalty: float | msgspec.UnsetType = msgspec.UNSET  # OpenAI, [-2, 2]
    repetition_penalty: float | msgspec.UnsetType = msgspec.UNSET  # vLLM's extra parameter, > 0, prompt + output
    request_id: str | msgspec.UnsetType = msgspec.UNSET
    structured_outputs: dict[str, str] | msgspec.UnsetType = msgspec.UNSET  # {json | regex | grammar: text}


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None


class CompletionChoice(msgspec.Struct):
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct):
    choices: list[CompletionChoice] = msgspec.field(default_factory=list)


class PromptLogprobsRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/completions` scoring given token ids (a distillation teacher): `prompt_logprobs: 0` returns each
    prompt token's own logprob (no top-k beside it); one greedy token is generated and ignored."""

    model: str
    prompt: list[list[int]]  # a batch: one choice per sequence, `index` in this order
    prompt_logprobs: int = 0
    max_tokens: int = 1
    temperature: float = 0.0


class PromptLogprob(msgspec.Struct):
    logprob: float | None = None


class PromptLogprobsChoice(msgspec.Struct):
    index: int = 0
    # per prompt position: None at the first, else {"<token id>": {"logprob": ...}} holding the prompt token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class PromptLogprobsResponse(msgspec.Struct):
    choices: list[PromptLogprobsChoice] = msgspec.field(default_factory=list)


class ModelCard(msgspec.Struct):
    id: str


class ModelList(msgspec.Struct):
    """`GET /v1/models`."""

    data: list[ModelCard] = msgspec.field(default_factory=list)


class PausedReply(msgspec.Struct):
    """`GET /is_paused` (vLLM)."""

    is_paused: bool
