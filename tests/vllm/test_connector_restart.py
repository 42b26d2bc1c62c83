"""The simplest end-to-end path: publish on finish, restore after a restart.

Engine 1 (its own process) answers a ~500-token prompt with the connector and
publishes the request's blocks when it finishes; engine 2 (a new process, the
same store folder) restores them.  Both prefill in chunks of 128 tokens
(chunked prefill, which crashes vLLM's ExampleConnector).  Greedy tokens must
equal plain vLLM's (the session's baseline engine).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from tiny_model import (
    BLOCK_SIZE,
    LONG_PROMPT,
    MAX_TOKENS,
    NEEDS_VLLM,
    SHARED_PREFIX_PROMPT,
    run_engine_script,
)

pytestmark = NEEDS_VLLM

#: One engine with the connector: answer args["prompts"] in order, then wait
#: until every queued save is a ready snapshot, then report.
ENGINE = """
import time
from vllm import SamplingParams
from sparkcache import SnapshotStore
from tiny_model import connector_config, metrics_of

llm = make_llm(
    args["model"], kv_transfer_config=connector_config(args["folder"], **args["extra"]),
    max_num_batched_tokens=args["chunk"],
)
sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
outs = []
for prompt in args["prompts"]:
    out = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
    outs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
# Saves run after the request finished (blocks copied on a later engine step,
# then written by a background thread): wait for them before shutting down.
deadline = time.monotonic() + 60
with SnapshotStore(args["folder"]) as store:
    while time.monotonic() < deadline:
        snaps = store.snapshots()
        if len([s for s in snaps if s.state == "ready"]) >= args["want_snapshots"]:
            break
        time.sleep(0.2)
    report({
        "outs": outs,
        "metrics": metrics_of(llm),
        "snapshots": [[s.n_tokens, s.state, s.parent_id] for s in store.snapshots()],
        "stats": store.stats(),
    })
"""


def run_engine(model: Path, tmp: Path, folder: Path, prompts: list[list[int]],
               want_snapshots: int, **extra: Any) -> dict[str, Any]:
    return run_engine_script(ENGINE, args={
        "model": str(model), "tmp": str(tmp), "folder": str(folder), "prompts": prompts,
        "max_tokens": MAX_TOKENS, "chunk": 128, "want_snapshots": want_snapshots,
        "extra": extra,
    })


@pytest.fixture(scope="module")
def published(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Engine 1: a cold answer with the connector, published on finish.  The store."""
    tmp = tmp_path_factory.mktemp("engine1")
    folder = tmp / "store"
    first = run_engine(tiny_model_dir, tmp, folder, [LONG_PROMPT], want_snapshots=1)
    (out,) = first["outs"]
    assert out["cached"] == 0
    assert out["tokens"] == baseline["long"][0], "the connector changed a cold answer"
    # Prompt and output, whole blocks: 500 + 16 - 1 computed tokens -> 512.
    computed = (len(LONG_PROMPT) + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first["snapshots"] == [[computed, "ready", None]], first["_log"]
    assert first["metrics"]["vllm:external_prefix_cache_hits"] == 0
    return folder


@pytest.mark.parametrize("load_async", [False, True], ids=["sync-load", "async-load"])
def test_restore_after_restart(
    tiny_model_dir: Path, baseline: dict[str, Any], published: Path, tmp_path: Path,
    load_async: bool,
) -> None:
    folder = tmp_path / "store"
    shutil.copytree(published, folder)
    second = run_engine(tiny_model_dir, tmp_path, folder, [SHARED_PREFIX_PROMPT, LONG_PROMPT],
                        want_snapshots=2, load_async=load_async)
    shared, same = second["outs"]
    # A prompt sharing 300 tokens restores the stride alias below them (256) ...
    assert shared["cached"] == 256, second["_log"]
    assert shared["tokens"] == baseline["shared"]
    # ... the same prompt again is a local hit for the shared 288 tokens (9 blocks),
    # then restores up to its last whole block below the last token (the
    # breakpoint published at the prompt's end): local and external together.
    assert same["cached"] == (len(LONG_PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert same["tokens"] == baseline["long"][0]
    metrics = second["metrics"]
    external = 256 + same["cached"] - 288
    assert metrics["vllm:external_prefix_cache_hits"] == external
    assert metrics["vllm:prompt_tokens_cached_by_source[disk]"] == external
    assert second["stats"]["hits"] == 2
    assert not any(k.startswith("quarantined") for k in second["stats"])
    # The shared prompt's answer was published too (in full: no whole-snapshot
    # parent); the long one was already stored.
    assert sorted(second["snapshots"]) == [[512, "ready", None], [512, "ready", None]]


def test_corrupt_snapshot_is_recomputed(
    tiny_model_dir: Path, baseline: dict[str, Any], published: Path, tmp_path: Path
) -> None:
    """A snapshot whose payload fails verification is a miss: vLLM recomputes the
    blocks (kv_load_failure_policy=recompute) and the answer does not change."""
    folder = tmp_path / "store"
    shutil.copytree(published, folder)
    (segment,) = folder.glob("objects/*/*/*.safetensors")
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside layer payload, past the JSON header
    segment.write_bytes(bytes(data))

    run = run_engine(tiny_model_dir, tmp_path, folder, [SHARED_PREFIX_PROMPT, LONG_PROMPT],
                     want_snapshots=2)
    shared, same = run["outs"]
    assert shared["tokens"] == baseline["shared"], run["_log"]
    assert same["tokens"] == baseline["long"][0]
    # Offered at admission (counted), then failed on the worker and recomputed.
    assert run["metrics"]["vllm:external_prefix_cache_hits"] == 256
    assert any(k.startswith("quarantined.") for k in run["stats"]), run["stats"]
    assert "hits" not in run["stats"]
    # The damaged snapshot is never offered again; both answers are stored, the
    # long one under the quarantined snapshot's key (recomputed, published anew).
    states = sorted(state for _n, state, _p in run["snapshots"])
    assert states == ["quarantined", "ready", "ready"], run["snapshots"]
