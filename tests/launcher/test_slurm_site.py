"""launcher/slurm_site.py: `launcher.slurm.container`, every task of the Slurm job inside an image (pyxis or
Apptainer). The partition check (`check_partition`) runs against a real cluster in test_slurm.py.

Neither runtime runs on this machine (pyxis needs enroot inside Slurm, Apptainer is not
installed), so the generated script is checked as text and with `bash -n`, and the wrong
images are refused by `rlstream launch slurm` itself, one line naming the key, before any
file of the job is written. The script's task runner itself runs on a real Slurm cluster
with runtime=none (tests/launcher/test_slurm.py, test_slurm_nodes.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"


def _launch(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "launch", "slurm", "--config", str(CONFIG),
                           "--dry-run", f"cluster.fileroot={tmp_path / 'runs'}", "cluster.n_nodes=3",
                           "launcher.n_trainer_procs=2", "launcher.slurm.trainer_nodes=2", "launcher.n_producers=2",
                           *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=60)


def _srun_lines(script: str) -> list[str]:
    """Every srun command line of the script (continuation lines joined), not its mentions in comments or echo."""
    joined = script.replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() if re.search(r"(^|[{]\s)srun --", ln.strip())]


def test_pyxis_puts_every_srun_in_the_image(tmp_path):
    out = _launch(tmp_path, "launcher.slurm.container.runtime=pyxis",
                  "launcher.slurm.container.image=nvcr.io#nvidia/pytorch:24.05-py3",
                  "launcher.slurm.container.mounts=[/datasets:/data:ro]",
                  "launcher.slurm.container.args=[--container-writable]")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True).returncode == 0
    runs = str((tmp_path / "runs").resolve())
    image_srun = next(ln for ln in script.splitlines() if ln.startswith("IMAGE_SRUN="))
    assert shlex.split(image_srun.removeprefix("IMAGE_SRUN=(").removesuffix(")")) == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3", f"--container-mounts={runs},/datasets:/data:ro",
        "--container-writable"]
    assert "IMAGE_EXEC=()" in script
    sruns = _srun_lines(script)
    # the task runner, the prepare step and the helpers' `here`: all three kinds of srun take the image
    assert len(sruns) == 3 and all('"${IMAGE_SRUN[@]}"' in ln for ln in sruns), sruns
    # the batch script runs no rlstream Python outside the image: every "$PY" goes through srun or `here`
    bare = [ln for ln in script.replace("\\\n", " ").splitlines()
            if '"$PY"' in ln and not ln.lstrip().startswith(("here ", "task ", "srun "))]
    assert bare == [], bare
    assert script.count('here "$PY" -m rlstream.launcher.slurm wait-') == 2  # Redis, then the engines
    assert "PY=python\n" in script  # the image's Python, not this machine's


def test_apptainer_wraps_each_command(tmp_path):
    sif = tmp_path / "rlstream.sif"
    sif.write_bytes(b"\0")  # only its existence is checked before submitting
    out = _launch(tmp_path, "launcher.slurm.container.runtime=apptainer", f"launcher.slurm.container.image={sif}",
                  "launcher.slurm.container.args=[--nv]", "launcher.slurm.python=/opt/venv/bin/python")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True).returncode == 0
    runs = str((tmp_path / "runs").resolve())
    assert f"IMAGE_EXEC=(apptainer exec --bind {runs} --nv {sif})" in script
    assert "IMAGE_SRUN=()" in script and 'here() { "${IMAGE_EXEC[@]}" "$@"; }' in script
    assert "PY=/opt/venv/bin/python\n" in script
    # each task's command (redis, engine, trainer, producers) runs behind the prefix inside its srun
    assert '"${IMAGE_EXEC[@]}" "$@"' in script and script.count("\ntask ") == 5


def test_no_container_leaves_the_script_as_before(tmp_path):
    out = _launch(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "IMAGE_SRUN=()\nIMAGE_EXEC=()\nhere() { \"$@\"; }" in out.stdout
    assert "apptainer" not in out.stdout and "--container-image" not in out.stdout


@pytest.mark.parametrize("overrides,message", [
    (["launcher.slurm.container.runtime=apptainer", "launcher.slurm.container.image=/no/such/rlstream.sif"],
     "launcher.slurm.container.image=/no/such/rlstream.sif: no such file on this node (apptainer takes"),
    (["launcher.slurm.container.runtime=pyxis", "launcher.slurm.container.image=/no/such/rlstream.sqsh"],
     "launcher.slurm.container.image=/no/such/rlstream.sqsh: no such file on this node (pyxis takes"),
    (["launcher.slurm.container.runtime=pyxis", "launcher.slurm.container.image=docker://nvcr.io/nvidia/pytorch"],
     "launcher.slurm.container.image=docker://nvcr.io/nvidia/pytorch: not an image reference pyxis takes"),
    (["launcher.slurm.container.runtime=pyxis", "launcher.slurm.container.image=NVCR.io#Bad Name"],
     "launcher.slurm.container.image=NVCR.io#Bad Name: not an image reference pyxis takes"),
    (["launcher.slurm.container.runtime=apptainer", "launcher.slurm.container.image=ftp://x/y.sif"],
     "launcher.slurm.container.image=ftp://x/y.sif: apptainer does not pull ftp://"),
    (["launcher.slurm.container.runtime=pyxis"], "launcher.slurm.container.image is empty"),
    (["launcher.slurm.container.runtime=pyxis", "launcher.slurm.container.image=ubuntu:22.04",
      "launcher.slurm.container.mounts=[data:/data]"], "launcher.slurm.container.mounts: 'data:/data' must start"),
])
def test_a_bad_image_is_one_line_before_anything_is_written(tmp_path, overrides, message):
    out = _launch(tmp_path, *overrides)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()  # nothing of the job was written, nothing submitted
