"""Fixtures shared by the backend tests: one factory per backend kind.

Every kind in :data:`BACKEND_KINDS` runs the whole conformance suite; a new backend
joins by adding a branch to :func:`make_backend`.  The kinds in
:data:`OBJECT_STORE_KINDS` run its :class:`~sparkcache.backends.ObjectStore` part
too; ``derived`` is one whose every derived method is the protocol's default.
``fsspec-s3`` talks to a real S3-protocol server: moto's (``tests/s3server.py``),
started on 127.0.0.1 for the session (one bucket per test).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from sparkcache import backends as registry
from sparkcache.backends import Backend, FsspecBackend, LocalBackend, MmapBackend, ObjectStore

from ..s3server import S3Server, free_port, s3_server, stop_s3_servers

__all__ = ["BACKEND_KINDS", "OBJECT_STORE_KINDS", "DerivedStore", "S3Server", "dispose_backend",
           "free_port", "make_backend", "s3_server"]

BACKEND_KINDS = ["local", "mmap", "fsspec-memory", "fsspec-file", "fsspec-s3"]
#: The kinds that are :class:`~sparkcache.backends.ObjectStore`\ s.
OBJECT_STORE_KINDS = ["fsspec-memory", "fsspec-file", "fsspec-s3", "derived"]


class DerivedStore(FsspecBackend):
    """The memory filesystem with only :class:`ObjectStore`'s core of its own:
    every derived method is the protocol's default, so the suite checks those."""

    head = ObjectStore.head
    read_stream = ObjectStore.read_stream
    get_many = ObjectStore.get_many
    delete_many = ObjectStore.delete_many
    local_path = ObjectStore.local_path
    conditional_writes = ObjectStore.conditional_writes
    etag = ObjectStore.etag
    put_conditional = ObjectStore.put_conditional


@pytest.fixture(scope="session", autouse=True)
def _stop_s3_server() -> Iterator[None]:
    yield
    stop_s3_servers()


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
    if kind == "derived":
        return DerivedStore(f"memory://sparkcache-test-{uuid.uuid4().hex}")
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


@pytest.fixture(params=OBJECT_STORE_KINDS)
def object_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    """Each object-store kind in turn, empty, removed after the test."""
    made = make_backend(str(request.param), tmp_path / "store")
    assert isinstance(made, ObjectStore)
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
