"""``sparkcache log``: the request log, as a table, as JSON lines and followed
(sparkcache.cli.commands)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.cli import commands, main

from .helpers import REPO, Run

T0 = 1767323045.0  # 2026-01-02 03:04:05 UTC


def log(folder: Path, *names: str, model: str = "tiny-llama", **fields: Any) -> None:
    """Log one request per name, of ``model`` (by its model row), one second apart."""
    with SnapshotStore(folder) as store:
        model_id = admin.resolve_model(store, model).id
        before = len(store.requests(limit=1000))
        store.log_requests([{"request_id": name, "model_id": model_id,
                             "created_at": T0 + before + n, **fields}
                            for n, name in enumerate(names)], keep=1000)


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines()]


def test_log_table_for_people(run: Run, folder: Path) -> None:
    assert run("log") == "no requests logged\n"
    log(folder, "a", api="chat", prompt_tokens=1200, live_tokens=512, restored_tokens=256,
        written_tokens=432, breakpoints=[512, 1024], cache_key="user-42", ttft_s=0.12345,
        total_s=2.5)
    log(folder, "b", model="other", prompt_tokens=16)
    lines = run("log").splitlines()
    assert lines[0].split() == ["TIME", "MODEL", "API", "PROMPT", "CACHED", "LIVE+RESTORED",
                                "WRITTEN", "BREAKPOINTS", "CACHE", "KEY", "TTFT", "TOTAL"]
    assert lines[1].split() == ["2026-01-02", "03:04:05", "tiny-llama", "chat", "1200", "768",
                                "512+256", "432", "512,1024", "user-42", "0.123", "2.5"]
    assert lines[2].split() == ["2026-01-02", "03:04:06", "other", "-", "16", "0", "0+0",
                                "-", "-", "-", "-", "-"]  # oldest first, newest last
    assert len(lines) == 3
    assert run("log", "--limit", "1").splitlines()[1:] == lines[2:]
    assert run("log", "--model", "tiny-llama").splitlines()[1:] == lines[1:2]


def test_log_json_lines(run: Run, folder: Path) -> None:
    assert run("log", "--json") == ""
    log(folder, "a", "b", "c", prompt_tokens=10, live_tokens=4, restored_tokens=2)
    log(folder, "d", model="other")
    rows = json_lines(run("log", "--json"))
    assert [r["request_id"] for r in rows] == ["a", "b", "c", "d"]
    assert [r["seq"] for r in rows] == [1, 2, 3, 4]
    assert (rows[0]["cached_tokens"], rows[0]["breakpoints"], rows[3]["prompt_tokens"]) == (
        6, [], None)
    with admin.open_store(folder) as store:
        expected = admin.to_dict(admin.request_log(store, model="tiny-llama", limit=2))
    assert json_lines(run("--json", "log", "--model", "tiny-llama", "--limit", "2")) == \
        json.loads(json.dumps(expected[::-1]))
    assert [r["request_id"] for r in expected] == ["c", "b"]


def test_log_usage_errors(run: Run, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--folder", str(folder), "log", "--limit", "0"]) == 2
    assert "--limit: '0' is not a number of requests" in capsys.readouterr().err
    run("log", "--model", "llama-9", code=2)
    assert "sparkcache models" in run.err


class Ticks:
    """time.sleep for ``log --follow``: each call runs the next step; then Ctrl-C."""

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        if not self.steps:
            raise KeyboardInterrupt
        self.steps.pop(0)()


def test_log_follow_prints_new_requests_until_ctrl_c(run: Run, folder: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    log(folder, "a", "b")
    ticks = Ticks(lambda: log(folder, "c", "d"), lambda: None,
                  lambda: log(folder, "e", model="other"), lambda: log(folder, "f"))
    monkeypatch.setattr(commands.time, "sleep", ticks)
    lines = run("log", "--follow", "--limit", "1").splitlines()  # exits 0 on Ctrl-C
    assert ticks.slept == [0.5] * 5
    assert lines[0].startswith("TIME") and sum(line.startswith("TIME") for line in lines) == 1
    assert [line.split()[3] for line in lines[1:]] == ["-"] * 5  # no api: offline requests
    assert len(lines) == 1 + 5  # b, then c and d, e, f
    assert " other " in lines[4]
    ticks = Ticks(lambda: log(folder, "g"))
    monkeypatch.setattr(commands.time, "sleep", ticks)
    rows = json_lines(run("log", "--follow", "--json", "--model", "tiny-llama", "--limit", "2"))
    assert [r["request_id"] for r in rows] == ["d", "f", "g"]


def test_log_follow_reads_every_row_of_a_burst(run: Run, folder: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "FOLLOW_BATCH", 2)
    ticks = Ticks(lambda: log(folder, *"abcde"))
    monkeypatch.setattr(commands.time, "sleep", ticks)
    rows = json_lines(run("log", "--follow", "--json"))
    assert [r["request_id"] for r in rows] == list("abcde")
    assert len(ticks.slept) == 2  # all five in one look


def _sigint(disposition: Any) -> Callable[[], None]:
    """A ``preexec_fn`` starting the child with SIGINT at ``disposition``."""
    return lambda: signal.signal(signal.SIGINT, disposition) and None


@pytest.mark.parametrize(("sigint", "stop"), [
    (signal.SIG_DFL, signal.SIGINT),  # a terminal's Ctrl-C
    # A background job of a non-interactive shell starts with SIGINT ignored
    # and keeps ignoring it (as every program does): SIGTERM ends it.
    (signal.SIG_IGN, signal.SIGTERM),
], ids=["sigint", "sigterm-with-sigint-ignored"])
def test_log_follow_as_a_real_process(folder: Path, sigint: Any, stop: int) -> None:
    """``sparkcache log --follow`` in its own process sees what another process
    logs, and a SIGINT (Ctrl-C) or a SIGTERM ends it with exit status 0."""
    log(folder, "a")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkcache", "--folder", str(folder), "log", "--follow",
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=_sigint(sigint))
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                              daemon=True)
    reader.start()
    try:
        assert json.loads(lines.get(timeout=60))["request_id"] == "a"
        log(folder, "b", prompt_tokens=7)
        row = json.loads(lines.get(timeout=30))
        assert (row["request_id"], row["prompt_tokens"]) == ("b", 7)
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert proc.stderr is not None and proc.stderr.read() == ""
    assert lines.empty()
