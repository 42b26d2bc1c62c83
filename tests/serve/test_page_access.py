"""sparkcache.serve.middleware, driven as an ASGI app over a real store: who may see
the /sparkcache page (loopback with a local Host, or the admin token), the clear
form's CSRF and origin checks, what passes to vLLM untouched, and Anthropic's 400
for a malformed cache_control."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import html
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import pytest

from sparkcache import SnapshotStore, admin

from ..filled import fill, segment_path
from ..store.helpers import identity, pages_for, tokens

# The middleware imports vLLM's Anthropic request model.
pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")
from sparkcache.connector.requests import params_of
from sparkcache.serve.middleware import ServeSettings, SparkCacheMiddleware
from sparkcache.serve.tenants import tenant_salt

pytestmark = pytest.mark.vllm

TOKEN = "t0k-3n_admin"
#: vLLM's app as the page reads it: its state names the served models.
SERVED_APP = SimpleNamespace(state=SimpleNamespace(openai_serving_models=SimpleNamespace(
    base_model_paths=[SimpleNamespace(name="tiny")])))
SCRIPT_MODEL = "<script>alert('x')</script>"
LOCAL = ("127.0.0.1", 50123)
LOCAL_HOST = "127.0.0.1:8000"


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.decode("latin-1").lower() == name:
                return value.decode("latin-1")
        return None

    @property
    def text(self) -> str:
        return self.body.decode()


@dataclass
class Inner:
    """vLLM's app as the middleware sees it: records each call and answers 200."""

    calls: list[tuple[dict[str, Any], bytes]] = field(default_factory=list)
    answer: bytes = b'{"ok":true}'

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append((scope, body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"x-inner", b"1")]})
        await send({"type": "http.response.body", "body": self.answer, "more_body": False})


@dataclass
class Server:
    app: SparkCacheMiddleware
    inner: Inner
    folder: Path

    def call(self, method: str, path: str, *, client: tuple[str, int] | None = LOCAL,
             host: str | None = LOCAL_HOST, headers: Sequence[tuple[str, str]] = (),
             body: bytes = b"", query: str = "", scope: dict[str, Any] | None = None
             ) -> Response:
        hdrs = [(b"host", host.encode())] if host is not None else []
        hdrs += [(k.lower().encode(), v.encode("latin-1")) for k, v in headers]
        if body:
            hdrs.append((b"content-length", str(len(body)).encode()))
        full: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query.encode(), "headers": hdrs, "client": client,
            "server": ("127.0.0.1", 8000), **(scope or {}),
        }
        return asyncio.run(_drive(self.app, full, body))

    def page(self, **kwargs: Any) -> Response:
        return self.call("GET", "/sparkcache", **kwargs)

    def post_form(self, path: str, form: dict[str, str], *,
                  headers: Sequence[tuple[str, str]] = (), **kwargs: Any) -> Response:
        return self.call("POST", path, body=urlencode(form).encode(), headers=[
            ("content-type", "application/x-www-form-urlencoded"), *headers], **kwargs)

    def snapshots(self) -> dict[str, list[int]]:
        with SnapshotStore(self.folder) as store:
            return {m.name: [s.id for s in admin.list_snapshots(store, m.id)]
                    for m in admin.list_models(store)}


async def _drive(app: Any, scope: dict[str, Any], body: bytes) -> Response:
    sent: list[dict[str, Any]] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies and not bodies[-1].get("more_body"), sent
    return Response(starts[0]["status"], list(starts[0]["headers"]),
                    b"".join(m.get("body", b"") for m in bodies))


@dataclass
class Stored:
    folder: Path
    models: dict[str, int]  # name -> id
    ids: dict[str, list[int]]  # name -> its snapshots
    files: dict[str, list[Path]]  # name -> its snapshots' segment files


@pytest.fixture
def stored(tmp_path: Path) -> Stored:
    """tiny-llama (2 snapshots), other (1) and a model named like a script (1)."""
    folder = tmp_path / "store"
    with SnapshotStore(folder, alias_stride=16) as store:
        filled = fill(store)
        ident, toks = identity(model=SCRIPT_MODEL), tokens(16, seed=7)
        script = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        models = {m.name: m.id for m in admin.list_models(store)}
        ids = {"tiny-llama": [filled.root, filled.child], "other": [filled.other],
               SCRIPT_MODEL: [script]}
        files = {name: [segment_path(store, i) for i in snaps] for name, snaps in ids.items()}
    assert all(p.is_file() for paths in files.values() for p in paths)
    # The forms below name tiny-llama as model "1": fill() publishes it first.
    assert models["tiny-llama"] == 1 and ids["tiny-llama"] == [1, 2]
    return Stored(folder, models, ids, files)


@contextmanager
def _server(stored: Stored, admin_token: str | None) -> Iterator[Server]:
    inner = Inner()
    app = SparkCacheMiddleware(inner, ServeSettings(folder=str(stored.folder),
                                                    admin_token=admin_token, log_rows=100))
    try:
        yield Server(app, inner, stored.folder)
    finally:
        # The middleware lives as long as vLLM's process; the tests end it by hand.
        app._db.shutdown(wait=True)
        if app._store is not None:
            app._store.close()


@pytest.fixture
def server(stored: Stored) -> Iterator[Server]:
    with _server(stored, None) as running:
        yield running


@pytest.fixture
def guarded(stored: Stored) -> Iterator[Server]:
    """A server started with an admin token."""
    with _server(stored, TOKEN) as running:
        yield running


def csrf_of(page: Response) -> str:
    found = set(re.findall(r'name="csrf" value="([^"]+)"', page.text))
    assert len(found) == 1, found
    return html.unescape(found.pop())


# -- who sees the page ---------------------------------------------------------------------

def test_loopback_gets_the_page_with_its_snapshots(server: Server, stored: Stored) -> None:
    r = server.page(scope={"app": SERVED_APP})
    assert r.status == 200
    assert r.header("content-type") == "text/html; charset=utf-8"
    assert r.header("cache-control") == "no-store"
    assert r.header("x-frame-options") == "DENY"
    csp = r.header("content-security-policy") or ""
    for directive in ("default-src 'none'", "form-action 'self'", "frame-ancestors 'none'"):
        assert directive in csp
    # One script, inline, allowed by its hash alone; nothing from elsewhere.
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", r.text, re.S)
    assert [attrs for attrs, _ in scripts] == [""]
    digest = base64.b64encode(hashlib.sha256(scripts[0][1].encode()).digest()).decode()
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == f"'sha256-{digest}'"
    assert "http" not in csp and "src=" not in r.text
    assert int(r.header("content-length") or -1) == len(r.body)
    text = r.text
    assert text.startswith("<!doctype html>")
    assert text.count('<section class="model"') == 3
    for name, model_id in stored.models.items():
        assert f'id="clear-{model_id}"' in text
        assert html.escape(name) in text
    assert "2 snapshots" in text and "1 snapshot," in text
    # tiny-llama's table: the root (32 tokens) and its child (64), child of the root.
    section = text.split(f'id="model-{stored.models["tiny-llama"]}"')[1].split("</section>")[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\w+)</td><td>(\d+)</td>", section)
    assert rows == [("1", "ready", "32"), ("2", "ready", "64")]
    assert not server.inner.calls


def test_a_model_name_is_escaped(server: Server) -> None:
    text = server.page().text
    assert "<script>" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text


def test_a_note_is_shown_escaped(server: Server) -> None:
    text = server.page(query="note=" + "%3Cb%3Edone%3C/b%3E").text
    assert '<p class="note" id="note">&lt;b&gt;done&lt;/b&gt;</p>' in text


@pytest.mark.parametrize(("client", "host"), [
    (("127.0.0.1", 1), "localhost:8000"),
    (("127.0.0.1", 1), "localhost"),
    (("127.0.0.1", 1), "LOCALHOST:8000"),
    (("127.0.0.1", 1), "127.0.0.1"),
    (("127.5.6.7", 1), "127.0.0.1:8000"),
    (("::1", 1), "[::1]:8000"),
    (("::1", 1), "[::1]"),
])
def test_loopback_clients_with_a_local_host(server: Server, client: tuple[str, int],
                                            host: str) -> None:
    assert server.page(client=client, host=host).status == 200


@pytest.mark.parametrize("client", [("10.0.0.5", 4000), ("192.168.1.2", 1), ("::2", 1),
                                    ("2001:db8::1", 1), None, ("testclient", 50000)])
def test_other_clients_are_refused(server: Server, client: tuple[str, int] | None) -> None:
    r = server.page(client=client)
    assert r.status == 403
    assert "loopback clients only" in r.text and "--admin-token" in r.text
    assert "<form" not in r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example:80", "[::2]:8000", "", None])
def test_a_host_other_than_this_machine_is_refused(server: Server, host: str | None) -> None:
    """DNS rebinding: another site's name resolving to 127.0.0.1."""
    r = server.page(host=host)
    assert r.status == 403
    assert "answers only to 127.0.0.1 or localhost" in r.text


def test_refused_clients_cannot_clear(server: Server, stored: Stored) -> None:
    csrf = csrf_of(server.page())
    before = server.snapshots()
    r = server.post_form("/sparkcache/clear", {"model": "1", "csrf": csrf},
                         client=("10.0.0.5", 1))
    assert r.status == 403
    r = server.post_form("/sparkcache/clear", {"model": "1", "csrf": csrf},
                         host="evil.example")
    assert r.status == 403
    assert server.snapshots() == before


# -- the admin token -----------------------------------------------------------------------

def test_with_a_token_no_token_gets_the_login_form(guarded: Server) -> None:
    for client in (LOCAL, ("10.0.0.5", 1)):
        r = guarded.page(client=client)
        assert r.status == 401
        assert r.header("content-type") == "text/html; charset=utf-8"
        assert 'action="/sparkcache/login"' in r.text and 'name="token"' in r.text
        assert "snapshot" not in r.text.lower()


@pytest.mark.parametrize("authorization", [f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}",
                                           TOKEN, f"Bearer {TOKEN[:-1]}"])
def test_a_wrong_token_is_refused(guarded: Server, authorization: str) -> None:
    r = guarded.page(headers=[("authorization", authorization)])
    assert r.status == 401
    assert "sparkcache_admin" not in (r.header("set-cookie") or "")


def test_a_bearer_token_opens_the_page_to_any_client(guarded: Server, stored: Stored) -> None:
    for client, host in ((LOCAL, LOCAL_HOST), (("10.0.0.5", 1), "cache.example:8000")):
        for scheme in ("Bearer", "bearer"):
            r = guarded.page(client=client, host=host,
                             headers=[("Authorization", f"{scheme} {TOKEN}")])
            assert r.status == 200
            assert all(html.escape(name) in r.text for name in stored.models)


def test_login_sets_a_cookie_that_opens_the_page(guarded: Server) -> None:
    client = ("10.0.0.5", 1)
    host = "cache.example:8000"
    r = guarded.post_form("/sparkcache/login", {"token": TOKEN}, client=client, host=host,
                          headers=[("origin", f"http://{host}")])
    assert r.status == 303
    assert r.header("location") == "/sparkcache"
    cookie = r.header("set-cookie") or ""
    attributes = [a.strip() for a in cookie.split(";")]
    # A session derived from the token (its expiry and an HMAC), never the token.
    assert re.fullmatch(r"sparkcache_admin=\d+\.[0-9a-f]{64}", attributes[0]), attributes[0]
    assert TOKEN not in cookie
    assert {"HttpOnly", "SameSite=Strict", "Path=/sparkcache", "Max-Age=43200"} \
        <= set(attributes[1:])
    r = guarded.page(client=client, host=host,
                     headers=[("cookie", f"theme=dark; {attributes[0]}; other=1")])
    assert r.status == 200
    assert "Clear KV snapshots" in r.text
    for wrong in ("nope", TOKEN, "1.ab", "99999999999." + "0" * 64):
        r = guarded.page(client=client, host=host,
                         headers=[("cookie", f"sparkcache_admin={wrong}")])
        assert r.status == 401, wrong


def test_a_token_a_cookie_cannot_hold_as_is_still_logs_in(stored: Stored) -> None:
    odd = "correct horse; battery=staple,\"x\""
    with _server(stored, odd) as server:
        r = server.post_form("/sparkcache/login", {"token": odd})
        assert r.status == 303
        cookie = (r.header("set-cookie") or "").split(";")[0]
        assert re.fullmatch(r"sparkcache_admin=[0-9a-f.]+", cookie), cookie
        assert server.page(headers=[("cookie", cookie)]).status == 200
        assert server.page(headers=[("authorization", f"Bearer {odd}")]).status == 200
        assert server.page(headers=[("cookie", "sparkcache_admin=correct horse")]).status \
            == 401


@pytest.mark.parametrize(("form", "headers"), [
    ({"token": "wrong"}, []),
    ({}, []),
    ({"token": TOKEN}, [("origin", "http://evil.example")]),
    ({"token": TOKEN}, [("sec-fetch-site", "cross-site")]),
], ids=["wrong-token", "no-token", "other-origin", "cross-site"])
def test_a_refused_login_sets_no_cookie(guarded: Server, form: dict[str, str],
                                        headers: list[tuple[str, str]]) -> None:
    r = guarded.post_form("/sparkcache/login", form, headers=headers)
    assert r.status == 401
    assert r.header("set-cookie") is None
    assert "wrong token" in r.text


def test_with_a_token_clear_still_needs_the_form_token(guarded: Server) -> None:
    auth = [("authorization", f"Bearer {TOKEN}")]
    before = guarded.snapshots()
    r = guarded.post_form("/sparkcache/clear", {"model": "1"}, headers=auth)
    assert r.status == 403
    r = guarded.post_form("/sparkcache/clear", {"model": "1", "csrf": TOKEN}, headers=auth)
    assert r.status == 403
    assert guarded.snapshots() == before
    csrf = csrf_of(guarded.page(headers=auth))
    r = guarded.post_form("/sparkcache/clear", {"model": "1", "csrf": csrf})  # no token
    assert r.status == 401
    assert guarded.snapshots() == before
    r = guarded.post_form("/sparkcache/clear", {"model": "1", "csrf": csrf}, headers=auth)
    assert r.status == 303
    assert guarded.snapshots()["tiny-llama"] == []


# -- clearing ------------------------------------------------------------------------------

@pytest.mark.parametrize(("form", "headers"), [
    ({"model": "1"}, []),
    ({"model": "1", "csrf": ""}, []),
    ({"model": "1", "csrf": "0" * 64}, []),
    ({"model": "1", "csrf": "RIGHT"}, [("origin", "http://evil.example")]),
    ({"model": "1", "csrf": "RIGHT"}, [("origin", "http://127.0.0.1:9999")]),
    ({"model": "1", "csrf": "RIGHT"}, [("origin", "null")]),
    ({"model": "1", "csrf": "RIGHT"}, [("sec-fetch-site", "cross-site")]),
    ({"model": "1", "csrf": "RIGHT"}, [("sec-fetch-site", "same-site")]),
    ({"model": "1", "csrf": "RIGHT"}, [("origin", f"http://{LOCAL_HOST}"),
                                       ("sec-fetch-site", "cross-site")]),
], ids=["no-csrf", "empty-csrf", "wrong-csrf", "other-origin", "other-port", "null-origin",
        "cross-site", "same-site", "cross-site-with-origin"])
def test_clear_refused_deletes_nothing(server: Server, stored: Stored, form: dict[str, str],
                                       headers: list[tuple[str, str]]) -> None:
    csrf = csrf_of(server.page())
    form = {k: csrf if v == "RIGHT" else v for k, v in form.items()}
    before = server.snapshots()
    r = server.post_form("/sparkcache/clear", form, headers=headers)
    assert r.status == 403
    assert r.header("location") is None
    assert "did not come from this server's page" in r.text
    assert server.snapshots() == before
    assert all(p.is_file() for p in stored.files["tiny-llama"])


def test_a_form_token_of_another_server_process_is_refused(server: Server,
                                                           stored: Stored) -> None:
    other = SparkCacheMiddleware(Inner(), ServeSettings(folder=str(stored.folder)))
    try:
        token = other.pages.csrf("clear")
    finally:
        other._db.shutdown()
    assert token != server.app.pages.csrf("clear")
    r = server.post_form("/sparkcache/clear", {"model": "1", "csrf": token})
    assert r.status == 403


def test_clear_with_the_pages_token_deletes_the_models_snapshots(server: Server,
                                                                 stored: Stored) -> None:
    csrf = csrf_of(server.page())
    tiny = stored.models["tiny-llama"]
    r = server.post_form("/sparkcache/clear", {"model": str(tiny), "csrf": csrf}, headers=[
        ("origin", f"http://{LOCAL_HOST}"), ("sec-fetch-site", "same-origin")])
    assert r.status == 303
    assert r.body == b""
    location = r.header("location") or ""
    assert location.startswith("/sparkcache?note=")
    note = parse_qs(urlsplit(location).query)["note"][0]
    assert note == "Cleared 2 snapshots of tiny-llama"
    assert server.snapshots() == {**stored.ids, "tiny-llama": []}
    assert not any(p.exists() for p in stored.files["tiny-llama"])
    assert all(p.is_file() for p in stored.files["other"] + stored.files[SCRIPT_MODEL])
    # The redirect's page shows the note and the model with no snapshot.
    page = server.page(query=urlsplit(location).query).text
    assert '<p class="note" id="note">Cleared 2 snapshots of tiny-llama</p>' in page
    section = page.split(f'id="model-{tiny}"')[1].split("</section>")[0]
    assert "0 snapshots" in section and "No snapshots." in section


def test_clear_without_browser_headers_is_allowed(server: Server, stored: Stored) -> None:
    """curl sends neither Origin nor Sec-Fetch-Site; the form token is what counts."""
    csrf = csrf_of(server.page())
    other = stored.models["other"]
    r = server.post_form("/sparkcache/clear", {"model": str(other), "csrf": csrf},
                         headers=[("sec-fetch-site", "none")])
    assert r.status == 303
    assert unquote(r.header("location") or "").endswith("Cleared 1 snapshot of other")
    assert server.snapshots()["other"] == []
    assert server.snapshots()["tiny-llama"] == stored.ids["tiny-llama"]


def test_clear_resets_vllms_prefix_cache_when_it_can(server: Server, stored: Stored) -> None:
    resets: list[bool] = []

    class Engine:
        async def reset_prefix_cache(self) -> bool:
            resets.append(True)
            return True

    app = SimpleNamespace(state=SimpleNamespace(engine_client=Engine()))  # vLLM's app
    csrf = csrf_of(server.page())
    r = server.post_form("/sparkcache/clear", {"model": "1", "csrf": csrf},
                         scope={"app": app})
    assert r.status == 303
    assert resets == [True]
    assert unquote(r.header("location") or "").endswith("; vLLM's live prefix cache reset")


@pytest.mark.parametrize(("model", "status", "note"), [
    ("", 400, None), ("tiny", 400, None), ("999", 303, "not cleared: "),
])
def test_clear_of_no_or_an_unknown_model(server: Server, model: str, status: int,
                                         note: str | None) -> None:
    csrf = csrf_of(server.page())
    before = server.snapshots()
    r = server.post_form("/sparkcache/clear", {"model": model, "csrf": csrf})
    assert r.status == status
    if note is not None:
        assert note in unquote(r.header("location") or "")
    assert server.snapshots() == before


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/sparkcache"), ("GET", "/sparkcache/clear"), ("GET", "/sparkcache/"),
    ("GET", "/sparkcache/other"), ("POST", "/sparkcache/login"),
])
def test_other_page_paths_are_not_found(server: Server, method: str, path: str) -> None:
    r = server.call(method, path)
    assert r.status == 404
    assert not server.inner.calls


# -- everything else -----------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/models"), ("POST", "/v1/embeddings"), ("GET", "/v1/messages"),
    ("GET", "/sparkcache-other"), ("GET", "/health"), ("POST", "/sparkcachex/clear"),
])
def test_other_paths_pass_to_vllm_untouched(server: Server, method: str, path: str) -> None:
    body = b'{"input": "x", "cache_control": 5}' if method == "POST" else b""
    r = server.call(method, path, body=body, client=("10.0.0.5", 1), host="evil.example")
    assert (r.status, r.body, r.header("x-inner")) == (200, b'{"ok":true}', "1")
    ((scope, seen),) = server.inner.calls
    assert scope["path"] == path and scope["method"] == method
    assert scope["headers"][0] == (b"host", b"evil.example")
    assert seen == body


def test_a_bad_cache_control_is_a_400_in_anthropics_format(server: Server) -> None:
    request = {"model": "tiny", "max_tokens": 8,
               "system": [{"type": "text", "text": "s",
                           "cache_control": {"type": "ephemeral", "ttl": "10m"}}],
               "messages": [{"role": "user", "content": "hi"}]}
    r = server.call("POST", "/v1/messages", body=json.dumps(request).encode(),
                    headers=[("content-type", "application/json")])
    assert r.status == 400
    assert r.header("content-type") == "application/json"
    answer = json.loads(r.body)
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith("system[0].cache_control.ttl must be one of")
    assert not server.inner.calls
    with SnapshotStore(server.folder) as store:
        (row,) = store.requests()
    assert (row.api, row.model, row.status) == ("messages", "tiny", 400)


def test_a_good_request_reaches_vllm_named_for_the_log(server: Server) -> None:
    request = {"model": "tiny", "max_tokens": 8, "prompt_cache_key": "user-7",
               "messages": [{"role": "user", "content": "hi"}]}
    r = server.call("POST", "/v1/chat/completions", body=json.dumps(request).encode())
    assert r.status == 200
    ((scope, seen),) = server.inner.calls
    forwarded = json.loads(seen)
    ours = forwarded.pop("kv_transfer_params")["sparkcache"]
    # The key is the request's tenant: its salt and its name for the connector.
    assert forwarded.pop("cache_salt") == tenant_salt("user-7", None)
    assert forwarded == {k: v for k, v in request.items() if k != "prompt_cache_key"}
    assert re.fullmatch(r"sc-[0-9a-f]{32}", ours["id"])
    assert ours["tenant"] == "user-7"
    assert all(k != b"content-length" for k, _ in scope["headers"])
    with SnapshotStore(server.folder) as store:
        row = store.request(ours["id"])
    assert row is not None
    assert (row.api, row.cache_key, row.tenant, row.status) == ("chat", "user-7", "user-7", 200)


class Renderer:
    """vLLM's renderer as the middleware uses it: one token per character of the
    system and message texts, in order; ``fail`` raises for a cut that has it."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls = 0

    async def render_messages_request(self, request: Any) -> Any:
        self.calls += 1
        text = "".join(str(b.text) for b in request.system or [])
        text += "|" + "|".join(
            m.content if isinstance(m.content, str) else "".join(str(b.text) for b in m.content)
            for m in request.messages)
        if self.fail is not None and self.fail in text:
            raise RuntimeError("the template cannot render this")
        return SimpleNamespace(token_ids=[ord(c) for c in text])


def breakpoints_seen(server: Server, renderer: Renderer) -> list[dict[str, Any]]:
    request = {"model": "tiny", "max_tokens": 8,
               "system": [{"type": "text", "text": "a" * 40},
                          {"type": "text", "text": "b" * 30,
                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
               "messages": [{"role": "user", "content": [
                   {"type": "text", "text": "question",
                    "cache_control": {"type": "ephemeral"}}]}]}
    app = SimpleNamespace(state=SimpleNamespace(serving_render=renderer))
    r = server.call("POST", "/v1/messages", body=json.dumps(request).encode(),
                    headers=[("content-type", "application/json")], scope={"app": app})
    assert r.status == 200
    ((_scope, seen),) = server.inner.calls
    ours: dict[str, Any] = json.loads(seen)["kv_transfer_params"]["sparkcache"]
    return list(ours.get("breakpoints", []))


#: The whole prompt of :func:`breakpoints_seen`'s request as :class:`Renderer`
#: renders it (the prompt vLLM computes).
PROMPT = [ord(c) for c in "a" * 40 + "b" * 30 + "|question"]


def placed(marks: list[dict[str, Any]]) -> tuple[tuple[int, ...], dict[int, float]]:
    """The breakpoints the connector sets in PROMPT from ``marks``, and their ttls."""
    params = params_of(SimpleNamespace(request_id="r", prompt_token_ids=PROMPT,
                                       kv_transfer_params={"sparkcache": {"breakpoints":
                                                                          marks}}))
    return params.breakpoints, dict(params.keep)


def test_breakpoints_are_where_the_cut_renders_stop_agreeing(server: Server) -> None:
    renderer = Renderer()
    marks = breakpoints_seen(server, renderer)
    assert [set(m) for m in marks] == [{"prefix", "ttl"}] * 2
    # system (70 chars) + "|" then the placeholder differs; the whole prompt for the last.
    assert placed(marks) == ((71, 71 + len("question")), {71: 3600.0, 71 + 8: 300.0})
    assert renderer.calls == 2  # the cuts only: the whole prompt is vLLM's to render


def test_a_cut_that_fails_to_render_sets_no_breakpoint_and_the_request_goes_on(
        server: Server) -> None:
    marks = breakpoints_seen(server, Renderer(fail="\u2400"))  # the placeholder's cut
    assert placed(marks) == ((71 + len("question"),), {71 + 8: 300.0})
