"""Dry runs: a deleting operation rehearsed, reporting what it would delete.

:func:`run` runs the real operation (``check --fix``, ``clear``, ``rm``,
``sweep``) on a core whose storage only records deletions and refuses writes,
inside one write transaction that is then rolled back: the rehearsal follows
the very rules the real run follows, and changes nothing.  The store's
deleting methods (:meth:`SnapshotStore.check <sparkcache.store.SnapshotStore.check>`
with ``fix``, ``sweep``, ``clear_model``, ``delete_model``) take ``dry_run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from sparkcache.backends import Backend, Blob, BufferLike, DiskUsage
from sparkcache.core import Core
from sparkcache.errors import NotFound

__all__ = ["DryRun", "run"]


ReportT = TypeVar("ReportT")


@dataclass(frozen=True)
class DryRun(Generic[ReportT]):
    """What a deleting operation would do; nothing was changed.

    ``report`` is the real operation's own result, computed by running it in a
    transaction that was rolled back; ``files`` the object keys whose files it
    would delete and ``folders`` the model folders it would remove.
    """

    report: ReportT
    files: list[str]
    folders: list[str]


# -- dry runs ---------------------------------------------------------------------------------


class _DryBackend:
    """The store's backend during a dry run: reads go through, deletions are only
    recorded (and look done to the rest of the run), writes are refused.

    So a dry run cannot change a file, whether it deletes after a commit (which
    never comes) or directly, as removing a model's folder does.
    """

    def __init__(self, backend: Backend) -> None:
        self.inner = backend
        self.url = backend.url
        self.zero_copy = backend.zero_copy
        self.gone: dict[str, int] = {}  # object key -> bytes its deletion frees
        self.folders_gone: list[str] = []

    def put(self, key: str, chunks: Iterable[BufferLike], *, durable: bool = True) -> int:
        raise RuntimeError(f"a dry run tried to write {key}; a dry run must change nothing")

    def open(self, key: str) -> Blob:
        if key in self.gone:
            raise NotFound(f"{key} (deleted earlier in this dry run)")
        return self.inner.open(key)

    def delete(self, key: str) -> bool:
        if key in self.gone or not self.inner.exists(key):
            return False
        self.gone[key] = self.inner.size(key)
        return True

    def exists(self, key: str) -> bool:
        return key not in self.gone and self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return (key for key in self.inner.list(prefix) if key not in self.gone)

    def size(self, key: str) -> int:
        if key in self.gone:
            raise NotFound(f"{key} (deleted earlier in this dry run)")
        return self.inner.size(key)

    def folders(self, prefix: str) -> Iterator[str]:
        return (f for f in self.inner.folders(prefix) if f not in self.folders_gone)

    def remove_tree(self, prefix: str) -> int:
        removed = sum(self.delete(key) for key in list(self.list(prefix)))
        if prefix not in self.folders_gone:
            self.folders_gone.append(prefix)
        return removed

    def disk_usage(self) -> DiskUsage | None:
        usage = self.inner.disk_usage()
        if usage is None:
            return None
        return DiskUsage(usage.total, usage.free + sum(self.gone.values()))

    def close(self) -> None:
        """The store's backend stays open: it belongs to the store."""


class _Rehearsal(Core):
    """A core over the store's index and a :class:`_DryBackend`.

    The files a transaction would delete after its commit are recorded as gone
    at once, since the dry run never commits: what a real sweep sees between
    its transactions (free disk, what a folder still holds) the dry run sees
    too.  No deleting operation catches an error inside its own transaction,
    so nothing recorded here is ever rolled back by the operation itself.
    """

    def delete_after_commit(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete_object(key)

    def release_reserve(self) -> bool:
        return False  # a rehearsal never touches the store's files

    def keep_reserve(self) -> bool:
        return False


class _RolledBack(Exception):
    """Ends a dry run's transaction by rolling it back."""


def run(core: Core, dry_run: bool,
        action: Callable[[Core], ReportT]) -> ReportT | DryRun[ReportT]:
    """``action(core)``, or with ``dry_run`` its rehearsal: ``action`` runs on a
    :class:`_Rehearsal` core inside one write transaction that is rolled back.

    The transaction is the index's own (``Database.write``), not ``core``'s, so
    counts the store has not saved yet are not rolled back with it.  It holds
    the write lock while the operation runs, as the real one would.
    """
    if not dry_run:
        return action(core)
    backend = _DryBackend(core.backend)
    rehearsal = _Rehearsal(core.root, core.db, backend, core.clock)
    reports: list[ReportT] = []
    with contextlib.suppress(_RolledBack), core.db.write():
        reports.append(action(rehearsal))
        raise _RolledBack
    return DryRun(reports[0], sorted(backend.gone), sorted(backend.folders_gone))
