"""Redis key layout of one run (ARCHITECTURE.md, "Redis layout").

Every key of a run shares the hash tag `{rlstream:exp:trial}` so the multi-key Lua
scripts also run on Redis Cluster; different runs spread over the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlstream.common.engine_api import ENGINES_SERVICE

TRAIN_GROUP = "train"
# The stream-entry field a commit through admission adds (the lease id): an entry counted in `{ns}:admit:accepted`.
# A bad one dead-lettered gives its slot back; one written around admission (tools, garbage) has none to give.
LEASE_FIELD = "l"
NAMESPACE_PREFIX = "rlstream"


def namespace(experiment: str, trial: str) -> str:
    return f"{NAMESPACE_PREFIX}:{experiment}:{trial}"


@dataclass(frozen=True)
class Keys:
    """All keys of one namespace `rlstream:{experiment}:{trial}`."""

    ns: str

    def _k(self, suffix: str) -> str:
        return "{" + self.ns + "}:" + suffix

    @property
    def traj(self) -> str:
        """Stream: one entry per prompt group; consumer group `train`."""
        return self._k("traj")

    @property
    def version(self) -> str:
        """String: policy version every engine serves now."""
        return self._k("version")

    @property
    def trainer_version(self) -> str:
        """String: version the trainer has produced (may run ahead of `version` during a push)."""
        return self._k("trainer_version")

    @property
    def events(self) -> str:
        """Pub/sub channel and stream (same name) of version bumps, pause/resume, shutdown."""
        return self._k("events")

    @property
    def admit_accepted(self) -> str:
        """Counter: groups accepted so far (cumulative)."""
        return self._k("admit:accepted")

    @property
    def admit_running(self) -> str:
        """Sorted set: rollout leases, score = expiry ms."""
        return self._k("admit:running")

    @property
    def admit_owners(self) -> str:
        """Hash: lease owner (producer process) -> how many leases it holds in `admit_running` (no field at 0).
        Kept by the same scripts that add and drop leases, so the fair-share check reads it instead of every lease."""
        return self._k("admit:owners")

    @property
    def admit_waiting(self) -> str:
        """Sorted set: producers refused a lease lately (fair share), score = last refusal ms, + 0.5 once a wake-up
        named it (the next wake-up names the oldest refusals not woken yet)."""
        return self._k("admit:waiting")

    @property
    def admit_alive(self) -> str:
        """Sorted set: producer liveness records (lease owner -> expiry ms); a dead owner's leases are freed."""
        return self._k("admit:alive")

    @property
    def admit_wake(self) -> str:
        """Stream (short, MAXLEN ~100): one entry each time capacity may have grown while a producer waited for it
        (a lease released, abandoned, dropped stale or expired; a commit when the concurrency limit refused; a
        fair-share refusal with slots free), naming the waiting producers it wakes (`o`). Waiters XREAD it."""
        return self._k("admit:wake")

    @property
    def admit_armed(self) -> str:
        """String: set by a refused acquisition (`c`: the concurrency limit refused, else `b`); each capacity
        change writes an `admit_wake` entry naming the waiters it wakes, and disarms it (`-`) once it named every
        producer still waiting (no entry while nobody waits)."""
        return self._k("admit:armed")

    @property
    def admit_rejected(self) -> str:
        """Counter: groups finished but rejected by `should_accept`."""
        return self._k("admit:rejected")

    def admit_done(self, lease_id: str) -> str:
        """String (expires): the answer of a finished lease, so a retried finish is not applied twice."""
        return self._k("admit:done:" + lease_id)

    @property
    def run(self) -> str:
        """Hash: the run's durable state (`state` = running | finished, set by the trainer; `updated_at`, `detail`)."""
        return self._k("run")

    @property
    def dead(self) -> str:
        """Stream: entries that failed to decode or validate, with the reason."""
        return self._k("dead")

    @property
    def dropped(self) -> str:
        """Stream: entries the consumer refused as too stale, with the reason."""
        return self._k("dropped")

    @property
    def steps(self) -> str:
        """Stream: which entry ids each train step consumed (exact replay)."""
        return self._k("steps")

    def service(self, name: str) -> str:
        """Sorted set: addresses registered under service `name` with name_resolve=redis, score = expiry ms."""
        return self._k(name)

    def service_changes(self, name: str) -> str:
        """Stream (short, MAXLEN ~100): one entry each time an address joins or leaves service `name` (or is swept
        out, expired); watchers block on it and list the members only when it moves."""
        return self._k(name + ":changes")

    @property
    def engines(self) -> str:
        """Sorted set: engine addresses registered with name_resolve=redis, score = expiry ms."""
        return self.service(ENGINES_SERVICE)

    @property
    def producers(self) -> str:
        """Hash: producer id -> msgpack state (dataset position, counters)."""
        return self._k("producers")

    @property
    def meta(self) -> str:
        """Hash: run metadata (config snapshot digest, created_at, consumer_batch_size)."""
        return self._k("meta")

    @property
    def evals(self) -> str:
        """Stream: one held-out evaluation record per evaluated version (broker/evals.py)."""
        return self._k("eval")

    @property
    def eval_claim(self) -> str:
        """String (expires): `version:owner` of the evaluation running now."""
        return self._k("eval:claim")

    def image(self, sha256: str) -> str:
        """String: the bytes of one image of a multimodal prompt, named by their sha256 (broker/images.py)."""
        return self._k("img:" + sha256)

    @property
    def images_live(self) -> str:
        """Sorted set: image sha256 -> a time (ms) at or after the id of the newest entry referencing it; a trim
        deletes the images whose every entry is gone (broker/images.py)."""
        return self._k("img:live")

    def all(self) -> list[str]:
        return [
            self.traj, self.version, self.trainer_version, self.events, self.admit_accepted,
            self.admit_running, self.admit_owners, self.admit_waiting, self.admit_alive, self.admit_rejected, self.dead, self.dropped, self.steps,
            self.engines, self.service_changes(ENGINES_SERVICE), self.admit_wake, self.admit_armed, self.producers, self.meta, self.run, self.evals, self.eval_claim,
            self.images_live,
        ]


def parse_namespace(key: str) -> str | None:
    """`{rlstream:a:b}:traj` -> `rlstream:a:b`."""
    if key.startswith("{" + NAMESPACE_PREFIX + ":") and "}:" in key:
        return key[1 : key.index("}:")]
    return None
