"""pyproject.toml lists every package folder: a non-editable install (a wheel, the Docker
image) ships only what `[tool.setuptools] packages` names, while an editable install maps the
folders and would hide a missing entry (rlstream.trainer.weights was missing: the image's
trainer could not import it; found by tests/launcher/test_compose_up.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_PACKAGED = {"tests", "benchmarks", "scripts", "docs", "configs", "build", "dist", "runs"}


def test_every_package_folder_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"rlstream"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in NOT_PACKAGED or rel.parts[0].startswith(".")):
            continue
        found.add(".".join(("rlstream", *rel.parts)))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
