"""Replace (or append) one section of benchmarks/README.md, leaving the others as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def publish(text: str, raw: Any, json_path: str | None, section: str | None) -> None:
    """A benchmark's result: its table printed, its raw numbers to `json_path`, its README section replaced."""
    print("\n" + text)
    if json_path:
        Path(json_path).write_text(json.dumps(raw, indent=2))
    if section:
        write_section(section, text)


def write_nested_section(text: str, readme: Path, section: str, parent: str) -> None:
    """Replace `section` of `readme` (other sections untouched), or add it: `section` is either `parent`
    itself (a `## ` heading) or a `### ` subsection of it; a missing subsection goes at the end of `parent`,
    anything else missing at the end of the file. `text` starts with the `section` header line."""
    old = readme.read_text() if readme.exists() else "# Benchmarks\n\n"
    level = section.split(" ", 1)[0]
    start = old.find(section + "\n")
    if start < 0 and level != parent.split(" ", 1)[0]:
        top = old.find(parent + "\n")
        if top >= 0:  # append the subsection to the end of the parent section
            nxt = old.find("\n## ", top + len(parent))
            end = len(old) if nxt < 0 else nxt + 1
            head = old[:end].rstrip("\n") + "\n\n"
            readme.write_text(head + text.rstrip("\n") + "\n" + ("\n" + old[end:] if nxt >= 0 else ""))
            return
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        # the section ends where the next heading of the same or a higher level starts
        ends = [i for i in (old.find("\n## ", start + len(section)),
                            old.find("\n### ", start + len(section)) if level == "###" else -1) if i >= 0]
        nxt = min(ends) if ends else -1
        new = old[:start] + text.rstrip("\n") + "\n" + ("" if nxt < 0 else "\n" + old[nxt + 1:])
    readme.write_text(new)


def publish_nested(text: str, raw: Any, json_path: str | None, readme: bool, section: str, parent: str) -> None:
    """publish() for a `### ` subsection of `parent` (written when `readme`)."""
    print(json.dumps(raw, indent=1) + "\n\n" + text)
    if json_path:
        Path(json_path).write_text(json.dumps(raw, indent=1))
    if readme:
        write_nested_section(text, README, section, parent)
