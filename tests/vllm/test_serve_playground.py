"""The ``/sparkcache`` playground and charts in a real headless Chromium, on real vLLM.

One server with an admin token and vLLM's ``--api-key``: the browser logs in
with the token's form, types a system prompt marked ``cache_control`` and two
turns into the playground (JavaScript on: the page's script posts them), and
the second turn shows tokens read from the cache; each turn's numbers are the
request log's row for its answer.  Then a browser with JavaScript off does the
same with plain form posts and sees the charts drawn from those requests; its
page is the screenshot docs/serve.md shows (``SPARKCACHE_UPDATE_DOCS=1``
refreshes it).  A turn without the API key gets vLLM's 401.  Token counts are
counted by hand from the texts (:data:`serve_helpers.SYSTEM_FRAME`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import SYSTEM_FRAME, Server, saved, system_prompt, whole
from tiny_model import NEEDS_VLLM

from sparkcache.store import SnapshotStore
from tests.browser import Browser, find_chromium, skip_reason

pytestmark = NEEDS_VLLM

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "playground-admin"
KEY = "sk-playground"
SYSTEM = system_prompt(5, 300)
BOUNDARY = len(SYSTEM) + SYSTEM_FRAME  # the system prompt's end, where its mark writes
NUMBERS = """[...document.querySelectorAll('.turn')].map(t => ({
  cached: +t.querySelector('[data-cached-tokens]').dataset.cachedTokens,
  written: +t.querySelector('[data-written-tokens]').dataset.writtenTokens,
  input: +t.querySelector('[data-input-tokens]').dataset.inputTokens,
  live: +t.querySelector('[data-live-tokens]').dataset.liveTokens,
  disk: +t.querySelector('[data-disk-tokens]').dataset.diskTokens,
  tier: +t.querySelector('[data-tier-tokens]').dataset.tierTokens,
  ttft: t.querySelector('[data-ttft-ms]').dataset.ttftMs, id: t.dataset.answerId}))"""


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if find_chromium() is None:
        pytest.skip(skip_reason())
    folder = tmp_path_factory.mktemp("playground-store")
    log = tmp_path_factory.mktemp("playground-log") / "server.log"
    with Server(tiny_model_dir, folder, log, "--admin-token", TOKEN, "--api-key", KEY) as server:
        yield server


def login(browser: Browser, server: Server) -> None:
    browser.open(server.url + "/sparkcache")
    assert "needs the server's admin token" in browser.text()
    browser.type("input[name=token]", TOKEN)
    browser.click("form button")
    assert browser.evaluate("!!document.getElementById('playground')"), browser.text()


def send(browser: Browser, message: str, *, navigation: bool, system: str | None = None
         ) -> None:
    if system is not None:
        browser.type("#pg-system", system)
    browser.type("#pg-key", KEY)
    browser.type("#pg-message", message)
    browser.click("#pg-send", navigation=navigation)


def check_turns(server: Server, turns: list[dict[str, Any]], first: str) -> None:
    """Turn 1 wrote the marked system prompt (to its mark: the prompt fills the
    KV block holding it); turn 2 read it (and more, vLLM's live cache holding
    turn 1); each turn's numbers are its log row's."""
    prompt1 = BOUNDARY + len(first) + 4  # <|end|> \n <|assistant|> \n
    assert saved(BOUNDARY, prompt1) == BOUNDARY
    assert turns[0]["cached"] == 0 and turns[0]["written"] == BOUNDARY, turns
    assert turns[0]["input"] + turns[0]["written"] == prompt1, turns
    assert turns[1]["cached"] >= whole(prompt1) > 0 and turns[1]["written"] == 0, turns
    with SnapshotStore(server.folder) as store:
        rows = [store.request_by_answer(turn["id"]) for turn in turns]
    for turn, row in zip(turns, rows, strict=True):
        assert row is not None and row.api == "messages" and row.status == 200, turn
        restored, remote = row.restored_tokens or 0, row.remote_tokens or 0
        assert (turn["live"], turn["disk"], turn["tier"]) == (row.live_tokens,
                                                              restored - remote, remote), turn
        assert turn["cached"] == row.cached_tokens and turn["written"] == row.written_tokens
        assert row.ttft_s is not None and turn["ttft"] == f"{row.ttft_s * 1000:.0f} ms", turn


def test_two_turns_with_javascript_read_the_first_turns_cache(served: Server) -> None:
    with Browser(timeout=120) as browser:
        login(browser, served)
        first = "first: what is in the cache?"
        send(browser, first, system=SYSTEM, navigation=False)
        browser.wait_for("document.querySelectorAll('.turn').length === 1")
        assert browser.evaluate("location.pathname") == "/sparkcache"  # no page load
        send(browser, "second: and now?", navigation=False)
        browser.wait_for("document.querySelectorAll('.turn').length === 2")
        turns = browser.evaluate(NUMBERS)
        assert "failed" not in browser.evaluate(
            "document.querySelector('.pg-status').textContent")
    check_turns(served, turns, first)


def test_two_turns_without_javascript_and_the_charts(served: Server, tmp_path: Path) -> None:
    with Browser(timeout=120, width=1100) as browser:
        browser.scripts(False)
        login(browser, served)
        first = "third: a plain form this time"
        # Another system prompt: this conversation's turn 1 writes its own blocks.
        system = system_prompt(6, len(SYSTEM))  # differs from its first word on
        send(browser, first, system=system, navigation=True)
        send(browser, "fourth: and again?", navigation=True)
        assert browser.evaluate("location.pathname") == "/sparkcache/playground"
        turns = browser.evaluate(NUMBERS)
        assert len(turns) == 2
        check_turns(served, turns, first)
        charts = browser.evaluate("""[...document.querySelectorAll('svg[role=img]')].map(s =>
            [s.id, s.querySelector('title').textContent, s.querySelector('desc').textContent,
             s.getBoundingClientRect().width])""")
        names = [c[0].rsplit("-", 1)[0] for c in charts]
        assert names == ["chart-hits", "chart-tokens", "chart-store", "chart-ttft"], charts
        assert all(c[3] > 300 for c in charts), charts
        hits, tokens, _store, ttft = (c[2] for c in charts)
        assert "Hit rate per" in hits and "% overall" in hits, hits
        assert "restored from disk" in tokens and "computed" in tokens, tokens
        assert "Hits: median" in ttft and "Misses: median" in ttft, ttft
        text = browser.text()
        assert "Latest requests" in text and "cached" in text
        shot = tmp_path / "serve-playground.png"
        browser.screenshot(shot, width=1100)
        if os.environ.get("SPARKCACHE_UPDATE_DOCS"):
            (ROOT / "docs" / "serve-playground.png").write_bytes(shot.read_bytes())


def test_a_turn_without_vllms_key_shows_vllms_401(served: Server) -> None:
    """The turn is an API request like any other: without the --api-key, vLLM refuses it."""
    with Browser(timeout=120) as browser:
        login(browser, served)
        browser.type("#pg-message", "no key this time")
        browser.click("#pg-send", navigation=False)
        browser.wait_for("document.querySelectorAll('.turn').length === 1")
        turn = browser.evaluate("document.querySelector('.turn').textContent")
        assert browser.evaluate("document.querySelector('.turn').className") == "turn err"
    assert "the API answered 401" in turn and "cached" not in turn, turn
