"""sparkcache.serve.usage: Anthropic usage from the connector's facts, for a whole
answer and for a stream rewritten event by event whatever its chunking."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.serve.usage import SseRewriter, anthropic_usage, facts_of

FACTS = {"prompt_tokens": 40, "live_tokens": 16, "restored_tokens": 16, "written_tokens": 4,
         "id": "sc-1"}


def test_usage_splits_the_prompt_into_read_written_and_the_rest() -> None:
    vllm = {"input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": 32}
    out = anthropic_usage(vllm, FACTS)
    assert out == {"input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 32,
                   "cache_creation_input_tokens": 4,
                   "cache_creation": {"ephemeral_5m_input_tokens": 4,
                                      "ephemeral_1h_input_tokens": 0}}
    assert vllm == {"input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": 32}


def test_written_is_clamped_to_what_was_not_read() -> None:
    facts = {"prompt_tokens": 100, "live_tokens": 0, "restored_tokens": 90,
             "written_tokens": 64}
    out = anthropic_usage({"input_tokens": 100, "output_tokens": 1}, facts)
    assert out["cache_read_input_tokens"] == 90
    assert out["cache_creation_input_tokens"] == 10
    assert out["input_tokens"] == 0


def test_missing_usage_and_missing_facts_count_as_zero() -> None:
    out = anthropic_usage(None, {"prompt_tokens": 12, "live_tokens": None})
    assert out == {"cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
                   "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                      "ephemeral_1h_input_tokens": 0},
                   "input_tokens": 12, "output_tokens": 0}


@pytest.mark.parametrize(("by_ttl", "written", "five", "hour"), [
    ({"3600": 96, "300": 64}, 160, 64, 96),
    ({"3600": 96}, 96, 0, 96),
    ({"300": 32, "0": 32}, 64, 64, 0),  # a breakpoint without a ttl: the default, 5m
    ({"1800": 32, "300": 32}, 64, 32, 32),  # kept longer than 5 minutes: the 1h cache
    (None, 64, 64, 0),  # a row from before the split: all 5m
    ({"3600": 200}, 64, 0, 64),  # clamped with the written total
    ({"3600": "x", "h": 3, "300": 64}, 64, 64, 0),  # garbage counts for nothing
])
def test_cache_creation_splits_the_written_tokens_by_ttl(
        by_ttl: Any, written: int, five: int, hour: int) -> None:
    facts = {"prompt_tokens": 500, "live_tokens": 0, "restored_tokens": 0,
             "written_tokens": written, "written_by_ttl": by_ttl}
    out = anthropic_usage({"input_tokens": 500, "output_tokens": 1}, facts)
    assert out["cache_creation"] == {"ephemeral_5m_input_tokens": five,
                                     "ephemeral_1h_input_tokens": hour}
    assert five + hour == out["cache_creation_input_tokens"] == written


def test_other_usage_fields_are_kept() -> None:
    out = anthropic_usage({"input_tokens": 9, "output_tokens": 3, "service_tier": "standard"},
                          {"prompt_tokens": 9, "live_tokens": 8})
    assert out["service_tier"] == "standard"
    assert (out["input_tokens"], out["cache_read_input_tokens"], out["output_tokens"]) == (1, 8, 3)


@given(prompt=st.integers(0, 10_000), live=st.integers(0, 10_000),
       restored=st.integers(0, 10_000), written=st.integers(0, 10_000),
       output=st.integers(0, 500))
def test_usage_adds_up_to_the_prompt(prompt: int, live: int, restored: int, written: int,
                                     output: int) -> None:
    live, restored = min(live, prompt), min(restored, prompt - min(live, prompt))
    facts = {"prompt_tokens": prompt, "live_tokens": live, "restored_tokens": restored,
             "written_tokens": written}
    out = anthropic_usage({"input_tokens": prompt, "output_tokens": output}, facts)
    assert out["cache_read_input_tokens"] == live + restored
    assert 0 <= out["cache_creation_input_tokens"] <= written
    assert out["input_tokens"] >= 0
    assert out["cache_read_input_tokens"] + out["cache_creation_input_tokens"] \
        + out["input_tokens"] == prompt
    split = out["cache_creation"]
    assert split["ephemeral_5m_input_tokens"] + split["ephemeral_1h_input_tokens"] == \
        out["cache_creation_input_tokens"]
    assert out["output_tokens"] == output


@pytest.mark.parametrize(("response", "expected"), [
    ({"kv_transfer_params": {"sparkcache": FACTS}}, FACTS),
    ({"kv_transfer_params": {"sparkcache": {"prompt_tokens": 0}, "other": 1}},
     {"prompt_tokens": 0}),
    ({}, None),
    ({"kv_transfer_params": None}, None),
    ({"kv_transfer_params": ["sparkcache"]}, None),
    ({"kv_transfer_params": {"other": FACTS}}, None),
    ({"kv_transfer_params": {"sparkcache": {"id": "sc-1"}}}, None),  # before the prompt ran
    ({"kv_transfer_params": {"sparkcache": [FACTS]}}, None),
], ids=["facts", "zero-prompt", "none", "null-params", "list-params", "other-connector",
        "only-id", "list-facts"])
def test_facts_of(response: dict[str, Any], expected: dict[str, Any] | None) -> None:
    assert facts_of(response) == expected


# -- the stream -------------------------------------------------------------------------

def event(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode()


START = ('{"type":"message_start","message":{"id":"chatcmpl-1","type":"message",'
         '"role":"assistant","content":[],"model":"tiny","stop_reason":null,'
         '"stop_sequence":null,"usage":{"input_tokens":40,"output_tokens":0,'
         '"cache_read_input_tokens":32}}}')
DELTA = ('{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
         '"usage":{"input_tokens":40,"output_tokens":5,"cache_read_input_tokens":32}}')
STREAM = b"".join([
    event("message_start", START),
    event("content_block_start",
          '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'),
    # Non-ASCII text and an escaped blank line inside the JSON pass untouched.
    event("content_block_delta",
          '{"type":"content_block_delta","index":0,'
          '"delta":{"type":"text_delta","text":"Grüß\\n\\ndich"}}'),
    event("content_block_delta",
          '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"!"}}'),
    event("content_block_stop", '{"type":"content_block_stop","index":0}'),
    event("message_delta", DELTA),
    event("message_stop", '{"type":"message_stop"}'),
])
REWRITTEN = STREAM.replace(
    START.encode(),
    b'{"type":"message_start","message":{"id":"chatcmpl-1","type":"message",'
    b'"role":"assistant","content":[],"model":"tiny","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":4,"output_tokens":0,'
    b'"cache_read_input_tokens":32,"cache_creation_input_tokens":4,'
    b'"cache_creation":{"ephemeral_5m_input_tokens":4,"ephemeral_1h_input_tokens":0}}}}',
).replace(
    DELTA.encode(),
    b'{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"input_tokens":4,"output_tokens":5,"cache_read_input_tokens":32,'
    b'"cache_creation_input_tokens":4,'
    b'"cache_creation":{"ephemeral_5m_input_tokens":4,"ephemeral_1h_input_tokens":0}}}',
)


class Source:
    """The facts, counting how often they were awaited."""

    def __init__(self, facts: Mapping[str, Any] | None) -> None:
        self.facts = facts
        self.awaited = 0

    async def __call__(self) -> Mapping[str, Any] | None:
        self.awaited += 1
        await asyncio.sleep(0)
        return self.facts


async def _through(rewriter: SseRewriter, chunks: Iterable[bytes]) -> bytes:
    out = [await rewriter.feed(chunk) for chunk in chunks]
    return b"".join(out) + rewriter.rest()


def run(chunks: Iterable[bytes], facts: Mapping[str, Any] | None) -> tuple[bytes, Source,
                                                                            SseRewriter]:
    source = Source(facts)
    rewriter = SseRewriter(source)
    return asyncio.run(_through(rewriter, chunks)), source, rewriter


def test_the_expected_stream_is_what_a_parser_reads() -> None:
    """REWRITTEN (written out by hand) has the usage anthropic_usage gives."""
    datas = [json.loads(line[6:]) for line in REWRITTEN.decode().split("\n")
             if line.startswith("data: ")]
    assert datas[0]["message"]["usage"] == anthropic_usage(
        json.loads(START)["message"]["usage"], FACTS)
    assert datas[-2]["usage"] == anthropic_usage(json.loads(DELTA)["usage"], FACTS)
    assert REWRITTEN != STREAM


def test_a_whole_stream_is_rewritten() -> None:
    out, source, rewriter = run([STREAM], FACTS)
    assert out == REWRITTEN
    assert source.awaited == 1
    assert rewriter.output_tokens == 5


def test_every_split_point_gives_the_same_stream() -> None:
    async def check() -> None:
        for i in range(len(STREAM) + 1):
            source = Source(FACTS)
            rewriter = SseRewriter(source)
            out = await _through(rewriter, [STREAM[:i], STREAM[i:]])
            assert out == REWRITTEN, f"split at byte {i}"
            assert source.awaited == 1, f"split at byte {i}"
            assert rewriter.output_tokens == 5

    asyncio.run(check())


def test_a_stream_fed_byte_by_byte_is_rewritten() -> None:
    source = Source(FACTS)
    rewriter = SseRewriter(source)

    async def feed() -> list[bytes]:
        return [await rewriter.feed(STREAM[i:i + 1]) for i in range(len(STREAM))]

    outs = asyncio.run(feed())
    assert b"".join(outs) + rewriter.rest() == REWRITTEN
    assert source.awaited == 1
    # Each event goes on as soon as its blank line arrives, never earlier.
    sent = [i for i, out in enumerate(outs) if out]
    ends = [i + 1 for i in range(len(STREAM) - 1) if STREAM[i:i + 2] == b"\n\n"]
    assert sent == ends


@given(st.lists(st.integers(0, len(STREAM)), max_size=30))
def test_any_chunking_gives_the_same_stream(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    out, source, _ = run(chunks, FACTS)
    assert out == REWRITTEN
    assert source.awaited == 1


def test_no_facts_leave_the_stream_byte_identical() -> None:
    for i in range(0, len(STREAM) + 1, 7):
        out, source, rewriter = run([STREAM[:i], STREAM[i:]], None)
        assert out == STREAM
        assert source.awaited == 1
        assert rewriter.output_tokens == 5


def test_facts_are_awaited_only_at_the_first_usage() -> None:
    source = Source(FACTS)
    rewriter = SseRewriter(source)
    ping = event("ping", '{"type":"ping"}')
    first = asyncio.run(rewriter.feed(ping + STREAM[:20]))
    assert first == ping
    assert source.awaited == 0


def test_what_is_not_an_anthropic_usage_event_passes_as_is() -> None:
    stream = b"".join([
        b": a comment\n\n",
        event("error", '{"type":"error","error":{"type":"overloaded_error","message":"x"}}'),
        b"data: [DONE]\n\n",
        event("message_start", '["not", "an", "object"]'),
        event("message_start", '{"type":"message_start","message":"not an object"}'),
    ])
    out, source, _ = run([stream], FACTS)
    assert out == stream
    assert source.awaited == 0


def test_an_unfinished_last_event_is_passed_on_at_the_end() -> None:
    truncated = STREAM + b'event: message_delta\ndata: {"type":"message_del'
    out, _, _ = run([truncated], FACTS)
    assert out == REWRITTEN + b'event: message_delta\ndata: {"type":"message_del'
