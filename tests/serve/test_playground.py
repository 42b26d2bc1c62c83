"""The page's playground (sparkcache.serve.playground) through the middleware as an
ASGI app over a real store: a turn is a real request to /v1/messages through the
middleware (the inner app stands in for vLLM and answers an Anthropic message),
the page's rules hold for it (loopback or the admin token, the form token, the
same origin), and the conversation travels in the form, checked."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from sparkcache import SnapshotStore

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")
from sparkcache.serve import playground

from .test_page_access import (
    LOCAL_HOST,
    SERVED_APP,
    TOKEN,
    Response,
    Server,
    Stored,
    _server,
    stored,
)

__all__ = ["stored"]  # the fixture
pytestmark = pytest.mark.vllm

ANSWER = {"id": "msg_inner", "type": "message", "role": "assistant", "model": "tiny",
          "content": [{"type": "text", "text": "hello <b>there</b>"}],
          "stop_reason": "end_turn",
          "usage": {"input_tokens": 5, "cache_read_input_tokens": 64,
                    "cache_creation_input_tokens": 32, "output_tokens": 2}}
ACTION = "/sparkcache/playground"
SCOPE = {"app": SERVED_APP}


def _ready(server: Server) -> Server:
    server.inner.answer = json.dumps(ANSWER).encode()
    assert server.app.pages.playground is not None
    server.app.pages.playground.row_wait_s = 0.0  # no connector: no facts will come
    return server


@pytest.fixture
def server(stored: Stored) -> Iterator[Server]:
    with _server(stored, None) as running:
        yield _ready(running)


@pytest.fixture
def guarded(stored: Stored) -> Iterator[Server]:
    with _server(stored, TOKEN) as running:
        yield _ready(running)


def form_of(text: str) -> dict[str, str]:
    """The playground form's hidden fields, as the page rendered them."""
    found = re.search(r'<form id="playground".*?</form>', text, re.S)
    assert found, text
    return {k: html.unescape(v) for k, v in
            re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', found.group(0))}


def send(server: Server, fields: dict[str, str], **kwargs: Any) -> Response:
    return server.post_form(ACTION, fields, scope=SCOPE, **kwargs)


def first_turn(server: Server, **extra: str) -> Response:
    fields = {**form_of(server.page(scope=SCOPE).text), "model": "tiny", "system": "be brief",
              "cache": "on", "message": "hi", **extra}
    return send(server, fields)


def test_a_turn_is_a_request_to_v1_messages_through_the_middleware(server: Server,
                                                                  stored: Stored) -> None:
    r = first_turn(server)
    assert r.status == 200 and r.header("content-type") == "text/html; charset=utf-8"
    assert "script-src 'sha256-" in (r.header("content-security-policy") or "")
    ((scope, raw),) = server.inner.calls
    assert (scope["method"], scope["path"]) == ("POST", "/v1/messages")
    body = json.loads(raw)
    assert body["model"] == "tiny" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["system"] == [{"type": "text", "text": "be brief",
                               "cache_control": {"type": "ephemeral"}}]
    assert body["diagnostics"] == {"previous_message_id": None}
    assert body["kv_transfer_params"]["sparkcache"]["id"].startswith("sc-")  # the middleware's
    assert "cookie" not in dict(scope["headers"])
    # The turn shows the API's usage, the answer escaped.
    turn = r.text.split('data-turn="1"')[1].split("</div>")[0]
    assert 'data-cached-tokens="64">64 cached' in turn
    assert 'data-written-tokens="32"' in turn and 'data-input-tokens="5"' in turn
    assert "hello &lt;b&gt;there&lt;/b&gt;" in turn and "marked cache_control" in turn
    answer_id = re.search(r'data-answer-id="(msg_[0-9a-f]{32})"', r.text)
    assert answer_id, r.text  # the server's own id (diagnostics), not the inner app's
    with SnapshotStore(stored.folder) as store:
        row = store.request_by_answer(answer_id.group(1))
    assert row is not None and row.api == "messages" and row.status == 200
    (state,) = json.loads(form_of(r.text)["state"])
    assert state["cached"] == 64 and state["answer_id"] == answer_id.group(1)


def test_the_next_turn_carries_the_conversation(server: Server) -> None:
    r = first_turn(server)
    fields = {**form_of(r.text), "model": "tiny", "system": "be brief", "message": "again"}
    r = send(server, fields)  # the cache_control box unticked this turn
    assert r.status == 200
    body = json.loads(server.inner.calls[-1][1])
    assert body["messages"] == [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello <b>there</b>"},
                                {"role": "user", "content": "again"}]
    assert body["system"] == [{"type": "text", "text": "be brief"}]
    first_id = json.loads(form_of(r.text)["state"])[0]["answer_id"]
    assert body["diagnostics"] == {"previous_message_id": first_id}
    assert r.text.count('class="turn"') == 2 and "not marked cache_control" in r.text


def test_the_pages_script_gets_the_section_as_json(server: Server) -> None:
    fields = {**form_of(server.page(scope=SCOPE).text), "model": "tiny", "message": "hi"}
    r = send(server, fields, headers=[("accept", "application/json"),
                                      ("origin", f"http://{LOCAL_HOST}"),
                                      ("sec-fetch-site", "same-origin")])
    assert r.status == 200 and r.header("content-type") == "application/json"
    section = json.loads(r.body)["html"]
    assert section.startswith('<section class="model pg" id="playground-box">')
    assert 'data-cached-tokens="64"' in section and "<h1>" not in section


@pytest.mark.parametrize(("change", "headers", "status"), [
    ({"client": ("10.0.0.5", 1)}, [], 403),
    ({"host": "evil.example"}, [], 403),
    ({"csrf": ""}, [], 403),
    ({"csrf": "clear"}, [], 403),  # another form's token
    ({}, [("origin", "http://evil.example")], 403),
    ({}, [("sec-fetch-site", "cross-site")], 403),
], ids=["not-loopback", "rebound-host", "no-csrf", "clear-csrf", "other-origin", "cross-site"])
def test_a_refused_turn_sends_nothing(server: Server, change: dict[str, Any],
                                      headers: list[tuple[str, str]], status: int) -> None:
    fields = {**form_of(server.page(scope=SCOPE).text), "model": "tiny", "message": "hi"}
    kwargs = {k: v for k, v in change.items() if k in ("client", "host")}
    if "csrf" in change:
        fields["csrf"] = server.app.pages.csrf("clear") if change["csrf"] == "clear" else ""
    r = send(server, fields, headers=headers, **kwargs)
    assert r.status == status
    assert server.inner.calls == []


def test_with_the_admin_token_any_client_may_play_and_no_token_none(guarded: Server) -> None:
    auth = [("authorization", f"Bearer {TOKEN}")]
    away = {"client": ("10.0.0.5", 1), "host": "cache.example:8000"}
    fields = {**form_of(guarded.page(scope=SCOPE, headers=auth, **away).text),
              "model": "tiny", "message": "hi"}
    r = send(guarded, fields, **away)  # no token
    assert r.status == 401 and guarded.inner.calls == []
    r = send(guarded, fields, headers=[("authorization", f"Bearer {TOKEN}x")], **away)
    assert r.status == 401 and guarded.inner.calls == []
    r = send(guarded, fields, headers=auth, **away)
    assert r.status == 200 and len(guarded.inner.calls) == 1
    assert 'data-cached-tokens="64"' in r.text


def test_the_api_key_goes_with_the_turn_and_is_not_shown_again(server: Server) -> None:
    assert server.app.pages.playground is not None
    server.app.pages.playground.needs_key = True
    page = server.page(scope=SCOPE).text
    assert 'name="api_key"' in page
    r = send(server, {**form_of(page), "model": "tiny", "message": "hi",
                      "api_key": "sk-secret"})
    assert dict(server.inner.calls[0][0]["headers"])[b"authorization"] == b"Bearer sk-secret"
    assert "sk-secret" not in r.text


@pytest.mark.parametrize(("fields", "note"), [
    ({"state": "[{\"model\": 1}]"}, "was not one this page wrote"),
    ({"state": "not json"}, "was not one this page wrote"),
    ({"model": "gpt-9"}, "Choose a model this server serves."),
    ({"message": "  "}, "Write a message first."),
    ({"state": json.dumps([{"model": "tiny", "user": "x"}] * playground.MAX_TURNS)},
     f"holds {playground.MAX_TURNS} turns"),
], ids=["bad-turn", "not-json", "unknown-model", "empty", "too-long"])
def test_a_form_the_playground_cannot_send_says_why(server: Server, fields: dict[str, str],
                                                    note: str) -> None:
    r = send(server, {**form_of(server.page(scope=SCOPE).text), "model": "tiny",
                      "message": "hi", **fields})
    assert r.status == 200 and note in html.unescape(r.text)
    assert server.inner.calls == []


def test_a_form_over_its_bound_is_413_unread(server: Server) -> None:
    fields = {**form_of(server.page(scope=SCOPE).text), "model": "tiny",
              "message": "x" * playground.MAX_FORM}
    r = send(server, fields)
    assert r.status == 413 and server.inner.calls == []
