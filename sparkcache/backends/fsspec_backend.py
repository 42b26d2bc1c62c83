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
(:data:`~sparkcache.backends.s3.S3_CLIENT_DEFAULTS`) unless ``config_kwargs`` says otherwise.
On an asynchronous filesystem (s3fs, gcsfs) every request ends within
``request_seconds`` (:data:`~sparkcache.backends.s3.REQUEST_SECONDS`), its
retries included, and within the calling thread's
:func:`~sparkcache.backends.base.deadline`: the request is cancelled then,
and a ``BackendError`` says so.

``open`` copies the object into memory (``fs.cat_file``); ``zero_copy`` is False and
``disk_usage`` is None (fsspec has no portable way to ask).  fsspec is imported
when the first backend is created, so ``import sparkcache`` stays cheap.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from sparkcache.backends import s3
from sparkcache.backends.base import (
    BufferBlob,
    ObjectStat,
    ObjectStore,
    piece_sizes,
    time_left,
    translate_os_error,
)
from sparkcache.backends.fsspec_support import (
    OBJECT_STORES,
    backend_error,
    callers_chunks,
    guarded_by,
    is_object_store,
    mtime_of,
    protocols,
)
from sparkcache.backends.keys import temp_key, validate_key
from sparkcache.buffers import as_byte_view
from sparkcache.errors import BackendError, InvalidArgument, NotFound, SparkCacheError, UnsafeName

if TYPE_CHECKING:
    from sparkcache.backends.base import Blob, BufferLike

__all__ = ["FSSPEC_PREFIX", "OBJECT_STORES", "FsspecBackend", "ObjectStat", "is_object_store"]

FSSPEC_PREFIX = "fsspec::"
"""Prefix that forces :func:`~sparkcache.backends.open_backend` to use this backend."""


#: Small objects read per request of :meth:`FsspecBackend.get_many` (concurrently).
GET_BATCH = 64


class FsspecBackend(ObjectStore):
    """Objects under the root path of an fsspec URL.

    ``storage_options`` are passed to the filesystem (credentials, endpoints).  The
    filesystem instance is fsspec's cached one for those options, so several
    backends on one bucket share connections.
    """

    zero_copy: bool = False

    def __init__(self, url: str | os.PathLike[str], *, request_seconds: float | None = None,
                 **storage_options: Any) -> None:
        text = os.fspath(url).removeprefix(FSSPEC_PREFIX)
        try:
            import fsspec.core
        except ImportError as exc:  # pragma: no cover - fsspec is a dependency
            raise BackendError(
                f"cannot open {text!r}: fsspec is not installed; run 'pip install fsspec'"
            ) from exc
        if text.split("://", 1)[0] in ("s3", "s3a"):
            given = storage_options.get("config_kwargs") or {}
            storage_options["config_kwargs"] = {**s3.S3_CLIENT_DEFAULTS, **given}
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
        self._s3 = self.object_store and s3.is_s3(fs)
        #: The most one request may take, retries included (asynchronous
        #: filesystems only: the others take no timeout).
        self.request_seconds = (None if not getattr(fs, "async_impl", False)
                                else request_seconds or s3.REQUEST_SECONDS)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self._root}/{validate_key(key)}"

    def _limit(self) -> float | None:
        """The timeout of the next request: ``request_seconds``, cut to what is
        left of the thread's deadline (BackendError when nothing is left)."""
        left, bound = time_left(), self.request_seconds
        if left is None or bound is None:
            return bound
        if left <= 0:
            raise BackendError(f"no time was left to ask {self.url}: the operation's deadline "
                               "passed; check the endpoint and the network")
        return min(bound, left)

    def _kw(self) -> dict[str, Any]:
        """The timeout argument of an fsspec call (``{}`` when there is none)."""
        limit = self._limit()
        return {} if limit is None else {"timeout": limit}

    def _os_error(self, exc: OSError, action: str, key: str, where: str, *,
                  missing_is_not_found: bool = True) -> SparkCacheError:
        """:func:`translate_os_error`, saying what to check on an object store
        (where a failure is no disk's): credentials, endpoint, bucket."""
        if isinstance(exc, TimeoutError) and self.request_seconds is not None:
            return BackendError(
                f"{action} object {key!r} in {where} got no answer in time (at most "
                f"{self.request_seconds:g} s a request, retries included): check the endpoint "
                "and the network")
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

    def check_root(self, name: str) -> None:
        """The bucket (object store) or the root folder must exist: neither is made."""
        root = str(self.fs._strip_protocol(self.url)).rstrip("/")
        if self.object_store:
            bucket = root.lstrip("/").split("/", 1)[0]
            if not bucket:
                raise InvalidArgument(f"{name} names no bucket; give s3://bucket/prefix")
            try:
                info = self.fs.info(bucket, **self._kw())
            except FileNotFoundError:
                raise NotFound(
                    f"the bucket {bucket!r} of {name} does not exist, or these credentials "
                    "cannot see it: create the bucket first (sparkcache never creates one), "
                    "or check the URL and the endpoint") from None
            except PermissionError as exc:
                raise BackendError(
                    f"access to {name} was denied ({exc}): check the credentials "
                    "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws) and "
                    "the bucket's policy") from exc
            except SparkCacheError:
                raise
            except Exception as exc:
                raise BackendError(
                    f"cannot reach {name}: {type(exc).__name__}: {exc}; check the endpoint "
                    "(endpoint_url, AWS_ENDPOINT_URL), the region and the network") from exc
            if info.get("type") != "directory":
                raise InvalidArgument(f"{bucket!r} is not a bucket; check the URL of {name}")
            return
        try:
            is_folder = bool(self.fs.isdir(root or "/"))
        except Exception as exc:
            raise BackendError(f"cannot look at {name}: {type(exc).__name__}: {exc}") from exc
        if not is_folder:
            raise NotFound(
                f"the folder of {name} does not exist: create it first (or mount the shared "
                "filesystem there); sparkcache never creates it, so that storage on a mount "
                "point that is not mounted cannot fill the local disk")

    # -- writes -----------------------------------------------------------------

    @guarded_by("writing")
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
            for chunk in callers_chunks(chunks):
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
        if self._s3:
            try:
                return s3.upload(self.fs, path, (as_byte_view(c, copy=True).data
                                                 for c in callers_chunks(chunks)), self._limit)
            except OSError as exc:
                raise self._os_error(exc, "writing", key, self.url,
                                     missing_is_not_found=False) from exc
        handle: Any = self.fs.open(path, "wb")
        try:
            total = 0
            for chunk in callers_chunks(chunks):
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

    @guarded_by("deleting")
    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            if self._s3:
                if self.head(key) is None:
                    return False
                s3.delete_objects(self.fs, [path], self.url, self._limit)
                return True
            if not self.fs.isfile(path, **self._kw()):
                return False
            self.fs.rm_file(path, **self._kw())
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._os_error(exc, "deleting", key, self.url) from exc
        return True

    # -- reads ------------------------------------------------------------------

    @guarded_by("reading")
    def open(self, key: str) -> Blob:
        """Fetch the whole object into memory (``cat_file``; on S3 in pieces)."""
        path = self._path(key)
        try:
            data = (s3.read_object(self.fs, path, self._limit) if self._s3
                    else self.fs.cat_file(path, **self._kw()))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._os_error(exc, "reading", key, self.url) from exc
        # s3fs returns a bytearray for a large object (read in concurrent ranges):
        # kept as it is, not copied again.
        return BufferBlob(data if isinstance(data, (bytes, bytearray)) else bytes(data))

    @guarded_by("reading")
    def read_range(self, key: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of an object (one ranged GET on an object store);
        fewer where the object is shorter."""
        path = self._path(key)
        try:
            data = self.fs.cat_file(path, start=start, end=end, **self._kw())
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._os_error(exc, "reading", key, self.url) from exc
        return data if isinstance(data, (bytes, bytearray)) else bytes(data)

    def read_stream(self, key: str, start: int, end: int,
                    piece: int | Sequence[int]) -> Generator[bytes | bytearray, None, None]:
        """:meth:`ObjectStore.read_stream` from one request, read as it arrives:
        on S3 one GET whose body is read piece by piece, elsewhere one open file."""
        path = self._path(key)
        sizes = piece_sizes(piece)
        try:
            if self._s3:
                yield from s3.stream(self.fs, path, start, end, sizes, self._limit)
                return
            with self.fs.open(path, "rb") as f:
                f.seek(start)
                at = start
                while at < end:
                    data = f.read(min(next(sizes), end - at))
                    if not data:
                        return
                    at += len(data)
                    yield data
        except SparkCacheError:
            raise
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._os_error(exc, "reading", key, self.url) from exc
        except Exception as exc:
            raise backend_error("reading", key, self.url, exc) from exc

    @guarded_by("looking up")
    def exists(self, key: str) -> bool:
        # Not fs.isfile: it answers False for any error, an unreachable endpoint
        # included, and a checker would take every object for missing.
        if self._s3:
            return self.head(key) is not None
        path = self._path(key)
        try:
            return bool(self.fs.info(path, **self._kw()).get("type") == "file")
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._os_error(exc, "inspecting", key, self.url) from exc

    @guarded_by("inspecting")
    def size(self, key: str) -> int:
        if self._s3:
            size = self.head(key)
            if size is None:
                raise NotFound(f"no object {key!r} in {self.url}")
            return size
        path = self._path(key)
        try:
            info = self.fs.info(path, **self._kw())
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._os_error(exc, "inspecting", key, self.url) from exc
        if info.get("type") != "file":
            raise NotFound(f"no object {key!r} in {self.url} (that name is a folder)")
        return int(info["size"])

    @guarded_by("inspecting")
    def head(self, key: str) -> int | None:
        """The object's size, or None when there is none, in one request where
        the filesystem allows: on S3 a HEAD (``size`` and ``exists`` go through
        ``fs.info``, which lists the prefix after a miss to tell a folder)."""
        if self._s3:
            out = self._head_object(key)
            return None if out is None else int(out["ContentLength"])
        return ObjectStore.head(self, key)

    @guarded_by("listing")
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys of every object under folder ``prefix`` (``fs.find``), temp keys included.

        Names that are not valid keys (written by other tools) are skipped.
        """
        base = validate_key(prefix.removesuffix("/")) if prefix else ""
        folder = f"{self._root}/{base}" if base else (self._root or "/")
        inside = self.fs._strip_protocol(folder).rstrip("/") + "/"
        if self._s3:
            return self._keys(list(self._find_s3(folder, base)), inside, base)
        try:
            found = self.fs.find(folder, **self._kw())
        except (FileNotFoundError, NotADirectoryError):
            found = []
        except OSError as exc:
            raise self._os_error(exc, "listing", base, self.url) from exc
        return self._keys(found, inside, base)

    def _find_s3(self, folder: str, base: str) -> dict[str, dict[str, Any]]:
        try:
            return s3.find(self.fs, folder, self._limit)
        except OSError as exc:
            raise self._os_error(exc, "listing", base, self.url) from exc

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

    @guarded_by("listing")
    def folders(self, prefix: str) -> Iterator[str]:
        """Keys of the folders directly inside ``prefix`` (``fs.ls``); ``""``:
        those at the root (a shared tier's model folders)."""
        base = validate_key(prefix.removesuffix("/")) if prefix else ""
        try:
            entries = self.fs.ls(f"{self._root}/{base}" if base else self._root, detail=True,
                                 **self._kw())
        except (FileNotFoundError, NotADirectoryError):
            return iter(())
        except OSError as exc:
            raise self._os_error(exc, "listing", base or "/", self.url) from exc
        found = []
        for entry in entries:
            if entry.get("type") == "directory":
                name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
                with suppress(UnsafeName):
                    found.append(validate_key(f"{base}/{name}" if base else name))
        return iter(found)

    @guarded_by("removing")
    def remove_tree(self, prefix: str) -> int:
        """Delete every object under ``prefix``, then the folder where the filesystem
        has folders (object stores have none left once their objects are gone)."""
        base = validate_key(prefix.removesuffix("/"))
        removed = sum(1 for key in list(self.list(base)) if self.delete(key))
        with suppress(OSError):
            self.fs.rm(f"{self._root}/{base}", recursive=True)
        return removed

    # -- many objects at once (the shared tier's sweep) ---------------------------

    @guarded_by("listing")
    def stat_list(self, prefix: str = "") -> builtins.list[ObjectStat]:
        """Every object under folder ``prefix`` with its size and last-modified
        time, from one listing (on S3: one LIST per 1000 keys), never cached."""
        base = validate_key(prefix.removesuffix("/")) if prefix else ""
        folder = f"{self._root}/{base}" if base else (self._root or "/")
        inside = self.fs._strip_protocol(folder).rstrip("/") + "/"
        if self._s3:
            return self._stats(self._find_s3(folder, base), inside, base)
        with suppress(Exception):
            self.fs.invalidate_cache(folder)
        try:
            found = self.fs.find(folder, detail=True, **self._kw())
        except (FileNotFoundError, NotADirectoryError):
            found = {}
        except OSError as exc:
            raise self._os_error(exc, "listing", base, self.url) from exc
        return self._stats({str(path): info for path, info in found.items()}, inside, base)

    def _stats(self, infos: dict[str, Any], inside: str, base: str) -> builtins.list[ObjectStat]:
        out = []
        for path, info in infos.items():
            if info.get("type", "file") != "file" or not path.startswith(inside):
                continue
            key = path[len(inside):]
            if base:
                key = f"{base}/{key}"
            with suppress(UnsafeName):
                out.append(ObjectStat(validate_key(key), int(info.get("size") or 0),
                                      mtime_of(info)))
        return out

    @guarded_by("reading")
    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The bytes of each of ``keys`` that exists (fetched concurrently where
        the filesystem can: s3fs's ``cat``); missing ones are left out."""
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), GET_BATCH):  # each batch within one request's bound
            out.update(self._get_batch(keys[i:i + GET_BATCH]))
        return out

    def _get_batch(self, keys: Sequence[str]) -> dict[str, bytes]:
        paths = {self._path(k): k for k in keys}
        try:
            got = self.fs.cat(list(paths), on_error="return", **self._kw())
        except OSError as exc:
            raise self._os_error(exc, "reading", keys[0], self.url) from exc
        if not isinstance(got, dict):  # one path: fsspec returns its bytes
            got = {next(iter(paths)): got}
        out: dict[str, bytes] = {}
        for path, value in got.items():
            key = paths.get(path) or paths.get(self.fs._strip_protocol(path))
            if key is None or isinstance(value, (FileNotFoundError, NotADirectoryError)):
                continue
            if isinstance(value, OSError):
                raise self._os_error(value, "reading", key, self.url)
            if isinstance(value, BaseException):
                raise BackendError(f"reading {key!r} in {self.url} failed: "
                                   f"{type(value).__name__}: {value}; check the endpoint, "
                                   "the credentials and the network")
            out[key] = bytes(value)
        return out

    @guarded_by("deleting")
    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete every one of ``keys`` (missing ones are no error): on an object
        store in batches of :data:`~sparkcache.backends.s3.DELETE_BATCH` per
        request, each object deleted whole and at once, in no order within a batch."""
        if not self.object_store:
            for key in keys:
                self.delete(key)
            return
        paths = [self._path(k) for k in keys]
        for i in range(0, len(paths), s3.DELETE_BATCH):
            batch = paths[i:i + s3.DELETE_BATCH]
            try:
                if self._s3:  # one DeleteObjects, errors checked
                    s3.delete_objects(self.fs, batch, self.url, self._limit)
                else:
                    self.fs.rm(batch, **self._kw())
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._os_error(exc, "deleting", keys[i], self.url) from exc

    def local_path(self, key: str) -> str | None:
        """The path of ``key`` on this host's own filesystem (``file://``: a local
        folder or a mount), or None for any other filesystem."""
        if not any(p in ("file", "local") for p in protocols(self.fs)):
            return None
        return self._path(key)

    # -- conditional writes (S3's If-None-Match / If-Match) ---------------------------

    @property
    def conditional_writes(self) -> bool:
        """Whether :meth:`put_conditional` works: an S3 (or S3-protocol) store
        through s3fs.  A server that ignores the conditions (an old MinIO or
        Ceph) is not detected here; docs/shared.md says what that costs."""
        return self._s3

    @guarded_by("inspecting")
    def etag(self, key: str) -> str | None:
        """The object's ETag (one HEAD), or None when there is none."""
        if not self.conditional_writes:
            raise InvalidArgument(f"{self.url} has no ETags: conditional writes need S3")
        out = self._head_object(key)
        return None if out is None else str(out["ETag"])

    def _head_object(self, key: str) -> dict[str, Any] | None:
        """s3fs: one HeadObject of ``key`` (its response), or None when there is none."""
        try:
            return s3.head_object(self.fs, self._path(key), self._limit)
        except OSError as exc:
            raise self._os_error(exc, "inspecting", key, self.url) from exc

    @guarded_by("writing")
    def put_conditional(self, key: str, data: bytes, match: str | None) -> str | None:
        """Write a small object only if there is none (``match`` None: If-None-Match
        ``*``) or only if its ETag is still ``match`` (If-Match); the new ETag, or
        None when the condition failed (another writer came first)."""
        if not self.conditional_writes:
            raise InvalidArgument(f"{self.url} has no conditional writes: they need S3")
        try:
            return s3.put_object(self.fs, self._path(key), data, match, self._limit)
        except OSError as exc:
            raise self._os_error(exc, "writing", key, self.url,
                                 missing_is_not_found=False) from exc

    def disk_usage(self) -> None:
        """Unknown: fsspec has no portable free-space query."""
        return None

    def close(self) -> None:
        """Nothing to release: the filesystem instance is fsspec's shared, cached one."""
