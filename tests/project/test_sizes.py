"""Size limits a newcomer relies on: a function fits a screen, a module holds one concept, and
benchmarks/README.md is a reference of current results rather than a diary."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600


def _product_modules() -> list[Path]:
    skip = {"tests", ".git", ".venv", "build"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts))


def test_no_function_over_a_screen_and_no_module_over_600_lines():
    too_long = []
    for path in _product_modules():
        source = path.read_text()
        rel = path.relative_to(ROOT)
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, "split by concept:\n" + "\n".join(too_long)


def test_benchmarks_readme_is_a_short_reference():
    lines = (ROOT / "benchmarks" / "README.md").read_text().splitlines()
    # ~30 benchmarks of a heading, a what-line, a table and a rerun line each
    assert len(lines) <= 320, f"benchmarks/README.md has {len(lines)} lines (at most 320: history lives in git)"
    wide = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 200]
    assert not wide, "benchmarks/README.md lines over 200 characters:\n" + "\n".join(wide)
