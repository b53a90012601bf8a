"""What the Slurm site offers a `rlstream launch slurm` job, checked before it is submitted: enough nodes in the
partition (`check_partition`), and the container runtime every task may run in (`launcher.slurm.container`).

Containers:

- pyxis (NVIDIA's SPANK plugin; enroot underneath): every srun of the job gets
  `--container-image=IMAGE --container-mounts=RUN_FOLDER,...`; the batch script's own helpers
  (waiting for Redis and the engines) run as a one-task srun on the first node, in the image too;
- apptainer: every command becomes `apptainer exec --bind RUN_FOLDER,... IMAGE COMMAND`, on the
  node the srun places it on; the helpers run the same way on the first node.

Either way the tasks run the image's Python (`launcher.slurm.python`, default `python`), and the
run folder (`cluster.fileroot`) is mounted at its own path, so the paths in the job's config hold
inside. What can be checked before submitting is: a local image file (a .sif, a sandbox folder, a
.sqsh) exists, a registry reference is well formed, mounts are absolute; a reference that the
registry does not know fails the first srun, and the job names that task (docs/launcher.md,
"Containers on Slurm").
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from rlstream.common.config import Config, ConfigError

__all__ = ["check_partition", "container_python", "container_shell", "check_container"]

KEY = "launcher.slurm.container"
# pyxis/enroot: [USER@][REGISTRY#]IMAGE[:TAG][@DIGEST] (enroot-import(1)); IMAGE in Docker's lowercase path form.
_PYXIS_REF = re.compile(r"^(?:[\w.-]+@)?(?:[\w.-]+(?::\d+)?#)?[a-z0-9]+(?:[._/-]+[a-z0-9]+)*"
                        r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
_APPTAINER_SCHEMES = ("docker", "docker-archive", "docker-daemon", "oras", "library", "shub", "http", "https")


def check_partition(cfg: Config) -> None:
    """Refuse a job the partition can never run (fewer nodes than cluster.n_nodes), before submitting it."""
    part = cfg.launcher.slurm.partition
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return  # sbatch says what is wrong
    rows = [line.split() for line in out.stdout.splitlines() if len(line.split()) == 2]
    nodes = {n for n, p in rows if (p.rstrip("*") == part if part else p.endswith("*"))}
    if out.returncode == 0 and rows and len(nodes) < cfg.cluster.n_nodes:
        where = f"partition {part}" if part else "the default partition"
        raise ConfigError(f"cluster.n_nodes={cfg.cluster.n_nodes} but {where} has {len(nodes)} node(s) (sinfo): lower "
                          f"cluster.n_nodes or choose launcher.slurm.partition")


def _is_local(runtime: str, image: str) -> bool:
    """Whether `image` names a file or folder on the shared filesystem rather than a registry image."""
    if runtime == "apptainer":
        return "://" not in image
    return image.startswith(("/", "./", "../", "~")) or image.endswith((".sqsh", ".squashfs"))


def check_container(cfg: Config) -> None:
    """Everything about the container that can be wrong before submitting: one ConfigError naming the key."""
    cc = cfg.launcher.slurm.container
    if cc.runtime == "none":
        return
    image = cc.image.strip()
    if not image:
        raise ConfigError(f"{KEY}.image is empty: name the image that {KEY}.runtime={cc.runtime} runs every task in")
    if _is_local(cc.runtime, image):
        if not Path(image).expanduser().exists():
            kind = ("a .sif file, a sandbox folder or a docker:// / oras:// / library:// URI" if cc.runtime == "apptainer"
                    else "a squashfs file (.sqsh) or a registry reference such as nvcr.io#nvidia/pytorch:24.05-py3")
            raise ConfigError(f"{KEY}.image={image}: no such file on this node ({cc.runtime} takes {kind})")
    elif cc.runtime == "apptainer":
        scheme = image.split("://", 1)[0]
        if scheme not in _APPTAINER_SCHEMES:
            raise ConfigError(f"{KEY}.image={image}: apptainer does not pull {scheme}:// (one of "
                              f"{', '.join(s + '://' for s in _APPTAINER_SCHEMES)})")
    elif "://" in image or not _PYXIS_REF.match(image):
        raise ConfigError(f"{KEY}.image={image}: not an image reference pyxis takes ([USER@][REGISTRY#]IMAGE[:TAG], "
                          f"e.g. nvcr.io#nvidia/pytorch:24.05-py3, or a .sqsh file)")
    for m in cc.mounts:
        src = m.split(":", 1)[0]
        if not src.startswith("/"):
            raise ConfigError(f"{KEY}.mounts: {m!r} must start with an absolute host path (SRC[:DST[:ro]])")


def container_python(cfg: Config) -> str | None:
    """The Python of the tasks when they run in an image and `launcher.slurm.python` is not set: the image's."""
    return "python" if cfg.launcher.slurm.container.runtime != "none" else None


def container_shell(cfg: Config) -> str:
    """Bash lines for the batch script: IMAGE_SRUN (srun options), IMAGE_EXEC (a command prefix) and `here`, which
    runs a helper command in the image on the first node (the batch script's own node)."""
    cc = cfg.launcher.slurm.container
    if cc.runtime == "none":
        return "IMAGE_SRUN=()\nIMAGE_EXEC=()\nhere() { \"$@\"; }"
    mounts = [str(Path(cfg.cluster.fileroot).resolve()), *cc.mounts]
    args = "".join(" " + shlex.quote(a) for a in cc.args)
    image = shlex.quote(cc.image.strip())
    if cc.runtime == "pyxis":
        return (f"# every task in {cc.image} (pyxis); helpers as a one-task srun on this node, in the image too\n"
                f"IMAGE_SRUN=(--container-image={image} --container-mounts={shlex.quote(','.join(mounts))}{args})\n"
                "IMAGE_EXEC=()\n"
                'here() { srun --overlap --nodes=1 --ntasks=1 --nodelist="${NODES[0]}" "${IMAGE_SRUN[@]}" "$@"; }')
    return (f"# every task in {cc.image} (apptainer exec)\n"
            "IMAGE_SRUN=()\n"
            f"IMAGE_EXEC=(apptainer exec --bind {shlex.quote(','.join(mounts))}{args} {image})\n"
            'here() { "${IMAGE_EXEC[@]}" "$@"; }')
