"""What one simulated run is: the cluster's shape (`Setting`), the presets (`SETTINGS`), what it measured (`Result`).

The control plane's timers are in real seconds; a run scales them by its time factor (`Setting.scale_timers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlstream.broker.versions import FOLLOW_BLOCK_MS
from rlstream.common.config import NameResolveConfig

__all__ = ["Setting", "Result", "SETTINGS", "ENGINE_TTL", "RESOLVE_POLL_S", "FOLLOW_BLOCK_S", "READ_BLOCK_S",
           "LEASE_TTL_S", "PROBE_FOLLOWERS", "PROBE_ADMIT_HZ"]

# name-resolve lease of an engine, real seconds: cluster.name_resolve.lease_ttl's default (keepalive every ttl / Setting.keepalives_per_ttl)
ENGINE_TTL = float(NameResolveConfig().lease_ttl)
RESOLVE_POLL_S = 0.5  # a producer's name-resolve poll of the generation (make_name_resolver's poll_interval)
FOLLOW_BLOCK_S = FOLLOW_BLOCK_MS / 1000  # XREAD BLOCK of an event follower (AsyncVersionRegistry.follow)
READ_BLOCK_S = 1.0  # XREADGROUP BLOCK of the trainer's reader (StepReader's default)
LEASE_TTL_S = 300.0  # rollout.lease_ttl: a producer renews its in-flight leases every third of it
PROBE_FOLLOWERS = 8  # event followers of the probe process (sim/cp_probe.py)
# its try_acquire calls per modeled second (x timer scale per wall second: 10 at x5): a fixed number per modeled
# step, so the probe's own Redis load per step does not grow as the time factor shrinks
PROBE_ADMIT_HZ = 2.0


@dataclass
class Setting:
    name: str
    hardware: str = "H100"
    model: str = "qwen2.5-1.5b"
    engines: int = 4  # one GPU each
    train_gpus: int = 4
    producers: int = 2
    batch: int = 32  # groups per step (B)
    n_samples: int = 8
    prompt_len: int = 256
    len_median: float = 1024.0
    len_sigma: float = 1.0
    max_new_tokens: int = 8192
    steps: int = 12
    accel: float = 20.0
    round_trip_probe_s: float = 5.0  # wall seconds of bare PINGs that price a round trip after the run (control plane)
    max_running: int = 256  # sequences per engine batch
    # The control plane as a cluster runs it: every engine registers under name resolve (keepalive), as
    # `rlstream serve` does; producers pick engines from their resolved list. Engines read nothing else from
    # Redis: the weight broadcaster reaches them over HTTP (pause, update, continue), the producers follow the events.
    control_plane: bool = False
    # What-if: every engine also follows the version events over Redis (XREAD BLOCK, a connection each), as no
    # rlstream engine does: the event fan-out at hundreds of readers.
    engine_events: bool = False
    elastic: int = 0  # engines that leave a third into the run and join again at two thirds (control_plane)
    seed: int = 0  # the k-th rollout's sample lengths come from (seed, k)
    # What a weight push's pause does to running requests (SGLang's /pause_generation modes): abort (they
    # return to their producer, which resubmits prompt + tokens so far to the least loaded engine it knows),
    # retract (they stay queued on their engine, re-prefilled at resume), in_place (they keep their batch
    # slot and KV cache and decode on under the new weights: no re-prefill).
    pause_mode: str = "abort"
    # producer.stop_stale_rollouts of the producers' admission loop (producer/admit_loop.py): a rollout whose
    # group can no longer be trained is stopped by what its requests have returned so far (under in_place a
    # running request returns only at its end).
    stop_stale: bool = True
    # What a group carries: "full" (every token, logprob and version: ~180 kB a group at 7B settings) or
    # "minimal" (one token per sample at its oldest version, the real counts in the group's metadata: the
    # same groups, commands and schedule with next to no payload, so Redis's CPU is the control plane's).
    payload: str = "full"
    # Run the wall-clock timers of the control plane (name-resolve keepalive and TTL, the resolvers' polls,
    # producer heartbeats and lease renewals, the refused producers' fallback poll, XREAD BLOCK timeouts)
    # `accel` times faster, so they come as often per modeled second as in a real run.
    scale_timers: bool = True
    # What-ifs for the timers (real seconds; None: what the producer and the name resolver use).
    resolve_poll_s: float | None = None  # a producer's name-resolve poll (RESOLVE_POLL_S)
    keepalives_per_ttl: int | None = None  # an engine's name-resolve keepalives per ttl (KEEPALIVES_PER_TTL)
    engine_ttl: float | None = None  # an engine's name-resolve lease, real seconds (ENGINE_TTL: the config's default)
    fill_fraction: float | None = None  # the trainer's reader while a step fills (consumer.reader.FILL_FRACTION; 0: off)
    slowlog: bool = False  # profile Redis's command time over the steady steps (SLOWLOG, threshold 0)
    batch_cap: int | None = None  # experiment: an engine's running batch (the bound and producers keep max_running)
    priority: bool = False  # experiment: a sample waits on its engine behind the samples of older groups (admission order)
    trace: bool = False  # record every rollout's timeline (admitted, samples done, committed) in Result.trace


@dataclass
class Result:
    eta: int
    wall_s: float = 0.0
    modeled_s: float = 0.0
    trained_tokens: int = 0
    steps: int = 0
    utilisation: float = 0.0
    staleness: list[int] = field(default_factory=list)
    stale_drops: int = 0
    redis_cpu_s: float = 0.0  # the whole run's, set-up (256 registrations) and pipeline fill included
    # Redis (INFO cpu, INFO commandstats) when the steady state starts (the end of the last warm-up step) and
    # when the last step ends: the per-step figures are taken over the same steps as the step time.
    redis_at_steady: tuple = ()
    redis_at_end: tuple = ()
    admission_ms: list[float] = field(default_factory=list)
    push_s: float = 0.0
    train_s: float = 0.0
    gen_wait_s: float = 0.0
    max_over_budget: int = 0
    read_ahead: list[str] = field(default_factory=list)  # in the trainer's pool at the end, not trained yet
    checks: dict = field(default_factory=dict)
    event_ms: list[float] = field(default_factory=list)  # version event written -> seen by an engine's follower (wall)
    engines_pid: int = 0  # the process the engines' control plane ran in (sim/cp_engines.py)
    push_wall_ms: list[float] = field(default_factory=list)  # pause + update + resume of every engine (wall)
    step_ends: list[float] = field(default_factory=list)  # modeled time at the end of each step
    step_tokens: list[int] = field(default_factory=list)
    left: int = 0
    joined: int = 0
    min_resolved: int = 0  # fewest engines a producer's name-resolve view held (elastic: the leave was seen)
    prefill_share: float = 0.0  # of the engines' busy time (prompts and re-prefill after pushes)
    mean_batch: float = 0.0  # sequences per decode step, averaged over the engines' steps
    wasted_tokens: int = 0  # decoded but not trained (dropped stale, stopped stale, read ahead)
    generated_trained: int = 0
    redis_usec_per_step: dict = field(default_factory=dict)  # INFO commandstats delta over the steady steps, top commands
    stopped_stale: int = 0  # rollouts stopped before they finished, their group no longer trainable (stop_stale)
    dropped_before_commit: int = 0  # finished groups a producer dropped as already too stale (never written)
    registered_at_end: int = 0  # engines registered under name resolve when the last step ended
    probe: dict = field(default_factory=dict)  # cp_probe.ProbeResult of this run's probe process (as JSON)
    redis_calls_per_step: dict = field(default_factory=dict)  # INFO commandstats calls delta, same commands
    redis_cpu_minimal_per_step: float | None = None  # Redis CPU a steady step of the same run with payload "minimal"
    redis_usec_minimal_per_step: dict = field(default_factory=dict)
    wakeups: int = 0  # admission wake-ups (capacity events) producer 0 saw over the whole run
    woken: int = 0  # producers those wake-ups woke, summed over producers (each entry names the ones it wakes)
    # --slowlog: Redis command time per steady step by script / command and key (name -> [calls, usec]), from
    # SLOWLOG with a 0 us threshold (adds its own cost: not for the headline Redis CPU)
    redis_profile: dict = field(default_factory=dict)
    trace: list = field(default_factory=list)  # --trace: per rollout [t_admit, v_admit, t_done, t_commit, entry id, sample ends]
    read_times: list = field(default_factory=list)  # modeled time each step's read completed
    # per step whose last group came while the trainer waited: modeled seconds from that group's commit (its entry
    # id's server time) to the read's return (what reading in fewer, later calls costs the schedule)
    read_lag_s: list = field(default_factory=list)
    redis_reads_per_step: float = 0.0  # Redis read events (INFO stats total_reads_processed) per steady step
    round_trip_cpu_s: float = 0.0  # Redis CPU per bare PING at the steady steps' read rate (`round_trip_cpu_s`)

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.modeled_s if self.modeled_s else 0.0

    @property
    def step_s(self) -> float:
        return self.modeled_s / max(self.steps, 1)

    @property
    def warmup(self) -> int:
        """Steps not counted in the steady state: the first third (η > 0 fills its pipeline there)."""
        return max(1, self.steps // 3) if self.steps >= 3 else 0

    @property
    def steady_step_s(self) -> float:
        w = self.warmup
        if not w:
            return self.step_s
        return (self.step_ends[-1] - self.step_ends[w - 1]) / (self.steps - w)

    @property
    def round_trips_cpu_per_step(self) -> float:
        """Redis CPU seconds per steady step that its read events cost at a bare round trip's price each."""
        return self.redis_reads_per_step * self.round_trip_cpu_s

    @property
    def redis_cpu_per_step(self) -> float:
        """Redis CPU seconds per steady-state step (the steps `steady_step_s` is taken over)."""
        return (self.redis_at_end[0] - self.redis_at_steady[0]) / (self.steps - self.warmup)

    @property
    def steady_tokens_per_s(self) -> float:
        w = self.warmup
        return sum(self.step_tokens[w:]) / (self.steady_step_s * (self.steps - w))


SETTINGS = {
    # AReaL Table 7's setting: 1.5B on 8 GPUs (here 4 engines + 4 trainer GPUs).
    "areal-1.5b-8gpu": Setting("areal-1.5b-8gpu", model="qwen2.5-1.5b", engines=4, train_gpus=4, producers=2,
                               batch=32, n_samples=8, steps=12, accel=20.0),
    # verl fully-async 7B on 128 GPUs: 64 engine GPUs + 64 trainer GPUs, the cluster's control plane on.
    "verl-7b-128gpu": Setting("verl-7b-128gpu", model="qwen2.5-7b", engines=64, train_gpus=64, producers=8,
                              batch=256, n_samples=8, steps=9, accel=10.0, control_plane=True),
    # The control plane at 256 engines: 7B on 256 engine + 256 trainer GPUs, 32 producers, 32 engines
    # leaving a third into the run and rejoining at two thirds.
    "cp-7b-256engines": Setting("cp-7b-256engines", model="qwen2.5-7b", engines=256, train_gpus=256, producers=32,
                                batch=1024, n_samples=8, steps=6, accel=10.0, control_plane=True, elastic=32,
                                # as docs/scaling.md advises at hundreds of engines (the defaults are 3 and 10 s)
                                keepalives_per_ttl=2, engine_ttl=30.0),
    "quick": Setting("quick", model="qwen2.5-1.5b", engines=4, train_gpus=4, producers=2, batch=8, n_samples=4,
                     prompt_len=128, len_median=256, len_sigma=0.8, max_new_tokens=2048, steps=6, accel=20.0,
                     control_plane=True, elastic=1, round_trip_probe_s=1.0),
}
