"""sparkcache.serve.openai_usage: OpenAI usage with ``cache_write_tokens`` from the
connector's facts, whole answers and streams whatever their chunking, parsed
into the ``openai`` SDK's own usage types."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sparkcache.serve.cache_control import Cut
from sparkcache.serve.openai_cache import Plan
from sparkcache.serve.openai_usage import (
    OpenAISseRewriter,
    chat_usage,
    responses_usage,
    rewrite_answer,
    written_split,
)

openai = pytest.importorskip("openai")

FACTS = {"prompt_tokens": 100, "live_tokens": 32, "restored_tokens": 32, "written_tokens": 32}
THIRTY = Plan()
TWELVE = Plan(ttl=43200.0)


def test_chat_usage_gets_cache_write_tokens_and_keeps_the_rest() -> None:
    vllm = {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104,
            "prompt_tokens_details": {"cached_tokens": 64}}
    out = openai.types.CompletionUsage.model_validate(chat_usage(vllm, FACTS))
    details = out.prompt_tokens_details
    assert (out.prompt_tokens, details.cached_tokens, details.cache_write_tokens) == (100, 64, 32)
    assert out.prompt_tokens - details.cached_tokens - details.cache_write_tokens == 4
    assert vllm["prompt_tokens_details"] == {"cached_tokens": 64}  # not edited in place
    # No details from vLLM: cached_tokens from the facts.
    bare = chat_usage({"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}, FACTS)
    assert bare["prompt_tokens_details"] == {"cached_tokens": 64, "cache_write_tokens": 32}


def test_written_is_clamped_to_what_was_not_read() -> None:
    facts = {**FACTS, "restored_tokens": 60}  # 92 read of 100: at most 8 written
    assert chat_usage({}, facts)["prompt_tokens_details"]["cache_write_tokens"] == 8
    assert written_split(facts, THIRTY) == (8, 8, 0)


def test_responses_usage_replaces_vllms_write_count_and_splits_by_ttl() -> None:
    vllm = {"input_tokens": 100, "output_tokens": 4, "total_tokens": 104,
            "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 1056},
            "output_tokens_details": {"reasoning_tokens": 0}}
    out = openai.types.responses.ResponseUsage.model_validate(
        responses_usage(vllm, FACTS, THIRTY))
    details = out.input_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (64, 32)
    assert (details.cache_write_tokens_details.ttl_30m_tokens,
            details.cache_write_tokens_details.ttl_12h_tokens) == (32, 0)
    twelve = responses_usage(vllm, FACTS, TWELVE)["input_tokens_details"]
    assert twelve["cache_write_tokens_details"] == {"ttl_30m_tokens": 0, "ttl_12h_tokens": 32}


def test_the_split_follows_the_connectors_written_by_ttl() -> None:
    facts = {**FACTS, "written_tokens": 96, "live_tokens": 0, "restored_tokens": 0,
             "written_by_ttl": {"1800": 32, "43200": 32, "86400": 16, "0": 16}}
    assert written_split(facts, THIRTY) == (96, 48, 48)
    assert written_split(facts, TWELVE) == (96, 32, 64)  # "0": the request's own ttl
    wrong = {**facts, "written_by_ttl": {"1800": 5}}  # not adding up: the request's ttl
    assert written_split(wrong, TWELVE) == (96, 0, 96)
    junk = {**facts, "written_by_ttl": {"soon": "x"}}
    assert written_split(junk, THIRTY) == (96, 96, 0)
    # No split from the connector: the breakpoints' one ttl, else the request's.
    cuts = (Cut("a", 43200.0, {}), Cut("b", 43200.0, {}))
    bare = {**facts, "written_by_ttl": None}
    assert written_split(bare, Plan(cuts=cuts)) == (96, 0, 96)
    mixed = Plan(cuts=(*cuts, Cut("c", 1800.0, {})))
    assert written_split(bare, mixed) == (96, 96, 0)


def test_a_prewarm_answer_is_completed_and_empty() -> None:
    answer = {"id": "resp_1", "object": "response", "status": "incomplete",
              "incomplete_details": {"reason": "max_output_tokens"}, "max_output_tokens": 1,
              "output": [{"type": "message", "content": []}],
              "usage": {"input_tokens": 100, "output_tokens": 1, "total_tokens": 101,
                        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 9},
                        "output_tokens_details": {"reasoning_tokens": 0}}}
    rewrite_answer("responses", answer, FACTS, Plan(prewarm=True, max_output_tokens=None))
    assert (answer["status"], answer["incomplete_details"], answer["output"],
            answer["max_output_tokens"]) == ("completed", None, [], None)
    usage = openai.types.responses.ResponseUsage.model_validate(answer["usage"])
    assert (usage.output_tokens, usage.total_tokens) == (0, 100)
    assert usage.input_tokens_details.cache_write_tokens == 32


def test_an_answer_without_facts_keeps_vllms_usage() -> None:
    answer = {"usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}
    rewrite_answer("chat", answer, None, THIRTY)
    assert answer == {"usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}


def _stream(api: str, events: list[bytes], chunk: int,
            facts: dict[str, Any] | None = FACTS) -> tuple[bytes, int]:
    asked = 0

    async def get() -> dict[str, Any] | None:
        nonlocal asked
        asked += 1
        return facts

    async def run() -> bytes:
        rewriter = OpenAISseRewriter(api, THIRTY, get)
        data = b"".join(events)
        out = b""
        for i in range(0, len(data), chunk):
            out += await rewriter.feed(data[i:i + chunk])
        return out + rewriter.rest()

    return asyncio.run(run()), asked


def _sse(payload: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(payload).encode() + b"\n\n"


CHAT = [
    _sse({"object": "chat.completion.chunk", "choices": [{"delta": {"content": "a"}}],
          "usage": None}),
    _sse({"object": "chat.completion.chunk", "choices": [],
          "usage": {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104,
                    "prompt_tokens_details": {"cached_tokens": 64}}}),
    b"data: [DONE]\n\n",
]


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_a_chat_stream_gets_cache_write_tokens_in_its_usage_chunk(chunk: int) -> None:
    out, asked = _stream("chat", CHAT, chunk)
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == CHAT[0]  # no usage: passed on as it was
    final = openai.types.chat.ChatCompletionChunk.model_validate(
        {"id": "c", "created": 0, "model": "m", **json.loads(events[1][5:])})
    assert final.usage is not None
    assert final.usage.prompt_tokens_details.cache_write_tokens == 32
    assert events[2] == b"data: [DONE]" and asked == 1


RESPONSES = [
    _sse({"type": "response.created", "response": {"usage": None}}, "response.created"),
    _sse({"type": "response.output_text.delta", "delta": "a"}, "response.output_text.delta"),
    _sse({"type": "response.completed", "response": {"usage": {
        "input_tokens": 100, "output_tokens": 4, "total_tokens": 104,
        "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 1056},
        "output_tokens_details": {"reasoning_tokens": 0}}}}, "response.completed"),
]


@pytest.mark.parametrize("chunk", [3, 4096])
def test_a_responses_stream_gets_ours_in_response_completed(chunk: int) -> None:
    out, asked = _stream("responses", RESPONSES, chunk)
    events = out.split(b"\n\n")
    assert [e + b"\n\n" for e in events[:2]] == RESPONSES[:2]
    head, data = events[2].split(b"\n")
    assert head == b"event: response.completed"
    usage = openai.types.responses.ResponseUsage.model_validate(
        json.loads(data[5:])["response"]["usage"])
    assert usage.input_tokens_details.cache_write_tokens == 32
    assert usage.input_tokens_details.cache_write_tokens_details.ttl_30m_tokens == 32
    assert asked == 1


def test_a_stream_without_facts_is_passed_on_unchanged() -> None:
    out, asked = _stream("chat", CHAT, 5, facts=None)
    assert out == b"".join(CHAT) and asked == 1
    out, asked = _stream("chat", [CHAT[0], b"data: {not json\n\n"], 5)
    assert out == CHAT[0] + b"data: {not json\n\n" and asked == 0
