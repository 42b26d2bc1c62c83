"""Diagnostics through the middleware, driven as an ASGI app over a real store.

vLLM's answer carries the connector's facts, so the client has it before the
connector's log writer commits them to the request's row.  A request naming that
answer must wait for them (the missed tokens are its prompt's), not call the
comparison ``unavailable``; one naming an answer that was an error does not wait.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from sparkcache import SnapshotStore

from .test_page_access import Server, server, stored

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")
from sparkcache.serve import middleware
from sparkcache.serve.diagnostics import BETA

pytestmark = pytest.mark.vllm
__all__ = ["server", "stored"]  # the fixtures this module uses

PROMPT = 57
FACTS = {"prompt_tokens": PROMPT, "live_tokens": 0, "restored_tokens": 0,
         "written_tokens": 0, "written_by_ttl": {}}
HEADERS = [("content-type", "application/json"), ("anthropic-beta", BETA)]


def _message(previous: str | None, system: str) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 4, "system": system,
                       "messages": [{"role": "user", "content": "tell me about rivers"}],
                       "diagnostics": {"previous_message_id": previous}}).encode()


def _answer(facts: dict[str, Any]) -> bytes:
    return json.dumps({
        "id": "msg_vllm", "type": "message", "role": "assistant", "model": "tiny",
        "content": [{"type": "text", "text": "x"}], "stop_reason": "max_tokens",
        "stop_sequence": None, "usage": {"input_tokens": PROMPT, "output_tokens": 1},
        "kv_transfer_params": {"sparkcache": facts}}).encode()


def _first(server: Server) -> tuple[str, str]:
    """Ask once; the answer's id and the row's request id (the connector's key)."""
    server.inner.answer = _answer(FACTS)
    r = server.call("POST", "/v1/messages", body=_message(None, "you are terse"),
                    headers=HEADERS)
    assert r.status == 200
    seen = json.loads(server.inner.calls[-1][1])
    return json.loads(r.body)["id"], seen["kv_transfer_params"]["sparkcache"]["id"]


def _write_later(server: Server, row: dict[str, Any], delay: float) -> threading.Thread:
    """The connector's log writer: the row's facts, committed ``delay`` s from now."""
    def write() -> None:
        time.sleep(delay)
        with SnapshotStore(server.folder) as store:
            store.log_requests([row], keep=100)
    thread = threading.Thread(target=write)
    thread.start()
    return thread


def test_a_comparison_waits_for_the_facts_of_the_answer_it_names(server: Server) -> None:
    answer_id, request_id = _first(server)
    with SnapshotStore(server.folder) as store:
        row = store.request_by_answer(answer_id)
    assert row is not None and row.fingerprint is not None and row.prompt_tokens is None
    writer = _write_later(server, {"request_id": request_id, **FACTS}, 0.4)
    started = time.monotonic()
    r = server.call("POST", "/v1/messages", body=_message(answer_id, "you are verbose"),
                    headers=HEADERS)
    writer.join()
    assert r.status == 200
    assert json.loads(r.body)["diagnostics"] == {"cache_miss_reason": {
        "type": "system_changed", "cache_missed_input_tokens": PROMPT}}
    assert time.monotonic() - started < middleware.PREVIOUS_WAIT_S


def test_an_answer_that_was_an_error_is_not_waited_for(server: Server,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    answer_id, request_id = _first(server)
    with SnapshotStore(server.folder) as store:  # as if vLLM had answered it with a 400
        store.log_requests([{"request_id": request_id, "status": 400}], keep=100)
    monkeypatch.setattr(middleware, "PREVIOUS_WAIT_S", 30.0)
    started = time.monotonic()
    r = server.call("POST", "/v1/messages", body=_message(answer_id, "you are verbose"),
                    headers=HEADERS)
    assert r.status == 200
    assert json.loads(r.body)["diagnostics"] == {"cache_miss_reason": {"type": "unavailable"}}
    assert time.monotonic() - started < 5.0
