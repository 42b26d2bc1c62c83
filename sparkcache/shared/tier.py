"""A shared tier: objects under one URL that several hosts' stores replicate to.

:class:`SharedTier` opens the URL through fsspec (``s3://bucket/prefix``,
``gs://...``, ``file:///mnt/nfs/...``, any fsspec URL) and checks it at once,
so that a wrong endpoint, bad credentials or a missing bucket is a clear
:class:`~sparkcache.errors.SparkCacheError` when a store starts, not a stream
of failed uploads later:

* on an object store the bucket must exist: sparkcache never creates one (a
  typo would become a bucket with its own owner and costs);
* on a local or mounted filesystem (``file://``) the tier's folder must exist:
  sparkcache never creates it (on a mount point that is not mounted, it would
  fill the local disk);
* ``tier.json`` is read, or written when the tier is new: it records the
  tier's alias stride, which every host then uses.

Opening ends within ``open_seconds`` in all, and every later request within
``request_seconds``, retries included (on an object store; a ``file://``
tier is the kernel's): an endpoint that accepts connections and never
answers costs that, then a ``BackendError``, never retries times timeouts.

Options (endpoint, region, profile, client settings) go to the filesystem;
credentials never do: they come from each filesystem's usual environment and
configuration (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws``, ...), and
the tier's URL is recorded without them.  Writes are whole-object: on an object
store an upload is visible only when complete, elsewhere a temp key is renamed
(:class:`~sparkcache.backends.FsspecBackend`).  :meth:`SharedTier.put_once`
makes every write idempotent: an object already there with the right size is
not sent again.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from sparkcache.backends import BufferLike, FsspecBackend, ObjectStore, canonical_url, deadline
from sparkcache.backends.s3 import REQUEST_SECONDS
from sparkcache.errors import BackendError, InvalidArgument, NotFound, SparkCacheError
from sparkcache.shared.layout import MAX_JSON_BYTES, TIER_FILE, TierInfo, parse_tier, tier_bytes

T = TypeVar("T")

__all__ = [
    "CREDENTIAL_OPTIONS",
    "OPEN_SECONDS",
    "REQUEST_SECONDS",
    "SHARED_ENV",
    "SharedTier",
    "check_options",
    "describe_error",
    "resolve_shared",
    "shared_url",
]

#: The environment variable naming the shared tier when none is given.
SHARED_ENV = "SPARK_KV_CACHE_SHARED"
#: Option names that would carry a secret: refused (use the environment or config).
CREDENTIAL_OPTIONS = frozenset({
    "key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "account_key", "sas_token", "client_secret", "connection_string",
    "credentials", "session_token", "secret_access_key", "access_key_id",
})
#: Bytes sent per chunk: a segment is uploaded in slices, never copied whole.
UPLOAD_CHUNK = 8 << 20
#: Opening a tier (reaching it, checking the bucket, ``tier.json``) ends within this.
OPEN_SECONDS = 30.0


def resolve_shared(given: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The shared tier's URL: ``given``, else ``$SPARK_KV_CACHE_SHARED``, else None
    (no shared tier).  An empty value means none."""
    env = os.environ if env is None else env
    for value in (given, env.get(SHARED_ENV)):
        if value is not None and value.strip():
            return value.strip()
    return None


def shared_url(url: str | os.PathLike[str]) -> str:
    """How a store records a shared tier: a plain path as ``file://<absolute>``, a
    URL without credentials (:func:`~sparkcache.backends.canonical_url`), no
    trailing slash.  Two spellings of one tier compare equal."""
    text = os.fspath(url).strip()
    if not text:
        raise InvalidArgument("the shared tier's URL is empty; give s3://bucket/prefix, "
                              "file:///path or another fsspec URL")
    if "://" not in text:
        text = "file://" + os.path.abspath(os.path.expanduser(text))
    return canonical_url(text).rstrip("/")


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The filesystem options, checked: a mapping with string keys and no secret
    (:data:`CREDENTIAL_OPTIONS`, also inside ``client_kwargs``)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise InvalidArgument(f"shared_options must be a mapping of option names to values, "
                              f"got {options!r}")
    nested = options.get("client_kwargs")
    names = set(options) | (set(nested) if isinstance(nested, Mapping) else set())
    secret = sorted(n for n in names if n.lower() in CREDENTIAL_OPTIONS)
    if secret:
        raise InvalidArgument(
            f"shared_options must not carry credentials ({', '.join(secret)}): they would "
            "be copied into command lines and logs. Give them to the filesystem as usual: "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials) "
            "for S3, GOOGLE_APPLICATION_CREDENTIALS for GCS")
    return dict(options)


class SharedTier:
    """The objects of one shared tier (see the module doc), checked when opened.

    ``alias_stride`` is used only when the tier is new (it has no
    ``tier.json``); the tier's own stride is :attr:`alias_stride` afterwards.
    ``create``: write ``tier.json`` into a new tier (False: a reader that must
    write nothing, such as a dry run, takes ``alias_stride`` without writing it).
    ``counts`` tallies what was sent (``puts``, ``put_bytes``) and what was
    found already there (``skipped``), for tests and benchmarks.  Opening
    takes at most ``open_seconds``, a request at most ``request_seconds``
    (module doc).  Thread-safe.
    """

    def __init__(self, url: str | os.PathLike[str], options: Mapping[str, Any] | None = None,
                 *, alias_stride: int, create: bool = True,
                 open_seconds: float = OPEN_SECONDS,
                 request_seconds: float = REQUEST_SECONDS) -> None:
        text = os.fspath(url).strip()
        self.url = shared_url(text)
        if "://" not in text:
            text = self.url
        opts = check_options(options)
        if not (open_seconds > 0 and request_seconds > 0):
            raise InvalidArgument("open_seconds and request_seconds must be positive")
        self.backend: ObjectStore = FsspecBackend(text, request_seconds=request_seconds, **opts)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, object]] = {}
        try:
            with deadline(open_seconds):
                self.backend.check_root(f"the shared tier {self.url}")
                self.info = self._tier_info(alias_stride, create)
        except BaseException:
            self.backend.close()
            raise

    @property
    def alias_stride(self) -> int:
        """The tier's alias stride in tokens (``tier.json``): aliases lie on it."""
        return self.info.alias_stride

    def __repr__(self) -> str:
        return f"SharedTier({self.url!r})"

    def _tier_info(self, alias_stride: int, create: bool) -> TierInfo:
        """``tier.json``: read, or written first when the tier is new (then read
        again: of two hosts starting a new tier at once, both use the winner's);
        without ``create``, a new tier's is ``alias_stride``'s, written nowhere."""
        raw = self.get(TIER_FILE)
        if raw is None:
            if not isinstance(alias_stride, int) or alias_stride <= 0:
                raise InvalidArgument(f"alias_stride must be a positive integer, got "
                                      f"{alias_stride!r}")
            if not create:
                return parse_tier(tier_bytes(alias_stride), self.url)
            self.put(TIER_FILE, [tier_bytes(alias_stride)])
            raw = self.get(TIER_FILE)
            if raw is None:
                raise BackendError(f"the shared tier {self.url} lost {TIER_FILE} right after "
                                   "it was written: check that the tier is not being deleted")
        return parse_tier(raw, self.url)

    # -- objects ---------------------------------------------------------------------

    def get(self, key: str, max_bytes: int = MAX_JSON_BYTES) -> bytes | None:
        """A small object's bytes (a manifest, an alias), or None when there is none.
        One larger than ``max_bytes`` is refused before it is read."""
        size = self.size(key)
        if size is None:
            return None
        if size > max_bytes:
            raise InvalidArgument(f"{key} in {self.url} is {size} bytes, more than "
                                  f"{max_bytes}: it is not a sparkcache object")
        try:  # one ranged GET (a rewritten object is checked again by its size)
            data = self.backend.read_range(key, 0, max_bytes + 1)
        except NotFound:  # deleted between the two requests
            return None
        if len(data) > max_bytes:
            raise InvalidArgument(f"{key} in {self.url} is more than {max_bytes} bytes: it is "
                                  "not a sparkcache object")
        return bytes(data)

    def size(self, key: str) -> int | None:
        """The object's size (one HEAD), or None when there is none."""
        self._count("heads")
        return self.backend.head(key)

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def put(self, key: str, chunks: Iterable[BufferLike]) -> int:
        """Write an object whole (replacing one that is there); returns its size."""
        written = self.backend.put(key, chunks)
        self._count("puts")
        self._count("put_bytes", written)
        return written

    def put_once(self, key: str, data: bytes | memoryview) -> bool:
        """Write ``data`` under ``key`` unless an object of that size is there
        already (True: written).  Keys name their content (docs/shared.md), so
        the size check guards against nothing but a foreign object."""
        view = memoryview(data).cast("B")
        if self.size(key) == view.nbytes:
            self._count("skipped")
            return False
        self.put(key, (view[i:i + UPLOAD_CHUNK] for i in range(0, view.nbytes, UPLOAD_CHUNK)))
        return True

    def _count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.counts[name] += value

    def cached(self, name: str, seconds: float, make: Callable[[], T]) -> T:
        """``make()``'s value, made again once it is ``seconds`` old (what this
        process learned of the tier, e.g. its models: ``shared.siblings``).  A
        failing ``make`` raises and keeps nothing."""
        now = time.monotonic()
        with self._lock:
            kept = self._cache.get(name)
        if kept is not None and now - kept[0] < seconds:
            return cast(T, kept[1])
        value = make()
        with self._lock:
            self._cache[name] = (now, value)
        return value

    def close(self) -> None:
        """Release the filesystem (fsspec's shared instance: nothing to do)."""
        self.backend.close()


def describe_error(exc: BaseException) -> str:
    """One line for a log: a SparkCacheError's message, anything else's type too."""
    if isinstance(exc, SparkCacheError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
