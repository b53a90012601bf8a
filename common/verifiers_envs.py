"""verifiers environments by name: the check a config gets at load, without importing the environment.

`train_dataset: {source: verifiers, task: <name>}` names an installed environment package (the Environments
Hub installs them as packages, e.g. `wordle`) or any importable module with `load_environment`. verifiers
resolves a name by its last `/` part with `-` read as `_` (`vf.load_environment`); so does this check. An
unknown name is one line with the close names among the installed top-level modules.
"""

from __future__ import annotations

import difflib
import importlib.util
import pkgutil

from rlstream.common.config.base import ConfigError

__all__ = ["WORKFLOW", "module_name", "check_environment"]

# producer.workflow when a config's train_dataset.source is verifiers and it names none.
WORKFLOW = "rlstream.producer.verifiers_env:VerifiersWorkflow"


def module_name(name: str) -> str:
    """The module verifiers imports for an environment name (`org/my-env` -> `my_env`)."""
    return name.replace("-", "_").split("/")[-1]


def check_environment(name: str, *, key: str) -> None:
    """A ConfigError of one line naming `{key}.task` when the environment is not named or not installed."""
    if not name:
        raise ConfigError(f"{key}.source=verifiers needs {key}.task (an installed verifiers environment, "
                          "e.g. wordle, or a module path with load_environment)")
    mod = module_name(name)
    try:
        found = importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        found = False
    if found:
        return
    top = sorted({m.name for m in pkgutil.iter_modules()})
    close = difflib.get_close_matches(mod, top, n=5, cutoff=0.6)
    hint = f"close names: {', '.join(close)}" if close else "no installed module has a close name"
    raise ConfigError(f"{key}.task={name!r} is not an installed verifiers environment (module {mod!r} not found; "
                      f"install its package, e.g. `prime env install {name}`); {hint}")
