"""Restores on real vLLM: after a restart, across chat turns, after live-cache
eviction, and for concurrent requests sharing one stored base.

One engine process (``restored``) runs every scenario in turn on a copy of
engine 1's store (see conftest.published), with a 64-block KV cache so that
one long conversation pushes another out; vLLM's prefix cache is reset
between scenarios so that each restores from disk.  Every engine prefills in
chunks of 128 tokens.  Answers are compared with plain vLLM's (the session's
baseline engine) and engine 1's: greedy tokens, and logprobs within
LOGPROB_TOL (test_connector_faults.py proves the comparison catches a wrong
restore).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import (
    BLOCK_SIZE,
    CHAT_TURNS,
    COMPUTED,
    CONCURRENT_PROMPTS,
    EVICT_A,
    EVICT_A_NEXT,
    EVICT_B,
    LONG_PROMPT,
    NEEDS_VLLM,
    SHARED_PREFIX_PROMPT,
    SMALL_CACHE_BLOCKS,
    run_scenario,
    same_answer,
)

pytestmark = NEEDS_VLLM

#: Bytes of one block of one layer of the tiny model: 2 KV heads x 32 tokens x
#: (K and V) 64 floats.  A segment's header and token ids stay below SLACK.
PAGE_BYTES = 2 * 32 * 64 * 4
LAYERS = 2
SLACK = 8192


@pytest.fixture(scope="module")
def restored(
    tiny_model_dir: Path, published: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("engine2")
    folder = tmp / "store"
    shutil.copytree(published["folder"], folder)
    ops: list[dict[str, Any]] = [
        {"op": "gen", "name": "restart", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "concurrent", "prompts": CONCURRENT_PROMPTS, "ready": 4},
        {"op": "reset"},
        {"op": "gen", "name": "shared", "prompts": [SHARED_PREFIX_PROMPT], "ready": 5},
        {"op": "reset"},
        {"op": "chat", "name": "chat", "turns": CHAT_TURNS, "reset": True, "ready": 6},
        {"op": "chat", "name": "evict", "turns": [EVICT_A, EVICT_A_NEXT], "between": [EVICT_B],
         "ready": 9},
    ]
    engine = {**CHUNK, "num_gpu_blocks_override": SMALL_CACHE_BLOCKS}
    return run_scenario(tiny_model_dir, tmp, ops, folder=folder, engine=engine)


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def test_restore_after_restart(
    restored: dict[str, Any], published: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """5a: a new engine on the same store restores >= 90% of a prompt engine 1
    answered; tokens and logprobs equal engine 1's and plain vLLM's."""
    (out,) = restored["restart"]["outs"]
    assert out["cached"] >= 0.9 * len(LONG_PROMPT), restored["_log"]
    # All but the last prompt tokens vLLM computes itself (COMPUTED): the
    # prompt-end alias (480 tokens) and the stored block holding tokens
    # 480..511 (engine 1's prompt end and answer).
    assert out["cached"] == len(LONG_PROMPT) - COMPUTED
    blocks = -(-out["cached"] // BLOCK_SIZE)  # whole blocks read: 16
    assert same_answer(out, published["outs"][0]) == ""
    assert same_answer(out, baseline["long"][0]) == ""
    metrics = restored["restart"]["metrics"]
    assert metrics["vllm:external_prefix_cache_hits"] == out["cached"]
    assert metrics["vllm:prompt_tokens_cached_by_source[disk]"] == out["cached"]
    # The connector's own stats reach vLLM's Prometheus registry (build_prom_metrics).
    assert metrics.get("vllm:sparkcache_hit_tokens") == out["cached"], sorted(metrics)
    assert metrics.get("vllm:sparkcache_loaded_bytes") == blocks * LAYERS * PAGE_BYTES
    # The default load_async: true - landed before the prefill step.
    assert metrics.get("vllm:sparkcache_loads_in_step", 0) == 0
    # Its start read the store's snapshots into the page cache (warm_mb).
    stored = sum(f.stat().st_size for f in Path(published["folder"]).rglob("*.safetensors"))
    assert 0 < metrics.get("vllm:sparkcache_warmed_bytes", 0) <= stored, sorted(metrics)
    stats = restored["restart"]["stats"]
    assert stats["hits"] == 1 and stats["restored_tokens"] == blocks * BLOCK_SIZE
    assert not any(k.startswith("quarantined") for k in stats)


def test_concurrent_requests_read_the_base_once(
    restored: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """5g: three requests sharing a stored 480-token base, admitted together: one
    reads it from disk, the others wait for it and hit vLLM's own prefix cache."""
    rec, before = restored["concurrent"], restored["restart"]
    for out, ref in zip(rec["outs"], baseline["concurrent"], strict=True):
        assert same_answer(out, ref) == "", restored["_log"]
        assert out["cached"] == 480
    assert _delta(rec["stats"], before["stats"], "hits") == 1, rec["stats"]
    assert _delta(rec["stats"], before["stats"], "restored_tokens") == 480
    assert _delta(rec["metrics"], before["metrics"], "vllm:external_prefix_cache_hits") == 480
    # Each answer is stored (in full: the base matched at an alias, not a snapshot end).
    assert len([s for s in rec["snapshots"] if s[2] == "ready"]) == 4


def test_a_shared_prefix_restores_all_it_shares(
    restored: dict[str, Any], baseline: dict[str, Any]
) -> None:
    (out,) = restored["shared"]["outs"]
    # Shares 300 tokens with LONG_PROMPT: the lookup stops at the 256-token stride
    # alias, grow() reaches the last whole shared block (9 x 32), as vLLM's own
    # prefix cache would (it restored 256 before), and extend() the 12 tokens of
    # the next stored block that the prompt shares.
    assert out["cached"] == 300
    assert same_answer(out, baseline["shared"][0]) == ""


def test_chat_turns_restore_the_previous_turn_and_store_tails(
    restored: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """5b: turn 2 restores turn 1's prompt and answer, turn 3 turn 2's; each
    turn's snapshot extends the previous one and stores only the new tail."""
    turns = restored["chat"]["outs"]
    for out, ref in zip(turns, baseline["chat"], strict=True):
        assert same_answer(out, ref) == "", restored["_log"]
    # Every turn's prompt + answer ends on a block boundary (see CHAT_TURNS); the
    # last answer token's KV is computed by the next turn.
    assert [t["cached"] for t in turns] == [0, 320, 384]
    assert [t["prompt_len"] for t in turns] == [305, 369, 433]
    first, second, third = turns[-1]["snapshots"][-3:]
    assert (first[1], second[1], third[1]) == (320, 384, 448)
    assert second[2] == first[0] and third[2] == second[0]  # copy-on-write parents
    assert first[3] >= 10 * LAYERS * PAGE_BYTES
    for snap in (second, third):  # 64-token tails: 2 blocks per layer on disk
        assert 2 * LAYERS * PAGE_BYTES <= snap[3] < 2 * LAYERS * PAGE_BYTES + SLACK, snap


def test_live_cache_eviction_restores_from_disk(
    restored: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """5c: conversation B pushes A out of a 64-block KV cache; A's next turn is
    restored from disk (external hits), with the same answer."""
    rec, before = restored["evict"], restored["chat"]
    a1, a2 = rec["outs"]
    (b,) = rec["between"]
    assert same_answer(a1, baseline["evict"][0]) == ""
    assert same_answer(b, baseline["evict_b"][0]) == ""
    assert same_answer(a2, baseline["evict"][1]) == "", restored["_log"]
    # A's snapshot: 400 + 15 computed tokens -> 384.  The turn restores all of it,
    # partly from vLLM's cache (blocks B left) and the rest from disk.
    assert a2["cached"] == 384
    external = _delta(rec["metrics"], before["metrics"], "vllm:external_prefix_cache_hits")
    assert 0 < external <= 384, external
