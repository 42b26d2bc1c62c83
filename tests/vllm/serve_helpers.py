"""``sparkcache serve`` as the tests run it: a real server process on 127.0.0.1.

:class:`Server` starts ``python -m sparkcache serve`` with the tests' tiny model
(float32, 32-token blocks, a 64-block KV cache so that one long conversation
pushes another out of vLLM's live cache) on a free port, waits until vLLM's
``/health`` answers, and stops it (SIGINT, then SIGKILL of its process group)
even when a test fails.  Its output goes to a log file that a failure shows.
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

from tiny_model import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_CACHE_BLOCKS, apply_cpu_env

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
START_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One ``sparkcache serve`` process (a context manager)."""

    def __init__(self, model_dir: Path, folder: Path, log: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.folder = folder
        self.log_path = log
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "sparkcache", "serve", str(model_dir),
            "--folder", str(folder), "--port", str(self.port),
            "--served-model-name", MODEL_NAME, "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS), "--max-num-seqs", "8",
            "--seed", "0", *extra,
        ]
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
