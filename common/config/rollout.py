"""Rollouts: sampling parameters, admission and engine clients, the prompt datasets."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rlstream.common.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section

__all__ = ["GenerationHyperparameters", "RolloutConfig", "ImageLimitsConfig", "DatasetConfig"]


class GenerationHyperparameters(Section):
    n_samples: PositiveInt = 1
    """Samples per prompt; they form one group."""
    max_new_tokens: PositiveInt = 16384
    """Maximum tokens generated per sample."""
    max_tokens: PositiveInt | None = None
    """Maximum tokens of prompt + generated tokens (AReaL's key): each request asks for at most max_tokens minus its
    prompt, and prompts of max_tokens or more are dropped when the dataset loads. None = no such bound."""
    min_new_tokens: NonNegativeInt = 0
    """Minimum tokens generated before a stop token counts."""
    greedy: bool = False
    """Greedy decoding (temperature 0)."""
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling probability."""
    top_k: PositiveInt = 100_000_000
    """Top-k sampling (large = off)."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature; behaviour logprobs are of softmax(logits / T)."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    """Token ids that end a sample (the tokenizer's EOS and the model's generation_config eos ids are added)."""
    stop: list[Annotated[str, Meta(min_length=1)]] = msgspec.field(default_factory=list)
    """Stop strings (OpenAI/SGLang/vLLM `stop`): a sample ends once its decoded text contains one (counted from
    min_new_tokens on). The trajectory keeps exactly the sampled tokens, up to and including the one that completed
    the string; the answer's text ends before it (SGLang's and vLLM's default)."""
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    """OpenAI's frequency penalty: each logit minus this times the count of its token in the output so far. Any
    penalty makes the behaviour logprobs those of the penalised distribution, which the trainer's recomputation
    (without penalties) does not reproduce: the decoupled loss counts the gap as off-policyness."""
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    """OpenAI's presence penalty: each logit minus this when its token is in the output so far (behaviour logprobs
    as for frequency_penalty)."""
    repetition_penalty: PositiveFloat = 1.0
    """CTRL's repetition penalty (HF, vLLM): the logit of a token of the prompt or output so far divided by this when
    positive, multiplied when negative (1 = off; > 1 discourages repeats; SGLang accepts at most 2; behaviour logprobs
    as for frequency_penalty)."""


class RolloutConfig(Section):
    experiment_name: str | None = None
    """Defaults to the top-level experiment_name."""
    trial_name: str | None = None
    """Defaults to the top-level trial_name."""
    backend: Literal["sglang", "vllm"] = "sglang"
    """Engine protocol: sglang (native /generate; also the local engine) or vllm (/v1/completions)."""
    max_concurrent_rollouts: PositiveInt | None = None
    """Global cap on rollouts in flight (None = consumer_batch_size)."""
    queue_size: PositiveInt | None = None
    """Accepted for compatibility with AReaL configs, not used: a finished group is written to Redis at once, so none
    wait in a producer."""
    consumer_batch_size: PositiveInt = 1
    """Groups the trainer consumes per step (B)."""
    max_head_offpolicyness: NonNegativeInt = 0
    """Off-policyness budget η: versions a group may lag the trainer."""
    schedule_policy: Literal["round_robin", "least_inflight"] = "round_robin"
    """How a producer picks an engine for a request."""
    request_timeout: PositiveFloat = 3600.0
    """Seconds one engine request may take."""
    request_retries: PositiveInt = 3
    """Attempts per request, each on another healthy engine."""
    setup_timeout: PositiveFloat = 120.0
    """Seconds to wait for engines to appear at start-up."""
    lease_ttl: PositiveFloat = 300.0
    """Seconds a rollout lease lives; a crashed producer's leases expire after this."""
    check_trajectory_format: bool = True
    """Validate every group before it is written."""
    engine_addresses: list[str] = msgspec.field(default_factory=list)
    """Engine addresses host:port (overrides name resolve when non-empty)."""
    api_key: str | None = None
    """Bearer token sent to engines; masked in logs."""
    health_check_interval: PositiveFloat = 5.0
    """Seconds between engine health checks."""
    pause_grace_period: NonNegativeFloat = 0.0
    """Seconds a weight push waits after every engine acknowledged /pause_generation before it sends weights (AReaL's
    key: for engines whose pause returns before their running requests are dropped; rlstream's engines, vLLM's and
    SGLang's abort pause acknowledge once nothing runs, so 0 needs no wait)."""


class ImageLimitsConfig(Section):
    """Limits on the images of one prompt, enforced where images enter: a dataset row over them is skipped with one
    line naming it, a gateway call is a 400 naming the limit, a group a workflow built over them goes to the
    dead-letter stream with the reason instead of its commit. vLLM names the count limit `limit_mm_per_prompt`
    (`{"image": N}`), SGLang `--limit-mm-data-per-request`; the pixel bound is the Qwen2-VL image processor's
    `max_pixels`."""

    max_per_prompt: PositiveInt = 16
    """Images one sequence may hold, over all its turns (vLLM's `limit_mm_per_prompt.image`, SGLang's
    `limit_mm_data_per_request.image`); the local engine refuses a request with more."""
    max_bytes: PositiveInt = 20 * 1024 * 1024
    """Largest encoded image (PNG/JPEG bytes as given), 20 MiB: a photo is far under it; each one is stored in Redis
    once per run (`{ns}:img:<sha256>`), so this bounds one key's size."""
    max_pixels: PositiveInt = 12_845_056
    """Largest image in pixels (width x height, read from the header without decoding), 3584 x 3584: Qwen2-VL's image
    processor shrinks anything larger to its `max_pixels` (12,845,056 in Qwen2-VL's released configs) anyway, so a
    larger image only costs decoding memory (Pillow's decompression-bomb guard is at 89 M pixels)."""


class DatasetConfig(Section):
    source: Literal["files", "reasoning_gym", "verifiers"] = "files"
    """Where the rows come from: files = `path`; reasoning_gym = generated by the reasoning-gym task `task` (chat
    prompts with `few_shot` solved examples, its own scorer as the default producer.reward_fn); verifiers = the
    dataset of the installed verifiers environment `task` (valid_dataset: its eval dataset), run by
    rlstream.producer.verifiers_env:VerifiersWorkflow (the default producer.workflow) and scored by its rubric."""
    path: str = ""
    """Local JSONL / Parquet / CSV file or folder, or a hub name `org/name` read from the local HF datasets cache
    (never downloaded: common/hub_datasets.py)."""
    subset: str | None = None
    """The hub dataset's configuration (HF `name`), e.g. `main` for openai/gsm8k."""
    revision: str | None = None
    """The commit a cached copy of the hub dataset was built from (offline, branch and tag names cannot be resolved)."""
    split: str = "train"
    """The split to read, HF syntax with slices: `train`, `test`, `train[:90%]`, `train[-500:]` (local files hold one
    split, `train`)."""
    task: str = ""
    """reasoning-gym task name (source=reasoning_gym), e.g. chain_sum, basic_arithmetic; or the verifiers
    environment (source=verifiers): an installed environment package or module with `load_environment`, e.g.
    `wordle` or `my_envs.math_tools` (`-` read as `_`, as `vf.load_environment` does)."""
    size: PositiveInt = 1000
    """Problems generated (source=reasoning_gym): the rows of one epoch."""
    seed: int | None = None
    """Seed of the generated problems (source=reasoning_gym; problem i is drawn with seed + i, so two sets of one
    task are disjoint when their ranges [seed, seed + size) are); None = the run's `seed` for train_dataset and
    train_dataset's seed + size for valid_dataset (the next problems: held out)."""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    """The task's own options (source=reasoning_gym): fields of its reasoning-gym config class, e.g.
    {min_terms: 2, max_terms: 3} for chain_sum; source=verifiers: the keyword arguments of the environment's
    `load_environment`."""
    few_shot: NonNegativeInt = 1
    """Solved examples of the task (another seed), each a user/assistant exchange answering in <answer></answer>
    tags, put before every generated problem (source=reasoning_gym)."""
    type: Literal["auto", "json", "parquet", "csv", "rl"] = "auto"
    """File format (auto: by extension; rl, AReaL's prompt-dataset type, is read as auto)."""
    prompt_key: str = "prompt"
    """Column with the prompt text."""
    answer_key: str = "answer"
    """Column with the reference answer."""
    image_key: str = "images"
    """Column with each row's images (a list, or one image): file paths (relative ones from the dataset's folder),
    bytes, or HF datasets `Image` values. A chat prompt's bare `{"type": "image"}` parts take them in order; the
    rest go before the first user message's text (a text prompt becomes that message). A missing column: no
    images; chat messages may still carry their own (`image` / `image_url` parts). Needs a vision actor.path."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    chat_template_path: str | None = None
    """A Jinja chat template file used instead of the tokenizer's (cosmos-rl multi_turn_config.custom_chat_template_path;
    implies apply_chat_template), read once when a process starts; train_dataset's also renders the turns of the
    agent, verifiers and gateway workflows and `rlstream sft`'s conversations. An unreadable file is an error naming
    this key."""
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Extra variables of every chat-template rendering (keyword arguments of tokenizer.apply_chat_template, as verl and
    SGLang pass them), e.g. {enable_thinking: false} for Qwen3's template (cosmos-rl multi_turn_config.enable_thinking);
    train_dataset's also apply to the workflows' turns."""
    shuffle: bool = True
    """Shuffle each epoch (seeded)."""
    batch_size: PositiveInt | None = None
    """Prompts per batch as AReaL reads it: train_dataset: prompts per train step, i.e. rollout.consumer_batch_size
    groups of n_samples (sets it when not given, must equal it when given); valid_dataset: evaluation requests in flight
    (sets evaluator.concurrency when not given)."""
    max_prompt_len: PositiveInt | None = None
    """Drop prompts longer than this many tokens."""
    max_length: PositiveInt | None = None
    """AReaL's name for max_prompt_len (must agree with it when both are set)."""

    @property
    def has_rows(self) -> bool:
        """Rows to read: a `path`, or a generated source."""
        return bool(self.path) or self.source != "files"
