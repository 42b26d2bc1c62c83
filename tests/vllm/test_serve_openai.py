"""OpenAI prompt caching on ``sparkcache serve`` and real vLLM, through the ``openai`` client.

One server (``served``) runs the tests in file order: a chat breakpoint on a
long system text part writes its prefix (``cache_write_tokens``, rounded down
to whole KV blocks) and another question under it reads it
(``cached_tokens``), whole and streamed; a Responses breakpoint with a 12-hour
ttl reports the write in ``ttl_12h_tokens``; explicit mode without a
breakpoint writes nothing to the store; a Responses prewarm writes and
answers nothing; and every malformed field is a 400 naming its ``param``.

The token positions are counted by hand from the texts
(:data:`serve_helpers.SYSTEM_FRAME`): a cut after the system message renders
``<bos><|system|>\\n{text}<|end|>\\n`` and then the generation prompt, so it
agrees with the whole prompt for ``len(text) + SYSTEM_FRAME - 2`` tokens.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import (
    MODEL_NAME,
    SYSTEM_FRAME,
    USER_FRAME,
    Server,
    block_end,
    newest_rows,
    settled_snapshots,
    system_prompt,
    wait_for,
    whole,
)
from tiny_model import NEEDS_VLLM

from sparkcache.store import SnapshotStore

pytestmark = NEEDS_VLLM

openai = pytest.importorskip("openai")

#: Tokens of a cut after the system message that agree with the whole prompt.
CUT_FRAME = SYSTEM_FRAME - 2


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-openai-log") / "server.log"
    with Server(tiny_model_dir, tmp_path_factory.mktemp("serve-openai-store"), log) as server:
        yield server


def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def marked(text: str, **mark: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text,
             "prompt_cache_breakpoint": {"mode": "explicit", **mark}}]


def chat(server: Server, system: str, user: str, **extra: Any) -> Any:
    return client(server).chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": marked(system)},
                  {"role": "user", "content": user}], **extra)


def snapshots(server: Server) -> set[int]:
    with SnapshotStore(server.folder) as store:
        return {s.id for s in store.snapshots()}


def keep_leases(server: Server, until: Callable[[dict[int, float]], bool]) -> dict[int, float]:
    """Snapshot tokens -> the longest keep lease on it, in seconds (the index's
    ``leases`` table, docs/index.md); polled until ``until`` holds (a
    breakpoint's snapshot is published just after its step)."""
    deadline = time.monotonic() + 20
    while True:
        with sqlite3.connect(server.folder / "index.sqlite") as db:
            rows = db.execute("SELECT s.n_tokens, MAX(l.expires_at - l.created_at) FROM leases l "
                              "JOIN snapshots s ON s.id = l.snapshot_id WHERE l.kind = 'keep' "
                              "GROUP BY s.n_tokens").fetchall()
        found = {int(n): float(seconds) for n, seconds in rows}
        if until(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_chat_breakpoint_writes_its_prefix_and_another_question_reads_it(
        served: Server) -> None:
    system = system_prompt(31, 690)
    boundary = len(system) + CUT_FRAME  # 695: inside the block 672-704
    first = chat(served, system, "alpha: what now?",
                 prompt_cache_options={"mode": "explicit"})
    prompt = len(system) + SYSTEM_FRAME + len("alpha: what now?") + USER_FRAME
    assert block_end(boundary) <= prompt  # the prompt fills that block: exact
    usage = first.usage
    assert isinstance(usage, openai.types.CompletionUsage)
    assert usage.prompt_tokens == prompt and usage.completion_tokens == 4
    details = usage.prompt_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (0, boundary)
    assert usage.prompt_tokens - details.cached_tokens - details.cache_write_tokens == \
        prompt - boundary  # the guide's formula: what was computed, not cached
    second = chat(served, system, "bravo: and then?", prompt_cache_options={"mode": "explicit"})
    details = second.usage.prompt_tokens_details
    # Read to the breakpoint and the 2 frame tokens after it that the stored
    # block shares (the cut's frame ends differently); it is stored already.
    shared = len(system) + SYSTEM_FRAME
    assert (details.cached_tokens, details.cache_write_tokens) == (shared, 0)
    rows = newest_rows(served.folder, second.usage.prompt_tokens, prompt)
    assert [(r.api, r.written_tokens, r.breakpoints) for r in rows] == \
        [("chat", 0, (boundary,)), ("chat", boundary, (boundary,))]


def test_implicit_mode_also_writes_the_prompt_end_and_a_stream_reports_it(
        served: Server) -> None:
    system = system_prompt(32, 500)
    user = "charlie: stream it please"
    prompt = len(system) + SYSTEM_FRAME + len(user) + USER_FRAME
    chunks = list(client(served).chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": marked(system)},
                  {"role": "user", "content": user}]))
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.prompt_tokens == prompt
    # The breakpoint's blocks and the implicit breakpoint's (the prompt's end): all new.
    assert (usage.prompt_tokens_details.cached_tokens,
            usage.prompt_tokens_details.cache_write_tokens) == (0, whole(prompt))
    row, = newest_rows(served.folder, prompt)
    assert row.breakpoints == (len(system) + CUT_FRAME, prompt)
    # One prefill step passed both: one snapshot to the prompt's end (the
    # breakpoint an alias inside it), kept the request's ttl, 30 minutes.
    kept = keep_leases(served, lambda k: whole(prompt) in k)
    assert 1799 < kept[whole(prompt)] <= 1800
    assert whole(len(system) + CUT_FRAME) not in kept


def test_retention_24h_keeps_every_breakpoint_a_day(served: Server) -> None:
    system = system_prompt(37, 520)
    user = "hotel: keep it long"
    prompt = len(system) + SYSTEM_FRAME + len(user) + USER_FRAME
    answer = chat(served, system, user, prompt_cache_retention="24h")
    assert answer.usage.prompt_tokens_details.cache_write_tokens == whole(prompt)
    kept = keep_leases(served, lambda k: whole(prompt) in k)
    assert 86399 < kept[whole(prompt)] <= 86400


def test_completions_report_cache_write_tokens(served: Server) -> None:
    text = system_prompt(38, 300)
    done = client(served).completions.create(model=MODEL_NAME, prompt=text, max_tokens=4,
                                             temperature=0)
    details = done.usage.prompt_tokens_details
    # Automatic caching: saved when it finishes, no breakpoint wrote anything.
    assert (done.usage.prompt_tokens, details.cached_tokens, details.cache_write_tokens) == \
        (len(text), 0, 0)  # no template, no special token


def test_a_responses_breakpoint_with_a_12h_ttl_is_split_by_ttl(served: Server) -> None:
    text = system_prompt(33, 640)
    boundary = len(text) + CUT_FRAME  # in the prompt's last block: whole blocks
    api = client(served).responses

    def ask(question: str) -> Any:
        return api.create(
            model=MODEL_NAME, max_output_tokens=4, temperature=0,
            prompt_cache_options={"mode": "explicit", "ttl": "12h"},
            input=[{"role": "system", "content": [
                        {"type": "input_text", "text": text,
                         "prompt_cache_breakpoint": {"mode": "explicit"}}]},
                   {"role": "user", "content": question}])

    first = ask("delta: why?")
    assert isinstance(first, openai.types.responses.Response)
    usage = first.usage
    prompt = len(text) + SYSTEM_FRAME + len("delta: why?") + USER_FRAME
    assert usage.input_tokens == prompt and block_end(boundary) > prompt
    details = usage.input_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (0, whole(boundary))
    assert (details.cache_write_tokens_details.ttl_30m_tokens,
            details.cache_write_tokens_details.ttl_12h_tokens) == (0, whole(boundary))
    again = ask("echo: how?").usage.input_tokens_details
    assert (again.cached_tokens, again.cache_write_tokens) == (whole(boundary), 0)
    assert (again.cache_write_tokens_details.ttl_30m_tokens,
            again.cache_write_tokens_details.ttl_12h_tokens) == (0, 0)
    assert 43199 < keep_leases(served, lambda k: whole(boundary) in k)[whole(boundary)] <= 43200


def test_a_streamed_response_reports_the_write_in_response_completed(served: Server) -> None:
    text = system_prompt(39, 450)
    boundary = len(text) + CUT_FRAME
    events = list(client(served).responses.create(
        model=MODEL_NAME, max_output_tokens=4, temperature=0, stream=True,
        prompt_cache_options={"mode": "explicit"},
        input=[{"role": "system", "content": [
                    {"type": "input_text", "text": text,
                     "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
               {"role": "user", "content": "india?"}]))
    (done,) = [e for e in events if e.type == "response.completed"]
    details = done.response.usage.input_tokens_details
    assert done.response.usage.input_tokens == len(text) + SYSTEM_FRAME + len("india?") + \
        USER_FRAME
    assert (details.cached_tokens, details.cache_write_tokens) == (0, whole(boundary))
    # The one breakpoint's ttl, 12h (the request's own is 30m).
    assert (details.cache_write_tokens_details.ttl_30m_tokens,
            details.cache_write_tokens_details.ttl_12h_tokens) == (0, whole(boundary))


def test_explicit_mode_without_a_breakpoint_writes_nothing(served: Server) -> None:
    text = system_prompt(34, 400)
    before = settled_snapshots(served.folder)  # the earlier tests' writes landed
    answer = client(served).chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": text}],
        prompt_cache_options={"mode": "explicit"})
    assert answer.usage.prompt_tokens_details.cache_write_tokens == 0
    row, = newest_rows(served.folder, answer.usage.prompt_tokens)
    assert (row.restored_tokens, row.written_tokens) == (0, 0)
    assert settled_snapshots(served.folder) == before  # not even at the finish
    # The same kind of request without the option is saved when it finishes.
    client(served).chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": system_prompt(35, 400)}])
    wait_for(lambda: len(snapshots(served)) > len(before))


def test_a_prewarm_writes_the_breakpoints_and_generates_nothing(served: Server) -> None:
    text = system_prompt(36, 600)
    boundary = len(text) + CUT_FRAME  # 605: inside the block 576-608
    api = client(served).responses
    system = {"role": "system", "content": [
        {"type": "input_text", "text": text, "prompt_cache_breakpoint": {"mode": "explicit"}}]}
    warm = api.create(model=MODEL_NAME, temperature=0,
                      prompt_cache_options={"mode": "explicit", "prewarm": True},
                      input=[system, {"role": "user", "content": "foxtrot?"}])
    assert isinstance(warm, openai.types.responses.Response)
    assert warm.status == "completed" and warm.output == [] and warm.incomplete_details is None
    prompt = len(text) + SYSTEM_FRAME + len("foxtrot?") + USER_FRAME
    usage = warm.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (prompt, 0, prompt)
    assert block_end(boundary) <= prompt  # the prompt fills that block: exact
    assert usage.input_tokens_details.cache_write_tokens == boundary
    assert usage.input_tokens_details.cache_write_tokens_details.ttl_30m_tokens == boundary
    after = api.create(model=MODEL_NAME, temperature=0, max_output_tokens=4,
                       input=[{"role": "system", "content": text},
                              {"role": "user", "content": "golf?"}])
    # Read to the breakpoint and the 2 frame tokens after it that the stored block shares.
    assert after.usage.input_tokens_details.cached_tokens == len(text) + SYSTEM_FRAME
    assert after.usage.output_tokens == 4


BAD = [
    ("chat", {"prompt_cache_options": {"ttl": "12h"}}, "prompt_cache_options.ttl"),
    ("chat", {"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options.mode"),
    ("chat", {"prompt_cache_options": "explicit"}, "prompt_cache_options"),
    ("chat", {"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
    ("chat", {"prompt_cache_retention": "48h"}, "prompt_cache_retention"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"ttl": "30m"}}]}]},
     "messages[0].content[0].prompt_cache_breakpoint.mode"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit",
                                                                   "ttl": "1h"}}]}]},
     "messages[0].content[0].prompt_cache_breakpoint.ttl"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "no", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]},
     "messages[1].content[0].prompt_cache_breakpoint"),
    ("responses", {"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
    ("responses", {"prompt_cache_options": {"prewarm": "yes"}}, "prompt_cache_options.prewarm"),
    ("responses", {"prompt_cache_options": {"comparison_response_id": 7}},
     "prompt_cache_options.comparison_response_id"),
    ("responses", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ("responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi", "prompt_cache_breakpoint": "yes"}]}]},
     "input[0].content[0].prompt_cache_breakpoint"),
]


@pytest.mark.parametrize(("api", "extra", "param"), BAD, ids=[p for _, _, p in BAD])
def test_a_malformed_caching_field_is_a_400_naming_it(served: Server, api: str,
                                                      extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if api == "chat":
            client(served).chat.completions.create(
                model=MODEL_NAME, max_tokens=4,
                **{"messages": [{"role": "user", "content": "hi"}], **extra})
        else:
            client(served).responses.create(
                model=MODEL_NAME, max_output_tokens=4, **{"input": "hi", **extra})
    assert caught.value.status_code == 400
    assert caught.value.param == param, caught.value.message
