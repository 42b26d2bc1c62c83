"""sparkcache.serve.bodies: bodies read within their bound, JSON refused past
MAX_DEPTH levels whatever its shape (a property), never a RecursionError."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcache.errors import SparkCacheError
from sparkcache.serve.bodies import MAX_DEPTH, BadBody, Gone, TooLarge, parse_json, read_body


def _nest(depth: int, shapes: list[bool]) -> Any:
    value: Any = 1
    for level in range(depth):
        value = {"k": value} if shapes[level % len(shapes)] else [value]
    return value


@settings(max_examples=80, deadline=None)
@given(depth=st.integers(0, 3 * MAX_DEPTH), shapes=st.lists(st.booleans(), min_size=1,
                                                             max_size=8))
def test_json_deeper_than_max_depth_is_refused_and_no_shallower(depth: int,
                                                                shapes: list[bool]) -> None:
    raw = json.dumps({"model": "m", "x": _nest(depth, shapes)}).encode()
    if depth + 1 > MAX_DEPTH:
        with pytest.raises(BadBody, match="nests deeper than"):
            asyncio.run(parse_json(raw))
    else:
        assert asyncio.run(parse_json(raw))["model"] == "m"


@pytest.mark.parametrize("levels", [1000, 100_000])
def test_json_beyond_pythons_recursion_limit_is_a_bad_body(levels: int) -> None:
    with pytest.raises(BadBody) as caught:
        asyncio.run(parse_json(b"[" * levels + b"]" * levels))
    assert isinstance(caught.value, SparkCacheError)


def test_a_large_body_parses_off_the_loop_and_a_non_json_one_is_none() -> None:
    raw = json.dumps({"text": "x" * 1_000_000}).encode()
    assert len(asyncio.run(parse_json(raw))["text"]) == 1_000_000
    assert asyncio.run(parse_json(b"not json")) is None


def _receive(chunks: list[bytes], gone: bool = False) -> Any:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    if gone:
        messages[-1]["more_body"] = True
        messages.append({"type": "http.disconnect"})
    read = iter(messages)

    async def receive() -> Any:
        return next(read)

    return receive


def test_read_body_stops_at_its_bound() -> None:
    scope: dict[str, Any] = {"headers": []}
    assert asyncio.run(read_body(scope, _receive([b"ab", b"cd"]), 4)) == b"abcd"
    with pytest.raises(TooLarge, match="larger than 4 bytes"):
        asyncio.run(read_body(scope, _receive([b"ab", b"cd", b"e", b"never read"]), 4))
    with pytest.raises(TooLarge, match=r"\(5 bytes\)"):
        asyncio.run(read_body({"headers": [(b"content-length", b"5")]}, _receive([]), 4))
    with pytest.raises(Gone):
        asyncio.run(read_body(scope, _receive([b"a"], gone=True), 4))
