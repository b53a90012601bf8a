"""Per-file test times for the suite's order: the longest files go to the workers first.

`--dist loadfile` hands whole files to the workers; started in collection order, a long file
collected last leaves one worker idle while the other finishes it. `tests/conftest.py` orders
the files longest first from `tests/file_times.json` (seconds per file, from a CI run's
JUnit XML); a file not in the table goes after those that are. Refresh the table with

    python tests/file_times.py /path/to/junit.xml [more.xml ...]   # the mean of the runs given
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("file_times.json")


def file_of(classname: str) -> str:
    """`tests.e2e.test_faults.TestX` -> `tests/e2e/test_faults.py` (JUnit names the module, not the file)."""
    parts = classname.split(".")
    last = max(i for i, p in enumerate(parts) if p.startswith("test_"))
    return "/".join(parts[: last + 1]) + ".py"


def times_of(junit: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        seconds[file_of(case.get("classname", ""))] += float(case.get("time") or 0.0)
    return seconds


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def main(paths: list[str]) -> None:
    runs = [times_of(Path(p)) for p in paths]
    files = sorted({f for run in runs for f in run})
    mean = {f: round(sum(run.get(f, 0.0) for run in runs) / len(runs), 1) for f in files}
    TABLE.write_text(json.dumps(dict(sorted(mean.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    print(f"{TABLE}: {len(mean)} files, {sum(mean.values()):.0f} s in all")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
