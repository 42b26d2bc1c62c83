"""A worker outlives the first stop signal (``connector.signals``), proved on real
processes with real signals: each child installs a handler like vLLM's worker
(SystemExit at the first SIGINT or SIGTERM), then the connector's notice over
it, and says on its output what happened.  On real vLLM:
tests/vllm/test_serve.py (a restarted server stopped while the step carrying
its answer's save is on its way keeps that snapshot)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sparkcache.connector import signals
from sparkcache.connector.signals import (
    AFTER_DRAIN_S,
    Notice,
    outlive_first_signal,
    outlive_first_signal_in_worker,
)

ROOT = Path(__file__).resolve().parents[2]

#: A process with vLLM's worker handler (exit 7 at a stop signal), then the
#: notice (grace from argv) unless argv says "none"; it ticks until it exits.
CHILD = textwrap.dedent("""
    import signal, sys, time
    from sparkcache.connector.signals import outlive_first_signal

    def vllm_like(signum, frame):
        print("vllm handler", signum, flush=True)
        raise SystemExit(7)

    signal.signal(signal.SIGINT, vllm_like)
    signal.signal(signal.SIGTERM, vllm_like)
    if sys.argv[1] != "none":
        print("installed", outlive_first_signal(float(sys.argv[1])), flush=True)
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
""")


def start(grace: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, grace], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    lines = []
    while (line := proc.stdout.readline()) and line.strip() != "ready":
        lines.append(line)
    assert line.strip() == "ready", "".join(lines)
    return proc


def still_running(proc: subprocess.Popen[str], seconds: float) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


@pytest.mark.parametrize("first,second", [(signal.SIGINT, signal.SIGTERM),
                                          (signal.SIGTERM, signal.SIGINT),
                                          (signal.SIGINT, signal.SIGINT)])
def test_the_first_signal_is_notice_and_the_second_goes_to_vllms_handler(
        first: int, second: int) -> None:
    proc = start("60")
    proc.send_signal(first)
    assert still_running(proc, 1.0), finish(proc)
    proc.send_signal(second)
    code, out = finish(proc)
    assert code == 7, out
    assert f"vllm handler {int(second)}" in out


def test_the_grace_period_ends_with_the_signal_sent_again() -> None:
    proc = start("1.5")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert still_running(proc, 1.0), finish(proc)
    code, out = finish(proc)
    assert code == 7, out
    assert f"vllm handler {int(signal.SIGTERM)}" in out
    assert 1.4 < time.monotonic() - started < 10


def test_without_the_notice_the_first_signal_stops_the_process() -> None:
    """The negative control: the children above would have exited at once."""
    proc = start("none")
    proc.send_signal(signal.SIGINT)
    assert not still_running(proc, 10.0)
    assert finish(proc)[0] == 7


@pytest.fixture
def handlers() -> Any:
    """This process's stop handlers, put back after the test."""
    saved = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    yield saved
    for s, h in saved.items():
        signal.signal(s, h)


def test_installed_once_and_only_over_a_python_handler(handlers: Any) -> None:
    def vllm_like(signum: int, frame: Any) -> None:
        raise SystemExit(7)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert not outlive_first_signal(5.0)  # nothing of Python's to outlive
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    signal.signal(signal.SIGTERM, vllm_like)
    assert outlive_first_signal(5.0)
    notice = signal.getsignal(signal.SIGTERM)
    assert isinstance(notice, Notice)
    assert notice.previous == {int(signal.SIGTERM): vllm_like}
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # left as it was
    assert outlive_first_signal(9.0)  # again: the same notice
    assert signal.getsignal(signal.SIGTERM) is notice and notice.grace_s == 5.0


def test_only_the_main_thread_installs(handlers: Any) -> None:
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(outlive_first_signal(5.0)))
    thread.start()
    thread.join()
    assert got == [False]
    assert not any(isinstance(signal.getsignal(s), Notice) for s in signals.STOP_SIGNALS)


def test_only_a_worker_of_the_mp_executor_installs_with_the_engines_drain(
        handlers: Any) -> None:
    def config(backend: str, timeout: int) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend), shutdown_timeout=timeout)

    signal.signal(signal.SIGINT, lambda s, f: None)
    for backend in ("uni", "ray", "external_launcher"):  # the engine core's own process
        assert not outlive_first_signal_in_worker(config(backend, 30))
        assert not isinstance(signal.getsignal(signal.SIGINT), Notice)
    assert outlive_first_signal_in_worker(config("mp", 30))
    notice = signal.getsignal(signal.SIGINT)
    assert isinstance(notice, Notice) and notice.grace_s == 30 + AFTER_DRAIN_S
