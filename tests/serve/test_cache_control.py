"""sparkcache.serve.cache_control: each ``cache_control`` placement becomes a cut of
the request in prompt order (tools, system, messages); malformed marks are refused
with a message that names the block."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.errors import InvalidArgument
from sparkcache.serve.cache_control import (
    PLACEHOLDER,
    CacheControlError,
    common_prefix,
    cuts,
    strip,
)

FIVE_MINUTES = {"type": "ephemeral"}
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}


def tool(name: str, mark: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "description": f"tool {name}",
                           "input_schema": {"type": "object", "properties": {}}}
    if mark is not None:
        out["cache_control"] = mark
    return out


def text(value: str, mark: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "text", "text": value}
    if mark is not None:
        out["cache_control"] = mark
    return out


def request() -> dict[str, Any]:
    """A request with one mark of each kind but the top-level one, written in an
    order (messages first, then system, then tools) unlike the prompt's."""
    return {
        "model": "tiny",
        "max_tokens": 16,
        "stream": True,
        "messages": [
            {"role": "user", "content": [text("u0a"), text("u0b", FIVE_MINUTES), text("u0c")]},
            {"role": "assistant", "content": "a1", "cache_control": FIVE_MINUTES},
            {"role": "user", "content": "u2"},
        ],
        "system": [text("s0"), text("s1", FIVE_MINUTES), text("s2")],
        "tools": [tool("t0"), tool("t1", ONE_HOUR), tool("t2")],
        "temperature": 0.0,
    }


def test_every_placement_gives_its_cut_in_prompt_order() -> None:
    body = request()
    found = cuts(body)
    assert [c.where for c in found] == [
        "tools[1]", "system[1]", "messages[0].content[1]", "messages[1]"]
    assert [c.ttl for c in found] == [3600.0, 300.0, 300.0, 300.0]
    common = {"model": "tiny", "max_tokens": 16, "temperature": 0.0}

    tools_cut = found[0].body
    assert tools_cut == {**common, "tools": [tool("t0"), tool("t1", ONE_HOUR)],
                         "messages": [PLACEHOLDER]}
    assert "system" not in tools_cut  # the system prompt comes after the tools

    assert found[1].body == {**common, "tools": request()["tools"],
                             "system": [text("s0"), text("s1", FIVE_MINUTES)],
                             "messages": [PLACEHOLDER]}

    assert found[2].body == {**common, "tools": request()["tools"],
                             "system": request()["system"],
                             "messages": [{"role": "user",
                                           "content": [text("u0a"), text("u0b", FIVE_MINUTES)]}]}

    assert found[3].body == {**common, "tools": request()["tools"],
                             "system": request()["system"],
                             "messages": request()["messages"][:2]}


def test_cuts_drop_stream_and_the_top_level_mark() -> None:
    body = request()
    del body["messages"][1]["cache_control"]
    body["cache_control"] = FIVE_MINUTES
    found = cuts(body)
    assert [c.where for c in found][-1] == "cache_control" and len(found) == 4
    for cut in found:
        assert "stream" not in cut.body and "cache_control" not in cut.body
        assert cut.body["tools"] and cut.body["messages"]
    assert body["stream"] is True and body["cache_control"] == FIVE_MINUTES


def test_a_top_level_mark_keeps_the_whole_request_and_comes_last() -> None:
    body = {"cache_control": {"type": "ephemeral", "ttl": "5m"}, "stream": False,
            "model": "tiny", "max_tokens": 8, "system": "be brief",
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [text("yes", ONE_HOUR)]},
                         {"role": "user", "content": "more"}]}
    found = cuts(body)
    assert [(c.where, c.ttl) for c in found] == [
        ("messages[1].content[0]", 3600.0), ("cache_control", 300.0)]
    assert found[1].body == {"model": "tiny", "max_tokens": 8, "system": "be brief",
                             "messages": body["messages"]}
    # A string system prompt stays as it is in a message's cut.
    assert found[0].body["system"] == "be brief"
    assert found[0].body["messages"] == body["messages"][:2]
    assert strip(body) == found[1].body


def test_a_system_cut_keeps_no_message_and_a_tool_cut_no_system() -> None:
    body = {"model": "tiny", "system": [text("s0", FIVE_MINUTES)],
            "tools": [tool("t0", ONE_HOUR)],
            "messages": [{"role": "user", "content": "question"}]}
    tool_cut, system_cut = cuts(body)
    assert tool_cut.body == {"model": "tiny", "tools": [tool("t0", ONE_HOUR)],
                             "messages": [PLACEHOLDER]}
    assert system_cut.body == {"model": "tiny", "tools": [tool("t0", ONE_HOUR)],
                               "system": [text("s0", FIVE_MINUTES)],
                               "messages": [PLACEHOLDER]}


def test_content_blocks_of_a_message_come_before_the_message_mark() -> None:
    message = {"role": "user", "content": [text("a", FIVE_MINUTES), text("b")],
               "cache_control": FIVE_MINUTES}
    found = cuts({"model": "tiny", "messages": [message]})
    assert [c.where for c in found] == ["messages[0].content[0]", "messages[0]"]
    assert found[0].body["messages"][0]["content"] == [text("a", FIVE_MINUTES)]
    assert found[1].body["messages"] == [message]


def test_cuts_are_copies() -> None:
    body = request()
    before = copy.deepcopy(body)
    found = cuts(body)
    for cut in found:
        cut.body["messages"][0]["content"] = "changed"
        cut.body["tools"][0]["name"] = "changed"
    assert body == before
    assert PLACEHOLDER == {"role": "user", "content": "\u2400"}


def test_no_marks_no_cuts() -> None:
    body = {"model": "tiny", "system": [text("s0")], "tools": [tool("t0")],
            "messages": [{"role": "user", "content": [text("hi")], "cache_control": None}],
            "cache_control": None}
    assert cuts(body) == []
    # Parts of the wrong shape are vLLM's to refuse, not ours.
    assert cuts({"model": "tiny", "tools": "x", "system": 3,
                 "messages": ["not a message", {"role": "user", "content": [7]}]}) == []


def test_four_marks_allowed_five_refused() -> None:
    four = {"model": "tiny", "messages": [
        {"role": "user", "content": [text(str(i), FIVE_MINUTES) for i in range(4)]}]}
    assert len(cuts(four)) == 4
    five = copy.deepcopy(request())
    five["cache_control"] = FIVE_MINUTES
    with pytest.raises(CacheControlError) as info:
        cuts(five)
    message = str(info.value)
    assert "at most 4" in message and "found 5" in message
    for where in ("tools[1]", "system[1]", "messages[0].content[1]", "messages[1]",
                  "cache_control"):
        assert where in message


@pytest.mark.parametrize(("body", "where", "fragment"), [
    ({"model": "tiny", "system": [text("s0", {"type": "persistent"})],
      "messages": [{"role": "user", "content": "hi"}]},
     "system[0].cache_control.type", "got 'persistent'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"},
                                    {"role": "user", "content": [
                                        text("x"), text("y", {"type": "ephemeral",
                                                              "ttl": "10m"})]}]},
     "messages[1].content[1].cache_control.ttl", "got '10m'"),
    ({"model": "tiny", "tools": [tool("t0"), tool("t1", {"type": "ephemeral", "ttl": 5})],
      "messages": [{"role": "user", "content": "hi"}]},
     "tools[1].cache_control.ttl", "got 5"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi",
                                     "cache_control": "ephemeral"}]},
     "messages[0].cache_control must be an object", "got 'ephemeral'"),
    ({"model": "tiny", "tools": [{**tool("t0"), "cache_control": True}],
      "messages": [{"role": "user", "content": "hi"}]},
     "tools[0].cache_control must be an object", "got True"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
      "cache_control": {"type": "ephemeral", "ttl": "1d"}},
     "request.cache_control.ttl", "got '1d'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
      "cache_control": {}}, "request.cache_control.type", "got None"),
], ids=["type-persistent", "ttl-10m", "ttl-int", "message-not-object", "tool-not-object",
        "top-level-ttl", "top-level-no-type"])
def test_malformed_marks_name_their_block(body: dict[str, Any], where: str,
                                          fragment: str) -> None:
    with pytest.raises(CacheControlError) as info:
        cuts(body)
    message = str(info.value)
    assert message.startswith(where), message
    assert fragment in message
    # The server answers 400 with it: an InvalidArgument, so a ValueError too.
    assert isinstance(info.value, InvalidArgument) and isinstance(info.value, ValueError)


def test_one_hour_after_five_minutes_is_refused() -> None:
    body = {"model": "tiny", "system": [text("s0", FIVE_MINUTES)],
            "messages": [{"role": "user", "content": [text("q", ONE_HOUR)]}]}
    with pytest.raises(CacheControlError) as info:
        cuts(body)
    message = str(info.value)
    assert message.startswith("messages[0].content[0] ")
    assert "system[0]" in message and "'1h'" in message


@pytest.mark.parametrize("ttls", [["1h", "1h", "5m", "5m"], ["1h", "5m"], ["5m", "5m"],
                                  ["1h"], [None, "5m"]])
def test_longer_ttls_first_is_accepted(ttls: list[str | None]) -> None:
    blocks = [text(str(i), {"type": "ephemeral"} if ttl is None
                   else {"type": "ephemeral", "ttl": ttl}) for i, ttl in enumerate(ttls)]
    found = cuts({"model": "tiny", "messages": [{"role": "user", "content": blocks}]})
    assert [c.ttl for c in found] == [3600.0 if t == "1h" else 300.0 for t in ttls]


def test_a_late_one_hour_mark_is_refused_after_a_run_of_them() -> None:
    marks = [ONE_HOUR, FIVE_MINUTES, ONE_HOUR]
    blocks = [text(str(i), m) for i, m in enumerate(marks)]
    with pytest.raises(CacheControlError, match=re.escape("messages[0].content[2] asks")):
        cuts({"model": "tiny", "messages": [{"role": "user", "content": blocks}]})


@pytest.mark.parametrize(("a", "b", "n"), [
    ([], [], 0),
    ([], [1, 2], 0),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2], [1, 2, 3, 4], 2),
    ([1, 2, 3, 4], [1, 2], 2),
    ([9, 2, 3], [1, 2, 3], 0),
    ([1, 2, 9, 4], [1, 2, 3, 4], 2),
    ((5, 6, 7), [5, 6, 8], 2),
])
def test_common_prefix(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == n
    assert common_prefix(b, a) == n


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_is_the_longest_shared_start(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def tool_turns(inner: list[dict[str, Any]], mark: dict[str, Any] | None = None
               ) -> list[dict[str, Any]]:
    """A tool call and its result, whose content is ``inner`` (blocks)."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": "call_1", "content": inner}
    if mark is not None:
        result["cache_control"] = mark
    return [{"role": "user", "content": "look it up"},
            {"role": "assistant", "content": [
                text("calling"), {"type": "tool_use", "id": "call_1", "name": "find",
                                  "input": {}}]},
            {"role": "user", "content": [result, text("and now?")]}]


def test_a_mark_inside_a_tool_result_cuts_inside_it() -> None:
    """A block of a tool_result's content with cache_control is a breakpoint: the
    cut keeps the tool result up to and including that block (the earlier
    messages and blocks whole), before the tool result's own mark."""
    messages = tool_turns([text("r0"), text("r1", ONE_HOUR), text("r2")], FIVE_MINUTES)
    found = cuts({"model": "tiny", "messages": messages})
    assert [(c.where, c.ttl) for c in found] == [
        ("messages[2].content[0].content[1]", 3600.0), ("messages[2].content[0]", 300.0)]
    cut = found[0].body["messages"]
    assert cut[:2] == messages[:2]
    assert cut[2] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1", "cache_control": FIVE_MINUTES,
         "content": [text("r0"), text("r1", ONE_HOUR)]}]}
    assert found[1].body["messages"][2]["content"] == [messages[2]["content"][0]]


def test_tool_result_marks_are_checked_and_counted_like_any() -> None:
    bad = tool_turns([text("r0", {"type": "ephemeral", "ttl": "2h"})])
    with pytest.raises(CacheControlError, match=re.escape(
            "messages[2].content[0].content[0].cache_control.ttl")):
        cuts({"model": "tiny", "messages": bad})
    five = tool_turns([text(f"r{i}", FIVE_MINUTES) for i in range(5)])
    with pytest.raises(CacheControlError, match="found 5"):
        cuts({"model": "tiny", "messages": five})
    # Only a tool_result's content is looked into; a string content has no blocks.
    other = tool_turns([])
    other[2]["content"][0]["content"] = "plain"
    other[1]["content"][0]["content"] = [text("x", FIVE_MINUTES)]  # not a tool_result
    assert cuts({"model": "tiny", "messages": other}) == []


@pytest.mark.parametrize("where", ["block", "message", "tool_result_inner"])
def test_a_top_level_mark_on_a_marked_last_block_with_its_ttl_is_one_breakpoint(
        where: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "cache_control": ONE_HOUR,
                            "system": [text("s", ONE_HOUR)]}
    if where == "block":
        body["messages"] = [{"role": "user", "content": [text("q0"), text("q1", ONE_HOUR)]}]
    elif where == "message":
        body["messages"] = [{"role": "user", "content": "q", "cache_control": ONE_HOUR}]
    else:
        turns = tool_turns([text("r0"), text("r1", ONE_HOUR)])
        turns[2]["content"] = turns[2]["content"][:1]  # the tool result is the last block
        body["messages"] = turns
    found = cuts(body)
    assert len(found) == 2 and found[-1].where != "cache_control"
    assert found[-1].body == strip(body)
    # ... so it takes one of the four slots, not two.
    body["system"] = [text(f"s{i}", ONE_HOUR) for i in range(3)]
    assert len(cuts(body)) == 4


@pytest.mark.parametrize(("last", "top"), [(ONE_HOUR, FIVE_MINUTES), (FIVE_MINUTES, ONE_HOUR)])
def test_a_top_level_mark_on_a_marked_last_block_with_another_ttl_is_refused(
        last: dict[str, Any], top: dict[str, Any]) -> None:
    body = {"model": "tiny", "cache_control": top,
            "messages": [{"role": "user", "content": [text("q0"), text("q1", last)]}]}
    with pytest.raises(CacheControlError) as info:
        cuts(body)
    message = str(info.value)
    assert "messages[0].content[1]" in message and "same ttl" in message


def test_a_top_level_mark_past_the_last_mark_is_its_own_breakpoint() -> None:
    body = {"model": "tiny", "cache_control": FIVE_MINUTES,
            "messages": [{"role": "user", "content": [text("q0", ONE_HOUR), text("q1")]}]}
    assert [(c.where, c.ttl) for c in cuts(body)] == [
        ("messages[0].content[0]", 3600.0), ("cache_control", 300.0)]
    # There the usual order holds: a 1h top-level mark after a 5m block is refused.
    body["cache_control"] = ONE_HOUR
    body["messages"][0]["content"][0]["cache_control"] = FIVE_MINUTES
    with pytest.raises(CacheControlError, match="cache_control asks for a longer ttl"):
        cuts(body)


def test_a_malformed_mark_is_shown_bounded() -> None:
    body = {"model": "tiny", "system": [text("s", "x" * 10_000)],  # type: ignore[arg-type]
            "messages": [{"role": "user", "content": "q"}]}
    with pytest.raises(CacheControlError) as info:
        cuts(body)
    assert len(str(info.value)) < 300
