"""The browser harness (tests/browser.py) against a real HTTP server on 127.0.0.1.

The page is a tiny stand-in for a server-rendered admin page: a list of models, each
with a POST form and a button; the server records each POST and answers 303 to the
page, which then no longer shows the model.
"""

from __future__ import annotations

import html
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from .browser import Browser, BrowserError, BrowserTimeout, needs_chromium, running_in_group

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Post:
    path: str
    content_type: str
    form: dict[str, list[str]]


@dataclass
class Site:
    """The server's state: the models it lists and the POSTs it received."""

    url: str
    models: list[str]
    posts: list[Post] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def page(models: list[str]) -> bytes:
    rows = "".join(
        f'<li><span class="model">{html.escape(m)}</span>'
        f'<form method="post" action="/clear">'
        f'<input type="hidden" name="model" value="{html.escape(m)}">'
        f"<button>Clear KV snapshots</button></form></li>"
        for m in models
    )
    body = f"<ul>{rows}</ul>" if models else "<p>No models.</p>"
    return (f"<!doctype html><html><head><title>models</title></head>"
            f"<body><h1>Models</h1>{body}</body></html>").encode()


def handler_for(site: Site) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/":
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            with site.lock:
                body = page(site.models)
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            form = parse_qs(self.rfile.read(length).decode())
            with site.lock:
                site.posts.append(Post(self.path, self.headers.get("Content-Type", ""), form))
                for model in form.get("model", []):
                    if model in site.models:
                        site.models.remove(model)
            self.send_response(HTTPStatus.SEE_OTHER)
            self.send_header("Location", "/")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: pytest shows failures, not access logs

    return Handler


@pytest.fixture
def site() -> Iterator[Site]:
    state = Site(url="", models=["tiny-llama", "qwen-0.5b"])
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/"
    # A short poll interval: shutdown() waits for the loop to notice.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="test-http",
                              daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with Browser(timeout=20) as b:
        yield b


@needs_chromium
def test_click_posts_the_form_and_shows_the_redirected_page(browser: Browser, site: Site,
                                                             tmp_path: Path) -> None:
    browser.open(site.url)
    assert browser.evaluate("[...document.querySelectorAll('.model')].map(e => e.textContent)") \
        == ["tiny-llama", "qwen-0.5b"]
    assert "tiny-llama" in browser.text()

    browser.click("li:first-child form button")

    text = browser.text()
    assert "tiny-llama" not in text
    assert "qwen-0.5b" in text
    assert browser.evaluate("location.href") == site.url  # followed the 303
    assert site.posts == [Post("/clear", "application/x-www-form-urlencoded",
                               {"model": ["tiny-llama"]})]

    shot = browser.screenshot(tmp_path / "page.png", width=640)
    data = shot.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 640 and height > 0


@needs_chromium
def test_last_click_leaves_the_empty_page(browser: Browser, site: Site) -> None:
    browser.open(site.url)
    browser.click("form button")
    browser.click("form button")
    assert "No models." in browser.text()
    assert [p.form for p in site.posts] == [{"model": ["tiny-llama"]}, {"model": ["qwen-0.5b"]}]


@needs_chromium
def test_errors_name_the_cause(browser: Browser, site: Site) -> None:
    browser.open(site.url)
    with pytest.raises(BrowserError, match="the page threw: ReferenceError"):
        browser.evaluate("no_such_name")
    with pytest.raises(BrowserError, match="no visible element matches 'table'"):
        browser.click("table")
    with pytest.raises(BrowserTimeout):
        browser.evaluate("new Promise(() => {})", timeout=0.5)
    # A click that does not navigate returns at once; the page is unchanged.
    browser.click("h1")
    assert site.posts == []
    assert browser.evaluate("document.title") == "models"


@needs_chromium
def test_close_stops_every_process_and_removes_the_profile() -> None:
    with pytest.raises(RuntimeError, match="test failed"), Browser(timeout=20) as b:
        assert b.process is not None and b.profile is not None
        pid, profile = b.process.pid, b.profile
        assert running_in_group(pid)
        raise RuntimeError("test failed")
    assert not profile.exists()
    assert running_in_group(pid) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie


def test_a_browser_that_never_listens_times_out_and_is_killed(tmp_path: Path) -> None:
    """A hung start fails the test within the timeout; no process or profile is left."""
    said = tmp_path / "args"
    hung = tmp_path / "hung-chromium"
    hung.write_text(f'#!/bin/sh\necho $$ "$@" > {said}\nexec sleep 600\n')
    hung.chmod(0o755)
    with pytest.raises(BrowserTimeout, match="did not write DevToolsActivePort within 1 s"), \
            Browser(str(hung), timeout=1):
        pytest.fail("a browser that never listens started")
    pid, *args = said.read_text().split()
    profile = Path(next(a for a in args if a.startswith("--user-data-dir=")).split("=", 1)[1])
    assert "--remote-debugging-port=0" in args
    assert not profile.exists()
    assert running_in_group(int(pid)) == []
