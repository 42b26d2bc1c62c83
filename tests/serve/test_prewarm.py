"""sparkcache.serve.prewarm: Anthropic's ``max_tokens: 0`` pre-warm is sent to vLLM
as one token and answered as Anthropic answers it (no content, ``stop_reason``
``max_tokens``, ``output_tokens`` 0, the cache fields from the connector); a
pre-warm that streams, thinks or forces a tool is a 400 in Anthropic's format."""

from __future__ import annotations

from typing import Any

import pytest

from sparkcache.errors import InvalidArgument
from sparkcache.serve.checks import Refused
from sparkcache.serve.prewarm import ENGINE_MAX_TOKENS, prewarm_answer, prewarm_of

BASE: dict[str, Any] = {"model": "tiny", "max_tokens": 0,
                        "messages": [{"role": "user", "content": "hi"}]}


def test_max_tokens_zero_is_a_prewarm_sent_as_one_token() -> None:
    body = dict(BASE)
    assert prewarm_of("messages", body) is True
    assert body["max_tokens"] == ENGINE_MAX_TOKENS == 1


@pytest.mark.parametrize(("api", "max_tokens"), [
    ("messages", 1), ("messages", False), ("messages", None), ("messages", 0.0),
    ("messages", -1), ("chat", 0), ("completions", 0), (None, 0)])
def test_anything_else_is_no_prewarm_and_left_alone(api: str | None, max_tokens: Any) -> None:
    body = {**BASE, "max_tokens": max_tokens}
    assert prewarm_of(api, body) is False
    assert body["max_tokens"] is max_tokens


@pytest.mark.parametrize(("extra", "why"), [
    ({"stream": True}, "stream: true"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking enabled"),
    ({"thinking": {"type": "adaptive"}}, "thinking enabled"),
    ({"tool_choice": {"type": "tool", "name": "find"}}, "tool_choice of type 'tool'"),
    ({"tool_choice": {"type": "any"}}, "tool_choice of type 'any'"),
], ids=["stream", "thinking", "adaptive-thinking", "forced-tool", "any-tool"])
def test_a_prewarm_that_streams_thinks_or_forces_a_tool_is_refused(
        extra: dict[str, Any], why: str) -> None:
    body = {**BASE, **extra}
    with pytest.raises(Refused) as caught:
        prewarm_of("messages", body)
    assert caught.value.status == 400 and why in caught.value.message
    assert "max_tokens: 0" in caught.value.message
    assert isinstance(caught.value, InvalidArgument)
    assert body["max_tokens"] == 0  # nothing changed


@pytest.mark.parametrize("extra", [
    {"stream": False}, {"thinking": {"type": "disabled"}}, {"tool_choice": {"type": "auto"}},
    {"tool_choice": {"type": "none"}}])
def test_what_anthropic_allows_with_a_prewarm_is_allowed(extra: dict[str, Any]) -> None:
    assert prewarm_of("messages", {**BASE, **extra}) is True


def test_the_answer_has_no_content_stops_at_max_tokens_and_keeps_its_usage() -> None:
    answer = {"id": "msg_1", "type": "message", "role": "assistant", "model": "tiny",
              "content": [{"type": "text", "text": "x"}], "stop_reason": "end_turn",
              "stop_sequence": "\n", "usage": {"input_tokens": 3, "output_tokens": 1,
                                               "cache_read_input_tokens": 64,
                                               "cache_creation_input_tokens": 32}}
    out = prewarm_answer(answer)
    assert out == {**answer, "content": [], "stop_reason": "max_tokens", "stop_sequence": None,
                   "usage": {"input_tokens": 3, "output_tokens": 0,
                             "cache_read_input_tokens": 64, "cache_creation_input_tokens": 32}}
    assert answer["content"] and answer["usage"]["output_tokens"] == 1  # a copy
    assert prewarm_answer({"usage": None})["usage"] == {"output_tokens": 0}
