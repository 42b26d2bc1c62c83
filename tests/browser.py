"""A headless Chromium for tests of server-rendered pages, driven over the DevTools protocol.

No Selenium or Playwright: Chromium itself (Debian's ``chromium``, installed by
``scripts/install-browser.sh``) and one WebSocket to its DevTools endpoint.

    with Browser() as browser:
        browser.open(url)
        assert "tiny-llama" in browser.text()
        browser.click("form button")        # a form submits: waits for the next page
        browser.screenshot(tmp_path / "page.png", width=1024)

Contract:

- Chromium listens on 127.0.0.1 only, on a port it picks (``--remote-debugging-port=0``,
  read back from ``DevToolsActivePort`` in a fresh temporary profile).
- Every call has a deadline (``timeout`` seconds, per call or per browser); a hung
  browser raises :class:`BrowserTimeout`, it never hangs the test run.
- Leaving the ``with`` block, even on an exception, kills the browser's whole process
  group and removes the profile.

Tests that need the browser carry :data:`needs_chromium`; it skips them, with the
reason ``install-browser.sh`` recorded, when Chromium is missing.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

__all__ = [
    "CHROMIUM",
    "Browser",
    "BrowserError",
    "BrowserTimeout",
    "find_chromium",
    "needs_chromium",
    "running_in_group",
    "skip_reason",
]

CHROMIUM = "/usr/bin/chromium"
# Written by scripts/install-browser.sh when it could not install Chromium.
SKIP_REASON_FILE = Path(__file__).resolve().parent.parent / ".venv" / ".sparkcache-browser-skip"
DEFAULT_TIMEOUT = 30.0
# How long close() waits for Chromium to quit when asked, before it kills the group.
QUIT_TIMEOUT = 5.0
# How long close() waits for the killed process group to be gone.
STOP_TIMEOUT = 10.0
# A screenshot of a long page is megabytes of base64 in one message.
MAX_MESSAGE = 256 * 1024 * 1024

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # The tests browse 127.0.0.1 only: an http_proxy in the environment must not apply.
    "--no-proxy-server",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)

Event = dict[str, Any]


class BrowserError(Exception):
    """Chromium did not start, a command failed, or the page threw."""


class BrowserTimeout(BrowserError):
    """Chromium did not answer (or a page did not load) within the deadline."""


def find_chromium() -> str | None:
    """The Chromium executable: /usr/bin/chromium, else one on PATH; None when there is none."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def skip_reason() -> str:
    """Why the browser tests skip: what install-browser.sh said, else how to install."""
    try:
        said = SKIP_REASON_FILE.read_text().strip()
    except OSError:
        said = ""
    how = "run: bash scripts/install-browser.sh (as root)"
    return f"needs Chromium: {said}" if said else f"needs Chromium at {CHROMIUM}; {how}"


needs_chromium = pytest.mark.skipif(find_chromium() is None, reason=skip_reason())


class _DevTools:
    """One WebSocket to the browser endpoint: commands by id, events kept in arrival order."""

    def __init__(self, url: str, timeout: float) -> None:
        # Entered as a context manager, as websockets asks; close() leaves it.
        self._stack = ExitStack()
        # proxy=None: connect straight to 127.0.0.1 whatever the environment says.
        self._ws: ClientConnection = self._stack.enter_context(connect(
            url, proxy=None, open_timeout=timeout, close_timeout=1,
            max_size=MAX_MESSAGE, compression=None, ping_interval=None,
        ))
        self._next_id = 0
        self.events: list[Event] = []

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: str | None = None, timeout: float) -> dict[str, Any]:
        """Send a command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self._ws.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline, f"{method} had no reply")
            if reply.get("id") != self._next_id:
                # An event, or the late reply to a command that timed out before.
                if "method" in reply:
                    self.events.append(reply)
                continue
            if "error" in reply:
                raise BrowserError(f"{method} failed: {reply['error'].get('message')}")
            result: dict[str, Any] = reply.get("result", {})
            return result

    def wait_event(self, match: Callable[[Event], bool], *, deadline: float,
                   what: str) -> Event:
        """Remove and return the first kept or arriving event that matches."""
        while True:
            for i, event in enumerate(self.events):
                if match(event):
                    del self.events[i]
                    return event
            reply = self._receive(deadline, what)
            if "method" in reply:
                self.events.append(reply)

    def _receive(self, deadline: float, what: str) -> dict[str, Any]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BrowserTimeout(what)
        try:
            raw = self._ws.recv(timeout=left)
        except TimeoutError:
            raise BrowserTimeout(what) from None
        except WebSocketException as e:
            raise BrowserError(f"{what}: the DevTools connection closed ({e})") from e
        reply: dict[str, Any] = json.loads(raw)
        return reply

    def close(self) -> None:
        self._stack.close()


class Browser:
    """A headless Chromium with one page (tab); a context manager.

    ``timeout`` bounds every call (start, navigation, evaluation); each method takes its
    own ``timeout`` to override it.  ``width`` and ``height`` size the window.
    """

    def __init__(self, executable: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 width: int = 1280, height: int = 800) -> None:
        found = executable or find_chromium()
        if found is None:
            raise BrowserError(skip_reason())
        self.executable = found
        self.timeout = timeout
        self.width, self.height = width, height
        self.profile: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._devtools: _DevTools | None = None
        self._session = ""

    # -- lifetime -------------------------------------------------------------------

    def __enter__(self) -> Browser:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _start(self) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="sparkcache-chromium-"))
        log = (self.profile / "chromium.log").open("wb")
        with log:
            # A session of its own: close() kills the browser with all its helpers
            # (zygotes, renderers, GPU and network processes) as one process group.
            self.process = subprocess.Popen(
                [self.executable, *FLAGS, f"--user-data-dir={self.profile}",
                 f"--window-size={self.width},{self.height}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        deadline = time.monotonic() + self.timeout
        endpoint = self._endpoint(deadline)
        self._devtools = _DevTools(endpoint, max(deadline - time.monotonic(), 1.0))
        target = self._call("Target.createTarget", {"url": "about:blank"}, browser=True)
        attached = self._call("Target.attachToTarget",
                              {"targetId": target["targetId"], "flatten": True}, browser=True)
        self._session = attached["sessionId"]
        self._call("Page.enable")

    def _endpoint(self, deadline: float) -> str:
        """The browser's WebSocket URL, once Chromium has written DevToolsActivePort."""
        assert self.profile is not None and self.process is not None
        active = self.profile / "DevToolsActivePort"
        while True:
            try:
                port, path = active.read_text().split()[:2]
                return f"ws://127.0.0.1:{int(port)}{path}"
            except (OSError, ValueError):
                pass  # not there yet, or half written
            if self.process.poll() is not None:
                raise BrowserError(f"chromium exited with status {self.process.returncode} "
                                   f"before listening: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise BrowserTimeout(f"chromium did not write {active.name} within "
                                     f"{self.timeout:g} s: {self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self, lines: int = 5) -> str:
        assert self.profile is not None
        try:
            text = (self.profile / "chromium.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def close(self) -> None:
        """Stop the browser, kill what is left of its process group, remove its profile.

        Safe to call twice, and on a browser that failed to start.
        """
        devtools, self._devtools = self._devtools, None
        process, self.process = self.process, None
        profile, self.profile = self.profile, None
        try:
            if devtools is not None:
                _ask_to_quit(devtools, process)
            if process is not None:
                _kill_group(process)
        finally:
            if profile is not None:
                shutil.rmtree(profile, ignore_errors=True)

    # -- page -----------------------------------------------------------------------

    def open(self, url: str, *, timeout: float | None = None) -> None:
        """Navigate to ``url`` and wait for its load event; raise when it cannot load."""
        deadline = self._deadline(timeout)
        devtools = self._connected()
        devtools.events.clear()
        result = self._call("Page.navigate", {"url": url}, timeout=timeout)
        if result.get("errorText"):
            raise BrowserError(f"cannot open {url}: {result['errorText']}")
        devtools.wait_event(_named("Page.loadEventFired"), deadline=deadline,
                            what=f"{url} did not load")

    def evaluate(self, js: str, *, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression in the page (promises awaited).

        Returns what survives JSON (None for undefined); raises BrowserError with the
        page's message when it throws.
        """
        result = self._call("Runtime.evaluate", {
            "expression": js, "returnByValue": True, "awaitPromise": True,
        }, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            message = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"the page threw: {message}")
        return result["result"].get("value")

    def click(self, selector: str, *, navigation: bool | None = None,
              timeout: float | None = None) -> None:
        """Click the first element matching ``selector`` with the mouse, as a user would.

        Waits for the next page's load event when the click navigates: by default when
        the element submits a form or is a link; ``navigation=True`` or ``False`` says
        so for clicks that script decides (a handler that navigates or prevents it).
        """
        deadline = self._deadline(timeout)
        found = self.evaluate(_CLICK_TARGET % json.dumps(selector), timeout=timeout)
        if found is None:
            raise BrowserError(f"no visible element matches {selector!r}")
        if navigation is None:
            navigation = bool(found["navigates"])
        devtools = self._connected()
        devtools.events.clear()
        point = {"x": found["x"], "y": found["y"], "button": "left", "clickCount": 1}
        for kind in ("mousePressed", "mouseReleased"):
            self._call("Input.dispatchMouseEvent", {"type": kind, **point}, timeout=timeout)
        if navigation:
            what = f"clicking {selector!r} loaded no page"
            devtools.wait_event(_main_frame_navigated, deadline=deadline, what=what)
            devtools.wait_event(_named("Page.loadEventFired"), deadline=deadline, what=what)

    def type(self, selector: str, text: str, *, timeout: float | None = None) -> None:
        """Focus the first element matching ``selector``, empty it, and type ``text``
        into it as a keyboard would (``Input.insertText``: input events fire)."""
        found = self.evaluate(_FOCUS % json.dumps(selector), timeout=timeout)
        if not found:
            raise BrowserError(f"no element matches {selector!r}")
        self._call("Input.insertText", {"text": text}, timeout=timeout)

    def scripts(self, enabled: bool, *, timeout: float | None = None) -> None:
        """Let the page's own scripts run, or not (as a browser with JavaScript off);
        :meth:`evaluate` works either way."""
        self._call("Emulation.setScriptExecutionDisabled", {"value": not enabled},
                   timeout=timeout)

    def wait_for(self, js: str, *, timeout: float | None = None) -> Any:
        """The first truthy value of the expression ``js``, polled; BrowserTimeout when
        it stays falsy for ``timeout`` seconds."""
        deadline = self._deadline(timeout)
        while not (value := self.evaluate(js, timeout=timeout)):
            if time.monotonic() > deadline:
                raise BrowserTimeout(f"{js} stayed false")
            time.sleep(0.1)
        return value

    def text(self, *, timeout: float | None = None) -> str:
        """The page's visible text (``document.body.innerText``)."""
        value = self.evaluate("document.body ? document.body.innerText : ''", timeout=timeout)
        return str(value)

    def screenshot(self, path: str | os.PathLike[str], *, width: int | None = None,
                   timeout: float | None = None) -> Path:
        """Write a PNG of the whole page laid out ``width`` CSS pixels wide; return its path."""
        width = width or self.width
        self._call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": self.height, "deviceScaleFactor": 1, "mobile": False,
        }, timeout=timeout)
        try:
            size = self._call("Page.getLayoutMetrics", timeout=timeout)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": width,
                    "height": max(1, round(size["height"])), "scale": 1}
            shot = self._call("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True, "clip": clip,
            }, timeout=timeout)
        finally:
            self._call("Emulation.clearDeviceMetricsOverride", timeout=timeout)
        out = Path(path)
        out.write_bytes(base64.b64decode(shot["data"]))
        return out

    # -- plumbing -------------------------------------------------------------------

    def _connected(self) -> _DevTools:
        if self._devtools is None:
            raise BrowserError("the browser is not running: use it inside `with Browser()`")
        return self._devtools

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _call(self, method: str, params: dict[str, Any] | None = None, *,
              browser: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """A command to the page's session, or to the browser itself (``browser=True``)."""
        session = None if browser else self._session
        return self._connected().call(method, params, session=session,
                                      timeout=self.timeout if timeout is None else timeout)


# Scrolls the element into view; returns its centre in viewport coordinates and whether
# clicking it navigates by default (a form's submit button, a link), or null.
_CLICK_TARGET = """(() => {
  const el = document.querySelector(%s);
  if (!el) return null;
  el.scrollIntoView({block: "center", inline: "center"});
  const box = el.getBoundingClientRect();
  if (box.width === 0 || box.height === 0) return null;
  const submits = el.form !== undefined && el.form !== null && el.type === "submit";
  const follows = el.closest("a[href]") !== null;
  return {x: box.left + box.width / 2, y: box.top + box.height / 2,
          navigates: submits || follows};
})()"""


# Focuses the element and empties it (a text field or text area); false when none matches.
_FOCUS = """(() => {
  const el = document.querySelector(%s);
  if (!el) return false;
  el.focus();
  if ("value" in el) el.value = "";
  return true;
})()"""


def _named(method: str) -> Callable[[Event], bool]:
    return lambda event: event.get("method") == method


def _main_frame_navigated(event: Event) -> bool:
    frame = event.get("params", {}).get("frame", {})
    return event.get("method") == "Page.frameNavigated" and "parentId" not in frame


def _ask_to_quit(devtools: _DevTools, process: subprocess.Popen[bytes] | None) -> None:
    """Browser.close, then a short wait: a browser that quits reaps its own helpers."""
    try:
        devtools.call("Browser.close", timeout=QUIT_TIMEOUT)
        if process is not None:
            process.wait(timeout=QUIT_TIMEOUT)
    except (BrowserError, OSError, WebSocketException, subprocess.TimeoutExpired):
        pass  # killed next, whatever state it is in
    finally:
        with suppress(OSError, WebSocketException):
            devtools.close()


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group led by ``process``; wait until no member runs.

    Chromium's helpers outlive a killed parent only as zombies (they are re-parented
    to init, which may not reap them in a container); a zombie does not count.
    """
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise BrowserTimeout(f"chromium (pid {process.pid}) survived SIGKILL") from e
    deadline = time.monotonic() + STOP_TIMEOUT
    while running_in_group(process.pid):
        if time.monotonic() > deadline:
            raise BrowserTimeout(f"chromium's processes {running_in_group(process.pid)} "
                                 f"survived SIGKILL")
        time.sleep(0.05)


def running_in_group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc; [] without /proc."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids
