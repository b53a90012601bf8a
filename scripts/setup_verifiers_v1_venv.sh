#!/usr/bin/env bash
# Create (or reuse) the virtualenv that runs verifiers 0.4 environments (producer/verifiers_v1.py).
#
# verifiers 0.4 lives in its OWN venv: its pins (openai<3, mcp==2.0.0, ...) conflict with rlstream's
# main environment, and it talks to rlstream only over HTTP (the gateway). The driver needs nothing of
# rlstream but producer/verifiers_v1.py, imported from the repo through PYTHONPATH.
#
#   RLSTREAM_VERIFIERS_V1_VENV     where the venv lives   (default /opt/rlstream-verifiers-v1-venv)
#   RLSTREAM_VERIFIERS_V1_VERSION  the verifiers version  (default 0.4.0, the one tested)
#
# Usage: bash scripts/setup_verifiers_v1_venv.sh [--force]
set -euo pipefail

VENV="${RLSTREAM_VERIFIERS_V1_VENV:-/opt/rlstream-verifiers-v1-venv}"
VERSION="${RLSTREAM_VERIFIERS_V1_VERSION:-0.4.0}"
PYTHON="$(command -v python3.11 || command -v python3)"

if [[ "${1:-}" != "--force" ]] && "$VENV/bin/python" -c \
    "import sys, verifiers, verifiers.v1; sys.exit(verifiers.__version__ != '$VERSION')" 2>/dev/null; then
  echo "[setup_verifiers_v1_venv] $VENV already has verifiers $VERSION" >&2
  exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "verifiers==$VERSION"
"$VENV/bin/python" -c "import verifiers.v1, verifiers; print('[setup_verifiers_v1_venv] verifiers', verifiers.__version__, 'in $VENV')"
