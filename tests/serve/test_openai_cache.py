"""sparkcache.serve.openai_cache: OpenAI's caching fields checked as the SDK's types
define them, taken out of the request, and turned into the cuts a request writes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sparkcache.serve.openai_cache import IMPLICIT, NONE, OpenAICacheError, plan


def bp(**mark: Any) -> dict[str, Any]:
    return {"mode": "explicit", **mark}


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": list(parts)},
                         {"role": "user", "content": "question"}], **extra}


def text(t: str, **mark: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": t}
    if mark:
        part["prompt_cache_breakpoint"] = bp(**mark) if mark != {"none": True} else None
    return part


def test_a_request_that_says_nothing_of_caching_is_left_as_it_is() -> None:
    body = chat(text("a"), text("b"))
    before = copy.deepcopy(body)
    assert plan("chat", body) is NONE and body == before
    assert plan("completions", {"prompt": "x", "prompt_cache_options": 3}) is NONE
    assert plan("messages", {"messages": []}) is NONE and plan(None, {}) is NONE


def test_implicit_mode_writes_the_latest_three_breakpoints_and_the_prompt_end() -> None:
    body = chat(*(text(str(i), ttl="30m") for i in range(5)))
    got = plan("chat", body)
    assert [c.where for c in got.cuts] == ["messages[0].content[2]", "messages[0].content[3]",
                                           "messages[0].content[4]", IMPLICIT]
    assert got.cache and all(c.ttl == 1800 for c in got.cuts)
    # The fields are gone from the request vLLM reads, and from every cut.
    assert all("prompt_cache_breakpoint" not in p for p in body["messages"][0]["content"])
    cut = got.cuts[0].body
    assert cut["messages"] == [{"role": "system", "content": [text("0"), text("1"), text("2")]}]
    assert "stream" not in cut and "stream_options" not in cut and cut["model"] == "m"


def test_explicit_mode_writes_the_latest_four_and_no_prompt_end() -> None:
    body = chat(*(text(str(i), ttl="12h") for i in range(6)),
                prompt_cache_options={"mode": "explicit"})
    got = plan("chat", body)
    assert [c.where for c in got.cuts] == [f"messages[0].content[{i}]" for i in range(2, 6)]
    assert all(c.ttl == 43200 for c in got.cuts) and got.cache
    assert "prompt_cache_options" not in body


def test_explicit_mode_without_a_breakpoint_does_not_cache() -> None:
    got = plan("chat", chat(text("a"), prompt_cache_options={"mode": "explicit"}))
    assert got.cuts == () and got.cache is False
    got = plan("chat", chat(text("a", none=True), prompt_cache_options={"mode": "explicit"}))
    assert got.cache is False  # a null breakpoint is none


def test_a_breakpoint_inherits_the_request_ttl_and_retention_24h_keeps_a_day() -> None:
    body = {"model": "m", "prompt_cache_options": {"ttl": "12h"},
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "a", "prompt_cache_breakpoint": bp()},
                {"type": "input_image", "image_url": "data:,",
                 "prompt_cache_breakpoint": bp(ttl="30m")}]}]}
    got = plan("responses", body)
    assert [(c.where, c.ttl) for c in got.cuts] == [
        ("input[0].content[0]", 43200), ("input[0].content[1]", 1800), (IMPLICIT, 43200)]
    assert got.ttl == 43200
    body = chat(text("a", ttl="30m"), prompt_cache_retention="24h")
    got = plan("chat", body)
    assert [c.ttl for c in got.cuts] == [86400, 86400] and got.retention == "24h"
    assert "prompt_cache_retention" not in body
    got = plan("chat", chat(text("a", mode="explicit"), prompt_cache_retention="in_memory"))
    assert [c.ttl for c in got.cuts] == [1800, 1800]


def test_responses_options_prewarm_and_comparison_id_are_kept() -> None:
    body = {"model": "m", "max_output_tokens": 9, "input": "hi",
            "prompt_cache_options": {"prewarm": True, "comparison_response_id": "resp_1"}}
    got = plan("responses", body)
    assert got.prewarm and got.max_output_tokens == 9 and body["max_output_tokens"] == 1
    assert got.comparison_response_id == "resp_1"
    assert [c.where for c in got.cuts] == [IMPLICIT]


def test_breakpoints_are_read_only_from_message_parts() -> None:
    body = {"model": "m", "input": [
        {"type": "function_call_output", "call_id": "c", "output": "x"},
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_file", "file_id": "f",
                                      "prompt_cache_breakpoint": bp()}]}],
            "prompt_cache_options": {"mode": "explicit"}}
    assert [c.where for c in plan("responses", body).cuts] == ["input[2].content[1]"]
    for kind in ("image_url", "file", "input_audio"):
        one = chat({"type": kind, "prompt_cache_breakpoint": bp()})
        assert plan("chat", one).cuts[0].where == "messages[0].content[0]"


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"prompt_cache_options": "on"}, "prompt_cache_options"),
    ("chat", {"prompt_cache_options": {"mode": "auto"}}, "prompt_cache_options.mode"),
    ("chat", {"prompt_cache_options": {"ttl": "12h"}}, "prompt_cache_options.ttl"),
    ("chat", {"prompt_cache_options": {"ttl": 1800}}, "prompt_cache_options.ttl"),
    ("chat", {"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
    ("chat", {"prompt_cache_options": {"comparison_response_id": "r"}},
     "prompt_cache_options.comparison_response_id"),
    ("chat", {"prompt_cache_options": {"x" * 500: 1}}, "prompt_cache_options"),
    ("chat", {"prompt_cache_retention": "48h"}, "prompt_cache_retention"),
    ("chat", {"prompt_cache_retention": 24}, "prompt_cache_retention"),
    ("responses", {"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
    ("responses", {"prompt_cache_options": {"prewarm": 1}}, "prompt_cache_options.prewarm"),
    ("responses", {"prompt_cache_options": {"comparison_response_id": ""}},
     "prompt_cache_options.comparison_response_id"),
    ("responses", {"prompt_cache_options": {"comparison_response_id": "r" * 257}},
     "prompt_cache_options.comparison_response_id"),
    ("responses", {"prompt_cache_options": {"prewarm": True}, "stream": True},
     "prompt_cache_options.prewarm"),
]


@pytest.mark.parametrize(("api", "extra", "param"), BAD)
def test_malformed_options_are_refused_naming_the_field(api: str, extra: dict[str, Any],
                                                        param: str) -> None:
    body = {"model": "m", "messages": [], "input": "hi", **extra}
    with pytest.raises(OpenAICacheError) as caught:
        plan(api, body)
    assert caught.value.param == param
    assert len(str(caught.value)) < 300  # no client text echoed unbounded


BAD_MARKS: list[tuple[Any, str]] = [
    ("yes", "messages[0].content[0].prompt_cache_breakpoint"),
    ({}, "messages[0].content[0].prompt_cache_breakpoint.mode"),
    ({"mode": "implicit"}, "messages[0].content[0].prompt_cache_breakpoint.mode"),
    ({"mode": "explicit", "ttl": "5m"}, "messages[0].content[0].prompt_cache_breakpoint.ttl"),
    ({"mode": "explicit", "ttl": None}, "messages[0].content[0].prompt_cache_breakpoint.ttl"),
    ({"mode": "explicit", "type": "x"}, "messages[0].content[0].prompt_cache_breakpoint.type"),
]


@pytest.mark.parametrize(("mark", "param"), BAD_MARKS)
def test_malformed_breakpoints_are_refused_naming_the_part(mark: Any, param: str) -> None:
    body = chat({"type": "text", "text": "a", "prompt_cache_breakpoint": mark})
    with pytest.raises(OpenAICacheError) as caught:
        plan("chat", body)
    assert caught.value.param == param


def test_a_breakpoint_on_a_part_that_cannot_carry_one_is_refused() -> None:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no",
                                           "prompt_cache_breakpoint": bp()}]}]}
    with pytest.raises(OpenAICacheError) as caught:
        plan("chat", body)
    assert caught.value.param == "messages[1].content[0].prompt_cache_breakpoint"
    assert "'refusal'" in str(caught.value)
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "text", "text": "a", "prompt_cache_breakpoint": bp()}]}]}
    with pytest.raises(OpenAICacheError) as caught:
        plan("responses", body)  # Responses parts are input_text, not chat's text
    assert caught.value.param == "input[0].content[0].prompt_cache_breakpoint"
