"""Fixtures for the vLLM tests: the tiny model and plain vLLM's answers, once per session.

This folder has no ``__init__.py`` on purpose: pytest's default (prepend)
import mode would import a package ``tests/vllm`` as top-level ``vllm`` and
shadow the real one.  Modules here import their helpers as top-level modules
(``tiny_model``, ``random_models``).

Every test module here sets ``pytestmark = NEEDS_VLLM``; without vLLM they are
skipped with the reason (how to install it), never failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from random_models import build_model
from tiny_model import (
    ALIAS_END_PROMPT,
    CHAT_TURNS,
    CONCURRENT_PROMPTS,
    EVICT_A,
    EVICT_A_NEXT,
    EVICT_B,
    LONG_PROMPT,
    MAX_TOKENS,
    MISSING,
    OTHER_PROMPT,
    SHARED_PREFIX_PROMPT,
    run_scenario,
)

TEXTS = ["the quick brown fox jumps over the lazy dog", "river 42 mountain cloud window"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder vLLM serves: random Llama weights, BPE tokenizer, chat template."""
    if MISSING:
        pytest.skip(f"needs {', '.join(MISSING)}")
    return build_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def baseline(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What plain vLLM (no connector, one engine) answers: the reference of every
    connector test.  Prompts are separated by prefix-cache resets where a
    connector test restores them, so nothing here reads another prompt's KV."""
    tmp = tmp_path_factory.mktemp("baseline")
    ops: list[dict[str, Any]] = [
        {"op": "text", "name": "texts", "prompts": TEXTS},
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "gen", "name": "long_again", "prompts": [LONG_PROMPT]},
        {"op": "gen", "name": "shared", "prompts": [SHARED_PREFIX_PROMPT]},
        {"op": "template", "name": "template", "content": TEXTS[0]},
        {"op": "reset"},
        {"op": "gen", "name": "concurrent", "prompts": CONCURRENT_PROMPTS},
        {"op": "reset"},
        {"op": "gen", "name": "alias_end", "prompts": [ALIAS_END_PROMPT]},
        {"op": "reset"},
        {"op": "chat", "name": "chat", "turns": CHAT_TURNS, "reset": True},
        {"op": "chat", "name": "evict", "turns": [EVICT_A, EVICT_A_NEXT], "reset": True},
        {"op": "gen", "name": "evict_b", "prompts": [EVICT_B]},
        {"op": "gen", "name": "other", "prompts": [OTHER_PROMPT]},
    ]
    result = run_scenario(tiny_model_dir, tmp, ops)
    ref = {name: rec.get("outs") for name, rec in result.items() if name != "_log"}
    ref["metrics"] = result["texts"]["metrics"]
    ref["metrics_long_again"] = result["long_again"]["metrics"]
    ref["_log"] = result["_log"]
    assert len(ref["long"][0]["tokens"]) == MAX_TOKENS
    return ref


#: Every connector engine prefills in chunks of 128 tokens (chunked prefill).
CHUNK = {"max_num_batched_tokens": 128}


@pytest.fixture(scope="session")
def published(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Engine 1: a cold answer to LONG_PROMPT with the connector, published on finish.

    Returns its record (``outs``, ``snapshots``, ...) plus ``folder``: the store,
    which tests copy before they use it.
    """
    tmp = tmp_path_factory.mktemp("engine1")
    folder = tmp / "store"
    ops = [{"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True, "ready": 1}]
    result = run_scenario(tiny_model_dir, tmp, ops, folder=folder, engine=CHUNK)
    record: dict[str, Any] = result["long"]
    record["folder"] = folder
    record["_log"] = result["_log"]
    return record
