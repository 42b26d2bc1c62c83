"""5e: store-only publishes and never restores; restore-only restores and never
publishes; an engine of another identity (block size 64) never restores.

Two engines in a chain on one store: store-only with block size 64 answers
OTHER_PROMPT twice (its own snapshot must not be restored), then a
restore-only engine with block size 32 restores engine 1's snapshot of
LONG_PROMPT, misses the block-64 snapshot of OTHER_PROMPT and stores nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from conftest import CHUNK
from tiny_model import (
    COMPUTED,
    LONG_PROMPT,
    NEEDS_VLLM,
    OTHER_PROMPT,
    run_scenario,
    same_answer,
)

pytestmark = NEEDS_VLLM


def test_store_only_then_restore_only_on_another_identity(
    tiny_model_dir: Path, baseline: dict[str, Any], published: dict[str, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "store"
    shutil.copytree(published["folder"], folder)
    store_only = run_scenario(tiny_model_dir, tmp_path, [
        {"op": "gen", "name": "first", "prompts": [OTHER_PROMPT], "ready": 2},
        {"op": "reset"},
        {"op": "gen", "name": "again", "prompts": [OTHER_PROMPT]},
    ], folder=folder, engine={**CHUNK, "block_size": 64}, extra={"mode": "store-only"})
    (first,), (again,) = store_only["first"]["outs"], store_only["again"]["outs"]
    assert first["tokens"] == again["tokens"] == baseline["other"][0]["tokens"]
    assert first["cached"] == again["cached"] == 0, store_only["_log"]
    # Published under its own identity (block size 64: 400 + 15 computed -> 384) ...
    assert sorted(s[1] for s in store_only["again"]["snapshots"]) == [384, 512]
    # ... and never looked up, though its own snapshot was there the second time.
    assert "hits" not in store_only["again"]["stats"]
    assert store_only["again"]["metrics"]["vllm:external_prefix_cache_hits"] == 0

    restore_only = run_scenario(tiny_model_dir, tmp_path, [
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "gen", "name": "other", "prompts": [OTHER_PROMPT]},
    ], folder=folder, engine=CHUNK, extra={"mode": "restore-only", "load_async": False})
    (long,), (other,) = restore_only["long"]["outs"], restore_only["other"]["outs"]
    # All but the last prompt tokens, which vLLM computes itself.
    assert long["cached"] == len(LONG_PROMPT) - COMPUTED, restore_only["_log"]
    # Read layer by layer under the prefill's forward: same tokens and logprobs.
    assert restore_only["long"]["metrics"]["vllm:sparkcache_loads_in_step"] == 1
    assert same_answer(long, baseline["long"][0]) == ""
    assert other["cached"] == 0  # the block-64 snapshot is another identity's
    assert same_answer(other, baseline["other"][0]) == ""
    stats = restore_only["other"]["stats"]
    assert stats["hits"] == 1
    # Nothing new stored (restore-only plans no save at all).
    assert len(restore_only["other"]["snapshots"]) == 2
    assert stats["publishes"] == store_only["again"]["stats"]["publishes"]
