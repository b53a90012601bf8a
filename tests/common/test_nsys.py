"""perf_tracer.nsys: the trainer under `nsys profile` (launcher), every span an NVTX range (NVIDIA's nvtx package).

nsys itself is not installed here: the launcher's wrapping runs against an `nsys` on PATH written by the test (it
records its arguments and runs the command after them, as `nsys profile` does); NVTX ranges are no-ops without an
attached tool, so the spans are checked to run through the real nvtx module, not to appear in a report."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from rlstream.common import tracing
from rlstream.common.config import load_config

FAKE_NSYS = """#!/bin/sh
# records `nsys profile [options] -o OUT CMD...` and runs CMD, as nsys does
echo "$@" > "$(dirname "$0")/args.txt"
shift
while [ "$1" != "-o" ]; do shift; done
shift 2
exec "$@"
"""


def _cfg(tmp_path, *extra):
    return load_config(None, [f"cluster.fileroot={tmp_path / 'runs'}", "perf_tracer.nsys=true", *extra])


def test_the_trainer_command_runs_under_nsys_with_its_options(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nsys").write_text(FAKE_NSYS)
    (bin_dir / "nsys").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = _cfg(tmp_path, "perf_tracer.nsys_args=[--trace=nvtx,--sample=none]")
    argv = tracing.nsys_wrap(cfg, [sys.executable, "-c", "print('trained')"])
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "trained"
    out = tracing.trace_folder(cfg) / "nsys-trainer"
    assert (bin_dir / "args.txt").read_text().split()[:5] == ["profile", "--trace=nvtx", "--sample=none", "-o", str(out)]
    assert out.parent.is_dir()  # nsys writes its report there


def test_without_nsys_on_path_the_trainer_runs_plainly_with_one_line(tmp_path, monkeypatch):
    from tests.common.test_tracing import _Lines

    monkeypatch.setenv("PATH", str(tmp_path))
    argv = [sys.executable, "-c", "pass"]
    seen = _Lines()
    tracing.log.addHandler(seen)
    try:
        assert tracing.nsys_wrap(_cfg(tmp_path), argv) == argv
    finally:
        tracing.log.removeHandler(seen)
    assert len(seen.lines) == 1 and "perf_tracer.nsys=true but nsys is not on PATH" in seen.lines[0]
    off = load_config(None, [f"cluster.fileroot={tmp_path / 'runs'}"])
    assert tracing.nsys_wrap(off, argv) == argv


class _Recording:
    """The real nvtx module, its range starts and ends recorded (name, thread)."""

    def __init__(self, nvtx) -> None:
        self.nvtx, self.calls = nvtx, []

    def start_range(self, message, domain):
        self.calls.append(("start", message, domain, threading.get_ident()))
        return (message, self.nvtx.start_range(message=message, domain=domain))

    def end_range(self, rng):
        self.calls.append(("end", rng[0], None, threading.get_ident()))
        self.nvtx.end_range(rng[1])


def test_spans_are_nvtx_ranges_also_without_trace_files(tmp_path, monkeypatch):
    import nvtx

    ranges = _Recording(tracing.nvtx_ranges())
    assert ranges.nvtx is nvtx
    monkeypatch.setattr(tracing, "nvtx_ranges", lambda: ranges)
    cfg = _cfg(tmp_path, "perf_tracer.enabled=false")
    tracer = tracing.configure(cfg, "trainer")
    try:
        assert tracer.enabled and tracer.path is None
        with tracing.span("trainer/step", step=1):
            with tracing.span("trainer/forward_backward"):
                pass
        done = []

        def lane():  # a lane span ends on another thread than the one that opened the step's span
            with tracing.lane_span("producer/rollout"):
                done.append(True)

        t = threading.Thread(target=lane)
        t.start()
        t.join()
        assert done and not tracing.trace_folder(cfg).exists()  # ranges only: no trace file
        main, other = threading.get_ident(), t.ident
        assert ranges.calls == [("start", "trainer/step", "rlstream", main),
                                ("start", "trainer/forward_backward", "rlstream", main),
                                ("end", "trainer/forward_backward", None, main), ("end", "trainer/step", None, main),
                                ("start", "producer/rollout", "rlstream", other),
                                ("end", "producer/rollout", None, other)]
    finally:
        tracing.configure(load_config(None, [f"cluster.fileroot={tmp_path / 'runs'}"]), "trainer")


def test_the_slurm_script_runs_the_trainer_under_nsys_when_the_node_has_it(tmp_path):
    from rlstream.launcher.slurm import plan, render_script

    cfg = _cfg(tmp_path, "cluster.n_nodes=1", "cluster.n_gpus_per_node=2", "launcher.n_engines=1")
    script = render_script(cfg, plan(cfg, external_redis=False), config_path=tmp_path / "c.yaml", redis_url=None)
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert "then mkdir -p \"$RUN_DIR/trace\"; NSYS=(nsys profile --trace=cuda,nvtx,osrt --force-overwrite=true -o " \
           "\"$RUN_DIR/trace\"/nsys-trainer-%h)" in script
    trainer = next(line for line in script.splitlines() if line.startswith("task trainer"))
    assert '"${NSYS[@]}" "$PY"' in trainer
