"""``sparkcache serve`` with vLLM's ``--api-key`` and an admin token, on real vLLM,
driven by real HTTP clients: what a hostile or careless client can send.

One server (``guarded``: ``--api-key``, ``--admin-token``, a 40-row log, a 2 MB
body limit) runs every test: a body nested 100,000 levels, or 700 levels with
a ``cache_control`` mark, is the API's own 400 and the server keeps serving; a
request without vLLM's key gets vLLM's 401 and leaves no trace in the log
(however many, however large); a 20 MB login form is refused unread while
``/health`` stays fast and the server's memory flat; the log keeps a row for
every request vLLM answers (non-JSON bodies, empty, huge and invalid text),
SageMaker's ``/invocations`` included, under a key no client can choose; a
malformed ``kv_transfer_params`` is Anthropic's 400; the middleware's warnings
reach the server's log; an admin login sets a session, never the token.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL_NAME, Server, log_rows
from tiny_model import NEEDS_VLLM

pytestmark = NEEDS_VLLM

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-key"
TOKEN = "admin-t0ken"
AUTH = {"authorization": f"Bearer {KEY}"}
LOG_ROWS = 40


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("guarded-store")
    log = tmp_path_factory.mktemp("guarded-log") / "server.log"
    with Server(tiny_model_dir, folder, log, "--api-key", KEY, "--admin-token", TOKEN,
                "--log-rows", str(LOG_ROWS), env={"SPARKCACHE_MAX_BODY_MB": "2"}) as server:
        yield server


def post(server: Server, path: str, body: bytes | dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra}


def message(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello there",
                                      "cache_control": {"type": "ephemeral"}}]}], **extra}


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_deep_json_is_the_apis_own_400_and_the_server_keeps_serving(guarded: Server) -> None:
    deep = nested(100_000)
    base = json.dumps(message())[:-1]
    r = post(guarded, "/v1/messages", f'{base}, "metadata": {deep}}}'.encode(), AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "nests deeper than" in r.json()["error"]["message"]
    r = post(guarded, "/v1/chat/completions",
             f'{json.dumps(chat())[:-1]}, "extra": {deep}}}'.encode(), AUTH)
    assert r.status_code == 400, r.text
    assert "nests deeper than" in r.json()["error"]["message"]
    # 700 levels parse, but a copy of the request for a breakpoint would recurse.
    r = post(guarded, "/v1/messages",
             f'{base}, "metadata": {{"x": {nested(700)}}}}}'.encode(), AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert post(guarded, "/v1/messages", message(), AUTH).status_code == 200
    assert post(guarded, "/v1/chat/completions", chat(), AUTH).status_code == 200


def test_without_vllms_key_a_request_gets_vllms_401_and_no_row(guarded: Server) -> None:
    assert post(guarded, "/v1/chat/completions", chat("a real row", prompt_cache_key="mine"),
                AUTH).status_code == 200
    mine = log_rows(guarded.folder, lambda rows: any(r.cache_key == "mine" for r in rows))
    assert any(r.cache_key == "mine" for r in mine)
    before = _index_bytes(guarded.folder)
    bad_mark = message(system=[{"type": "text", "text": "s",
                                "cache_control": {"type": "ephemeral", "ttl": "10m"}}])
    r = post(guarded, "/v1/messages", bad_mark)
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    assert post(guarded, "/v1/messages", bad_mark, AUTH).status_code == 400  # with the key
    for n in range(LOG_ROWS + 5):
        r = post(guarded, "/v1/chat/completions",
                 chat(model="m" * 500_000 if n < 10 else MODEL_NAME),
                 {"authorization": "Bearer wrong"} if n % 2 else None)
        assert r.status_code == 401
    time.sleep(0.5)
    rows = log_rows(guarded.folder)
    assert any(r.cache_key == "mine" for r in rows)  # not flushed out
    assert not any(r.model and r.model.startswith("mmmm") for r in rows)
    assert _index_bytes(guarded.folder) - before < 1_000_000


def _index_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("index.sqlite*"))


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_20mb_login_form_is_refused_unread_and_health_stays_fast(guarded: Server) -> None:
    assert guarded.proc is not None
    peak = _peak_rss(guarded.proc.pid)
    latencies: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # Declared: answered 413 before a byte of the body is sent.
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=20) as sock:
            sock.sendall(b"POST /sparkcache/login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\n"
                         b"Content-Length: 20000000\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 413")
        # Streamed without a length: refused once it passes the bound.
        def form() -> Iterator[bytes]:
            yield b"token=" + b"x" * 65536
            for _ in range(320):
                yield b"x" * 65536

        try:
            r = httpx.post(guarded.url + "/sparkcache/login", content=form(), timeout=60,
                           headers={"content-type": "application/x-www-form-urlencoded"})
            assert r.status_code == 413
        except httpx.TransportError:
            pass  # the server answered and closed while the client still sent
    finally:
        done.set()
        watcher.join()
    assert latencies and max(latencies) < 2.0, latencies
    assert _peak_rss(guarded.proc.pid) - peak < 200 << 20


def test_every_request_vllm_answers_has_a_row(guarded: Server) -> None:
    since = time.time()  # the rows of the requests below arrived after it, no earlier one's
    r = post(guarded, "/v1/chat/completions", b"this is not json", AUTH)
    assert r.status_code == 400  # vLLM's
    r = post(guarded, "/v1/chat/completions", b'{"model": "tiny", "messages": [], '
             b'"max_tokens": 2, "prompt_cache_key": "lone \\ud800 key"}', AUTH)
    assert r.status_code in (200, 400), r.text
    assert post(guarded, "/v1/chat/completions", chat(model=""), AUTH).status_code != 500
    huge = post(guarded, "/v1/chat/completions", chat(model="q" * 1_000_000), AUTH)
    assert huge.status_code == 404, huge.text  # vLLM: no such model
    def ours(rows: list[Any]) -> list[Any]:
        return [r for r in rows if r.created_at >= since]

    def logged(rows: list[Any]) -> bool:
        mine = ours(rows)
        return (len(mine) >= 4 and any(r.api == "chat" and r.model is None for r in mine)
                and any(r.model == "" for r in mine)
                and any(r.cache_key == "lone \\ud800 key" for r in mine)
                and any((r.model or "").startswith("qqq") for r in mine))

    rows = ours(log_rows(guarded.folder, logged))
    assert any(r.api == "chat" and r.model is None and r.status == 400 for r in rows)
    assert any(r.model == "" for r in rows)
    assert any(r.cache_key == "lone \\ud800 key" for r in rows)
    (big,) = [r for r in rows if (r.model or "").startswith("qqq")]
    assert len(big.model or "") == 1024 and big.status == 404


def test_invocations_are_logged_under_a_key_no_client_chooses(guarded: Server) -> None:
    r = post(guarded, "/v1/chat/completions", chat("first, counted", prompt_cache_key="first"),
             AUTH)
    assert r.status_code == 200
    rows = log_rows(guarded.folder, lambda rows: any(
        r.cache_key == "first" and r.prompt_tokens for r in rows))
    (first,) = [r for r in rows if r.cache_key == "first"]
    forged = chat("a longer prompt that would overwrite the first request's row " * 2,
                  prompt_cache_key="sagemaker",
                  kv_transfer_params={"sparkcache": {"id": first.request_id}})
    r = post(guarded, "/invocations", forged)
    assert r.status_code == 200, r.text
    rows = log_rows(guarded.folder, lambda rows: any(
        r.cache_key == "sagemaker" and r.prompt_tokens for r in rows))
    (mine,) = [r for r in rows if r.cache_key == "sagemaker"]
    assert mine.api == "chat" and mine.status == 200 and mine.request_id != first.request_id
    (again,) = [r for r in rows if r.request_id == first.request_id]
    assert again.prompt_tokens == first.prompt_tokens and again.cache_key == "first"
    r = post(guarded, "/invocations", chat(prompt_cache_key=42))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"


@pytest.mark.parametrize("params", [
    {"sparkcache": {"breakpoints": 5}}, {"sparkcache": {"breakpoints": "12"}},
    {"sparkcache": 7}, "nope"])
def test_malformed_kv_transfer_params_is_anthropics_400(guarded: Server, params: Any) -> None:
    client = anthropic.Anthropic(base_url=guarded.url, api_key=KEY, max_retries=0,
                                 default_headers=AUTH)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=2, messages=message()["messages"],
                               extra_body={"kv_transfer_params": params})
    assert "kv_transfer_params" in caught.value.message
    assert caught.value.body["type"] == "error"  # type: ignore[index]


def test_the_middlewares_warnings_reach_the_servers_log(guarded: Server) -> None:
    # The whole prompt does not render for a breakpoint: a warning, then vLLM's own 400.
    r = post(guarded, "/v1/messages", message(max_tokens="many"), AUTH)
    assert r.status_code == 400
    deadline = time.monotonic() + 10
    while "sparkcache: render failed" not in guarded.log_tail(400) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert "sparkcache: render failed" in guarded.log_tail(400)


def test_admin_login_sets_a_session_and_bounds_attempts(guarded: Server) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(guarded.url + "/sparkcache/login", content=f"token={TOKEN}", headers=form)
    assert r.status_code == 303
    session = r.cookies.get("sparkcache_admin")
    assert session and TOKEN not in session
    page = httpx.get(guarded.url + "/sparkcache", headers={"cookie": f"sparkcache_admin={session}"})
    assert page.status_code == 200
    assert httpx.get(guarded.url + "/sparkcache",
                     headers={"cookie": f"sparkcache_admin={TOKEN}"}).status_code == 401
    for n in range(5):
        assert httpx.post(guarded.url + "/sparkcache/login", content=f"token=no{n}",
                          headers=form).status_code == 401
    r = httpx.post(guarded.url + "/sparkcache/login", content=f"token={TOKEN}", headers=form)
    assert r.status_code == 429 and "sparkcache_admin" not in r.cookies
    assert "5 failed admin attempts from 127.0.0.1" in guarded.log_tail(400)
