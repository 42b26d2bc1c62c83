"""Fixtures shared by the backend tests: one factory per backend kind.

Every kind in :data:`BACKEND_KINDS` runs the whole conformance suite; a new backend
joins by adding a branch to :func:`make_backend`.  ``fsspec-s3`` talks to a real
S3-protocol server: moto's, started on 127.0.0.1 for the session (one bucket per
test).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from sparkcache import backends as registry
from sparkcache.backends import Backend, FsspecBackend, LocalBackend, MmapBackend

BACKEND_KINDS = ["local", "mmap", "fsspec-memory", "fsspec-file", "fsspec-s3"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's S3 server on 127.0.0.1, and the options that reach it."""

    def __init__(self) -> None:
        self.port = free_port()
        # botocore reads these too: a bare s3:// URL (reopened from backend.url)
        # reaches this server, as it would a real endpoint set in the environment.
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.port}",
                          AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("moto's S3 server did not start")
            time.sleep(0.05)

    @property
    def options(self) -> dict[str, object]:
        return {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "test",
                "secret": "test"}

    def bucket(self) -> str:
        """A new, empty bucket."""
        import s3fs

        name = f"sparkcache-{uuid.uuid4().hex[:16]}"
        s3fs.S3FileSystem(**self.options).mkdir(name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_S3: list[S3Server] = []


def s3_server() -> S3Server:
    """The session's S3 server, started on first use (stopped by the session fixture)."""
    if not _S3:
        _S3.append(S3Server())
    return _S3[0]


@pytest.fixture(scope="session", autouse=True)
def _stop_s3_server() -> Iterator[None]:
    yield
    while _S3:
        _S3.pop().stop()


def make_backend(kind: str, folder: Path) -> Backend:
    """A fresh, empty backend of ``kind``; ``folder`` is used by the on-disk kinds."""
    if kind == "local":
        return LocalBackend(folder)
    if kind == "mmap":
        return MmapBackend(folder)
    if kind == "fsspec-memory":
        # The memory filesystem is one process-wide dict: a unique root per test.
        return FsspecBackend(f"memory://sparkcache-test-{uuid.uuid4().hex}")
    if kind == "fsspec-file":
        folder.mkdir(parents=True, exist_ok=True)
        return FsspecBackend(f"file://{folder}")
    if kind == "fsspec-s3":
        server = s3_server()
        return FsspecBackend(f"s3://{server.bucket()}/store", **server.options)
    raise AssertionError(f"unknown backend kind {kind!r}")


def dispose_backend(backend: Backend) -> None:
    """Close ``backend`` and drop what a memory backend stored (disk kinds use tmp_path)."""
    backend.close()
    if isinstance(backend, FsspecBackend) and backend.url.startswith("memory://"):
        with suppress(FileNotFoundError):
            backend.fs.rm(backend.url, recursive=True)


@pytest.fixture(params=BACKEND_KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend kind in turn, empty, removed after the test."""
    made = make_backend(str(request.param), tmp_path / "store")
    yield made
    dispose_backend(made)


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Restore the backend registry after a test that registers schemes."""
    saved, loaded = dict(registry._registry), dict(registry._loaded)
    yield
    registry._registry.clear()
    registry._registry.update(saved)
    registry._loaded.clear()
    registry._loaded.update(loaded)
