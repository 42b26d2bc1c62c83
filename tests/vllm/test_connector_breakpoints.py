"""Breakpoints publish while the request runs: an aborted request's prefix is kept.

One engine (chunked prefill, 128 tokens a step) gets LONG_PROMPT with a
breakpoint at token 300 and room for 1200 output tokens; the client polls
the store: it must hold the 288-token prefix (whole blocks) before the
request finishes; then the request is aborted.  (The engine core runs ahead
of the client in its own process, so the client's step count says nothing.)
After a reset of vLLM's own prefix cache, a prompt sharing those 300 tokens
restores 288 of them from disk and answers as plain vLLM does.  Under the
old behaviour (saves only at finish) the scenario fails: the request would
finish first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import CHUNK
from tiny_model import LONG_PROMPT, NEEDS_VLLM, SHARED_PREFIX_PROMPT, run_scenario, same_answer

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
    assert 288 in [s[1] for s in bp["snapshots"]], result["_log"]
    (shared,) = result["shared"]["outs"]
    assert shared["cached"] == 288, result["_log"]
    assert same_answer(shared, baseline["shared"][0]) == ""
    # The aborted request's computed blocks were saved too, on top of the prefix.
    snaps = {s[0]: s for s in result["shared"]["snapshots"]}
    prefix = next(s for s in snaps.values() if s[1] == 288)
    assert any(s[3] == prefix[0] for s in snaps.values()), snaps  # a copy-on-write tail
