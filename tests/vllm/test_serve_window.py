"""``sparkcache serve`` with a sliding-window model: a ``cache_control`` breakpoint end to end.

The model is the tiny random Gemma-3 of test_hybrid_models.py
(:data:`random_models.GEMMA3`: a 64-token sliding window on layers 0 and 2,
full attention on 1 and 3), so vLLM runs its hybrid KV cache manager with two
KV cache groups, and a snapshot holds the sliding-window layers only at its
end.  Three server processes share one store, one after the other:

1. *A* (a fresh store) answers question 1 after a ~600-token system prompt
   marked ``cache_control``: usage says the whole blocks up to the breakpoint
   were written, and the store holds a snapshot ending there, with the
   sliding window in its identity.  A also answers question 2 under a cache
   salt (nothing shared, nothing restored: vLLM computes it all) - the
   reference answer - and question 1 after another system prompt, unmarked.
2. *B*, started after A stopped (a restart: vLLM's live prefix cache is
   empty), answers question 2 under the marked system prompt: it reads the
   breakpoint's blocks, restored from disk (the request log's
   ``restored_tokens``), and answers as A computed it.  Question 2 after the
   unmarked system prompt restores nothing: A's snapshots of it end in
   question 1 and after A's answer, and a sliding-window snapshot restores
   only at its end.
3. *C*, with restored pages scrambled after verification
   (``SPARKCACHE_TEST_FAULT=flip-restored``), answers question 2 again,
   restoring the snapshot of its prompt that B saved, and must answer
   differently: the comparison in 2 can fail.

The tokenizer and chat template are the tests' own (see serve_helpers): the
token counts are by hand, and checked against vLLM's ``/tokenize``.
No server may log vLLM's "Turning off hybrid kv cache manager".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from random_models import GEMMA3, WINDOW, build_model
from serve_helpers import (
    MODEL_NAME,
    SYSTEM_FRAME,
    USER_FRAME,
    Server,
    ask,
    last_seq,
    requests,
    settled_snapshots,
    system_prompt,
    usage,
    whole,
)
from tiny_model import BLOCK_SIZE, MISSING, NEEDS_VLLM

from sparkcache.catalog import model_identity
from sparkcache.connector.worker import FAULT_ENV
from sparkcache.store import SnapshotStore

pytestmark = NEEDS_VLLM

anthropic = pytest.importorskip("anthropic")

#: vLLM's hybrid manager draws both groups' blocks from one pool and counts it
#: as blocks x 32 / 2 groups tokens: a 2048-token request needs more than 128
#: blocks (with serve_helpers' 65 vLLM refuses to start: at most 992 tokens).
CACHE_BLOCKS = 140
HMA_WARNING = "Turning off hybrid kv cache manager"
MAX_TOKENS = 12
SYSTEM = system_prompt(11, 600)
#: The breakpoint: the system prompt and its frame up to the user's text.
BOUNDARY = len(SYSTEM) + SYSTEM_FRAME
Q1 = "alpha: what is the plan?"
#: 20 characters: question 2's prompt (631 tokens) and its answer end past the
#: next block boundary, so the snapshot B saves when it finishes (640 tokens)
#: is not a prefix of that prompt; B also saves the prompt's last whole block
#: (608 tokens: a sliding-window request saves its prompt), which C restores.
Q2 = "bravo: what is next?"
#: Another system prompt, never marked.
UNMARKED = system_prompt(12, 600)


def prompt_tokens(user: str, system: str = SYSTEM) -> int:
    """The prompt's tokens, counted by hand (serve_helpers.SYSTEM_FRAME)."""
    return len(system) + SYSTEM_FRAME + len(user) + USER_FRAME


def tokenized(server: Server, user: str) -> int:
    """The prompt's length as vLLM's own renderer counts it (its /tokenize)."""
    status, answer = server.post("/tokenize", {
        "model": MODEL_NAME, "add_generation_prompt": True,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": user}]})
    assert status == 200, answer
    return int(answer["count"])


def client(server: Server) -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def ask_unmarked(server: Server, system: str, user: str, **extra: str) -> Any:
    """``user`` after ``system`` without ``cache_control``; ``extra``: more of
    vLLM's request fields (``cache_salt``)."""
    return client(server).messages.create(
        model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body={"temperature": 0, **extra},
        system=[{"type": "text", "text": system}], messages=[{"role": "user", "content": user}])


def text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def new_row(folder: Path, after: int, timeout: float = 10.0) -> Any:
    """The one request logged after row ``after``, once the connector and the
    server have both written their parts."""
    deadline = time.monotonic() + timeout
    while True:
        with SnapshotStore(folder) as store:
            rows = requests(store, after_seq=after, limit=10)
        done = [r for r in rows if r.status is not None and r.restored_tokens is not None]
        if done or time.monotonic() > deadline:
            assert len(rows) == 1 and done, rows
            return done[0]
        time.sleep(0.05)


def start(gemma_dir: Path, store_dir: Path, log: Path, **env: str) -> Server:
    return Server(gemma_dir, store_dir, log, env=env or None, cache_blocks=CACHE_BLOCKS)


def assert_hybrid_manager_on(log: Path) -> None:
    assert HMA_WARNING not in log.read_text(errors="replace"), log


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if MISSING:
        pytest.skip(f"needs {', '.join(MISSING)}")
    return build_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3_text", **GEMMA3)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-window-store")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-window-logs")


@pytest.fixture(scope="module")
def server_a(gemma_dir: Path, store_dir: Path, logs: Path) -> dict[str, Any]:
    """Server A's answers (it is stopped when this returns)."""
    with start(gemma_dir, store_dir, logs / "a.log") as server:
        counted = {user: tokenized(server, user) for user in (Q1, Q2)}
        first = ask(client(server), SYSTEM, Q1, max_tokens=MAX_TOKENS)
        first_row = new_row(store_dir, 0)
        seq = last_seq(store_dir)
        # Question 2 computed from scratch: a cache salt shares nothing.
        reference = ask_unmarked(server, SYSTEM, Q2, cache_salt="reference")
        reference_row = new_row(store_dir, seq)
        ask_unmarked(server, UNMARKED, Q1)
        # The answers' snapshots are written after they went out: let the last
        # one land before the stop (a save kept through a stop is test_serve's).
        settled_snapshots(store_dir)
    with SnapshotStore(store_dir) as store:
        ends = sorted(s.n_tokens for s in store.snapshots())
    return {"counted": counted, "first": first, "first_row": first_row,
            "reference": reference, "reference_row": reference_row, "ends": ends}


@pytest.fixture(scope="module")
def server_b(server_a: dict[str, Any], gemma_dir: Path, store_dir: Path,
             logs: Path) -> dict[str, Any]:
    """Server B (a restart on A's store) answers question 2."""
    seq = last_seq(store_dir)
    with start(gemma_dir, store_dir, logs / "b.log") as server:
        after = ask(client(server), SYSTEM, Q2, max_tokens=MAX_TOKENS)
        row = new_row(store_dir, seq)
        seq = last_seq(store_dir)
        unmarked = ask_unmarked(server, UNMARKED, Q2)
        unmarked_row = new_row(store_dir, seq)
    return {"answer": after, "row": row, "unmarked": unmarked, "unmarked_row": unmarked_row}


def test_a_breakpoint_on_a_sliding_window_model_is_a_snapshot_ending_there(
        server_a: dict[str, Any], store_dir: Path, logs: Path) -> None:
    assert_hybrid_manager_on(logs / "a.log")
    # The hand count is vLLM's own: the template frames the texts as counted.
    assert server_a["counted"] == {Q1: prompt_tokens(Q1), Q2: prompt_tokens(Q2)}
    first = server_a["first"]
    prompt = prompt_tokens(Q1)
    assert usage(first) == (prompt - whole(BOUNDARY), 0, whole(BOUNDARY))
    row = server_a["first_row"]
    assert (row.prompt_tokens, row.live_tokens, row.restored_tokens, row.written_tokens,
            row.breakpoints) == (prompt, 0, 0, whole(BOUNDARY), (BOUNDARY,)), row
    # Two snapshots per answer (its prompt's last whole block, 608 tokens, and
    # prompt and answer, 640) and the breakpoint's own, ending there.
    answered = whole(prompt_tokens(Q1) + MAX_TOKENS - 1)
    assert whole(prompt_tokens(Q2) + MAX_TOKENS - 1) == answered == 640
    prompt_ends = whole(prompt_tokens(Q1) - 1)
    assert whole(prompt_tokens(Q2) - 1) == prompt_ends == 608
    assert whole(BOUNDARY) == 576
    assert server_a["ends"] == [whole(BOUNDARY), *[prompt_ends] * 3, *[answered] * 3]
    with SnapshotStore(store_dir) as store:
        identity = model_identity(store._core, store.snapshots()[0].model_id)
    # The server ran the model with its sliding-window group: each sliding
    # layer's stored window is the blocks its 64-token window reaches.
    window = -(-(WINDOW - 1) // BLOCK_SIZE)
    assert identity.window_blocks == (window, 0, window, 0), identity
    reference = server_a["reference"]
    assert reference.usage.cache_read_input_tokens == 0
    assert server_a["reference_row"].restored_tokens == 0
    assert reference.usage.output_tokens == MAX_TOKENS
    assert len(set(text(reference))) > 1, "a degenerate model: one character throughout"


def test_a_restarted_server_restores_the_breakpoint_and_answers_as_computed(
        server_a: dict[str, Any], server_b: dict[str, Any], logs: Path) -> None:
    assert_hybrid_manager_on(logs / "b.log")
    after, row = server_b["answer"], server_b["row"]
    prompt = prompt_tokens(Q2)
    # Read from disk: vLLM's live prefix cache started empty.
    assert usage(after) == (prompt - whole(BOUNDARY), whole(BOUNDARY), 0)
    assert (row.prompt_tokens, row.live_tokens, row.restored_tokens, row.written_tokens) == (
        prompt, 0, whole(BOUNDARY), 0), row
    assert after.usage.output_tokens == MAX_TOKENS
    assert text(after) == text(server_a["reference"]), (text(after), server_a["reference"])


def test_without_a_breakpoint_another_question_restores_nothing(
        server_b: dict[str, Any]) -> None:
    """A sliding-window snapshot restores only at its end: the unmarked
    system prompt's snapshots (A stored them, see the first test) end in
    question 1 and after A's answer to it, so question 2 after the same
    system prompt shares no snapshot end."""
    assert usage(server_b["unmarked"]) == (prompt_tokens(Q2, UNMARKED), 0, 0)
    row = server_b["unmarked_row"]
    assert (row.live_tokens, row.restored_tokens) == (0, 0), row


def test_the_restart_comparison_catches_a_corrupted_restore(
        server_a: dict[str, Any], server_b: dict[str, Any], gemma_dir: Path,
        store_dir: Path, logs: Path) -> None:
    """The negative control: question 2 again, restoring what B stored of its
    prompt, its pages scrambled after verification (a test-only fault),
    answers differently."""
    seq = last_seq(store_dir)
    with start(gemma_dir, store_dir, logs / "c.log", **{FAULT_ENV: "flip-restored"}) as server:
        wrong = ask(client(server), SYSTEM, Q2, max_tokens=MAX_TOKENS)
        row = new_row(store_dir, seq)
    assert_hybrid_manager_on(logs / "c.log")
    stored = whole(prompt_tokens(Q2) - 1)
    assert usage(wrong)[1] == stored
    assert (row.live_tokens, row.restored_tokens) == (0, stored), row
    assert text(wrong) != text(server_a["reference"]), text(wrong)
