"""``sparkcache serve`` as the tests run it: a real server process on 127.0.0.1.

:class:`Server` starts ``python -m sparkcache serve`` with the tests' tiny model
(float32, 32-token blocks, a 64-block KV cache so that one long conversation
pushes another out of vLLM's live cache) on a free port, waits until vLLM's
``/health`` answers, and stops it (SIGINT, then SIGKILL of its process group)
even when a test fails.  Its output goes to a log file that a failure shows.

The helpers below ask it Anthropic questions and count tokens by hand.  The
tests' tokenizer (:func:`random_models.build_tokenizer`, every model built by
:func:`random_models.build_model` has it) is byte-level: one token per ASCII
character, one per special token; its chat template is
``<bos><|role|>\\n{content}<|end|>\\n ... <|assistant|>\\n``, so a test counts
prompt positions from its texts (:data:`SYSTEM_FRAME`, :data:`USER_FRAME`),
not with the code under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tiny_model import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_CACHE_BLOCKS, TEST_SETTINGS, apply_cpu_env

from sparkcache.connector.publisher import MAX_WAIT_S
from sparkcache.serve.warmup import REQUEST_PREFIX as WARM_UP_PREFIX
from sparkcache.store import SnapshotStore

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
START_TIMEOUT = 300.0
#: Tokens the template puts around a system prompt up to the next message's
#: text: <bos> <|system|> \n ... <|end|> \n <|user|> \n
SYSTEM_FRAME = 7
#: ... and around one user message: <|end|> \n <|assistant|> \n after it.
USER_FRAME = 4


def whole(n: int) -> int:
    """The first ``n`` tokens rounded down to whole KV blocks."""
    return n // BLOCK_SIZE * BLOCK_SIZE


def block_end(n: int) -> int:
    """The end of the KV block holding token ``n - 1``: where a breakpoint at
    ``n`` saves its snapshot when the prompt fills that block."""
    return -(-n // BLOCK_SIZE) * BLOCK_SIZE


def saved(mark: int, prompt: int) -> int:
    """What a breakpoint at ``mark`` of a ``prompt``-token prompt writes and a
    later prompt sharing it reads, counted by hand: to the mark exactly when the
    prompt fills the KV block holding it, else (the prompt's last, partial
    block) its whole blocks below."""
    return mark if block_end(mark) <= prompt else whole(mark)


def system_prompt(seed: int, n: int) -> str:
    """``n`` ASCII characters (tokens) of text, different for each seed."""
    words = ["river", "stone", "cloud", "amber", "delta", "orbit", "maple", "quartz"]
    out, i = [], seed
    while sum(len(w) + 1 for w in out) < n:
        out.append(words[(i * 7 + len(out) * 3) % len(words)] + str(i % 10))
        i += 1
    return " ".join(out)[:n]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One ``sparkcache serve`` process (a context manager); ``cache_blocks`` is
    vLLM's ``--num-gpu-blocks-override``, ``extra`` more vLLM options."""

    def __init__(self, model_dir: Path, folder: Path, log: Path, *extra: str,
                 env: dict[str, str] | None = None,
                 cache_blocks: int = SMALL_CACHE_BLOCKS) -> None:
        self.port = free_port()
        self.folder = folder
        self.log_path = log
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "sparkcache", "serve", str(model_dir),
            "--folder", str(folder), "--port", str(self.port),
            "--served-model-name", MODEL_NAME, "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(cache_blocks), "--max-num-seqs", "8",
            "--seed", "0", *extra,
        ]
        if "--connector-config" not in extra:  # the suite's settings (tiny_model)
            self.cmd += ["--connector-config", json.dumps(TEST_SETTINGS)]
        self.env = apply_cpu_env({**os.environ, **(env or {})})
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), self.env.get("PYTHONPATH", "")) if p)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sparkcache serve exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("sparkcache serve did not start in time:\n" + self.log_tail())

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGINT)  # vLLM shuts down its engine and workers
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):  # workers left behind, if any
            os.killpg(proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def post(self, path: str, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """POST JSON; (status, parsed answer)."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")


def ask(client: Any, system: str, user: str, *, ttl: str | None = None,
        max_tokens: int = 8) -> Any:
    mark: dict[str, str] = {"type": "ephemeral"}
    if ttl:
        mark["ttl"] = ttl
    return client.messages.create(
        model=MODEL_NAME, max_tokens=max_tokens, extra_body={"temperature": 0},
        system=[{"type": "text", "text": system, "cache_control": mark}],
        messages=[{"role": "user", "content": user}])


def usage(message: Any) -> tuple[int, int, int]:
    u = message.usage
    return u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens


def wait_for(what: Any, timeout: float = 30.0) -> Any:
    """``what()``'s first truthy value, polled (a server writes snapshots and log
    rows after the answer went out); fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return found


def settled_snapshots(folder: Path, quiet_s: float = MAX_WAIT_S + 1.0,
                      limit_s: float = 60.0) -> set[int]:
    """The store's snapshot ids once none has been added for ``quiet_s``
    (longer than a save may wait to publish, ``MAX_WAIT_S``, and its write): a
    server writes an answer's snapshot after the answer went out, so the
    previous request's may still be arriving (on a loaded machine, seconds
    later), and a save still to come would have landed."""
    deadline = time.monotonic() + limit_s
    with SnapshotStore(folder) as store:
        seen, since = {s.id for s in store.snapshots()}, time.monotonic()
        while time.monotonic() - since < quiet_s:
            assert time.monotonic() < deadline, "the store kept changing"
            time.sleep(0.2)
            now = {s.id for s in store.snapshots()}
            if now != seen:
                seen, since = now, time.monotonic()
    return seen


def requests(store: SnapshotStore, warm_up: bool = False, **query: Any) -> list[Any]:
    """``store.requests(**query)`` without the server's own warm-up request
    (:mod:`sparkcache.serve.warmup`) unless ``warm_up``."""
    rows = store.requests(**query)
    return rows if warm_up else [r for r in rows if not r.request_id.startswith(WARM_UP_PREFIX)]


def last_seq(folder: Path) -> int:
    """The newest request row's ``seq`` (0: none): later requests' rows come after it."""
    rows = log_rows(folder)
    return rows[0].seq if rows else 0


def complete(row: Any) -> bool:
    """Whether a request's row has both its parts: the server's (its status)
    and, for an answered request, the connector's (its live tokens)."""
    return row.status is not None and (row.status != 200 or row.live_tokens is not None)


def newest_rows(folder: Path, *prompts: int) -> list[Any]:
    """The newest rows, once they are complete and are requests of ``prompts``
    tokens, newest first (an answer's row is written just after the answer, so
    right after it the newest row can still be the request before)."""
    def ours(rows: list[Any]) -> bool:
        return tuple(r.prompt_tokens for r in rows[:len(prompts)]) == prompts and \
            all(complete(r) for r in rows[:len(prompts)])

    rows = log_rows(folder, ours)
    assert ours(rows), rows[:len(prompts) + 1]
    return rows[:len(prompts)]


def log_rows(folder: Path, until: Any = None, timeout: float = 10.0,
             warm_up: bool = False) -> list[Any]:
    """The request log, newest first; with ``until``, polled until it holds for
    the rows (the server writes its part just after the answer is sent);
    the server's warm-up request left out unless ``warm_up``."""
    deadline = time.monotonic() + timeout
    while True:
        with SnapshotStore(folder) as store:
            rows = requests(store, warm_up, limit=1000)
        if until is None or until(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)
