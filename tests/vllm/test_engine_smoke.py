"""vLLM serves the tiny model: one engine start (the session's baseline engine)."""

from __future__ import annotations

from typing import Any

from tiny_model import BLOCK_SIZE, LONG_PROMPT, MAX_TOKENS, NEEDS_VLLM

pytestmark = NEEDS_VLLM


def test_greedy_output_depends_on_the_prompt(baseline: dict[str, Any]) -> None:
    a, b = baseline["texts"]
    assert len(a) == len(b) == MAX_TOKENS
    assert a != b


def test_chat_template_renders(baseline: dict[str, Any]) -> None:
    prompt = baseline["chat_prompt"]
    assert prompt[0] == 0  # <|begin|>: the template starts with bos_token
    assert len(baseline["chat"]) == MAX_TOKENS


def test_prefix_cache_hit_for_a_repeated_prompt(baseline: dict[str, Any]) -> None:
    first, again = baseline["long"]
    assert first == again, "greedy decoding of the same prompt must repeat"
    cold, warm = baseline["long_cached"]
    assert cold == 0
    # Whole blocks only, and vLLM recomputes at least the last prompt token.
    assert warm == (len(LONG_PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert baseline["metrics"]["vllm:prefix_cache_hits"] >= warm
    assert baseline["metrics"]["vllm:external_prefix_cache_hits"] == 0
