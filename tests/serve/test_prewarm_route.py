"""A pre-warm through the middleware, driven as an ASGI app over a real store: vLLM
is sent one token, the client gets Anthropic's pre-warm answer; a streamed
pre-warm is a 400 in Anthropic's format that never reaches vLLM."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .test_page_access import Server, server, stored

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")

pytestmark = pytest.mark.vllm
__all__ = ["server", "stored"]  # the fixtures this module uses

BASE: dict[str, Any] = {"model": "tiny", "max_tokens": 0,
                        "messages": [{"role": "user", "content": "hi"}]}


def test_the_middleware_sends_one_token_and_answers_a_prewarm(server: Server) -> None:
    facts = {"prompt_tokens": 100, "live_tokens": 0, "restored_tokens": 0,
             "written_tokens": 96, "written_by_ttl": {"3600": 64, "300": 32}}
    server.inner.answer = json.dumps({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "tiny",
        "content": [{"type": "text", "text": "x"}], "stop_reason": "max_tokens",
        "stop_sequence": None, "usage": {"input_tokens": 100, "output_tokens": 1},
        "kv_transfer_params": {"sparkcache": facts}}).encode()
    r = server.call("POST", "/v1/messages", body=json.dumps(BASE).encode(),
                    headers=[("content-type", "application/json")])
    assert r.status == 200
    ((_scope, seen),) = server.inner.calls
    assert json.loads(seen)["max_tokens"] == 1
    answer = json.loads(r.body)
    assert (answer["content"], answer["stop_reason"]) == ([], "max_tokens")
    assert answer["usage"] == {"input_tokens": 4, "output_tokens": 0,
                               "cache_read_input_tokens": 0, "cache_creation_input_tokens": 96,
                               "cache_creation": {"ephemeral_5m_input_tokens": 32,
                                                  "ephemeral_1h_input_tokens": 64}}
    assert r.header("content-length") == str(len(r.body))


def test_the_middleware_refuses_a_streamed_prewarm_in_anthropics_format(
        server: Server) -> None:
    r = server.call("POST", "/v1/messages", body=json.dumps({**BASE, "stream": True}).encode(),
                    headers=[("content-type", "application/json")])
    assert r.status == 400
    answer = json.loads(r.body)
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "stream: true" in answer["error"]["message"]
    assert not server.inner.calls
