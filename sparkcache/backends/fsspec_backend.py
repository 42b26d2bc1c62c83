"""Objects on any filesystem fsspec can open: ``memory://``, ``file://``, ``s3://``, ...

Keys map to ``<root path of the URL>/<key>``.  A write goes to the temp key
(``fs.open(tmp, 'wb')``) and is published by ``fs.mv(tmp, final)``.  How atomic and
durable that is depends on the filesystem, and this backend cannot do better than
the filesystem allows:

* ``memory://``: the move is a single dict assignment, atomic within the process;
  nothing survives the process.
* ``file://``: the move is ``os.rename`` (atomic), but nothing is fsynced; use
  ``local://`` or a plain path for durable local storage.
* object stores (``s3://``, ``gs://``, ``az://``, ...: :data:`OBJECT_STORES`): an
  upload becomes visible whole when it completes, so ``put`` writes the final key
  directly (one PUT, or a multipart upload completed when the file is closed
  after its last byte; discarded on failure, never committed by a finaliser) --
  no temp object, no copy-then-delete, and never a folder made:
  s3fs's ``makedirs`` would create a missing bucket, and a typo must not become
  a bucket with its own owner and costs.  ``durable`` is the store's own guarantee.

Every failure reaches the caller as a :class:`~sparkcache.errors.SparkCacheError`
(a filesystem's own errors, botocore's included, as ``BackendError`` saying what to
check).  ``s3://`` clients get connect and read timeouts and a bounded retry
(``S3_CLIENT_DEFAULTS``) unless ``config_kwargs`` says otherwise.

``open`` copies the object into memory (``fs.cat_file``); ``zero_copy`` is False and
``disk_usage`` is None (fsspec has no portable way to ask).  fsspec is imported
when the first backend is created, so ``import sparkcache`` stays cheap.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from sparkcache.backends.base import BufferBlob, translate_os_error
from sparkcache.backends.keys import temp_key, validate_key
from sparkcache.buffers import as_byte_view
from sparkcache.errors import BackendError, NotFound, SparkCacheError, UnsafeName

if TYPE_CHECKING:
    from sparkcache.backends.base import Blob, BufferLike

__all__ = ["FSSPEC_PREFIX", "OBJECT_STORES", "FsspecBackend", "is_object_store"]

FSSPEC_PREFIX = "fsspec::"
"""Prefix that forces :func:`~sparkcache.backends.open_backend` to use this backend."""


#: Client settings for object stores reached through botocore (s3fs), unless the
#: caller passes its own: an unreachable endpoint is an error within seconds,
#: and a failing request is retried a bounded number of times.
S3_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5, "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}

#: fsspec protocols of object stores: the first part of a path is a bucket (or
#: container), there are no folders, and an upload is visible only once complete.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})

class _CallersError(Exception):
    """Carries an exception the caller's chunk iterator raised through ``put``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _chunks_of(chunks: Iterable[BufferLike]) -> Iterator[BufferLike]:
    """``chunks``, with what iterating them raises marked as the caller's."""
    it = iter(chunks)
    while True:
        try:
            chunk = next(it)
        except StopIteration:
            return
        except Exception as exc:
            raise _CallersError(exc) from exc
        yield chunk


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _guarded(action: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Every failure of the wrapped method is a SparkCacheError: a filesystem's
    own errors (botocore's, a cloud SDK's) become BackendError naming the
    object, the URL and what to check."""
    def wrap(method: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(method)
        def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return method(*args, **kwargs)
            except SparkCacheError:
                raise
            except _CallersError as wrapped:  # raised by the caller's own code: as it was
                raise wrapped.error from None
            except Exception as exc:
                self, key = args[0], (args[1] if len(args) > 1 else "")
                url = getattr(self, "url", "?")
                raise BackendError(
                    f"{action} {key!r} in {url} failed: {type(exc).__name__}: {exc}; check "
                    "the endpoint, the credentials and the network (and that the bucket "
                    "exists)") from exc
        return guarded
    return wrap


class FsspecBackend:
    """Objects under the root path of an fsspec URL.

    ``storage_options`` are passed to the filesystem (credentials, endpoints).  The
    filesystem instance is fsspec's cached one for those options, so several
    backends on one bucket share connections.
    """

    zero_copy: bool = False

    def __init__(self, url: str | os.PathLike[str], **storage_options: Any) -> None:
        text = os.fspath(url).removeprefix(FSSPEC_PREFIX)
        try:
            import fsspec.core
        except ImportError as exc:  # pragma: no cover - fsspec is a dependency
            raise BackendError(
                f"cannot open {text!r}: fsspec is not installed; run 'pip install fsspec'"
            ) from exc
        if text.split("://", 1)[0] in ("s3", "s3a"):
            given = storage_options.get("config_kwargs") or {}
            storage_options["config_kwargs"] = {**S3_CLIENT_DEFAULTS, **given}
        try:
            fs, root = fsspec.core.url_to_fs(text, **storage_options)
        except ImportError as exc:
            raise BackendError(
                f"cannot open {text!r}: fsspec needs an extra package for it ({exc}); "
                "install that package"
            ) from exc
        except Exception as exc:
            raise BackendError(f"cannot open {text!r} with fsspec: {type(exc).__name__}: "
                               f"{exc}; check the URL and the storage options") from exc
        self.fs: Any = fs
        self.url = text
        # Kept without its trailing slash so keys join as f"{root}/{key}"; a root of
        # "/" becomes "" and keys become "/key", which is what both the local and the
        # memory filesystem expect.
        self._root: str = str(root).rstrip("/")
        #: True on an object store (:data:`OBJECT_STORES`): ``put`` writes the key
        #: directly and never makes folders (nor buckets).
        self.object_store = is_object_store(fs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self._root}/{validate_key(key)}"

    def _os_error(self, exc: OSError, action: str, key: str, where: str, *,
                  missing_is_not_found: bool = True) -> SparkCacheError:
        """:func:`translate_os_error`, saying what to check on an object store
        (where a failure is no disk's): credentials, endpoint, bucket."""
        error = translate_os_error(exc, action, key, where,
                                   missing_is_not_found=missing_is_not_found)
        if not self.object_store or type(error) is not BackendError:
            return error
        what = ("access denied" if isinstance(exc, PermissionError)
                else "no such bucket or object" if isinstance(exc, FileNotFoundError)
                else f"{type(exc).__name__}: {exc}")
        return BackendError(
            f"{action} object {key!r} in {where} failed ({what}): check the credentials "
            "(the AWS_* environment, the profile), the endpoint and that the bucket exists")

    # -- writes -----------------------------------------------------------------

    @_guarded("writing")
    def put(self, key: str, chunks: Iterable[BufferLike], *, durable: bool = True) -> int:
        """Write ``chunks`` to a temp key, then move it onto ``key`` (on an object
        store: to ``key`` itself, committed only once complete).

        ``durable`` is accepted for the protocol; durability is the filesystem's
        (see the module doc).  On failure the temp object is removed (the upload
        discarded); a failure to remove it is swallowed so that the original
        error is the one raised.
        """
        if self.object_store:
            return self._upload(key, chunks)
        path = self._path(key)
        tmp = self._path(temp_key(key))
        handle: Any = None
        try:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            handle = self.fs.open(tmp, "wb")
            total = 0
            for chunk in _chunks_of(chunks):
                view = as_byte_view(chunk, copy=True)
                handle.write(view)
                total += view.size
            handle, closing = None, handle
            closing.close()
            self.fs.mv(tmp, path)
        except BaseException as exc:
            if handle is not None:
                with suppress(Exception):
                    handle.close()
            with suppress(Exception):
                self.fs.rm_file(tmp)
            if isinstance(exc, OSError):
                raise self._os_error(
                    exc, "writing", key, self.url, missing_is_not_found=False
                ) from exc
            raise
        return total

    def _upload(self, key: str, chunks: Iterable[BufferLike]) -> int:
        """``put`` on an object store: one upload of the final key, visible only
        when committed; no folder (nor bucket) is ever made."""
        path = self._path(key)
        handle: Any = self.fs.open(path, "wb")
        try:
            total = 0
            for chunk in _chunks_of(chunks):
                view = as_byte_view(chunk, copy=True)
                handle.write(view)
                total += view.size
            handle.close()  # the one commit: a put, or the multipart upload completed
        except BaseException as exc:
            with suppress(Exception):
                handle.discard()
            handle.closed = True  # never committed by the file's finaliser
            if isinstance(exc, OSError):
                raise self._os_error(
                    exc, "writing", key, self.url, missing_is_not_found=False
                ) from exc
            raise
        return total

    @_guarded("deleting")
    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            if not self.fs.isfile(path):
                return False
            self.fs.rm_file(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._os_error(exc, "deleting", key, self.url) from exc
        return True

    # -- reads ------------------------------------------------------------------

    @_guarded("reading")
    def open(self, key: str) -> Blob:
        """Fetch the whole object into memory (``cat_file``)."""
        path = self._path(key)
        try:
            data = self.fs.cat_file(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._os_error(exc, "reading", key, self.url) from exc
        # s3fs returns a bytearray for a large object (read in concurrent ranges):
        # kept as it is, not copied again.
        return BufferBlob(data if isinstance(data, (bytes, bytearray)) else bytes(data))

    @_guarded("looking up")
    def exists(self, key: str) -> bool:
        # Not fs.isfile: it answers False for any error, an unreachable endpoint
        # included, and a checker would take every object for missing.
        path = self._path(key)
        try:
            return bool(self.fs.info(path).get("type") == "file")
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._os_error(exc, "inspecting", key, self.url) from exc

    @_guarded("inspecting")
    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            info = self.fs.info(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._os_error(exc, "inspecting", key, self.url) from exc
        if info.get("type") != "file":
            raise NotFound(f"no object {key!r} in {self.url} (that name is a folder)")
        return int(info["size"])

    @_guarded("inspecting")
    def head(self, key: str) -> int | None:
        """The object's size, or None when there is none, in one request where
        the filesystem allows: on S3 a HEAD (``size`` and ``exists`` go through
        ``fs.info``, which lists the prefix after a miss to tell a folder)."""
        path = self._path(key)
        if self.object_store and hasattr(self.fs, "call_s3"):  # s3fs
            bucket, name, _version = self.fs.split_path(path)
            try:
                out = self.fs.call_s3("head_object", Bucket=bucket, Key=name)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._os_error(exc, "inspecting", key, self.url) from exc
            return int(out["ContentLength"])
        try:
            return self.size(key)
        except NotFound:
            return None

    @_guarded("listing")
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys of every object under folder ``prefix`` (``fs.find``), temp keys included.

        Names that are not valid keys (written by other tools) are skipped.
        """
        base = validate_key(prefix.removesuffix("/")) if prefix else ""
        folder = f"{self._root}/{base}" if base else (self._root or "/")
        try:
            found = self.fs.find(folder)
        except (FileNotFoundError, NotADirectoryError):
            found = []
        except OSError as exc:
            raise self._os_error(exc, "listing", base, self.url) from exc
        inside = self.fs._strip_protocol(folder).rstrip("/") + "/"
        return self._keys(found, inside, base)

    @staticmethod
    def _keys(found: Iterable[str], inside: str, base: str) -> Iterator[str]:
        for path in found:
            if not path.startswith(inside):
                continue  # the prefix itself when it names an object, not a folder
            key = path[len(inside) :]
            if base:
                key = f"{base}/{key}"
            try:
                yield validate_key(key)
            except UnsafeName:
                continue

    @_guarded("listing")
    def folders(self, prefix: str) -> Iterator[str]:
        """Keys of the folders directly inside ``prefix`` (``fs.ls``)."""
        base = validate_key(prefix.removesuffix("/"))
        try:
            entries = self.fs.ls(f"{self._root}/{base}", detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return iter(())
        except OSError as exc:
            raise self._os_error(exc, "listing", base, self.url) from exc
        found = []
        for entry in entries:
            if entry.get("type") == "directory":
                name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
                with suppress(UnsafeName):
                    found.append(validate_key(f"{base}/{name}"))
        return iter(found)

    @_guarded("removing")
    def remove_tree(self, prefix: str) -> int:
        """Delete every object under ``prefix``, then the folder where the filesystem
        has folders (object stores have none left once their objects are gone)."""
        base = validate_key(prefix.removesuffix("/"))
        removed = sum(1 for key in list(self.list(base)) if self.delete(key))
        with suppress(OSError):
            self.fs.rm(f"{self._root}/{base}", recursive=True)
        return removed

    def disk_usage(self) -> None:
        """Unknown: fsspec has no portable free-space query."""
        return None

    def close(self) -> None:
        """Nothing to release: the filesystem instance is fsspec's shared, cached one."""


def is_object_store(fs: Any) -> bool:
    """Whether an fsspec filesystem is an object store (:data:`OBJECT_STORES`)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in OBJECT_STORES for p in protocols)
