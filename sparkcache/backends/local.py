"""Objects as files under a root folder: :class:`LocalBackend` and :class:`MmapBackend`.

Writes are durable publications (the protocol in ``docs/architecture.md``):

1. create missing folders one by one, remembering which ones this call made;
2. write every chunk to a temp file in the object's own folder (``temp_key``),
   opened ``O_EXCL | O_NOFOLLOW`` so it can never land on someone else's file;
3. ``fsync`` the file, ``close`` it (errors of delayed writes surface there),
   ``rename`` it onto the final name -- atomic on POSIX filesystems, so readers
   see the old file or the new one;
4. ``fsync`` the object's folder (the rename lives in the folder's entries) and
   the parent of every folder created in step 1 (their entries live there).

Only after step 4 does ``put`` return, so an object the index marks ready survives
a power cut.  ``durable=False`` skips the fsyncs (tests, scratch stores).

Path safety: a key that passed ``validate_key`` cannot climb out of the root by
itself, but a symlink planted under the root could redirect it.  Every key is
therefore resolved with ``os.path.realpath`` and must stay strictly inside the
(real) root, else :class:`~sparkcache.errors.UnsafeName`.  The check is made when
the call starts; the store owns its root, so a symlink swapped in during a call
is out of scope (the temp file is still opened ``O_NOFOLLOW``).  ``list`` never
follows symlinks.

Deleting leaves empty folders in place on purpose: pruning them would race with a
concurrent ``put`` that just created the folder and is about to open its temp file.
Only ``remove_tree``, for a folder nothing writes to any more (a deleted model's),
removes folders.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

from sparkcache.backends.base import BufferBlob, DiskUsage, translate_os_error
from sparkcache.backends.keys import temp_key, validate_key
from sparkcache.buffers import as_byte_view
from sparkcache.errors import BackendError, InvalidArgument, NotFound, UnsafeName

if TYPE_CHECKING:
    from sparkcache.backends.base import Blob, BufferLike

__all__ = ["LocalBackend", "MmapBackend", "MmapBlob"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC
_FILE_MODE = 0o644
_FOLDER_MODE = 0o755

_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)", re.DOTALL)


def root_from_url(root: str | os.PathLike[str]) -> str:
    """Absolute folder path for a plain path or a ``<scheme>:///abs/path`` URL.

    The registry hands a backend factory the URL it was opened with, so the local
    backends accept ``local:///data/kv``, ``mmap:///data/kv`` or ``file:///data/kv``
    as well as ``/data/kv``.  A host part other than ``localhost`` is refused: it
    would silently mean a relative path.
    """
    text = os.fspath(root)
    match = _URL_RE.fullmatch(text)
    if match is not None:
        rest = match.group("rest")
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            raise InvalidArgument(
                f"local store URL {text!r} has no absolute path; write it with three "
                f"slashes, e.g. '{match.group('scheme')}:///data/sparkcache', or pass a "
                "plain path"
            )
        text = rest
    if not text:
        raise InvalidArgument("local store root is empty; pass a folder path")
    return os.path.abspath(text)


class LocalBackend:
    """Objects as files under ``root`` (created if missing); reads copy into memory.

    ``open`` reads the whole file into one ``bytearray`` with ``readinto`` (a single
    copy, no intermediate ``bytes``).  Use :class:`MmapBackend` to map instead.
    """

    scheme: ClassVar[str] = "local"
    zero_copy: bool = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = root_from_url(root)
        try:
            os.makedirs(path, mode=_FOLDER_MODE, exist_ok=True)
        except OSError as exc:
            raise BackendError(
                f"cannot create the store root {path!r}: {exc}; create it or choose a "
                "writable folder"
            ) from exc
        self.root = os.path.realpath(path)
        if not os.path.isdir(self.root):
            raise BackendError(f"store root {self.root!r} is not a folder; choose a folder")
        self._inside = self.root if self.root.endswith(os.sep) else self.root + os.sep
        self.url = f"{self.scheme}://{self.root}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    # -- paths ------------------------------------------------------------------

    def _resolve(self, key: str) -> str:
        """Real path of ``key``; UnsafeName unless it lies strictly inside the root."""
        validate_key(key)
        real = os.path.realpath(os.path.join(self.root, *key.split("/")))
        if not real.startswith(self._inside):
            raise UnsafeName(
                f"object key {key!r} resolves to {real!r}, outside the store root "
                f"{self.root!r}: a symlink under the root points elsewhere; remove it "
                "(the store never creates symlinks)"
            )
        return real

    def _make_folders(self, folder: str) -> list[str]:
        """Create ``folder`` and missing parents under the root; return those created.

        One ``mkdir`` at a time (not ``os.makedirs``) so the caller knows exactly
        which parents gained an entry and must be fsynced.
        """
        created: list[str] = []
        relative = os.path.relpath(folder, self.root)
        if relative == os.curdir:
            return created
        current = self.root
        for part in relative.split(os.sep):
            current = os.path.join(current, part)
            try:
                os.mkdir(current, _FOLDER_MODE)
            except FileExistsError:
                continue
            created.append(current)
        return created

    # -- writes -----------------------------------------------------------------

    def put(self, key: str, chunks: Iterable[BufferLike], *, durable: bool = True) -> int:
        """Publish ``chunks`` as ``key`` durably and atomically (see the module doc)."""
        final = self._resolve(key)
        tmp = self._resolve(temp_key(key))
        folder = os.path.dirname(tmp)
        fd = -1
        try:
            created = self._make_folders(folder)
            fd = os.open(tmp, _WRITE_FLAGS, _FILE_MODE)
            total = 0
            for chunk in chunks:
                total += _write_all(fd, as_byte_view(chunk, copy=True).data)
            if durable:
                os.fsync(fd)
            fd, closing = -1, fd
            os.close(closing)
            os.rename(tmp, final)
        except BaseException as exc:
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
            with suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise translate_os_error(
                    exc, "writing", key, self.url, missing_is_not_found=False
                ) from exc
            raise
        if durable:
            # Deepest first: the object's own folder holds the rename that matters most.
            folders = {folder, *(os.path.dirname(path) for path in created)}
            try:
                for path in sorted(folders, key=len, reverse=True):
                    _fsync_folder(path)
            except OSError as exc:
                # The object is in place but may not survive a power cut; the caller
                # must not mark it ready, and check(fix=True) removes the orphan.
                raise translate_os_error(
                    exc, "syncing the folder of", key, self.url, missing_is_not_found=False
                ) from exc
        return total

    def delete(self, key: str) -> bool:
        """Unlink the object; False if there was none (folders are not objects)."""
        path = self._resolve(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except OSError as exc:
            raise translate_os_error(exc, "deleting", key, self.url) from exc
        return True

    # -- reads ------------------------------------------------------------------

    def _stat(self, key: str) -> os.stat_result | None:
        """``stat`` of the object's file, or None if there is no regular file there."""
        path = self._resolve(key)
        try:
            result = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise translate_os_error(exc, "inspecting", key, self.url) from exc
        return result if stat.S_ISREG(result.st_mode) else None

    def exists(self, key: str) -> bool:
        return self._stat(key) is not None

    def size(self, key: str) -> int:
        result = self._stat(key)
        if result is None:
            raise NotFound(f"no object {key!r} in {self.url}")
        return result.st_size

    def _open_fd(self, key: str) -> tuple[int, int]:
        """Open the object's file read-only; return ``(fd, size)``.  NotFound if absent."""
        path = self._resolve(key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise translate_os_error(exc, "opening", key, self.url) from exc
        try:
            result = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise translate_os_error(exc, "opening", key, self.url) from exc
        if not stat.S_ISREG(result.st_mode):
            os.close(fd)
            raise NotFound(f"no object {key!r} in {self.url} (that name is a folder)")
        return fd, result.st_size

    def open(self, key: str) -> Blob:
        """Read the whole object into memory (one copy) and return it as a blob."""
        fd, length = self._open_fd(key)
        try:
            data = bytearray(length)
            with memoryview(data) as view, os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
                done = 0
                while done < length:
                    count = f.readinto(view[done:])
                    if not count:
                        break
                    done += count
        except OSError as exc:
            raise translate_os_error(exc, "reading", key, self.url) from exc
        finally:
            os.close(fd)
        if done < length:
            # Objects are immutable, so a short read means the file was truncated
            # behind the store's back; hand back what is there and let the digest
            # check in the reader call it corrupt.
            del data[done:]
        return BufferBlob(data)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys of every regular file under folder ``prefix``, temp files included.

        Symlinks are neither followed nor listed, and file names that are not valid
        keys (editor backups, ``.nfs*`` files) are skipped: no method could use them.
        """
        if prefix:
            base = validate_key(prefix.removesuffix("/"))
            folder = self._resolve(base)
        else:
            base, folder = "", self.root
        return self._walk(folder, base)

    def _walk(self, top: str, top_key: str) -> Iterator[str]:
        pending = [(top, top_key)]
        while pending:
            folder, folder_key = pending.pop()
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise translate_os_error(exc, "listing", folder_key, self.url) from exc
            for entry in entries:
                key = f"{folder_key}/{entry.name}" if folder_key else entry.name
                try:
                    validate_key(key)
                except UnsafeName:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, key))
                elif entry.is_file(follow_symlinks=False):
                    yield key

    def folders(self, prefix: str) -> Iterator[str]:
        """Keys of the folders directly inside ``prefix`` (symlinks are not folders)."""
        base = validate_key(prefix.removesuffix("/"))
        folder = self._resolve(base)
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return iter(())
        except OSError as exc:
            raise translate_os_error(exc, "listing", base, self.url) from exc
        found = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                with suppress(UnsafeName):
                    found.append(validate_key(f"{base}/{entry.name}"))
        return iter(found)

    def remove_tree(self, prefix: str) -> int:
        """Unlink every file under ``prefix``, then its folders, deepest first."""
        base = validate_key(prefix.removesuffix("/"))
        removed = sum(1 for key in list(self.list(base)) if self.delete(key))
        top = self._resolve(base)
        for folder, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with suppress(OSError):  # not empty (a stray non-key file), or gone already
                os.rmdir(folder)
        return removed

    def disk_usage(self) -> DiskUsage:
        """Size of the root's filesystem and the bytes an unprivileged writer may still use."""
        try:
            info = os.statvfs(self.root)
        except OSError as exc:
            raise BackendError(f"cannot read free space of {self.root!r}: {exc}") from exc
        return DiskUsage(info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize)

    def warm(self, key: str, buffer: Any, stop: Callable[[], bool] | None = None) -> int:
        """Read the object's file through ``buffer`` (reused, any writable
        buffer), so that its pages are in the OS page cache; return the bytes
        read.  Nothing is kept: a restore still reads and verifies every byte
        it copies.  ``stop()`` true ends the read between chunks.  NotFound if
        the object is absent, BackendError if it cannot be read."""
        fd, length = self._open_fd(key)
        target = memoryview(buffer).cast("B")
        done = 0
        try:
            while done < length and target.nbytes and not (stop is not None and stop()):
                got = _pread(fd, [target[:length - done]], done, key, self.url)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)
        return done

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own descriptors."""


class MmapBlob:
    """A :class:`Blob` over a read-only ``mmap`` of the whole file, plus its descriptor.

    The mapping keeps the bytes readable even if the file is deleted or replaced
    meanwhile (POSIX keeps an unlinked inode alive while mapped).  ``read_at``
    reads the same file positionally (``preadv``): a bulk reader that copies the
    bytes anyway avoids faulting the mapping in page by page and the cost of
    unmapping those pages.  ``close`` releases our view, unmaps and closes the
    descriptor.  If a consumer still holds views derived from ``buffer`` (slices,
    ``numpy.frombuffer``), unmapping is refused with ``BufferError``; the blob
    then drops its reference and the mapping is unmapped when the last of those
    views is garbage collected.  Consumers should release their views first.
    """

    __slots__ = ("_fd", "_key", "_mmap", "_url", "_view")

    def __init__(self, mapped: mmap.mmap, fd: int, key: str, url: str) -> None:
        self._mmap: mmap.mmap | None = mapped
        # ACCESS_READ mappings export read-only buffers, so writes raise TypeError.
        self._view: memoryview | None = memoryview(mapped)
        self._fd = fd  # owned: closed by close()
        self._key = key
        self._url = url

    @property
    def buffer(self) -> memoryview:
        if self._view is None:
            raise ValueError("blob is closed; open the object again to read it")
        return self._view

    def read_at(self, offset: int, out: Any) -> int:
        """Fill ``out`` (a writable buffer, or a list of them filled in order by
        one vectored read) from byte ``offset``; return the bytes read, fewer
        only where the file ends.  Safe from several threads."""
        if self._view is None:
            raise ValueError("blob is closed; open the object again to read it")
        parts = out if isinstance(out, (list, tuple)) else [out]
        return _pread(self._fd, [memoryview(p).cast("B") for p in parts], offset,
                      self._key, self._url)

    def close(self) -> None:
        view, self._view = self._view, None
        mapped, self._mmap = self._mmap, None
        fd, self._fd = self._fd, -1
        if view is not None:
            with suppress(BufferError):
                view.release()
        if mapped is not None:
            with suppress(BufferError):
                mapped.close()
        if fd >= 0:
            with suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class MmapBackend(LocalBackend):
    """:class:`LocalBackend` whose ``open`` maps the file instead of copying it.

    The default backend for a plain path: opening costs nothing until bytes are
    touched, the page cache is shared by every process reading the same
    segment, and the blob's ``read_at`` serves bulk readers (the verified
    restore) without faulting the mapping in.
    """

    scheme: ClassVar[str] = "mmap"
    zero_copy: bool = True

    def open(self, key: str) -> Blob:
        """Map the object read-only; the blob keeps the descriptor for ``read_at``.
        An empty object gets an empty in-memory blob."""
        fd, length = self._open_fd(key)
        try:
            if length == 0:
                os.close(fd)
                return BufferBlob(b"")  # mmap refuses a zero-length mapping
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            with suppress(OSError):
                os.close(fd)
            raise translate_os_error(exc, "mapping", key, self.url) from exc
        return MmapBlob(mapped, fd, key, self.url)


def _pread(fd: int, targets: list[memoryview], offset: int, key: str, url: str) -> int:
    """Fill ``targets`` in order from byte ``offset`` of ``fd`` (one vectored
    read, again for what a short read left); the bytes read, fewer only where
    the file ends (an OSError as the backend's error)."""
    done = 0
    try:
        while targets:
            got = os.preadv(fd, targets, offset + done)
            if got <= 0:
                break
            done += got
            while targets and got >= targets[0].nbytes:  # the filled ones
                got -= targets[0].nbytes
                targets = targets[1:]
            if targets and got:
                targets = [targets[0][got:], *targets[1:]]
    except OSError as exc:
        raise translate_os_error(exc, "reading", key, url) from exc
    return done


def _write_all(fd: int, view: memoryview) -> int:
    """Write all of ``view`` to ``fd`` (``os.write`` may write less); return its size."""
    total = view.nbytes
    done = 0
    while done < total:
        written = os.write(fd, view[done:])
        if written <= 0:  # never seen on regular files; avoid spinning if it happens
            raise OSError(errno.EIO, "write() made no progress")
        done += written
    return total


def _fsync_folder(path: str) -> None:
    """fsync a folder so the entries added to it (renames, new folders) are durable."""
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
