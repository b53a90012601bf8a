"""Launching: `rlstream run` on one machine, the demo task, Slurm, Ray."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rlstream.common.config.actor import FSDPConfig, OptimizerConfig
from rlstream.common.config.base import (Fraction, NonNegativeFloat, NonNegativeInt, Port, PositiveFloat, PositiveInt,
                                         Section)

__all__ = ["DemoTaskConfig", "EngineServerConfig", "RayConfig", "SlurmContainerConfig", "SlurmConfig", "ThreadsConfig",
           "WebConfig", "LauncherConfig"]


class DemoTaskConfig(Section):
    task: Literal["none", "reverse", "word_problems", "tool_multiply", "shape_colour"] = "none"
    """none; reverse: reverse a digit string (exact-match reward; data and tiny model generated locally); word_problems:
    one-step arithmetic word problems as one-shot chat prompts with \\boxed{} answers (math reward), for a real chat
    model; tool_multiply: multiply a 3-digit by a 2-digit number, with the calculator tool (multi-turn, tiny chat
    model); shape_colour: name the colour of a shape drawn with PIL (an image prompt, tiny vision-language model)."""
    tool_rate: Fraction = 0.15
    """tool_multiply: fraction of warm-start demonstrations that call the calculator (the others answer directly)."""
    digits: Annotated[int, Meta(ge=2, le=12)] = 4
    """Digits per demo prompt."""
    n_train: PositiveInt = 3000
    """Training prompts generated."""
    n_valid: PositiveInt = 200
    """Held-out prompts generated (disjoint from training)."""
    sft_noise: Fraction = 0.7
    """Fraction of warm-start demonstrations from an imperfect teacher: reverse echoes the digits unreversed,
    shape_colour names the next colour of the palette instead of the shape's."""
    hidden_size: Annotated[int, Meta(ge=8)] = 64
    """Hidden size of the tiny model built for the demo."""
    num_layers: PositiveInt = 2
    """Layers of the tiny model built for the demo."""
    num_experts: NonNegativeInt = 0
    """reverse: 0 builds a dense tiny Llama; N > 0 a tiny mixture-of-experts Qwen3-MoE (every layer sparse, N experts
    of width hidden_size, 2 per token), e.g. to try actor.expert_parallel."""


class EngineServerConfig(Section):
    """The inference server of each policy engine a launcher starts on a cluster (`rlstream launch slurm`: job steps
    on the engine nodes; `rlstream launch ray`: engine actors). One section for both, so a config (an imported one
    included) runs under either. `rlstream run` on one machine always starts local engines."""

    server: Literal["local", "sglang", "vllm"] = "local"
    """local (`rlstream serve`, registers with name resolve), sglang (`python -m sglang.launch_server`) or vllm
    (engine/vllm_server.py: vLLM's OpenAI server with rlstream's weight routes). SGLang and vLLM do not register: the
    launcher gives producers and the trainer their addresses, and rollout.backend must name the same server."""
    python: str = ""
    """Python with the server installed on every node, e.g. the vLLM virtualenv's (empty: the launcher's own,
    launcher.slurm.python on Slurm)."""
    tp: PositiveInt = 1
    """Tensor-parallel GPUs per SGLang/vLLM server (`--tp-size` / `--tensor-parallel-size`)."""
    pp: PositiveInt = 1
    """Pipeline-parallel stages per SGLang/vLLM server (`--pp-size` / `--pipeline-parallel-size`)."""
    args: list[str] = msgspec.field(default_factory=list)
    """Extra arguments for the server command, one per item (e.g. [--dtype, float32, --max-model-len, 2048]); their
    environment variables (e.g. VLLM_CPU_KVCACHE_SPACE) go in launcher.slurm.setup or launcher.ray.runtime_env."""


class SlurmContainerConfig(Section):
    runtime: Literal["none", "pyxis", "apptainer"] = "none"
    """Run every task of the job inside `image`: pyxis = srun --container-image (NVIDIA's Slurm plugin, enroot
    underneath); apptainer = apptainer exec around each command; none = the nodes' own Python."""
    image: str = ""
    """The image. pyxis: a registry reference ([USER@][REGISTRY#]IMAGE[:TAG], e.g. nvcr.io#nvidia/pytorch:24.05-py3) or
    a squashfs file (.sqsh); apptainer: a .sif file, a sandbox folder or a docker://, oras://, library:// URI.
    A local file must exist when the job is submitted; redis-server must be in the image when the job starts Redis."""
    mounts: list[str] = msgspec.field(default_factory=list)
    """Host folders the tasks see, SRC[:DST[:ro]] each, SRC absolute (pyxis --container-mounts, apptainer --bind);
    the run folder (cluster.fileroot) is always mounted at its own path."""
    args: list[str] = msgspec.field(default_factory=list)
    """Extra options of the runtime, one per item: pyxis srun options (e.g. --container-writable), apptainer exec
    options (e.g. --nv for GPUs)."""


class SlurmConfig(Section):
    partition: str | None = None
    """sbatch --partition (None = the cluster default)."""
    account: str | None = None
    """sbatch --account."""
    time_limit: str | None = None
    """sbatch --time, e.g. 24:00:00 (None = the partition default)."""
    exclusive: bool = True
    """Whole nodes for the job (sbatch --exclusive)."""
    sbatch_args: list[str] = msgspec.field(default_factory=list)
    """Extra sbatch options, one per item, e.g. --qos=high."""
    setup: list[str] = msgspec.field(default_factory=list)
    """Shell lines run first on every node's script, e.g. `source venv/bin/activate`."""
    python: str = ""
    """Python that runs rlstream on the nodes (empty = the one running `rlstream launch slurm`)."""
    trainer_nodes: NonNegativeInt = 0
    """Nodes for the trainer when cluster.n_nodes > 1 (the rest run engines; 0 = half)."""
    engine_port: Annotated[int, Meta(ge=1, le=65535)] = 30000
    """Port of the first engine server on a node (the next ones count up); the server itself: launcher.engine."""
    redis_port: Port = 0
    """Port of the Redis started on the first node (0 = 20000 + job id mod 20000)."""
    redis_tls_cert: str = ""
    """Server certificate (PEM) of the job's Redis: with redis_tls_key it serves TLS only and tasks connect with
    rediss:// (clients check it against redis.ssl_ca_certs)."""
    redis_tls_key: str = ""
    """Private key (PEM) of redis_tls_cert."""
    nodelist: list[str] = msgspec.field(default_factory=list)
    """Nodes the job runs on (sbatch --nodelist), at least cluster.n_nodes of them (empty = any the scheduler picks)."""
    node_loss: Literal["fail", "continue"] = "fail"
    """A node lost mid-run. fail: Slurm ends the job (NODE_FAIL; requeued while max_restarts allows). continue: the
    job runs on (sbatch --no-kill): the engine and producer tasks of a node Slurm reports down are dropped while one
    engine and one producer are left; losing the trainer, Redis or the last engine or producer still ends the job."""
    max_restarts: NonNegativeInt = 0
    """Times the job is requeued after a lost node or a failed task (sbatch --requeue); each restart resumes through
    recover.mode (auto or resume: exactly where the last recover checkpoint left off)."""
    container: SlurmContainerConfig = msgspec.field(default_factory=SlurmContainerConfig)
    """Every task inside a container image (pyxis or Apptainer); docs/launcher.md "Containers on Slurm"."""


class RayConfig(Section):
    address: str = ""
    """Ray cluster to run on: host:port of its GCS (the head's `ray start --head --port`), or `auto` (the cluster
    `ray start` joined on this machine). Empty: $RAY_ADDRESS when set (`ray job submit` sets it), else a one-node Ray
    started for the run, with the CPUs the run reserves (at least this machine's cores). `rlstream launch ray
    --address` overrides it."""
    engines_per_node: NonNegativeInt = 0
    """Elastic placement: every node with room for them gets this many engines (`rlstream serve`) and
    producers_per_node producers, a node added mid-run too; a node that leaves takes its own with it and the run goes
    on. 0: launcher.n_engines engines and launcher.n_producers producers spread over the cluster once (a lost one
    stops the run)."""
    producers_per_node: NonNegativeInt = 1
    """Producers per node when engines_per_node > 0."""
    engine_cpus: PositiveFloat = 1.0
    """CPUs reserved per engine (its placement-group bundle); the server each engine actor starts, on its node's
    address and a free port: launcher.engine (SGLang and vLLM need engines_per_node = 0: they do not register)."""
    engine_gpus: NonNegativeFloat = 0.0
    """GPUs reserved per engine (0 = a CPU engine); Ray sets the engine's CUDA_VISIBLE_DEVICES. An SGLang server
    needs launcher.engine.tp x pp of them."""
    producer_cpus: PositiveFloat = 1.0
    """CPUs reserved per producer (producers never get a GPU)."""
    trainer_cpus: PositiveFloat = 1.0
    """CPUs reserved per trainer rank (launcher.n_trainer_procs ranks, one Ray actor each)."""
    trainer_gpus: NonNegativeFloat = 0.0
    """GPUs reserved per trainer rank (0 = CPU training)."""
    trainer_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the trainer ranks: PACK keeps them on as few nodes as fit."""
    trainer_labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Node labels the trainer ranks must run on, e.g. {rlstream-role: trainer} for nodes started with `ray start
    --labels='{"rlstream-role": "trainer"}'` (empty: any node with room; elastic engines take what is left there)."""
    node_check_secs: PositiveFloat = 2.0
    """Seconds between two looks at the cluster's nodes (joins and losses) while the run runs."""
    runtime_env: dict[str, Any] = msgspec.field(default_factory=dict)
    """Ray's runtime environment for every process of the run (`env_vars`, `working_dir`, `py_modules`, `pip`, …;
    Ray's own schema, checked before anything starts): given to `ray.init`, so each actor, and the process it runs,
    gets it; with `--submit` it is the job's (`submit_job(runtime_env=…)`), the launcher's included. In a job
    submitted with a runtime environment of its own (`ray job submit --runtime-env-json`) that one is used. Empty:
    none (rlstream and the data already on every node, as on Slurm)."""


class ThreadsConfig(Section):
    trainer: NonNegativeInt = 0
    """torch/OpenMP threads of each trainer process (0 = this machine's cores divided among
    launcher.n_trainer_procs)."""
    engine: PositiveInt = 1
    """torch/OpenMP threads of each local engine (it mostly waits on the trainer between versions)."""
    producer: PositiveInt = 1
    """OpenMP threads of each producer (asyncio + reward workers: no heavy math)."""


class WebConfig(Section):
    enabled: bool = False
    """Serve the live web page while `rlstream run` runs (`rlstream run --web` sets it; `rlstream web` serves it for
    any run)."""
    host: str = "127.0.0.1"
    """Address the page listens on (0.0.0.0 shows it to other machines: the page has no login)."""
    port: Port = 8265
    """Port of the page (0 = pick a free one, printed). In use: one line, and the run goes on without the page."""
    refresh_secs: Annotated[float, Meta(ge=0.2)] = 1.0
    """Seconds between two looks at Redis and the engines (the page polls as often)."""


class LauncherConfig(Section):
    n_engines: NonNegativeInt = 1
    """Local engines `rlstream run` starts."""
    n_producers: NonNegativeInt = 1
    """Producers `rlstream run` starts."""
    n_trainer_procs: PositiveInt = 1
    """Trainer processes (torchrun data parallel) `rlstream run` starts."""
    startup_timeout: PositiveFloat = 300.0
    """Seconds for every child to become ready."""
    data_out_timeout: PositiveFloat = 30.0
    """Seconds without a train step, once every producer has finished its data and fewer groups than a step are
    left unacknowledged in the stream, before the run stops as out of data (while a step's worth is left, it waits)."""
    eval_n: NonNegativeInt = 0
    """Held-out prompts scored before and after training (0 = skip)."""
    sft_steps: NonNegativeInt = 0
    """Supervised warm-start steps before RL (0 = sft_epochs decides; both 0 = none)."""
    sft_epochs: NonNegativeFloat = 0.0
    """Passes over the demonstrations when sft_steps is 0: ceil(sft_epochs x rows / sft_batch_size) steps (AReaL SFT's
    total_train_epochs)."""
    sft_lr: PositiveFloat = 1e-3
    """Learning rate of the supervised warm start (Adam)."""
    sft_batch_size: PositiveInt = 64
    """Sequences per supervised warm-start step."""
    sft_optimizer: OptimizerConfig | None = None
    """The warm start's optimizer in full, its schedule over sft_steps (AReaL SFT's `model.optimizer`; its lr replaces
    sft_lr); None = Adam at sft_lr with the grad norm clipped at 1.0. actor.gradient_checkpointing and
    actor.disable_dropout apply to the warm start too."""
    sft_fsdp: FSDPConfig | None = None
    """The warm start's FSDP2 settings (AReaL SFT's `model.fsdp`); None = actor.fsdp. `rlstream sft` trains in one
    process on the host, where FSDP2 has nothing to shard: the unit classes are checked against the model (a name no
    submodule has is an error) and logged, and the weights are in host memory already (offload_params)."""
    sft_dataset: str = ""
    """JSONL/Parquet/CSV of prompt/answer demonstrations for `rlstream sft` (empty = train_dataset.path)."""
    threads: ThreadsConfig = msgspec.field(default_factory=ThreadsConfig)
    """Threads per child of `rlstream run` (OMP_NUM_THREADS/MKL_NUM_THREADS): the trainer gets the cores, engines and
    producers one each."""
    fork_server: bool = True
    """Start engines, the trainer (one process) and producers as forks of one process that imported torch and
    transformers once (launcher/forkserver.py), not each from a fresh interpreter: ~6 CPU s less per start. Off: every
    child is a fresh `python -m rlstream.launcher.cli` (as under torchrun, Slurm, Ray and compose)."""
    live_view: bool = True
    """Show the rich live view (off: one progress line every stats_logger.log_every_secs)."""
    web: WebConfig = msgspec.field(default_factory=WebConfig)
    """The live web page (`rlstream web`, `rlstream run --web`): curves, queue, admission, staleness, engines."""
    demo: DemoTaskConfig = msgspec.field(default_factory=DemoTaskConfig)
    """The built-in CPU demo task, generated on the spot when its files are missing."""
    engine: EngineServerConfig = msgspec.field(default_factory=EngineServerConfig)
    """The inference server of each policy engine `rlstream launch slurm` and `rlstream launch ray` start."""
    slurm: SlurmConfig = msgspec.field(default_factory=SlurmConfig)
    """`rlstream launch slurm`: sbatch options and placement."""
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    """`rlstream launch ray`: the Ray cluster, resources per process and elastic placement."""
