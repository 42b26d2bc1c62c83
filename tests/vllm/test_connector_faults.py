"""Damaged snapshots are recomputed; a wrong restore is caught (negative control).

* corrupt: one payload byte of engine 1's snapshot flipped.  It is offered,
  fails verification on the worker, is quarantined, its blocks are reported
  through get_block_ids_with_load_errors and vLLM recomputes them: same
  answer.  Both load paths: in the prefill step (layer by layer; vLLM drops
  that step's output) and asynchronous (before the request is scheduled).
* deleted: the payload file of a ready snapshot removed: found at lookup when
  the block holding the prompt's end is checked (never offered), or, for a
  prompt sharing only whole blocks with it, on the worker as above.
* a busy engine: with SPARKCACHE_TEST_FAULT=hold-publishes a save is not
  published until a request waits for it; a chat's next turn, sent once vLLM
  evicted the previous one, waits for that save, hurries it and restores it.
* negative control: with SPARKCACHE_TEST_FAULT=flip-restored the worker
  scrambles restored pages *after* verification; the restore tests'
  comparison (tokens and logprobs) must then fail - proof that it would catch
  a wrong restore.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import (
    ALIAS_END_PROMPT,
    CHAT_TURNS,
    COMPUTED,
    LONG_PROMPT,
    NEEDS_VLLM,
    SHARED_PREFIX_PROMPT,
    damaged_copy,
    run_scenario,
    same_answer,
)

from sparkcache.connector.worker import FAULT_ENV

pytestmark = NEEDS_VLLM


@pytest.mark.parametrize("load_async", [False, True], ids=["in-step", "async"])
def test_corrupt_and_deleted_snapshots_are_recomputed(
    tiny_model_dir: Path, baseline: dict[str, Any], published: dict[str, Any], tmp_path: Path,
    load_async: bool,
) -> None:
    folder = damaged_copy(published["folder"], tmp_path / "store")

    ops: list[dict[str, Any]] = [
        {"op": "gen", "name": "shared", "prompts": [SHARED_PREFIX_PROMPT], "ready": 1},
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "ready": 2},
        {"op": "reset"},
        {"op": "delete_newest", "name": "delete"},
        {"op": "gen", "name": "deleted", "prompts": [LONG_PROMPT], "ready": 2},
        {"op": "reset"},
        {"op": "delete_newest", "name": "delete2"},
        {"op": "gen", "name": "deleted2", "prompts": [ALIAS_END_PROMPT], "ready": 2},
    ]
    run = run_scenario(tiny_model_dir, tmp_path, ops, folder=folder, engine=CHUNK,
                       extra={"load_async": load_async})
    (shared,), (long,), (again,), (other,) = (
        run[k]["outs"] for k in ("shared", "long", "deleted", "deleted2"))
    assert same_answer(shared, baseline["shared"][0]) == "", run["_log"]
    assert same_answer(long, baseline["long"][0]) == ""
    assert same_answer(again, baseline["long"][0]) == ""
    assert same_answer(other, baseline["alias_end"][0]) == ""
    # Corrupt: offered at admission (counted by vLLM: the 300 tokens it shares,
    # 12 of them inside the block 288-320, its token ids verified intact), failed
    # on the worker (the payload), quarantined, recomputed; vLLM's cache then
    # served LONG_PROMPT's first 288, and the shared prompt's snapshot (stored
    # after its recompute) the 12 after them.
    assert run["shared"]["metrics"]["vllm:external_prefix_cache_hits"] == 300
    assert any(k.startswith("quarantined.") for k in run["shared"]["stats"]), run["shared"]
    assert run["long"]["stats"].get("hits") == 1
    in_step = run["deleted2"]["metrics"].get("vllm:sparkcache_loads_in_step", 0)
    # In the step: shared's (failed), long's 12 tokens, deleted2's (failed);
    # with load_async only long's: at most one block past vLLM's own hit is
    # read in the step whatever load_async says.
    assert in_step == (1 if load_async else 3), in_step
    assert long["cached"] == 300
    # Deleted: the answer recomputed anew was stored and its file removed.  The
    # same prompt again: found missing when the block holding the prompt's end is
    # checked at lookup, so quarantined and never offered; recomputed.
    stats = run["deleted"]["stats"]
    assert stats.get("quarantined.missing") == 1, stats
    assert run["deleted"]["metrics"]["vllm:external_prefix_cache_hits"] == \
        run["long"]["metrics"]["vllm:external_prefix_cache_hits"]
    # Again removed; a prompt ending right after its 480-token alias (nothing for
    # admission to read: no growth, no tail block) is offered those, which are
    # missing on the worker: quarantined, recomputed.
    stats = run["deleted2"]["stats"]
    assert stats.get("quarantined.missing") == 2, stats
    external = run["deleted2"]["metrics"]["vllm:external_prefix_cache_hits"]
    offered = external - run["deleted"]["metrics"]["vllm:external_prefix_cache_hits"]
    if load_async:
        # The failed load sends the request back to admission, where it is looked
        # up again: the shared prompt's snapshot restores the 300 tokens it
        # shares (the store counts the blocks it read: those 10, and the one
        # block of long's 12 tokens before).
        assert offered - 480 == 300, offered
        assert stats.get("restored_tokens", 0) == 320 + 32, stats
    else:
        # In the prefill step: vLLM drops the step's output and recomputes.
        assert offered == 480
        assert stats.get("hits") == 1, stats  # long's 12 tokens only
    states = sorted(s[2] for s in run["deleted2"]["snapshots"])
    assert states == ["quarantined"] * 3 + ["ready"] * 2, run["deleted2"]["snapshots"]


def test_the_next_turn_waits_for_its_previous_turns_save(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    """Each turn's save is held (``hold-publishes``: as if prefills never ended,
    half a minute at most) and vLLM's prefix cache is reset after each turn,
    and nothing waits for the store between turns: the next turn, sharing
    more of the held save than is stored or live, waits for it, has it
    published at once, and restores it.  Without the wait, or without the
    hurry, every turn recomputes (cached 0)."""
    ops = [{"op": "chat", "name": "chat", "turns": CHAT_TURNS, "reset": True, "wait": False}]
    run = run_scenario(tiny_model_dir, tmp_path, ops, folder=tmp_path / "store", engine=CHUNK,
                       env={FAULT_ENV: "hold-publishes"})
    turns = run["chat"]["outs"]
    for out, ref in zip(turns, baseline["chat"], strict=True):
        assert same_answer(out, ref) == "", run["_log"]
    # As when every save landed before the next turn (test_connector_restore).
    assert [t["cached"] for t in turns] == [0, 320, 384], run["_log"]
    assert run["chat"]["metrics"]["vllm:external_prefix_cache_hits"] == 320 + 384


def test_negative_control_a_scrambled_restore_is_caught(
    tiny_model_dir: Path, baseline: dict[str, Any], published: dict[str, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "store"
    shutil.copytree(published["folder"], folder)
    ops = [{"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True}]
    run = run_scenario(tiny_model_dir, tmp_path, ops, folder=folder, engine=CHUNK,
                       env={FAULT_ENV: "flip-restored"})
    (out,) = run["long"]["outs"]
    assert out["cached"] == len(LONG_PROMPT) - COMPUTED, run["_log"]  # restored, verified ...
    assert run["long"]["stats"]["hits"] == 1
    # ... then scrambled: the comparison the restore tests use must fail.
    assert same_answer(out, baseline["long"][0]) != ""
    assert same_answer(out, published["outs"][0]) != ""
