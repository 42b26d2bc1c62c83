"""vLLM serves the tiny model: one engine start (the session's baseline engine)."""

from __future__ import annotations

from typing import Any

from tiny_model import BLOCK_SIZE, LONG_PROMPT, MAX_TOKENS, NEEDS_VLLM

pytestmark = NEEDS_VLLM


def test_greedy_output_depends_on_the_prompt(baseline: dict[str, Any]) -> None:
    a, b = (o["tokens"] for o in baseline["texts"])
    assert len(a) == len(b) == MAX_TOKENS
    assert a != b


def test_chat_template_renders(baseline: dict[str, Any]) -> None:
    (out,) = baseline["template"]
    assert out["prompt"][0] == 0  # <|begin|>: the template starts with bos_token
    assert len(out["tokens"]) == MAX_TOKENS


def test_prefix_cache_hit_for_a_repeated_prompt(baseline: dict[str, Any]) -> None:
    (first,), (again,) = baseline["long"], baseline["long_again"]
    assert first["tokens"] == again["tokens"], "greedy decoding of the same prompt must repeat"
    assert first["cached"] == 0
    # Whole blocks only, and vLLM recomputes at least the last prompt token.
    warm = (len(LONG_PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again["cached"] == warm
    metrics = baseline["metrics_long_again"]
    assert metrics["vllm:prefix_cache_hits"] >= warm
    assert metrics["vllm:external_prefix_cache_hits"] == 0
