"""Anthropic's caching as Anthropic defines it, through ``sparkcache serve`` on real vLLM
and the official ``anthropic`` client.

One server runs the tests in file order: a request with a 1-hour and a
5-minute breakpoint reports ``usage.cache_creation`` split exactly by ttl
(whole answers and streams, ``message_start`` and the final
``message_delta``), and the request log holds the same split; a pre-warm
(``max_tokens: 0``) answers no content, ``stop_reason`` ``max_tokens`` and
exact usage, and a real request after it (its prefix pushed out of vLLM's
live cache) reads what it wrote; each pre-warm refusal is an
``anthropic.BadRequestError``; a mark inside a ``tool_result``'s content
writes its prefix, which the next turn reads back; a top-level mark with
another ttl than the marked last block is a 400.

Every position below is counted by hand from the texts
(:data:`serve_helpers.SYSTEM_FRAME`; the template is in
:mod:`serve_helpers`), not by the code under test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import (
    MODEL_NAME,
    SYSTEM_FRAME,
    USER_FRAME,
    Server,
    block_end,
    complete,
    log_rows,
    saved,
    system_prompt,
    wait_for,
    whole,
)
from tiny_model import NEEDS_VLLM

from sparkcache.store import SnapshotStore

pytestmark = NEEDS_VLLM

anthropic = pytest.importorskip("anthropic")
from anthropic.types import CacheCreation, Message, Usage  # noqa: E402

HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE = {"type": "ephemeral", "ttl": "5m"}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("anthropic-store")
    log = tmp_path_factory.mktemp("anthropic-log") / "server.log"
    with Server(tiny_model_dir, folder, log) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: Server) -> Any:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)


def two_marks(system: str, user: str) -> dict[str, Any]:
    """A request with a 1h mark on its system prompt and a 5m mark on its question."""
    return {"model": MODEL_NAME, "max_tokens": 4, "extra_body": {"temperature": 0},
            "system": [{"type": "text", "text": system, "cache_control": HOUR}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": user, "cache_control": FIVE}]}]}


def logged(server: Server, prompt: int) -> Any:
    """The request log's finished row of the (one) request with ``prompt`` tokens."""
    def done(rows: list[Any]) -> bool:
        return any(r.prompt_tokens == prompt and complete(r) for r in rows)
    return next(r for r in log_rows(server.folder, done) if r.prompt_tokens == prompt)


def stored_ends(server: Server) -> set[int]:
    """The token counts of the server's snapshots (each lands after its answer)."""
    with SnapshotStore(server.folder) as store:
        return {s.n_tokens for s in store.snapshots()}


def split(usage: Any) -> tuple[int, int]:
    """(5m, 1h) of a usage's ``cache_creation``, parsed as the SDK's type."""
    raw = usage.cache_creation
    creation = raw if isinstance(raw, CacheCreation) else CacheCreation.model_validate(raw)
    return creation.ephemeral_5m_input_tokens, creation.ephemeral_1h_input_tokens


def counts(usage: Any) -> Counts:
    return (usage.input_tokens, usage.cache_read_input_tokens,
            usage.cache_creation_input_tokens, split(usage))


Counts = tuple[int, int, int, tuple[int, int]]


def expected_two_marks(system: str, user: str) -> tuple[int, Counts]:
    """The prompt's length and its first answer's usage, counted by hand: the 1h
    mark ends after the system prompt's frame (the placeholder message that
    stands in for the question differs from its first character), the 5m mark
    is the whole prompt; each writes what it saves above the one before: the 1h
    mark to itself, the 5m mark, in the prompt's last block, its whole blocks."""
    hour = len(system) + SYSTEM_FRAME
    prompt = hour + len(user) + USER_FRAME
    assert block_end(hour) <= prompt  # the 1h mark is exact
    written = saved(prompt, prompt)
    return prompt, (prompt - written, 0, written, (written - hour, hour))


def test_cache_creation_splits_a_whole_answers_writes_by_ttl(served: Server, client: Any) -> None:
    system, user = system_prompt(31, 300), "delta: the first question, kept five minutes"
    prompt, expected = expected_two_marks(system, user)
    answer = client.messages.create(**two_marks(system, user))
    assert isinstance(answer, Message) and isinstance(answer.usage, Usage)
    assert counts(answer.usage) == expected
    assert isinstance(answer.usage.cache_creation, CacheCreation)
    row = logged(served, prompt)
    _five, hour = expected[3]
    assert row.written_tokens == expected[2]
    assert row.written_by_ttl == {"3600": hour, "300": expected[2] - hour}
    assert row.breakpoints == (len(system) + SYSTEM_FRAME, prompt)


def test_cache_creation_is_exact_at_message_start_and_in_the_last_delta(client: Any) -> None:
    system, user = system_prompt(32, 330), "echo: streamed this time, for the split"
    _prompt, expected = expected_two_marks(system, user)
    started: list[Any] = []
    deltas: list[Any] = []
    with client.messages.stream(**two_marks(system, user)) as stream:
        for event in stream:
            if event.type == "message_start":
                started.append(event.message.usage)
            elif event.type == "message_delta":
                deltas.append(event.usage)
        final = stream.get_final_message()
    assert len(started) == 1 and len(deltas) == 1
    assert counts(started[0]) == expected
    # The SDK's delta type has no cache_creation field: it is kept as an extra one.
    delta = deltas[0]
    assert (delta.input_tokens, delta.cache_read_input_tokens,
            delta.cache_creation_input_tokens) == expected[:3]
    assert split(delta) == expected[3]
    assert counts(final.usage) == expected
    assert final.usage.output_tokens == delta.output_tokens > 0


def test_a_prewarm_writes_and_a_real_request_reads_it(served: Server, client: Any) -> None:
    system, user = system_prompt(33, 300), "foxtrot: warm this, answer nothing"
    prompt, expected = expected_two_marks(system, user)
    warm = client.messages.create(**{**two_marks(system, user), "max_tokens": 0})
    assert isinstance(warm, Message)
    assert (warm.content, warm.stop_reason, warm.stop_sequence) == ([], "max_tokens", None)
    assert counts(warm.usage) == expected and warm.usage.output_tokens == 0
    # The breakpoint's snapshot and the prompt end's land in either order.
    wait_for(lambda: expected[2] in stored_ends(served))
    # 1867 tokens of another conversation push the warmed blocks out of vLLM's cache.
    client.messages.create(model=MODEL_NAME, max_tokens=4, extra_body={"temperature": 0},
                           messages=[{"role": "user", "content": system_prompt(34, 1860)}])
    question = "golf: now the real question"
    real = client.messages.create(**two_marks(system, question))
    hour = len(system) + SYSTEM_FRAME  # shared with the pre-warm: the system prompt
    real_prompt = hour + len(question) + USER_FRAME
    written = whole(real_prompt) - hour  # the 1h mark is read, inside its block
    assert counts(real.usage) == (real_prompt - whole(real_prompt), hour, written,
                                  (written, 0))
    assert real.usage.output_tokens > 0 and real.content
    row = logged(served, real_prompt)
    assert row.restored_tokens and row.restored_tokens > 0, row  # read from the snapshot
    assert row.live_tokens + row.restored_tokens == hour
    assert row.written_by_ttl == {"300": written}
    warm_row = logged(served, prompt)
    assert warm_row.output_tokens == 1  # what the engine really computed


@pytest.mark.parametrize(("extra", "why"), [
    ({"stream": True}, "stream: true"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking enabled"),
    ({"tools": [{"name": "find", "input_schema": {"type": "object", "properties": {}}}],
      "tool_choice": {"type": "tool", "name": "find"}}, "tool_choice of type 'tool'"),
    ({"tools": [{"name": "find", "input_schema": {"type": "object", "properties": {}}}],
      "tool_choice": {"type": "any"}}, "tool_choice of type 'any'"),
], ids=["stream", "thinking", "forced-tool", "any-tool"])
def test_a_prewarm_refusal_is_a_bad_request(served: Server, client: Any,
                                            extra: dict[str, Any], why: str) -> None:
    body = {**two_marks(system_prompt(35, 200), "hotel: refused"), "max_tokens": 0, **extra}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**body)
    assert caught.value.status_code == 400
    assert why in caught.value.message and "max_tokens: 0" in caught.value.message
    error = caught.value.body["error"] if isinstance(caught.value.body, dict) else {}
    assert error.get("type") == "invalid_request_error"


def tool_turns(inner: list[str], last: str) -> list[dict[str, Any]]:
    """A question, a tool call, and its result (blocks ``inner``, the second marked)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": t} for t in inner]
    blocks[1]["cache_control"] = FIVE
    return [{"role": "user", "content": "look it up"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "call_1", "name": "find", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": [
                    *blocks, {"type": "text", "text": last}]}]}]


def tool_mark_position(inner: list[str]) -> int:
    """Where the mark inside the tool result ends, counted by hand: vLLM renders the
    result as a ``tool`` message (role text ``<|tool|>``, 8 plain tokens) whose
    text is the blocks joined by newlines; the cut ends after block 1's text."""
    before = 3 + len("look it up") + 2  # <bos> <|user|> \n ... <|end|> \n
    before += 2 + len("calling") + 2  # <|assistant|> \n ... <|end|> \n
    before += len("<|tool|>") + 1  # <|tool|> \n
    return before + len(inner[0]) + 1 + len(inner[1])


def test_a_mark_inside_a_tool_result_writes_and_is_read_back(served: Server,
                                                            client: Any) -> None:
    inner = [system_prompt(36, 200), system_prompt(37, 120)]
    at = tool_mark_position(inner)
    first_last = "india: the rest of the result"
    first = client.messages.create(model=MODEL_NAME, max_tokens=4,
                                   extra_body={"temperature": 0},
                                   messages=tool_turns([*inner], first_last))
    prompt = at + 1 + len(first_last) + 1 + 1 + 2  # \n last <|end|> \n <|assistant|> \n
    assert block_end(at) <= prompt  # the mark is exact
    assert counts(first.usage) == (prompt - at, 0, at, (at, 0))
    row = logged(served, prompt)
    assert row.breakpoints == (at,)
    wait_for(lambda: block_end(at) in stored_ends(served))  # published after the answer
    # The same result up to the mark, another block after it: the prefix is read.
    second_last = "juliet: another ending"
    second = client.messages.create(model=MODEL_NAME, max_tokens=4,
                                    extra_body={"temperature": 0},
                                    messages=tool_turns([*inner], second_last))
    prompt2 = at + 1 + len(second_last) + 4
    # Read to the mark and the newline after it, which the stored block shares;
    # here the mark is in the prompt's last block: its whole blocks, stored.
    assert block_end(at) > prompt2
    assert counts(second.usage) == (prompt2 - at - 1, at + 1, 0, (0, 0))


def test_a_top_level_mark_must_agree_with_the_marked_last_block(client: Any) -> None:
    body = {**two_marks(system_prompt(38, 200), "kilo: agree"), "max_tokens": 4}
    body["messages"][0]["content"][0]["cache_control"] = HOUR
    extra = body.pop("extra_body")
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**body, extra_body={**extra, "cache_control": FIVE})
    assert "same ttl" in caught.value.message
    # The same ttl: a no-op, one breakpoint.
    same = client.messages.create(**body, extra_body={**extra, "cache_control": HOUR})
    assert isinstance(same, Message) and same.usage.cache_creation_input_tokens is not None
