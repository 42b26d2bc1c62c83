"""The middleware's OpenAI caching hooks, driven as an ASGI app over a real store
(a stand-in for vLLM's app answers): a malformed field is OpenAI's 400 with its
``param`` before vLLM sees anything, on SageMaker's ``/invocations`` too; the
body vLLM reads has the fields taken out and the connector's flags set; and
the answer's usage is rewritten from the connector's facts."""

from __future__ import annotations

import json

import pytest

from .test_page_access import Server, server, stored

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")

pytestmark = pytest.mark.vllm
__all__ = ["server", "stored"]  # the fixtures this module uses

FACTS = {"prompt_tokens": 100, "live_tokens": 0, "restored_tokens": 64, "written_tokens": 32}


def post(server: Server, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    r = server.call("POST", path, body=json.dumps(body).encode(),
                    headers=[("content-type", "application/json")])
    return r.status, json.loads(r.body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
def test_a_malformed_field_is_openais_400_and_vllm_sees_nothing(server: Server,
                                                                path: str) -> None:
    status, answer = post(server, path, {
        "model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "auto"}}]}]})
    assert status == 400 and not server.inner.calls
    error = answer["error"]
    assert isinstance(error, dict)
    assert error["param"] == "messages[0].content[0].prompt_cache_breakpoint.mode"
    assert error["type"] == "invalid_request_error"


def test_explicit_mode_without_a_breakpoint_asks_the_connector_not_to_cache(
        server: Server) -> None:
    server.inner.answer = json.dumps({
        "object": "chat.completion", "kv_transfer_params": {"sparkcache": FACTS},
        "usage": {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
                  "prompt_tokens_details": {"cached_tokens": 64}}}).encode()
    status, answer = post(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "prompt_cache_options": {"mode": "explicit"}, "prompt_cache_retention": "in_memory"})
    assert status == 200
    ((_scope, seen),) = server.inner.calls
    sent = json.loads(seen)
    assert "prompt_cache_options" not in sent and "prompt_cache_retention" not in sent
    assert sent["kv_transfer_params"]["sparkcache"]["cache"] is False
    assert answer["usage"] == {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
                               "prompt_tokens_details": {"cached_tokens": 64,
                                                         "cache_write_tokens": 32}}


def test_a_prewarm_runs_one_token_and_answers_none(server: Server) -> None:
    server.inner.answer = json.dumps({
        "object": "response", "status": "incomplete", "max_output_tokens": 1,
        "incomplete_details": {"reason": "max_output_tokens"}, "output": [{"type": "message"}],
        "kv_transfer_params": {"sparkcache": FACTS},
        "usage": {"input_tokens": 100, "output_tokens": 1, "total_tokens": 101,
                  "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 999},
                  "output_tokens_details": {"reasoning_tokens": 0}}}).encode()
    status, answer = post(server, "/v1/responses", {
        "model": "tiny", "input": "hi", "max_output_tokens": 50,
        "prompt_cache_options": {"prewarm": True, "ttl": "12h"}})
    assert status == 200
    ((_scope, seen),) = server.inner.calls
    sent = json.loads(seen)
    assert sent["max_output_tokens"] == 1 and "prompt_cache_options" not in sent
    assert (answer["status"], answer["output"], answer["max_output_tokens"]) == \
        ("completed", [], 50)
    usage = answer["usage"]
    assert isinstance(usage, dict)
    assert (usage["output_tokens"], usage["total_tokens"]) == (0, 100)
    assert usage["input_tokens_details"] == {
        "cached_tokens": 64, "cache_write_tokens": 32,
        "cache_write_tokens_details": {"ttl_30m_tokens": 0, "ttl_12h_tokens": 32}}
