"""The keys of the four systems' configuration references (`../shared/seeds/`), parsed from their text renderings.

Each parser returns `(key, example value)` pairs, dotted as the system's own config files spell them; the
coverage table (`rlstream config coverage`) classifies every one with the importers' tables. The formats:

- AReaL 001: Markdown tables, one per dataclass of `areal/api/cli_args.py`; a field whose type links to
  another section (`[`PPOActorConfig`](section-ppo-actor)`) is that section, nested under the field name.
  (000 is the same reference rendered without the parameter names, so it adds no key.)
- ROLL 002: a configuration guide whose YAML lost its indentation; the nesting is rebuilt from the section
  names the guide uses (workers, `*_args`, `strategy_config`), and the strategy configs its prose lists.
- cosmos-rl 003: a rendered pydantic JSON schema; property names are rendered as their titles
  ("Save Freq" for `save_freq`), and properties that only point at another definition show no name,
  so those field names come from `_COSMOS_REFS` (cosmos-rl's `cosmos_rl/policy/config/__init__.py`).
- RLinf 004: reStructuredText with one `.. code:: yaml` block per top-level key.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import yaml

__all__ = ["SEED_FILES", "SNAPSHOT", "parse_seed_keys", "snapshot_keys", "write_snapshot", "SeedError", "seed_dir", "areal_keys", "roll_keys", "cosmos_keys", "rlinf_keys",
           "rlinf_example", "seed_keys"]

SEED_FILES = {"areal": "001_137dc224920c3131.txt", "roll": "002_c3844dd9be1fc488.txt",
              "cosmos": "003_705d82c515e63e5c.txt", "rlinf": "004_dc7d3555c355ce64.txt"}


class SeedError(Exception):
    """A seed file is absent or not in the format its parser reads."""


def seed_dir(repo_root: Path) -> Path:
    """Where the references are expected: ../shared/seeds next to the repository, or $RLSTREAM_SEEDS
    (for a checkout elsewhere, such as a git worktree)."""
    return Path(os.environ.get("RLSTREAM_SEEDS") or (repo_root / ".." / "shared" / "seeds")).resolve()


def _read(folder: Path, system: str) -> str:
    path = folder / SEED_FILES[system]
    if not path.is_file():
        raise SeedError(f"the {system} configuration reference is expected at {path} (../shared/seeds/ next to "
                        "the repository, or the folder $RLSTREAM_SEEDS names); put the seeds there")
    return path.read_text(encoding="utf-8")


def _value(text: str) -> Any:
    text = text.strip().strip("`")
    if text in ("**Required**", "Required", "-", "", "None", "null"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


# ---------------------------------------------------------------------------------------------- AReaL

_AREAL_ROOTS = ("section-grpo", "section-ppo", "section-rw", "section-sft")
_LINK = re.compile(r"\]\((section-[\w-]+)\)")


def _areal_sections(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """section anchor -> [(parameter, type cell, default cell)]."""
    sections: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^\((section-[\w-]+)\)=$", line.strip()):
            current = sections.setdefault(m[1], [])
        elif current is not None and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            current.append((cells[0].strip("`"), cells[1], cells[2]))
    return sections


def areal_keys(folder: Path) -> list[tuple[str, Any]]:
    sections = _areal_sections(_read(folder, "areal"))
    if not all(root in sections for root in _AREAL_ROOTS):
        raise SeedError(f"{SEED_FILES['areal']}: the experiment sections {_AREAL_ROOTS} were not found")
    out: dict[str, Any] = {}

    def walk(anchor: str, prefix: str, seen: tuple[str, ...]) -> None:
        for name, type_cell, default in sections.get(anchor, []):
            link = _LINK.search(type_cell)
            key = f"{prefix}{name}"
            if link and "list of" not in type_cell and link[1] not in seen and link[1] in sections:
                walk(link[1], key + ".", (*seen, link[1]))
            else:
                out.setdefault(key, _value(default))

    for root in _AREAL_ROOTS:
        walk(root, "", (root,))
    return list(out.items())


# ----------------------------------------------------------------------------------------------- ROLL

_ROLL_WORKERS = ("actor_train", "actor_infer", "critic", "reference")
_ROLL_WORKER_KEYS = ("device_mapping", "infer_batch_size", "num_gpus_per_worker")
_ROLL_YAML = re.compile(r"^(\w+):(?: (\S+)(?: #.*)?)?$")
# The strategy configs the guide lists in prose, and the worker whose strategy they configure.
_ROLL_STRATEGIES = {"Megatron Strategy Config": "actor_train", "FSDP2 Strategy Config": "actor_train",
                    "VLLM Strategy Config": "actor_infer", "SGLang Strategy Config": "actor_infer"}
_ROLL_PROSE = [("actor_train.data_args.messages", None), ("actor_train.model_args.ulysses_size", None)]


def roll_keys(folder: Path) -> list[tuple[str, Any]]:
    lines = _read(folder, "roll").splitlines()
    out: dict[str, Any] = {}
    stack: list[str] = []
    for line in lines:
        m = _ROLL_YAML.match(line.strip())
        if not m:
            continue
        name, value = m[1], m[2]
        if value is None:  # a section
            if name in _ROLL_WORKERS:
                stack = [name]
            elif name.endswith("_args") and stack:
                stack = stack[:1] + [name]
            elif name == "strategy_config" and stack:
                stack = stack[:2] + [name]
            continue
        if name in _ROLL_WORKER_KEYS and stack:
            stack = stack[:1]
        out.setdefault(".".join([*stack, name]), _value(value))
    for i, line in enumerate(lines):
        worker = _ROLL_STRATEGIES.get(line.strip())
        if worker and i + 1 < len(lines):
            for key in re.findall(r"([a-z][a-z0-9]*(?:_[a-z0-9]+)+): ", lines[i + 1]):
                out.setdefault(f"{worker}.strategy_args.strategy_config.{key}", None)
    for key, value in _ROLL_PROSE:
        out.setdefault(key, value)
    if "actor_train.strategy_args.strategy_name" not in out:
        raise SeedError(f"{SEED_FILES['roll']}: the worker config example was not found")
    return list(out.items())


# ------------------------------------------------------------------------------------------ cosmos-rl

# (definition, referenced definition) -> field name; the rendering shows no name for these.
_COSMOS_REFS = {
    ("Config", "TrainingConfig"): "train", ("Config", "RolloutConfig"): "rollout",
    ("Config", "PolicyConfig"): "policy", ("Config", "LoggingConfig"): "logging",
    ("Config", "ProfilerConfig"): "profiler", ("Config", "ValidationConfig"): "validation",
    ("TrainingConfig", "GrpoConfig"): "train_policy", ("TrainingConfig", "SFTDataConfig"): "train_policy",
    ("TrainingConfig", "FP8Config"): "fp8", ("TrainingConfig", "FP4Config"): "fp4",
    ("TrainingConfig", "CheckpointConfig"): "ckpt", ("PolicyConfig", "ParallelismConfig"): "parallelism",
    ("PolicyConfig", "LoraConfig"): "lora", ("RolloutConfig", "RolloutParallelismConfig"): "parallelism",
    ("RolloutConfig", "SamplingConfig"): "sampling_config",
    ("RolloutConfig", "MultiTurnRolloutConfig"): "multi_turn_config",
    ("GrpoConfig", "DatasetConfig"): "dataset", ("GrpoConfig", "OverlongRewardConfig"): "overlong_reward",
    ("SFTDataConfig", "DatasetConfig"): "dataset", ("ValidationConfig", "DatasetConfig"): "dataset",
    ("ProfilerConfig", "SubProfilerConfig"): "sub_profiler_config",
}
_REF = re.compile(r"^#/\$defs/(\w+) \|$")


def _cosmos_defs(lines: list[str]) -> dict[str, list[tuple[str | None, list[str], Any]]]:
    """definition -> [(field name or None, referenced definitions, default)], in schema order."""
    defs: dict[str, list[tuple[str | None, list[str], Any]]] = {"Config": []}
    current = "Config"
    starts = [i for i, line in enumerate(lines) if line == "|"] + [len(lines)]
    for start, end in zip(starts, starts[1:]):
        block = lines[start + 1:end]
        if not block:
            continue
        head = block[0].removesuffix(" |").strip()
        if re.fullmatch(r"[A-Z]\w*Config", head) and block[2:4] == ["type |", "object |"]:
            current = head
            defs.setdefault(current, [])
            continue
        refs = [m[1] for line in block if (m := _REF.match(line))]
        default = None
        if "default |" in block:
            j = block.index("default |") + 1
            default = _value(block[j].removesuffix(" |")) if j < len(block) and block[j] != "|||||" else None
        title = None if _REF.match(block[0]) or refs else head
        defs[current].append((title, refs, default))
    return defs


def _title_to_name(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def cosmos_keys(folder: Path) -> list[tuple[str, Any]]:
    defs = _cosmos_defs(_read(folder, "cosmos").splitlines())
    if "TrainingConfig" not in defs or not defs["Config"]:
        raise SeedError(f"{SEED_FILES['cosmos']}: the schema's Config / TrainingConfig definitions were not found")
    out: dict[str, Any] = {}

    def walk(name: str, prefix: str) -> None:
        for title, refs, default in defs.get(name, []):
            if refs:
                for ref in refs:
                    field = _COSMOS_REFS.get((name, ref))
                    if field is None:
                        raise SeedError(f"{SEED_FILES['cosmos']}: {name} points at {ref} under a field name this "
                                        "parser does not know; add it to _COSMOS_REFS")
                    walk(ref, f"{prefix}{field}.")
            elif title:
                out.setdefault(prefix + _title_to_name(title), default)

    walk("Config", "")
    return list(out.items())


# ---------------------------------------------------------------------------------------------- RLinf


def rlinf_example(folder: Path) -> str:
    """The example YAML of the reference: its `.. code:: yaml` blocks, one per top-level key, joined."""
    text = _read(folder, "rlinf")
    blocks = re.findall(r"\.\. code:: yaml\n\n((?:[ \t]+.*\n|\n)+)", text + "\n")
    if not blocks:
        raise SeedError(f"{SEED_FILES['rlinf']}: no `.. code:: yaml` block found")
    return "\n".join(textwrap.dedent(b).strip() + "\n" for b in blocks)


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        return [kv for k, v in data.items() for kv in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, data)]


def rlinf_keys(folder: Path) -> list[tuple[str, Any]]:
    return _leaves(yaml.safe_load(rlinf_example(folder)))


# Every key the references name, with its default, as parsed here (`rlstream config coverage --snapshot`):
# the coverage check runs from it where the references are not beside the checkout (a CI clone).
SNAPSHOT = Path(__file__).with_name("seed_keys.json")


def parse_seed_keys(system: str, folder: Path) -> list[tuple[str, Any]]:
    """The keys of `system`'s reference in `folder`, parsed from its text."""
    return {"areal": areal_keys, "roll": roll_keys, "cosmos": cosmos_keys, "rlinf": rlinf_keys}[system](folder)


def snapshot_keys(system: str) -> list[tuple[str, Any]]:
    return [(key, default) for key, default in json.loads(SNAPSHOT.read_text(encoding="utf-8"))[system]]


def seed_keys(system: str, folder: Path) -> list[tuple[str, Any]]:
    """The references' keys: parsed from `folder` when it holds them, else the committed snapshot."""
    if (folder / SEED_FILES[system]).is_file():
        return parse_seed_keys(system, folder)
    return snapshot_keys(system)


def write_snapshot(folder: Path) -> None:
    data = {system: [[k, d] for k, d in parse_seed_keys(system, folder)] for system in SEED_FILES}
    SNAPSHOT.write_text(json.dumps(data, indent=0, sort_keys=False, default=str) + "\n", encoding="utf-8")
