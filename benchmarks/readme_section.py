"""Replace (or append) one `## ` section of benchmarks/README.md, leaving the others as they are."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).with_name("README.md")


def write_section(section: str, text: str, readme: Path = README) -> None:
    """`text` starts with the `section` header line; it replaces that section or is appended."""
    old = readme.read_text() if readme.exists() else "# Benchmarks\n"
    if section + "\n" in old:
        start = old.index(section + "\n")
        nxt = old.find("\n## ", start + len(section))
        new = old[:start] + text.rstrip("\n") + "\n\n" + (old[nxt + 1:] if nxt >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    readme.write_text(new if new.endswith("\n") else new + "\n")
