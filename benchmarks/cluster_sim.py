"""Benchmark driver of the simulated cluster (`rlstream sim`): runs settings, writes rows and the README section.

The simulator itself is the product's `rlstream.sim` (the real producer admission loop, broker and
trainer read path against simulated engines and trainer compute); this driver adds the results
file and the section of benchmarks/README.md.

    python benchmarks/cluster_sim.py --quick --json /tmp/rows.json   # what CI runs (`rlstream sim --quick`)
    nice -n 10 python benchmarks/cluster_sim.py --setting areal-1.5b-8gpu --write
    python benchmarks/cluster_sim.py --from-json benchmarks/results/cluster_sim_results.json  # re-render, no run

Every option of `rlstream sim` is accepted; without `--json` a full run writes its rows to
benchmarks/results/cluster_sim_results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_child import RedisChild  # noqa: E402

from rlstream.sim.main import parser as sim_parser  # noqa: E402
from rlstream.sim.main import run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_sim_results.json"
SECTION = "## Simulated cluster (cluster_sim.py)"
INTRO = """`nice -n 10 python benchmarks/cluster_sim.py --setting NAME --write` (`rlstream sim --help` lists the
options; re-render from the rows: `--from-json`). Real redis-server, the real producer admission loop
(producer/admit_loop.py), admission scripts, stream, trainer read path, acks and version events;
simulated engine and trainer compute (sim/engine.py, parameters and sources in configs/cluster_sim.yaml).
Tokens/s and step times are modeled seconds over the steady steps; Redis CPU and latencies are measured.
How to read the columns and the honest bound: docs/scaling.md."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[sim_parser()], add_help=False,
                                 conflict_handler="resolve")
    ap.add_argument("--write", action="store_true", help="write the tables into benchmarks/README.md")
    ap.add_argument("--from-json", default=None, help="re-render the README section from a saved --json file, no run")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        _write_readme([saved[name]["table"] for name in saved])
        return 0
    redis = RedisChild()
    try:
        tables, rows, traces = run(args, redis.url)
    finally:
        redis.stop()
    out = Path(args.json) if args.json else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2))
    if args.trace:
        Path(args.trace).write_text(json.dumps(traces))
    if args.write:
        _write_readme(tables)
    return 0


def _write_readme(tables: list[str]) -> None:
    from readme_section import write_section

    write_section(SECTION, SECTION + "\n\n" + INTRO + "\n\n" + "\n\n".join(tables) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
