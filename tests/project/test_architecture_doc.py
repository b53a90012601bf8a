"""docs/ARCHITECTURE.md names only what exists: every backticked repo path it names (`folder/module.py`,
`folder/`) is a file or folder of the repo, and every package folder `pyproject.toml` ships has a row in
its folder table. A module moved or renamed without the page fails here, with the paths to fix."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# A backticked path: at least one folder, then a module / file name or a trailing slash.
PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+(?:[A-Za-z0-9_-]+\.(?:py|md|toml|yaml|sh|json))?)`")
FOLDER_ROW = re.compile(r"^\| `([A-Za-z0-9_]+)/` \|", re.M)


def named_paths(text: str) -> set[str]:
    return {m for m in PATH.findall(text) if not m.startswith(("/", "."))}


def test_every_path_the_architecture_doc_names_exists():
    named = named_paths(DOC.read_text(encoding="utf-8"))
    assert len(named) > 20, f"the pattern found too few paths to be checking anything: {sorted(named)}"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, "docs/ARCHITECTURE.md names paths that do not exist (update the page): " + ", ".join(missing)


def test_every_shipped_top_level_package_has_a_row_in_the_folder_table():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    top_level = {p.split(".")[1] for p in packages if p.count(".") >= 1}
    rows = set(FOLDER_ROW.findall(DOC.read_text(encoding="utf-8")))
    missing = sorted(top_level - rows)
    assert not missing, "pyproject packages without a row in docs/ARCHITECTURE.md's folder table: " + ", ".join(
        f"{m}/" for m in missing)


def test_the_path_pattern_reads_modules_and_folders():
    text = "`common/wire.py`, `trainer/weights/`, `{ns}:traj`, `rlstream.common`, `local.py`, `../x/`"
    assert named_paths(text) == {"common/wire.py", "trainer/weights/"}
