"""The import layers hold (`[tool.importlinter]` in pyproject.toml, run by `lint-imports`).

common <- api <- broker <- {engine, producer, consumer} <- trainer <- sim <- launcher: imports only
point down, engine/producer/consumer do not import each other, and only broker/ imports
redis. The second test proves the check bites: the same contracts on a copy of the
package with one engine module importing the trainer fail, naming that import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "api", "broker", "engine", "producer", "consumer", "trainer", "sim", "launcher")


def lint_imports(cwd: Path, **env: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe) if exe.exists() else shutil.which("lint-imports") or "lint-imports", "--no-cache"]
    # Wide enough that a contract's name is never wrapped in the report.
    env = {**os.environ, "COLUMNS": "200", **env}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_the_tree_keeps_the_layers():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout, out.stdout[-2000:]


def test_an_engine_module_importing_the_trainer_breaks_the_layers(tmp_path):
    pkg = tmp_path / "site" / "rlstream"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "__init__.py", pkg / "__init__.py")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "engine" / "layer_probe.py").write_text("import rlstream.trainer.main\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")

    out = lint_imports(tmp_path, PYTHONPATH=str(tmp_path / "site"))

    assert out.returncode != 0, out.stdout[-2000:]
    assert "layers: common <- api <- broker <- {engine, producer, consumer} <- trainer <- sim <- launcher BROKEN" in out.stdout
    assert "rlstream.engine.layer_probe -> rlstream.trainer.main" in out.stdout, out.stdout[-3000:]
