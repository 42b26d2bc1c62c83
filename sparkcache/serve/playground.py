"""The ``/sparkcache`` page's playground: a conversation with a served model that
shows, turn by turn, what the cache did.

A turn is a POST of the ``#playground`` form to ``/sparkcache/playground``
(the page's rules first: who may see it, the form token, the same origin;
:mod:`sparkcache.serve.pages`).  The server sends it as an Anthropic request to
its own ``/v1/messages`` through the middleware, exactly as any client's
(:meth:`Playground.turn`): the answer's usage is the API's, and the request's
row in the request log (found by the answer's id, which the request's
``diagnostics`` opt-in makes the server's own) says where the cached tokens
came from (vLLM's live cache, disk, the shared tier) and the time to first
token.  With JavaScript the page's one script (allowed by its hash in the
page's ``Content-Security-Policy``) posts the form with ``fetch`` and puts the
returned section in place; without it the form posts as any form and the
answer is the whole page.  The conversation so far travels in the form
(``state``: its turns as JSON, checked and bounded); nothing is kept on the
server but the request log's rows.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import html
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from sparkcache.errors import SparkCacheError
from sparkcache.requestlog import RequestRow
from sparkcache.serve import page
from sparkcache.serve.bodies import Message, Receive, Scope, Send, header, replay
from sparkcache.store import SnapshotStore

__all__ = ["ACTION", "HEADERS", "MAX_FORM", "SCRIPT", "Playground", "Turn", "served_models"]

ACTION = page.PATH + "/playground"
#: The largest playground form (its conversation travels in it).
MAX_FORM = 256 * 1024
#: Turns a conversation holds at most, and characters of each text.
MAX_TURNS = 16
MAX_TEXT = 16 * 1024
MAX_TOKENS = 64
#: How long a turn waits for the connector's last facts (the time to first
#: token is committed just after the answer).
ROW_WAIT_S = 3.0

#: The page's one script: posts the playground form and puts the answer in place.
SCRIPT = """document.addEventListener("submit", async (event) => {
  const form = event.target;
  if (form.id !== "playground") return;
  event.preventDefault();
  const button = form.querySelector("button[type=submit]");
  const status = form.querySelector(".pg-status");
  const key = form.querySelector("input[name=api_key]");
  const kept = key ? key.value : "";
  button.disabled = true;
  status.textContent = "waiting for the model...";
  try {
    const answer = await fetch(form.action, {method: "POST", credentials: "same-origin",
      headers: {"accept": "application/json"},
      body: new URLSearchParams(new FormData(form))});
    if (!answer.ok) throw new Error(answer.status + " " + (await answer.text()).slice(0, 200));
    const data = await answer.json();
    document.getElementById("playground-box").outerHTML = data.html;
    const again = document.querySelector("#playground input[name=api_key]");
    if (again) again.value = kept;
    document.querySelector("#playground textarea[name=message]").focus();
  } catch (error) {
    status.textContent = "failed: " + error.message;
    button.disabled = false;
  }
});"""
SCRIPT_HASH = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
#: Sent with the page: no caching, no framing, no script but the one above.
HEADERS = [
    (b"cache-control", b"no-store"), (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{SCRIPT_HASH}'; "
     "connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
     "base-uri 'none'".encode()),
]
STYLE = """
.pg label{display:block;margin:6px 0 2px;color:#4a545e}
.pg textarea,.pg select,.pg input[type=password]{font:inherit;width:100%;box-sizing:border-box}
.pg label.inline{display:inline;color:inherit}
.pg button{background:#1e5fb4}.turn{border-left:3px solid #1e5fb4;padding:2px 10px;margin:8px 0}
.turn .you{margin:2px 0}.turn .bot{margin:2px 0;white-space:pre-wrap}
.nums{color:#4a545e;margin:2px 0}
.nums b{color:#1b7a3a}.turn.err{border-color:#b3261e}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class Turn:
    """One turn as the playground shows it (and carries in its form)."""

    model: str
    user: str
    answer: str = ""
    marked: bool = False  # the system prompt carried cache_control
    error: str = ""
    answer_id: str = ""
    input: int = 0  # the API's usage: computed, read from cache, written
    cached: int = 0
    written: int = 0
    live: int | None = None  # the request log's split of the cached tokens
    disk: int | None = None
    tier: int | None = None
    ttft_s: float | None = None
    miss: str = ""  # the API's cache-miss diagnosis, when it gave one


_TEXTS = ("model", "user", "answer", "error", "answer_id", "miss")


def _turn(raw: Any) -> Turn | None:
    """A turn from the form's state, None when it is not one (type by type)."""
    if not isinstance(raw, dict) or set(raw) - set(Turn.__dataclass_fields__):
        return None
    for name, value in raw.items():
        if name in _TEXTS and not (isinstance(value, str) and len(value) <= MAX_TEXT):
            return None
        if name == "marked" and not isinstance(value, bool):
            return None
        if name == "ttft_s" and value is not None and not isinstance(value, (int, float)):
            return None
        if name in ("input", "cached", "written", "live", "disk", "tier") and not (
                (value is None and name in ("live", "disk", "tier"))
                or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)):
            return None
    return Turn(**raw) if "model" in raw and "user" in raw else None


def parse_state(text: str) -> list[Turn] | None:
    """The conversation the form carries; None when it is not one the page wrote."""
    if not text:
        return []
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TURNS:
        return None
    turns = [_turn(item) for item in raw]
    return None if any(t is None for t in turns) else [t for t in turns if t is not None]


def served_models(scope: Scope) -> list[str]:
    """The names vLLM serves (its ``--served-model-name``), from its app's state."""
    state = getattr(scope.get("app"), "state", None)
    models = getattr(state, "openai_serving_models", None)
    return [str(p.name) for p in getattr(models, "base_model_paths", None) or []]


def _numbers(turn: Turn) -> str:
    if turn.error:
        return f'<p class="nums">{_e(turn.error)}</p>'
    where = ""
    if turn.live is not None:
        where = (f" (live <span data-live-tokens=\"{turn.live}\">{turn.live}</span>, disk "
                 f"<span data-disk-tokens=\"{turn.disk}\">{turn.disk}</span>, shared tier "
                 f"<span data-tier-tokens=\"{turn.tier}\">{turn.tier}</span>)")
    ttft = "-" if turn.ttft_s is None else f"{turn.ttft_s * 1000:.0f} ms"
    miss = f" · cache miss: {_e(turn.miss)}" if turn.miss else ""
    return (f'<p class="nums"><b data-cached-tokens="{turn.cached}">{turn.cached} cached</b>'
            f'{where} · <span data-written-tokens="{turn.written}">{turn.written} written'
            f'</span> · <span data-input-tokens="{turn.input}">{turn.input} computed</span> · '
            f'TTFT <span data-ttft-ms="{ttft}">{ttft}</span> · system prompt '
            f"{'marked' if turn.marked else 'not marked'} cache_control{miss}</p>")


def _turns(turns: list[Turn]) -> str:
    return "".join(
        f'<div class="turn{" err" if t.error else ""}" data-turn="{i + 1}" '
        f'data-answer-id="{_e(t.answer_id)}">'
        f'<p class="you"><b>You</b> ({_e(t.model)}): {_e(t.user)}</p>'
        + (f'<p class="bot">{_e(t.answer)}</p>' if not t.error else "")
        + _numbers(t) + "</div>"
        for i, t in enumerate(turns))


@dataclass
class Draft:
    """What the form holds besides the conversation (shown again after a turn)."""

    model: str = ""
    system: str = ""
    marked: bool = True
    note: str = ""


def _usage_split(row: RequestRow | None) -> dict[str, Any]:
    if row is None or row.prompt_tokens is None:
        return {}
    restored, remote = row.restored_tokens or 0, row.remote_tokens or 0
    return {"live": row.live_tokens or 0, "disk": restored - remote, "tier": remote,
            "ttft_s": row.ttft_s}


Db = Callable[[Callable[[SnapshotStore], Any]], Awaitable[Any]]
Api = Callable[[Scope, Receive, Send], Awaitable[None]]


class Playground:
    """The playground of one server process: its section of the page and its turns.

    ``api`` is the middleware itself (a turn goes through it as any request);
    ``needs_key``: vLLM has an ``--api-key``, which the form then asks for
    (sent as ``Bearer`` with the turn, never kept or shown again).
    """

    def __init__(self, api: Api, db: Db, *, needs_key: bool = False) -> None:
        self.api = api
        self.db = db
        self.needs_key = needs_key
        self.row_wait_s = ROW_WAIT_S

    def section(self, models: list[str], csrf: str, turns: list[Turn] | None = None,
                draft: Draft | None = None) -> str:
        """The playground's HTML: the turns so far and the form."""
        turns, draft = turns or [], draft or Draft()
        if not models:
            return ('<section class="model pg" id="playground-box"><h2>Playground</h2>'
                    '<p class="muted">No model is served here.</p></section>')
        options = "".join(f'<option{" selected" if m == draft.model else ""}>{_e(m)}</option>'
                          for m in models)
        state = json.dumps([asdict(t) for t in turns], separators=(",", ":"))
        key = ('<label for="pg-key">API key (the server\'s --api-key; not kept)</label>'
               '<input type="password" id="pg-key" name="api_key" autocomplete="off">'
               if self.needs_key else "")
        note = f'<p class="note">{_e(draft.note)}</p>' if draft.note else ""
        return (
            f'<section class="model pg" id="playground-box"><style>{STYLE}</style>'
            '<h2>Playground</h2><p class="muted">Each turn goes to this server\'s '
            "<code>/v1/messages</code> like any client's; its numbers are the API's usage "
            "and the request log's row.</p>"
            f"{note}{_turns(turns)}"
            f'<form id="playground" method="post" action="{ACTION}">'
            f'<input type="hidden" name="csrf" value="{_e(csrf)}">'
            f'<input type="hidden" name="state" value="{_e(state)}">'
            f'<label for="pg-model">Model</label><select id="pg-model" name="model">{options}'
            '</select><label for="pg-system">System prompt (optional)</label>'
            f'<textarea id="pg-system" name="system" rows="3">{_e(draft.system)}</textarea>'
            f'<label class="inline"><input type="checkbox" name="cache" value="on" id="pg-cache"'
            f'{" checked" if draft.marked else ""}> mark the system prompt '
            "<code>cache_control</code> this turn</label>"
            f'{key}<label for="pg-message">Message</label>'
            '<textarea id="pg-message" name="message" rows="3" required></textarea>'
            '<p><button type="submit" id="pg-send">Send</button> '
            f'<a href="{page.PATH}">New conversation</a> '
            '<span class="pg-status" role="status"></span></p></form>'
            f"<script>{SCRIPT}</script></section>")

    def _request(self, turns: list[Turn], draft: Draft, message: str) -> dict[str, Any]:
        """The Anthropic request of the next turn: the conversation so far and it."""
        messages: list[dict[str, Any]] = []
        for t in turns:
            if not t.error:
                messages += [{"role": "user", "content": t.user},
                             {"role": "assistant", "content": t.answer or "."}]
        messages.append({"role": "user", "content": message})
        body: dict[str, Any] = {"model": draft.model, "max_tokens": MAX_TOKENS,
                                "messages": messages}
        if draft.system:
            block: dict[str, Any] = {"type": "text", "text": draft.system}
            if draft.marked:
                block["cache_control"] = {"type": "ephemeral"}
            body["system"] = [block]
        previous = next((t.answer_id for t in reversed(turns) if t.answer_id), None)
        body["diagnostics"] = {"previous_message_id": previous}
        return body

    async def _call(self, scope: Scope, receive: Receive, body: dict[str, Any],
                    api_key: str) -> tuple[int, bytes]:
        """``body`` POSTed to ``/v1/messages`` through the middleware, in process."""
        raw = json.dumps(body).encode()
        headers = [(b"host", (header(scope, b"host") or "127.0.0.1").encode("latin-1")),
                   (b"content-type", b"application/json"),
                   (b"content-length", str(len(raw)).encode())]
        if api_key:
            headers.append((b"authorization", b"Bearer " + api_key.encode("latin-1", "replace")))
        inner = {**scope, "method": "POST", "path": "/v1/messages",
                 "raw_path": b"/v1/messages", "query_string": b"", "headers": headers}
        status, chunks = 500, []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.api(inner, replay(raw, receive), send)
        return status, b"".join(chunks)

    async def _row(self, answer_id: str) -> RequestRow | None:
        """The request log's row of the answer, once the connector's last facts are in."""
        deadline = time.monotonic() + self.row_wait_s
        while True:
            try:
                row: RequestRow | None = await self.db(
                    lambda store: store.request_by_answer(answer_id))
            except SparkCacheError:
                return None
            if (row is not None and row.ttft_s is not None) or time.monotonic() > deadline:
                return row
            await asyncio.sleep(0.05)

    async def turn(self, scope: Scope, receive: Receive, turns: list[Turn], draft: Draft,
                   message: str, api_key: str = "") -> Turn:
        """Send the next turn; what it answered and what the cache did."""
        status, raw = await self._call(scope, receive, self._request(turns, draft, message),
                                       api_key)
        base = Turn(model=draft.model, user=message, marked=bool(draft.system and draft.marked))
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if status != 200 or not isinstance(answer, dict):
            return _failed(base, status, answer)
        usage: dict[str, Any] = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
        text = "".join(b.get("text", "") for b in answer.get("content") or []
                       if isinstance(b, dict) and b.get("type") == "text")
        diag = answer.get("diagnostics")
        reason = diag.get("cache_miss_reason") if isinstance(diag, dict) else None
        answer_id = str(answer.get("id") or "")[:256]
        row = await self._row(answer_id) if answer_id else None
        return Turn(**{**asdict(base), "answer": text[:MAX_TEXT], "answer_id": answer_id,
                       "input": _int(usage.get("input_tokens")),
                       "cached": _int(usage.get("cache_read_input_tokens")),
                       "written": _int(usage.get("cache_creation_input_tokens")),
                       "miss": str(reason.get("type", ""))[:80] if isinstance(reason, dict)
                       else "", **_usage_split(row)})


def _failed(base: Turn, status: int, answer: Any) -> Turn:
    """A turn the API refused: its status and message."""
    message = ""
    if isinstance(answer, dict):
        error = answer.get("error")
        message = str(error.get("message", "") if isinstance(error, dict) else error or "")
    return Turn(**{**asdict(base), "error": f"the API answered {status}: {message}"[:500]})


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
