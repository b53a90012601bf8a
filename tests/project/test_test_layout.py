"""A newcomer finds the tests of a module in one hop: every product module `<package>/<module>.py` has
`tests/<package>/test_<module>.py` (a subpackage's `<package>/<sub>/<module>.py`:
`tests/<package>/test_<sub>_<module>.py` or `tests/<package>/<sub>/test_<module>.py`), or is named in tests/README.md's list of modules tested together
(tests/README.md, "Where a test lives")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "broker", "engine", "producer", "consumer", "trainer", "launcher", "api", "sim")
LIST_START = "A few modules are tested together with the one that uses them"
LIST_END = "Also run together"


def product_modules() -> list[str]:
    """Every `.py` under the product packages except `__init__.py`, as repository paths."""
    out = []
    for pkg in PACKAGES:
        if (ROOT / pkg).is_dir():
            out += [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / pkg).rglob("*.py"))
                    if p.name != "__init__.py" and "__pycache__" not in p.parts]
    return out


def expected_test_file(module: str) -> Path:
    """`broker/keys.py` -> tests/broker/test_keys.py,
    `trainer/megatron/backend.py` -> tests/trainer/test_megatron_backend.py."""
    pkg, *rest = Path(module).with_suffix("").parts
    return ROOT / "tests" / pkg / ("test_" + "_".join(rest) + ".py")


def candidate_test_files(module: str) -> list[Path]:
    """Where the tests of `module` may live: the flat name, or a folder mirroring its subpackage."""
    pkg, *rest = Path(module).with_suffix("").parts
    return [expected_test_file(module), ROOT / "tests" / pkg / Path(*rest[:-1]) / f"test_{rest[-1]}.py"]


def modules_tested_together() -> list[str]:
    """The modules (`a/b.py`) and subpackages (`a/b/`) tests/README.md lists as tested with another module."""
    text = (ROOT / "tests" / "README.md").read_text()
    assert LIST_START in text and LIST_END in text, "tests/README.md lost its list of modules tested together"
    section = text[text.index(LIST_START):text.index(LIST_END)]
    return [name for name in re.findall(r"`([a-z_]+/[a-z_/]*(?:\.py)?)`", section)
            if name.split("/")[0] in PACKAGES]


def test_every_product_module_has_its_test_module_or_is_listed_as_tested_together():
    listed = modules_tested_together()
    covered = lambda m: any(f.is_file() for f in candidate_test_files(m)) or m in listed or any(  # noqa: E731
        m.startswith(d) for d in listed if d.endswith("/"))
    missing = [m for m in product_modules() if not covered(m)]
    assert not missing, ("product modules without tests/<package>/test_<module>.py, and not in tests/README.md's "
                         "list of modules tested together:\n  " + "\n  ".join(
                             f"{m} (expected {expected_test_file(m).relative_to(ROOT)})" for m in missing))


def test_the_list_of_modules_tested_together_names_real_modules():
    stale = [name for name in modules_tested_together() if not (ROOT / name).exists()]
    assert not stale, f"tests/README.md lists modules tested together that do not exist (moved?): {stale}"
    assert modules_tested_together(), "the list of modules tested together was not found"
