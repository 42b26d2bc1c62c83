#!/usr/bin/env bash
# The one command a session with a lent GPU machine runs (through the device
# tool, from the repository root there): sparkcache's GPU tests and
# bench/gpu_check.py, the table and logs written to $OUT.
#
#   run(command="bash scripts/gpu-device.sh", carry=[".whl"], timeout_s=540)
#
# The machine (docs: /work/.library/device/KINDS.md) has Python 3.12 at
# /opt/torch/.venv with torch 2.11+cu130, numpy, xxhash, fsspec, safetensors,
# pytest and hypothesis, but not apsw, SQLAlchemy, alembic or Mako, and it
# reaches no registry.  Those four travel as wheels in .whl/ (ignored by git,
# carried by the call).  Prepare them once, on a machine with pip and network,
# in the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       apsw==3.54.1.0 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3
#
# (checked 2026-12-01: four wheels, 8.8 MB; SQLAlchemy 2.1 and alembic need
# typing-extensions >= 4.12, Mako needs MarkupSafe: both are on the machine.)
# vLLM for CUDA (hundreds of MB with its dependencies) cannot travel under the
# 64 MiB carry limit, so tests/vllm/test_connector_gpu.py's GPU test skips there
# and runs where vLLM for CUDA is installed.
#
# Device time is short (15 minutes per task, a machine start takes minutes):
# everything here is sized to end in about 5 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
    echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nproc; free -g | head -2; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
} 2>&1 | tee "$OUT/machine.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
# sparkcache itself, editable (its alembic revisions are mapped from migrations/
# to sparkcache._migrations); if the machine's setuptools cannot, a link in this
# throwaway copy of the tree does the same.
check='import sparkcache, apsw, sqlalchemy, alembic
from sparkcache.index.migrate import known_revisions
print("sparkcache", sparkcache.__file__, "schema", known_revisions()[-1])'
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
if ! $PY -c "$check" 2>/dev/null; then
    ln -sfn ../migrations sparkcache/_migrations
fi
$PY -c "$check" || { echo "missing dependencies: prepare .whl/ (see this script's header)"; exit 1; }

status=0
echo "== pytest -m gpu tests/cuda"
$PY -m pytest -q -p no:cacheprovider tests/cuda tests/vllm/test_connector_gpu.py -rs 2>&1 \
    | tee "$OUT/pytest.txt" || status=1
echo "== bench/gpu_check.py"
# Scratch on the machine's disk (not /tmp, which may be memory: no cold reads there).
timeout 300 $PY bench/gpu_check.py --dir "$PWD" --out "$OUT/gpu_check.md" --json 2>&1 \
    | tee "$OUT/gpu_check.log" || status=1
exit $status
