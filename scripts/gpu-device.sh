#!/usr/bin/env bash
# sparkcache's GPU checks on a CUDA machine, in one command, from the
# repository root: the tests of tests/cuda (the `gpu`-marked ones included)
# and tests/vllm/test_connector_gpu.py, then bench/gpu_check.py (every KV
# layout byte-equal to the CPU path, then GB/s against plain pinned copies;
# docs/benchmarks.md).  The machine's description, the test output and the
# benchmark's table and log are written to $OUT (default: ./gpu-out).
#
#   bash scripts/gpu-device.sh                 # with the default python3
#   PY=/path/to/python OUT=/tmp/gpu bash scripts/gpu-device.sh
#
# What it needs: an NVIDIA GPU with its driver (nvidia-smi), and a Python
# 3.11+ ($PY, default python3) with torch built for CUDA, numpy, xxhash,
# fsspec, safetensors, pytest and hypothesis.  sparkcache is installed from
# this tree (editable, without dependencies).  apsw, SQLAlchemy, alembic and
# Mako, if that Python lacks them, come as wheels in .whl/: the script
# installs whatever .whl/ holds into /tmp/site (never from the network), so it
# also runs on a machine without network access.  Prepare .whl/ once, on any machine with pip and network, in the
# repository root (the wheels below are for CPython 3.12 on x86-64 Linux;
# change --python-version to the CUDA machine's Python), then copy the tree
# with .whl/ to the CUDA machine:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       apsw==3.54.1.0 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3
#
# (four wheels, 8.8 MB; SQLAlchemy 2.1 and alembic also need
# typing-extensions >= 4.12, Mako needs MarkupSafe: install them too if that
# Python lacks them.)  tests/vllm/test_connector_gpu.py needs vLLM for CUDA
# (`pip install vllm==0.32.0`) in that Python and skips without it; the
# script does not install it.
#
# Everything here is sized to end in about 5 minutes on one GPU (the
# benchmark is stopped after 300 s).
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
# to sparkcache._migrations); if the machine's setuptools cannot, a link
# sparkcache/_migrations -> ../migrations in the tree does the same.
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
