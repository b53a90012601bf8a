"""`rlstream trace view` (launcher/trace_view.py): a merged trace in the vendored speedscope.

- the page and the trace are served over real HTTP (the trace merged first when the run has none yet);
- `--png` draws the chosen track of a real tracer session's merged trace in headless Chromium: a picture that is
  not blank, of the track asked for;
- a track no process has: exit 1 and one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlstream.common.tracing import PerfTracer
from rlstream.launcher.trace_view import SPEEDSCOPE_DIR, TraceServer, chromium_path, merged_trace


def _traced_run(root: Path) -> Path:
    """Two processes' tracer files, as a run writes them: a producer's rollouts on lanes, a trainer's steps."""
    folder = root / "trace"
    producer = PerfTracer(folder / "producer-0-1.trace.json", "producer-0")
    trainer = PerfTracer(folder / "trainer-2.trace.json", "trainer")
    for step in range(1, 4):
        with producer.lane_span("rollout", step=step), producer.span("rollout/generate"):
            time.sleep(0.01)
        with trainer.span("trainer/step", step=step):
            with trainer.span("trainer/read"):
                time.sleep(0.01)
            with trainer.span("trainer/forward_backward"):
                time.sleep(0.02)
            with trainer.span("trainer/push"):
                time.sleep(0.005)
    producer.close()
    trainer.close()
    return root


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "trace", "view", *args],
                          capture_output=True, text=True, timeout=180, env={**os.environ})


def test_the_viewer_and_the_merged_trace_are_served(tmp_path):
    run = _traced_run(tmp_path)
    trace_file = merged_trace(run)  # no merged file yet: merged now
    assert trace_file == run / "trace" / "merged.trace.json"
    server = TraceServer(trace_file)
    try:
        base = server.url.split("#", 1)[0].rsplit("/", 1)[0]
        assert server.url.endswith(f"#profileURL={base}/trace.json")
        with urllib.request.urlopen(server.url.split("#")[0], timeout=10) as r:
            page = r.read().decode()
        script = next(p.name for p in SPEEDSCOPE_DIR.glob("speedscope-*.js"))
        assert script in page
        with urllib.request.urlopen(f"{base}/{script}", timeout=10) as r:
            assert len(r.read()) > 100_000
        with urllib.request.urlopen(f"{base}/trace.json", timeout=10) as r:
            assert r.read() == trace_file.read_bytes()
    finally:
        server.close()


@pytest.mark.slow
def test_png_of_a_track_of_a_real_merged_trace(tmp_path):
    from PIL import Image, ImageStat

    if chromium_path() is None:
        missing = "the Debian package chromium is not installed (scripts/bootstrap.sh --test installs it)"
        if os.environ.get("RLSTREAM_REQUIRE_CHROMIUM") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    run = _traced_run(tmp_path)
    out = tmp_path / "view.png"
    res = _cli(str(run), "--png", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"wrote {out}: trainer (pid 2), MainThread"), res.stdout
    img = Image.open(out).convert("RGB")
    assert img.size[0] >= 1200 and img.size[1] >= 300
    assert len(img.getcolors(1 << 20)) > 20  # the spans' colours, text and the axis, not one flat fill
    assert ImageStat.Stat(img.convert("L")).stddev[0] > 20

    bad = _cli(str(run / "trace" / "merged.trace.json"), "--png", str(tmp_path / "no.png"), "--track", "no-such")
    assert bad.returncode == 1 and not (tmp_path / "no.png").exists()
    assert bad.stderr.strip().splitlines() == ["rlstream: error: trace view: no track of the trace has 'no-such' in "
                                               "its name"]
