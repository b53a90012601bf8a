"""Read another system's config file and import it: `rlstream config import --from SYSTEM FILE`.

The file is parsed in its system's format (YAML with `${...}` resolved by omegaconf for AReaL, ROLL and
RLinf; TOML for cosmos-rl), checked to be a config of that system, and run through its key table
(AReaL: `translate_areal`). Everything that goes wrong is a ConfigError of one line naming the file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Callable

import yaml

from rlstream.common.areal import Translation, translate_areal
from rlstream.common.config import ConfigError, field_docs
from rlstream.common.importers import cosmos, rlinf, roll
from rlstream.common.importers.rules import Table, apply_table, get

__all__ = ["SYSTEMS", "TABLES", "NAMES", "import_file", "import_data", "read_file", "detect"]

SYSTEMS = ("areal", "roll", "cosmos", "rlinf")
NAMES = {"areal": "AReaL", "roll": "ROLL", "cosmos": "cosmos-rl", "rlinf": "RLinf"}
TABLES: dict[str, Table] = {"roll": roll.TABLE, "cosmos": cosmos.TABLE, "rlinf": rlinf.TABLE}
_DEFAULTS = {"roll": roll.DEFAULTS, "cosmos": cosmos.DEFAULTS, "rlinf": rlinf.DEFAULTS}
_RESOLVERS = {"roll": roll.RESOLVERS, "cosmos": cosmos.RESOLVERS, "rlinf": rlinf.RESOLVERS}

# What makes a parsed file a config of each system: (test, the key that shows it).
_SIGNS: dict[str, list[tuple[str, Callable[[dict[str, Any]], bool]]]] = {
    "areal": [("gconfig", lambda d: "gconfig" in d), ("allocation_mode", lambda d: "allocation_mode" in d),
              ("actor + train_dataset", lambda d: "actor" in d and "train_dataset" in d),
              ("model + train_dataset", lambda d: "model" in d and "train_dataset" in d)],
    "roll": [(k, lambda d, k=k: k in d) for k in ("actor_train", "actor_infer", "num_return_sequences_in_group")],
    "cosmos": [("train.train_policy", lambda d: get(d, "train.train_policy") is not None),
               ("policy.model_name_or_path", lambda d: get(d, "policy.model_name_or_path") is not None),
               ("train.optm_lr", lambda d: get(d, "train.optm_lr") is not None)],
    "rlinf": [("runner", lambda d: "runner" in d),
              ("cluster.component_placement", lambda d: get(d, "cluster.component_placement") is not None)],
}


def detect(data: dict[str, Any]) -> dict[str, str]:
    """system -> the key that marks `data` as its config, for every system it looks like."""
    out = {}
    for system, signs in _SIGNS.items():
        for key, test in signs:
            if test(data):
                out[system] = key
                break
    return out


def _a(system: str) -> str:
    return ("an " if system in ("areal", "rlinf") else "a ") + NAMES[system]


def _parse(path: Path, toml: bool) -> Any:
    """TOML as a dict; YAML as OmegaConf reads it (so `1e-5` is a number, as in the systems' own loaders),
    interpolations not resolved yet."""
    from omegaconf import DictConfig, OmegaConf

    text = path.read_text(encoding="utf-8")
    if toml:
        return tomllib.loads(text)
    if not isinstance(yaml.safe_load(text), dict):  # OmegaConf.create reads a bare string as a one-key mapping
        return None
    cfg = OmegaConf.create(text)
    return OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else None


def read_file(system: str, file: str | Path) -> dict[str, Any]:
    """The file's keys, interpolations resolved; ConfigError (one line, naming the file) when it cannot be."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(file)
    fmt = "TOML" if system == "cosmos" else "YAML"
    try:
        data = _parse(path, system == "cosmos")
        error = None if isinstance(data, dict) else "not a mapping of keys"
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror or exc}; give the path of {_a(system)} config") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException) as exc:
        error = str(exc).splitlines()[0]
    if error is not None:
        other = _other_format(path, system == "cosmos")
        if other:
            raise ConfigError(f"{file} is not {fmt} but looks like {_a(other)} config; import it with --from {other}")
        raise ConfigError(f"cannot read {file} as {fmt} ({error}); {_a(system)} config is a {fmt} mapping of keys")
    _check_system(file, system, data)
    if system == "cosmos":
        return data
    for name, fn in _RESOLVERS.get(system, {}).items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_resolver(name, fn)
    try:
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve the ${{...}} interpolations of {file}: {str(exc).splitlines()[0]}; "
                          "compose the file first (Hydra's --cfg job)") from None


def _other_format(path: Path, toml: bool) -> str | None:
    """The system a file that fails its own format's parser looks like in the other format, if any."""
    try:
        data = _parse(path, not toml)
    except Exception:  # noqa: BLE001 - any failure means: it is not the other format either
        return None
    found = detect(data) if isinstance(data, dict) else {}
    return next(iter(found), None)


def _check_system(file: str | Path, system: str, data: dict[str, Any]) -> None:
    found = detect(data)
    if system in found:
        return
    if found:
        other, key = next(iter(found.items()))
        raise ConfigError(f"{file} looks like {_a(other)} config (it has {key}), not {NAMES[system]}; import "
                          f"it with --from {other}")
    signs = ", ".join(k for k, _ in _SIGNS[system])
    raise ConfigError(f"{file} has none of the keys of {_a(system)} config ({signs}); give {_a(system)} "
                      "config or pick its system with --from areal|roll|cosmos|rlinf")


_SCHEMA_DEFAULTS = {key: default for key, _, default in field_docs()}


def import_data(system: str, data: dict[str, Any]) -> Translation:
    """The rlstream config of a parsed config of `system`."""
    if system == "areal":
        return translate_areal(data)
    t = apply_table(data, TABLES[system], NAMES[system])
    for key, value in _DEFAULTS[system].items():
        if get(t.config, key, _UNSET) is _UNSET:
            t.put(f"{NAMES[system]} default", key, value)
            t.notes.append(f"{key}={value!r}: {NAMES[system]}'s default (rlstream's is {_SCHEMA_DEFAULTS.get(key)})")
    return t


_UNSET = object()


def import_file(system: str, file: str | Path) -> Translation:
    if system not in SYSTEMS:
        raise ConfigError(f"--from {system!r}: one of {', '.join(SYSTEMS)}")
    return import_data(system, read_file(system, file))


