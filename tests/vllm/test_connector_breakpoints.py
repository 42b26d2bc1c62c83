"""Breakpoints publish while the request runs: an aborted request's prefix is kept.

One engine (chunked prefill, 128 tokens a step) gets LONG_PROMPT with a
breakpoint at token 300 and room for 1200 output tokens; the client polls
the store: it must hold the 320-token prefix (to the end of the breakpoint's
block) before the request finishes; then the request is aborted.  (The engine
core runs ahead of the client in its own process, so the client's step count
says nothing.)  After a reset of vLLM's own prefix cache, a prompt sharing
those 300 tokens restores all 300 from disk (the last 12 from inside the
stored block) and answers as plain vLLM does.  Under the
old behaviour (saves only at finish) the scenario fails: the request would
finish first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import LONG_PROMPT, NEEDS_VLLM, SHARED_PREFIX_PROMPT, run_scenario, same_answer

from sparkcache.connector.faults import FAULT_ENV

pytestmark = NEEDS_VLLM


def test_a_breakpoint_is_published_before_the_request_finishes(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    result = run_scenario(tiny_model_dir, tmp_path, [
        {"op": "breakpoint_abort", "name": "bp", "prompt": LONG_PROMPT, "breakpoint": 300,
         "max_tokens": 1200},
        {"op": "reset"},
        {"op": "gen", "name": "shared", "prompts": [SHARED_PREFIX_PROMPT], "ready": 2},
    ], folder=tmp_path / "store", engine=CHUNK)
    bp = result["bp"]
    assert bp["generated"] < 1200, bp  # aborted long before its last token
    assert 320 in [s[1] for s in bp["snapshots"]], result["_log"]  # the breakpoint's block
    (shared,) = result["shared"]["outs"]
    assert shared["cached"] == 300, result["_log"]  # to the breakpoint, exactly
    assert same_answer(shared, baseline["shared"][0]) == ""
    # The aborted request's computed blocks were saved too, on top of the prefix.
    snaps = {s[0]: s for s in result["shared"]["snapshots"]}
    prefix = next(s for s in snaps.values() if s[1] == 320)
    assert any(s[3] == prefix[0] for s in snaps.values()), snaps  # a copy-on-write tail


@pytest.mark.parametrize("fault", [None, "slow-restore", "flip-restored"],
                         ids=["restored", "slow", "scrambled"])
def test_the_breakpoints_block_is_restored_inside_it(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path: Path, fault: str | None
) -> None:
    """vLLM's own prefix cache still holds the aborted request's whole blocks, so
    a prompt sharing its first 300 tokens gets 288 from it; the connector
    restores only the 12 after them, from inside the stored block 288-320.
    The answer is plain vLLM's, also when the restore is read in the prefill
    step and slower than its forward (which writes its new tokens into that
    block before each layer waits for the restore); scrambled after verification (negative
    control), those 12 tokens' KV alone change it."""
    result = run_scenario(tiny_model_dir, tmp_path, [
        {"op": "breakpoint_abort", "name": "bp", "prompt": LONG_PROMPT, "breakpoint": 300,
         "max_tokens": 1200},
        {"op": "gen", "name": "shared", "prompts": [SHARED_PREFIX_PROMPT]},
    ], folder=tmp_path / "store", engine=CHUNK, env={FAULT_ENV: fault} if fault else None,
        extra={"load_async": False} if fault == "slow-restore" else {})
    (shared,) = result["shared"]["outs"]
    assert shared["cached"] == 300, result["_log"]
    hits = "vllm:external_prefix_cache_hits"
    assert result["shared"]["metrics"][hits] - result["bp"]["metrics"][hits] == 12
    # 12 tokens past vLLM's hit, within one block: read in the step, load_async or not
    assert result["shared"]["metrics"].get("vllm:sparkcache_loads_in_step", 0) == 1
    if fault != "flip-restored":
        assert same_answer(shared, baseline["shared"][0]) == ""
    else:
        assert same_answer(shared, baseline["shared"][0]) != ""
