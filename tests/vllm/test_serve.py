"""``sparkcache serve`` on real vLLM, through the official ``anthropic`` and ``openai`` clients.

One server (``served``) runs the tests in file order: a bad ``cache_control``
is a 400; a breakpoint writes its prefix as a snapshot and the next request
reads it, with exact usage (whole answers and streamed ones); OpenAI requests
(chat completions, completions, responses) carry ``prompt_cache_key`` into
the request log; a conversation pushed out of
vLLM's 64-block live cache by another is restored, not lost; a second server
started on the same store (a restart) reads a breakpoint's prefix from disk
and answers as the first one did, and keeps its answer's snapshot when it is
stopped before the step carrying that save reached its worker; and the page,
in a real headless Chromium, clears the model's snapshots and their files.

The token positions below are counted by hand from the texts, not by the code
under test (:data:`serve_helpers.SYSTEM_FRAME`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import (
    MODEL_NAME,
    SYSTEM_FRAME,
    USER_FRAME,
    Server,
    ask,
    block_end,
    log_rows,
    newest_rows,
    settled_snapshots,
    system_prompt,
    usage,
    whole,
)
from tiny_model import NEEDS_VLLM

from sparkcache.serve import warmup
from sparkcache.store import SnapshotStore
from tests.browser import Browser, find_chromium, skip_reason

pytestmark = NEEDS_VLLM

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-store")


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, store_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-log") / "server-a.log"
    with Server(tiny_model_dir, store_dir, log) as server:
        yield server


def clients(server: Server) -> tuple[Any, Any]:
    return (anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0),
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))


def test_the_engine_is_warmed_up_before_the_first_request(served: Server) -> None:
    """The server's first request does not pay the engine's one-time set-up: a
    tiny request of its own ran at start, neither restored nor saved."""
    def warm(rows: list[Any]) -> list[Any]:
        return [r for r in rows if r.request_id.startswith(warmup.REQUEST_PREFIX)]

    # Its output tokens come with the connector's part of the row, written after.
    rows = log_rows(served.folder, until=lambda rows: any(
        r.output_tokens is not None for r in warm(rows)), warm_up=True)
    (first, *_), oldest = warm(rows)[::-1], min(rows, key=lambda r: r.seq)
    assert oldest.request_id == first.request_id, [r.request_id for r in rows]
    assert first.prompt_tokens == warmup.PROMPT_TOKENS and first.output_tokens == 1
    assert not first.restored_tokens and not first.written_tokens and first.api is None
    assert "engine warmed up" in served.log_path.read_text(errors="replace")


def test_bad_cache_control_is_a_400_that_says_what_is_wrong(served: Server) -> None:
    client, _ = clients(served)
    base = {"model": MODEL_NAME, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}]}
    cases = {
        "ttl": ({"type": "ephemeral", "ttl": "10m"}, "ttl must be one of"),
        "type": ({"type": "persistent"}, "type must be 'ephemeral'"),
        "shape": ("yes", "must be an object"),
    }
    for mark, expected in cases.values():
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(**base, system=[
                {"type": "text", "text": "be brief", "cache_control": mark}])
        assert expected in caught.value.message, caught.value.message
        assert "system[0]" in caught.value.message
    five = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
            for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**base, system=five)
    assert "at most 4" in caught.value.message and "found 5" in caught.value.message
    rows = [r for r in log_rows(served.folder, lambda rows: sum(r.status == 400 for r in rows) >= 4)
            if r.status == 400]
    assert len(rows) == 4 and all(r.api == "messages" for r in rows)


def test_a_breakpoint_writes_its_prefix_and_the_next_request_reads_it(served: Server) -> None:
    client, _ = clients(served)
    system = system_prompt(1, 700)
    boundary = len(system) + SYSTEM_FRAME  # the placeholder differs from the user text
    first = ask(client, system, "alpha: what is the plan?")
    prompt = len(system) + SYSTEM_FRAME + len("alpha: what is the plan?") + USER_FRAME
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens + \
        first.usage.cache_creation_input_tokens == prompt
    # The mark (707) is in the prompt's last block (704-736): its whole blocks.
    assert block_end(boundary) > prompt
    assert usage(first) == (prompt - whole(boundary), 0, whole(boundary))
    # Another question under the same system prompt: nothing written, and the
    # prefix read to the mark, from the first request's snapshot (its answer
    # filled the block holding the mark).
    second = ask(client, system, "bravo: and then?")
    prompt2 = len(system) + SYSTEM_FRAME + len("bravo: and then?") + USER_FRAME
    assert usage(second) == (prompt2 - boundary, boundary, 0)
    mine = newest_rows(served.folder, prompt2, prompt)
    assert sorted((r.prompt_tokens, r.written_tokens, r.breakpoints) for r in mine) == sorted(
        [(prompt, whole(boundary), (boundary,)), (prompt2, 0, (boundary,))])
    with SnapshotStore(served.folder) as store:
        assert whole(boundary) in {s.n_tokens for s in store.snapshots()}


def test_streamed_usage_is_exact_at_message_start_and_at_the_end(served: Server) -> None:
    client, _ = clients(served)
    system = system_prompt(2, 500)
    boundary = len(system) + SYSTEM_FRAME
    user = "charlie: stream it"
    prompt = len(system) + SYSTEM_FRAME + len(user) + USER_FRAME
    started: list[Any] = []
    with client.messages.stream(
            model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": user}]) as stream:
        for event in stream:
            if event.type == "message_start":
                started.append(event.message.usage)
        final = stream.get_final_message()
    assert len(started) == 1
    assert block_end(boundary) <= prompt  # the mark (507) is exact: the prompt fills 480-512
    expected = (prompt - boundary, 0, boundary)
    assert (started[0].input_tokens, started[0].cache_read_input_tokens,
            started[0].cache_creation_input_tokens) == expected
    assert usage(final) == expected and final.usage.output_tokens == 8
    # The same request again reads (at least) the prefix and writes nothing.
    again = ask(client, system, user)
    assert sum(usage(again)) == prompt
    assert usage(again)[1] >= boundary and usage(again)[2] == 0


def test_prompt_cache_key_is_accepted_and_logged(served: Server) -> None:
    _, client = clients(served)
    text = system_prompt(3, 300)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=4,
        temperature=0, prompt_cache_key="team-chat")
    assert chat.usage.prompt_tokens_details is not None
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=4,
        temperature=0, prompt_cache_key="team-chat")
    assert again.usage.prompt_tokens_details.cached_tokens >= whole(len(text))
    for _ in range(2):
        done = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4,
                                         temperature=0,
                                         extra_body={"prompt_cache_key": "team-cmpl"})
    assert done.usage.prompt_tokens_details.cached_tokens >= whole(len(text))
    for _ in range(2):
        answer = client.responses.create(model=MODEL_NAME, input=text, max_output_tokens=4,
                                         temperature=0, prompt_cache_key="team-resp")
    assert answer.usage.input_tokens_details.cached_tokens >= whole(len(text))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_cache_key": 42})
    assert "prompt_cache_key" in str(caught.value)
    expected = [("chat", "team-chat", 200)] * 2 + [("completions", "team-cmpl", 200)] * 2 + \
        [("responses", "team-resp", 200)] * 2

    def keyed(rows: list[Any]) -> list[tuple[Any, ...]]:
        return sorted((r.api, r.cache_key, r.status) for r in rows if r.cache_key)

    assert keyed(log_rows(served.folder, lambda rows: keyed(rows) == expected)) == expected
    with SnapshotStore(served.folder) as store:
        groups = {k.cache_key: k for k in store.requests_by_key()}
    assert groups["team-chat"].requests == 2 and groups["team-cmpl"].requests == 2
    assert groups["team-chat"].cached_tokens >= whole(len(text))


def test_a_conversation_pushed_out_of_the_live_cache_is_restored(served: Server) -> None:
    client, _ = clients(served)
    first_user = system_prompt(4, 1200)
    a = client.messages.create(model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": first_user}])
    # Its save landed (a finish save waits for a quiet moment, up to
    # MAX_WAIT_S): the next turn, sent once vLLM evicted it, reads it from the store.
    settled_snapshots(served.folder)
    # 1860 tokens of another conversation take 59 of the 64 blocks.
    client.messages.create(model=MODEL_NAME, max_tokens=4, extra_body={"temperature": 0},
                           messages=[{"role": "user", "content": system_prompt(5, 1860)}])
    answer = "".join(block.text for block in a.content if block.type == "text")
    nxt = client.messages.create(
        model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": first_user},
                  {"role": "assistant", "content": answer or "ok"},
                  {"role": "user", "content": "and next?"}])
    shared = 3 + len(first_user) + USER_FRAME  # up to A's answer
    assert nxt.usage.cache_read_input_tokens >= whole(shared)
    row, = newest_rows(served.folder, nxt.usage.input_tokens + nxt.usage.cache_read_input_tokens
                       + nxt.usage.cache_creation_input_tokens)
    assert row.restored_tokens > 0, row
    assert row.live_tokens + row.restored_tokens == nxt.usage.cache_read_input_tokens


def test_a_restarted_server_restores_a_breakpoint_and_answers_the_same(
        served: Server, tiny_model_dir: Path, store_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    system = system_prompt(1, 700)  # published by the breakpoint test above
    boundary = len(system) + SYSTEM_FRAME
    user = "delta: after a restart?"
    prompt = len(system) + SYSTEM_FRAME + len(user) + USER_FRAME
    log = tmp_path_factory.mktemp("serve-log") / "server-b.log"
    stored = len(settled_snapshots(store_dir))
    # The step that carries the answer's save reaches the worker two seconds
    # late (a test fault), so the stop below (SIGINT to every process, as a
    # Ctrl-C) reaches the worker first.
    with Server(tiny_model_dir, store_dir, log,
                env={"SPARKCACHE_TEST_FAULT": "slow-save-step"}) as fresh:
        after = ask(clients(fresh)[0], system, user, max_tokens=12)
    # Stopped right after answering: the worker ran the engine's last steps
    # (connector.signals), so the answer's snapshot was written before it exited.
    assert "died unexpectedly" not in log.read_text()
    with SnapshotStore(store_dir) as store:
        assert len(store.snapshots()) == stored + 1
    # Read to the mark, from the snapshot of the first request and its answer.
    assert usage(after) == (prompt - boundary, boundary, 0)
    row, = newest_rows(store_dir, prompt)
    assert (row.live_tokens, row.restored_tokens) == (0, boundary), row
    # The same request computed from scratch (a cache salt shares nothing).
    mark = {"type": "ephemeral"}
    computed = clients(served)[0].messages.create(
        model=MODEL_NAME, max_tokens=12, extra_body={"temperature": 0, "cache_salt": "fresh"},
        system=[{"type": "text", "text": system, "cache_control": mark}],
        messages=[{"role": "user", "content": user}])
    assert computed.usage.cache_read_input_tokens == 0
    assert after.content[0].text == computed.content[0].text


def test_the_restart_comparison_catches_a_corrupted_restore(
        served: Server, tiny_model_dir: Path, store_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The negative control of the test above: a server whose restored pages are
    scrambled after verification (a test-only fault) answers differently."""
    system = system_prompt(1, 700)
    user = "echo: corrupted?"
    log = tmp_path_factory.mktemp("serve-log") / "server-c.log"
    with Server(tiny_model_dir, store_dir, log,
                env={"SPARKCACHE_TEST_FAULT": "flip-restored"}) as faulty:
        wrong = ask(clients(faulty)[0], system, user, max_tokens=12)
        assert wrong.usage.cache_read_input_tokens >= 704  # it did restore
    computed = clients(served)[0].messages.create(
        model=MODEL_NAME, max_tokens=12, extra_body={"temperature": 0, "cache_salt": "fresh"},
        system=[{"type": "text", "text": system}], messages=[{"role": "user", "content": user}])
    assert wrong.content[0].text != computed.content[0].text


def test_the_page_clears_snapshots_in_a_browser(served: Server, tmp_path: Path) -> None:
    if find_chromium() is None:
        pytest.skip(skip_reason())
    settled_snapshots(served.folder)  # the tests above: their last saves landed first
    with SnapshotStore(served.folder) as store:
        before = store.snapshots()
    assert before, "the tests above published snapshots"
    objects = served.folder / "objects"
    assert any(p.is_file() for p in objects.rglob("*"))
    with Browser() as browser:
        browser.open(served.url + "/sparkcache")
        text = browser.text()
        assert "Clear KV snapshots" in text
        assert str(before[0].n_tokens) in text
        assert "Latest requests" in text and "team-resp" in text
        shot = tmp_path / "serve-page.png"
        browser.screenshot(shot, width=1100)
        if os.environ.get("SPARKCACHE_UPDATE_DOCS"):
            (ROOT / "docs" / "serve-page.png").write_bytes(shot.read_bytes())
        model_id = before[0].model_id
        browser.click(f"#clear-{model_id}")
        after = browser.text()
    assert "Cleared" in after and "No snapshots." in after, after
    with SnapshotStore(served.folder) as store:
        assert store.snapshots() == []
    assert not any(p.is_file() for p in objects.rglob("*")), list(objects.rglob("*"))
    # The next request after a clear is computed and stored again.
    client, _ = clients(served)
    again = ask(client, system_prompt(1, 700), "echo: from scratch")
    assert again.usage.cache_read_input_tokens == 0, usage(again)
