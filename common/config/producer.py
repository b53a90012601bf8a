"""Producers: workflow and rewards, multi-turn agents and their sandbox, the OpenAI-compatible gateway."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rlstream.common.config.base import NonNegativeFloat, Port, PositiveFloat, PositiveInt, Section

__all__ = ["ProducerConfig", "SandboxConfig", "OpenEnvConfig", "AgentConfig", "GatewayConfig"]


class ProducerConfig(Section):
    workflow: str = "rlstream.producer.workflow:RLVRWorkflow"
    """Workflow import path `module:callable` (builds an object with `arun_episode`)."""
    reward_fn: str = "rlstream.producer.rewards:math_reward"
    """Reward import path `module:function(prompt, completion, answer, **kw) -> float` (not given with
    train_dataset.source=reasoning_gym: rlstream.producer.rewards:reasoning_gym_reward, the task's own scorer)."""
    reward_timeout: PositiveFloat = 15.0
    """Seconds a reward call may take before the sample scores 0."""
    reward_workers: PositiveInt = 2
    """Processes in the reward pool."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO dynamic sampling); the producer generates replacements."""
    dynamic_sampling_reward_fn: str | None = None
    """With dynamic_sampling: import path `module:function` (as reward_fn) of a second reward whose scores decide
    which groups are all-equal and dropped (cosmos-rl filter_reward_metric); training still uses reward_fn. Needs the
    built-in RLVRWorkflow. None = filter on the training reward."""
    producer_id: str | None = None
    """Stable producer id (resumable dataset position); None = hostname-pid."""
    max_groups: PositiveInt | None = None
    """Stop after this many accepted groups (None = until the trainer finishes)."""
    shutdown_timeout: NonNegativeFloat = 30.0
    """Seconds a stopping producer (SIGTERM/SIGINT) lets in-flight rollouts finish before releasing their leases."""
    stop_stale_rollouts: bool = True
    """Stop a rollout as soon as the tokens its requests returned show its group is too stale for the trainer's next
    read (the engines stop generating it; its slot is held until that version is served, then the drop is recorded)."""


class SandboxConfig(Section):
    cpu_seconds: PositiveFloat = 5.0
    """RLIMIT_CPU of one sandboxed run (CPU seconds)."""
    wall_timeout: PositiveFloat = 10.0
    """Wall-clock seconds before a sandboxed run is killed."""
    memory_mb: Annotated[int, Meta(ge=64)] = 512
    """RLIMIT_AS of one sandboxed run (MB of address space)."""
    file_size_mb: PositiveInt = 16
    """RLIMIT_FSIZE: largest file (and captured output) a run may write, MB."""
    max_processes: PositiveInt = 16
    """RLIMIT_NPROC of a run's own uid (enforced when isolation is on)."""
    max_output_chars: Annotated[int, Meta(ge=16)] = 2000
    """Tool output longer than this is cut, with a truncation marker."""
    python: str = ""
    """Interpreter that runs the code (empty = /usr/bin/python3 when present, else the producer's own; it must be
    executable by an unprivileged uid)."""
    isolation: Literal["auto", "required", "off"] = "auto"
    """Own uid + network/mount/PID namespaces (as root) and the seccomp filter (needs libseccomp2): auto = what this
    machine allows, the rest named in one warning line; required = fail without all of them; off = rlimits and timeout
    only."""


class OpenEnvConfig(Section):
    url: str = ""
    """Base URL of a running OpenEnv environment server (`http://host:port`), used by
    agent.environment=rlstream.producer.openenv_env:OpenEnvEnvironment; each episode opens its own session on it."""
    action_field: str = "message"
    """The field of the environment's action that receives the model's turn (its text outside tool-call markup), e.g.
    `message` for echo_env, `code` for coding_env."""
    observation_field: str | None = None
    """The observation's field shown to the model as the next user message; None = every field but done, reward and
    metadata, as JSON."""
    prompt: Literal["observation", "dataset", "both"] = "both"
    """The episode's first user message: the reset observation, the dataset item's prompt, or the prompt followed by
    the observation."""
    message_timeout: PositiveFloat = 60.0
    """Seconds one reset or step may take on the server before the sample fails."""


class AgentConfig(Section):
    environment: str = "rlstream.producer.environment:ToolEnvironment"
    """Environment import path `module:callable(cfg=, tokenizer=, reward=, tools=)`, one built per episode."""
    tools: list[str] = msgspec.field(default_factory=lambda: ["rlstream.producer.tools:calculator"])
    """Tool import paths `module:callable(cfg=)` offered to the model (built-in: rlstream.producer.tools:calculator,
    :python)."""
    tool_parser: str = "rlstream.producer.toolcalls:parse_hermes"
    """Tool-call parser import path `module:callable(text) -> ParsedTurn` (built-in: Hermes/Qwen
    <tool_call>{json}</tool_call>)."""
    system_prompt: str | None = None
    """System message put before the prompt (None = none)."""
    max_turns: PositiveInt = 4
    """Model turns per episode; the episode stops (finish_reason length) after this many."""
    max_total_tokens: Annotated[int, Meta(ge=2)] = 1024
    """Prompt + every turn + observations; a turn may generate only what is left."""
    turn_timeout: PositiveFloat = 120.0
    """Seconds one model turn may take (incl. waits for weight updates) before the episode is aborted."""
    episode_timeout: PositiveFloat = 600.0
    """Seconds one whole episode may take before it is aborted."""
    tool_timeout: PositiveFloat = 15.0
    """Seconds one tool call may take before it returns an error observation."""
    on_env_error: Literal["fail_sample", "reject_group"] = "fail_sample"
    """An environment that raises: fail_sample = that sample gets reward 0 and metadata env_error; reject_group = the
    whole group is dropped."""
    sandbox: SandboxConfig = msgspec.field(default_factory=SandboxConfig)
    """Limits of the process the python tool runs code in."""
    openenv: OpenEnvConfig = msgspec.field(default_factory=OpenEnvConfig)
    """The OpenEnv environment server an OpenEnvEnvironment episode talks to."""


class GatewayConfig(Section):
    host: str = "127.0.0.1"
    """Bind address of the OpenAI-compatible gateway (`rlstream gateway`)."""
    port: Port = 0
    """Port of the gateway (0 = pick a free one)."""
    group_size: PositiveInt | None = None
    """Sessions (episodes) of one prompt or named group that form one trajectory group (None = gconfig.n_samples)."""
    session_timeout: PositiveFloat = 300.0
    """Seconds a session may stay idle (no call, no reward) before it is abandoned; a group that waits this long for
    members commits what finished."""
    admission_timeout: PositiveFloat = 600.0
    """Seconds the first call of a group waits for an admission lease before answering 503."""
    sampling: Literal["config", "request"] = "config"
    """config = temperature/top_p/top_k and the penalties from gconfig whatever a request says (the trainer recomputes
    logprobs at actor.temperature, without penalties); request = the request's temperature/top_p (0 = greedy) and
    frequency/presence/repetition penalties. A request's `stop` strings apply either way (with gconfig.stop)."""
    gateway_id: str | None = None
    """Producer id the gateway commits under (None = gateway-hostname-pid)."""
