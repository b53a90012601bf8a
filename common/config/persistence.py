"""What a run keeps: checkpoints, crash recovery, evaluation during training, metrics sinks."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rlstream.common.config.base import NonNegativeInt, Port, PositiveFloat, PositiveInt, Section

__all__ = ["SaverConfig", "S3UploadConfig", "HubUploadConfig", "EvaluatorConfig", "RecoverConfig", "WandbConfig",
           "SwanlabConfig", "TensorBoardConfig", "PrometheusConfig", "StatsLoggerConfig"]


class S3UploadConfig(Section):
    """Where the HF exports go besides the run folder (cosmos-rl train.ckpt.upload_s3): S3 or an S3-compatible store
    (MinIO, Ceph ...). Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
    ~/.aws, an instance role), never from the config."""

    bucket: str = ""
    """The bucket (it must exist)."""
    prefix: str = ""
    """Key prefix: a checkpoint's files go to {prefix}/{experiment_name}/{trial_name}/{step-N|final}/{file}."""
    endpoint_url: str | None = None
    """An S3-compatible store's URL (e.g. http://minio:9000); None = AWS S3."""
    region: str | None = None
    """The bucket's region (None = boto3's default)."""


class HubUploadConfig(Section):
    """Where the HF exports go besides the run folder (cosmos-rl train.ckpt.upload_hf with hf_repo_name): a model
    repository on the Hugging Face Hub, or a Hub-compatible server. The token comes from huggingface_hub's usual
    places (HF_TOKEN, `hf auth login`), never from the config."""

    repo_id: str = ""
    """The model repository, `namespace/name`; a bare `name` goes under the token's own user (as cosmos-rl's
    whoami()/name). Created when missing."""
    private: bool = True
    """Create the repository private (an existing one keeps its visibility)."""
    exports: Literal["final", "all"] = "final"
    """final: only `checkpoints/final`, at path_in_repo (cosmos-rl uploads the final model only); all: every
    export, each in its own folder `{path_in_repo}/step-N` and `{path_in_repo}/final`, one commit each."""
    path_in_repo: str = ""
    """Folder of the upload inside the repository ("" = its root: `from_pretrained(repo_id)` loads the final model)."""
    revision: str = "main"
    """Branch the commits go to (created from main when missing)."""
    endpoint: str | None = None
    """A Hub-compatible server's URL; None = $HF_ENDPOINT or https://huggingface.co."""


class SaverConfig(Section):
    freq_steps: PositiveInt | None = None
    """Save an HF checkpoint every N steps (None = only at the end)."""
    freq_epochs: PositiveInt | None = None
    """Save an HF checkpoint every N epochs."""
    freq_secs: PositiveInt | None = None
    """Save an HF checkpoint every N seconds."""
    async_save: bool = False
    """Write periodic exports in a background thread while the trainer waits for data and runs forward/backward; the
    next optimizer step waits for the write (the export holds its step's weights, no copy). `final` is always
    written before the run ends."""
    max_keep: PositiveInt | None = None
    """Keep the newest N periodic exports `checkpoints/step-*` (None = all); `checkpoints/final` is always kept."""
    upload_s3: S3UploadConfig | None = None
    """Upload every HF export (step-N and final) to S3 once written, in a background thread (the step does not wait;
    the run ends once `final` is uploaded); a failed upload is one error line and the run goes on (the export is on
    disk). Needs the s3 extra (boto3). None = no upload."""
    upload_hf: HubUploadConfig | None = None
    """Upload the final HF export (or every one: upload_hf.exports) to a Hugging Face Hub model repository, in the
    same background thread as upload_s3 and with the same failure rule (one error line, the export stays on disk).
    None = no upload."""


class EvaluatorConfig(Section):
    freq_steps: PositiveInt | None = None
    """Evaluate the served version on valid_dataset every N train steps (versions); None = off."""
    freq_epochs: PositiveInt | None = None
    """Evaluate every N epochs of train_dataset."""
    freq_secs: PositiveInt | None = None
    """Evaluate when this many seconds passed since the last evaluation."""
    max_prompts: PositiveInt | None = None
    """Evaluate on the first N prompts of valid_dataset (None = all)."""
    concurrency: PositiveInt = 32
    """Evaluation requests in flight at once (they share the engines with rollouts)."""

    @property
    def enabled(self) -> bool:
        return any(f is not None for f in (self.freq_steps, self.freq_epochs, self.freq_secs))


class RecoverConfig(Section):
    mode: Literal["disabled", "auto", "resume", "fault"] = "disabled"
    """disabled; auto/resume: resume from the last recover checkpoint if any; fault: only after a crash."""
    freq_steps: PositiveInt | None = 1
    """Write a recover checkpoint every N steps."""
    freq_secs: PositiveInt | None = None
    """Write a recover checkpoint every N seconds."""
    retries: NonNegativeInt = 3
    """Restarts a launcher attempts after a crash."""
    resume_path: str | None = None
    """Start from this recover checkpoint (`RUN_DIR/recover/ckpt-N`, or a `recover/` folder for its newest): model,
    optimizer, schedule, step and version, in a new trial (this trial's own newest checkpoint wins once it has one).
    The new trial's stream and dataset cursor start empty; the engines get the checkpoint's weights at start."""
    max_keep: PositiveInt = 1
    """Recover checkpoints kept (`recover/ckpt-*`, newest first); a run resumes from the newest, older ones are
    there to resume from by `recover.resume_path` (e.g. before a divergence)."""


class WandbConfig(Section):
    mode: Literal["online", "offline", "disabled"] = "disabled"
    """wandb logging mode."""
    project: str | None = None
    """wandb project (None = experiment_name)."""
    entity: str | None = None
    """wandb entity."""
    name: str | None = None
    """wandb run name (None = trial_name)."""
    api_key: str | None = None
    """wandb API key; masked in logs and `config show`."""
    group: str | None = None
    """wandb run group (runs of one experiment side by side; None = none)."""
    job_type: str | None = None
    """wandb job type (e.g. train, eval; None = none)."""
    tags: list[str] | None = None
    """wandb run tags (None = none)."""
    notes: str | None = None
    """wandb run notes, a longer description of the run (None = none)."""
    base_url: str | None = None
    """URL of a self-hosted wandb server (WANDB_BASE_URL; None = wandb's default or the environment's)."""
    config: dict[str, Any] | None = None
    """Extra entries for the run's config in wandb, next to rlstream's own (its keys win on a clash: the run's
    config is what ran)."""
    id_suffix: str | None = None
    """wandb run id `{experiment_name}_{trial_name}_{id_suffix}`: a restarted run with the same id resumes the same
    wandb run (None = a new id each start)."""


class SwanlabConfig(Section):
    """SwanLab experiment tracking (the `swanlab` package: pip install 'rlstream[swanlab]'), AReaL's names."""

    mode: Literal["disabled", "offline", "local", "cloud", "online"] | None = "disabled"
    """disabled (None too, as in AReaL), offline (no network: the run is written to logdir for a later `swanlab sync`),
    local (logdir, viewed with `swanlab watch`; needs swanlab's dashboard extra) or cloud (= online: the SwanLab
    server)."""
    project: str | None = None
    """SwanLab project (None = experiment_name)."""
    name: str | None = None
    """SwanLab experiment name (None = trial_name)."""
    config: dict[str, Any] | None = None
    """Extra entries for the experiment's config, next to rlstream's own (its keys win on a clash: the config is what
    ran)."""
    logdir: str | None = None
    """Folder of SwanLab's run files (None = {run_dir}/swanlab)."""
    api_key: str | None = None
    """SwanLab API key for mode=cloud (SWANLAB_API_KEY); masked in logs and `config show`."""


class TensorBoardConfig(Section):
    path: str | None = None
    """TensorBoard log dir (None = {run_dir}/tensorboard)."""
    enabled: bool = True
    """Write TensorBoard event files."""


class PrometheusConfig(Section):
    enabled: bool = False
    """Serve Prometheus metrics at http://host:port/metrics from the trainer (rank 0) and each producer (engines always
    serve /metrics on their own port)."""
    host: str = "127.0.0.1"
    """Interface the metrics endpoint binds (0.0.0.0 for a scraper on another host)."""
    port: Port = 0
    """Port of the metrics endpoint (0 = any free port; the address is logged and written to
    {run_dir}/prometheus/NAME.addr)."""


class StatsLoggerConfig(Section):
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    """Weights & Biases."""
    prometheus: PrometheusConfig = msgspec.field(default_factory=PrometheusConfig)
    """Prometheus /metrics endpoints (prometheus-client)."""
    tensorboard: TensorBoardConfig = msgspec.field(default_factory=TensorBoardConfig)
    """TensorBoard."""
    swanlab: SwanlabConfig = msgspec.field(default_factory=SwanlabConfig)
    """SwanLab (off unless stats_logger.swanlab.mode says otherwise)."""
    log_every_secs: PositiveFloat = 10.0
    """Seconds between one-line progress summaries of long-running processes."""
