"""SnapshotStore: publish, look up and read verified KV-cache snapshots.

One store is a root folder holding ``index.sqlite`` (the per-host index) and,
unless another storage URL is given, the payload objects.  Every process (the
scheduler and each local worker) opens the same root; the index serialises
them.  The protocol is described in docs/architecture.md; in short:

* ``publish`` writes one rank's segment durably *before* the index exposes it;
  a snapshot becomes visible to ``lookup`` once every rank of its topology has
  published, in the same transaction that inserts its boundary rows.
* ``lookup`` is SQL over indexed boundary rows and returns the longest snapshot
  every expected rank can restore.
* ``read`` / ``read_into`` verify identity, token ids, header and chunk digests
  before any byte is returned; a failure quarantines the snapshot and raises
  :class:`~sparkcache.errors.CorruptSnapshot`, which callers treat as a miss.
* with a ``shared`` tier (docs/shared.md), ``upload`` and ``start_uploader``
  copy every ready snapshot there, in the background for the latter.

This class is a facade: it opens the :class:`~sparkcache.core.Core` (index,
backend, clock, counters) and calls down into the modules that do the work
(:mod:`~sparkcache.publish`, :mod:`~sparkcache.lookup`,
:mod:`~sparkcache.reader`, :mod:`~sparkcache.maintenance`,
:mod:`~sparkcache.retention`, :mod:`~sparkcache.requestlog`,
:mod:`~sparkcache.shared`), each of which takes the core, never the store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache import lookup as lookups
from sparkcache import maintenance, reader, requestlog
from sparkcache.backends import Backend
from sparkcache.core import (
    DEFAULT_INDEX_RESERVE,
    INDEX_FILE,
    Core,
    Match,
    SnapshotInfo,
    ids,
    scalar,
    select_all,
)
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.holders import this_holder
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.index.db import Database
from sparkcache.maintenance import CheckReport
from sparkcache.publish import PublishResult
from sparkcache.publish import publish as publish_segment
from sparkcache.recorded import open_shared, recorded_storage
from sparkcache.requestlog import KeySummary, LogSummary, RequestRow
from sparkcache.retention import Retention, Sweeper, SweepReport
from sparkcache.shared import (
    DEFAULT_POLL_SECONDS,
    FetchResult,
    SharedTier,
    Uploader,
    UploadReport,
    fetch_prefix,
    upload_pending,
)

__all__ = ["Match", "PublishResult", "SnapshotInfo", "SnapshotStore"]

#: Default sparse alias stride in tokens (rounded down to whole blocks).
DEFAULT_ALIAS_STRIDE = 256
#: Default bound on copy-on-write chain length; longer chains are compacted.
DEFAULT_MAX_CHAIN = 8
#: How long ``close`` waits by default for the uploader's queue.
DEFAULT_UPLOAD_WAIT_SECONDS = 30.0


class SnapshotStore:
    """The one API over the index and the payload backend.

    ``root`` is a local folder (the index must be on a local filesystem);
    ``storage`` optionally puts payloads elsewhere (a path or any backend URL,
    see :func:`sparkcache.backends.open_backend`).  ``alias_stride`` and
    ``max_chain`` are fixed when the store is created and recorded in its
    settings table.  ``clock`` is injectable for tests.  With ``retention``
    (:class:`~sparkcache.retention.Retention`) every publish obeys Spark's limits
    and trims its own model; without it nothing is evicted automatically.
    ``upgrade=False`` never changes the index's schema: an index behind this
    sparkcache raises SchemaMismatch instead of being upgraded (see
    :class:`~sparkcache.index.db.Database`).  Safe to share between threads;
    each process opens its own store (connections reopen after fork).

    The store records its storage when it is created (:func:`canonical_url`:
    never credentials) and opens it again when ``storage`` is not given.
    Opening with another storage raises StorageMismatch naming both, unless
    ``relocate=True`` (after the payloads were moved there) records the new
    one.  ``index_reserve`` bytes of the index's disk are held back in
    ``index.reserve`` so that eviction can run when that disk is full.

    ``shared`` names a shared tier (docs/shared.md: ``s3://bucket/prefix``,
    ``file:///mnt/nfs/kv``, any fsspec URL) that this process uploads to;
    ``shared_options`` go to its filesystem (``endpoint_url``, ``profile``,
    ``client_kwargs``; never credentials: they come from the filesystem's usual
    environment and configuration).  The tier is checked here: an endpoint that
    does not answer, bad credentials or a missing bucket (never created) raise
    a SparkCacheError saying what to check.  The store records the first tier it
    is opened with, without credentials, like its storage: another one raises
    StorageMismatch unless ``relocate=True`` records it (and every snapshot is
    then uploaded to it).  Without ``shared`` the tier is neither contacted nor
    changed.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        storage: str | os.PathLike[str] | Backend | None = None,
        alias_stride: int | None = None,
        max_chain: int | None = None,
        busy_timeout_ms: int = 10_000,
        clock: Callable[[], float] = time.time,
        retention: Retention | None = None,
        upgrade: bool = True,
        relocate: bool = False,
        index_reserve: int = DEFAULT_INDEX_RESERVE,
        shared: str | os.PathLike[str] | None = None,
        shared_options: Mapping[str, Any] | None = None,
    ) -> None:
        root = Path(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgument(f"cannot create the store folder {root}: {exc}") from exc
        self.retention = retention
        db = Database(root / INDEX_FILE, busy_timeout_ms=busy_timeout_ms, upgrade=upgrade)
        try:
            backend = recorded_storage(db, root, storage, relocate=relocate, record=upgrade,
                                        clock=clock)
        except BaseException:
            db.close()
            raise
        #: The narrow core the store's helpers take (index, backend, clock, counters).
        self.core = Core(root, db, backend, clock, index_reserve=index_reserve)
        self.alias_stride = self._fixed_setting("alias_stride", alias_stride, DEFAULT_ALIAS_STRIDE)
        self.max_chain = self._fixed_setting("max_chain", max_chain, DEFAULT_MAX_CHAIN)
        #: The shared tier this process uploads to, or None.
        self.shared: SharedTier | None = None
        self._uploader: Uploader | None = None
        self._sweeper: Sweeper | None = None
        self._upload_wait = DEFAULT_UPLOAD_WAIT_SECONDS
        if shared is not None:
            try:
                self.shared = open_shared(self.core, shared, shared_options,
                                           alias_stride=self.alias_stride, relocate=relocate,
                                           record=upgrade)
            except BaseException:
                self.core.close()
                raise
        self.core.keep_reserve()

    @property
    def root(self) -> Path:
        return self.core.root

    @property
    def backend(self) -> Backend:
        return self.core.backend

    @property
    def db(self) -> Database:
        """The index connection (raises StoreClosed once closed)."""
        return self.core.db

    def _fixed_setting(self, key: str, given: int | None, default: int) -> int:
        if given is not None and (not isinstance(given, int) or given <= 0):
            raise InvalidArgument(f"{key} must be a positive integer, got {given!r}")
        # Read first: a store that has its settings opens without the write
        # lock, so a long write of another process does not time the open out.
        with self.core.read() as conn:
            found = ids(conn, q.GET_SETTING, (key,))
        if not found:
            with self.core.write() as conn:
                found = ids(conn, q.GET_SETTING, (key,))  # another process's, meanwhile
                if not found:
                    value = default if given is None else given
                    conn.execute(q.PUT_SETTING, (key, str(value), self.core.clock()))
                    return value
        stored = found[0]
        if given is not None and given != stored:
            raise InvalidArgument(
                f"this store was created with {key}={stored}; open it without {key} "
                f"(or with {key}={stored}), or use another folder for {key}={given}"
            )
        return stored

    def close(self) -> None:
        """Stop the sweeper, then the uploader (waiting for its queue up to the
        ``wait_seconds`` it was started with), save pending counters and close
        the index.  Idempotent."""
        sweeper, self._sweeper = self._sweeper, None
        uploader, self._uploader = self._uploader, None
        try:
            if sweeper is not None:
                sweeper.stop()
            if uploader is not None:
                uploader.close(self._upload_wait)
        finally:
            self.core.close()
            if self.shared is not None:
                self.shared.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publish (sparkcache.publish) ---------------------------------------------------

    def publish(
        self,
        identity: ModelIdentity,
        rank: int,
        token_ids: Sequence[int] | np.ndarray,
        pages: Sequence[Any],
        *,
        parent: int | None = None,
        scope: RequestScope | None = None,
        breakpoints: Iterable[int] = (),
    ) -> PublishResult:
        """Publish this rank's segment of the snapshot of ``token_ids``.

        ``pages`` holds one buffer per layer with this rank's blocks, in the
        engine's layout, for tokens ``[start, len(token_ids))`` where ``start`` is
        the parent's token count (0 without a parent): with a parent only the
        new tail is written (copy-on-write).  Chains longer than ``max_chain``
        are compacted here: the parent's rows are read (verified) and a full
        segment is written.  A model whose identity keeps windows
        (:attr:`~sparkcache.identity.ModelIdentity.window_blocks`: sliding-window
        layers) passes, for each such layer, only the window's blocks ending at
        the snapshot's end, and no parent.  ``breakpoints`` (token counts, rounded down to whole
        blocks) get alias rows.  Returns once this rank's bytes are durable; the
        snapshot is restorable when every rank has published.
        """
        result = publish_segment(self.core, identity, rank, token_ids, pages, parent=parent,
                                 scope=scope, breakpoints=breakpoints,
                                 alias_stride=self.alias_stride, max_chain=self.max_chain,
                                 policy=self.retention)
        if result.state == "ready" and self._uploader is not None:
            self._uploader.wake()
        return result

    # -- lookup (sparkcache.lookup) -----------------------------------------------------

    def lookup(
        self,
        identity: ModelIdentity,
        token_ids: Sequence[int] | np.ndarray,
        *,
        scope: RequestScope | None = None,
        ranks: Iterable[int] | None = None,
        hashes: Sequence[bytes] | None = None,
        whole_first: bool = False,
        ends_only: bool = False,
    ) -> Match | None:
        """The longest stored prefix of ``token_ids`` that every rank in ``ranks``
        (default: all ranks of the topology) can restore, or None.

        ``hashes`` may pass precomputed :func:`~sparkcache.hashing.prefix_hashes`.
        Among snapshots holding the same longest prefix the newest is chosen, or
        with ``whole_first`` one that ends there (a copy-on-write parent for a
        save of a longer prompt).  With ``ends_only`` only a prefix at which a
        snapshot ends is a match (a sliding-window model's snapshot stores its
        window there alone): one query over every block's hash instead of the
        binary search over strides.  Read-only: it takes no write lock.  Token
        ids are compared on ``read``.
        """
        return lookups.lookup(self.core, identity, token_ids, alias_stride=self.alias_stride,
                              scope=scope, ranks=ranks, hashes=hashes, whole_first=whole_first,
                              ends_only=ends_only)

    def extend(
        self, match: Match, token_ids: Sequence[int] | np.ndarray, *,
        ranks: Iterable[int] | None = None,
    ) -> Match | None:
        """``match`` grown by one block, when the snapshot's next stored block
        begins with the rest of ``token_ids`` (fewer than a block of tokens
        after ``match.n_tokens``); else None.

        A prompt's last partial block has no boundary hash, so ``lookup`` never
        returns it; a snapshot that went on past those tokens (the same prompt,
        answered and stored before) holds it.  The new match's ``token_ids``
        are ``token_ids`` followed by the stored tokens completing the block: a
        read of it restores that whole block (its slots past the prompt are the
        stored request's, which the caller overwrites before use).  The stored
        token ids are read verified from the first of ``ranks`` (default: all
        of the topology), every one of which must be able to restore the grown
        match.  A segment failing
        its checks is quarantined and raises CorruptSnapshot (a vanished
        snapshot NotFound): the match itself is then no longer a hit.
        """
        return lookups.extend(self.core, match, token_ids, ranks=ranks)

    def grow(
        self, match: Match, token_ids: Sequence[int] | np.ndarray, *,
        ranks: Iterable[int] | None = None,
    ) -> Match:
        """``match`` grown by the whole blocks after it that its snapshot stores
        and ``token_ids`` (the prompt, starting with the match's tokens) share.

        A lookup ends at a boundary row: the snapshot's end, a stride alias or a
        breakpoint.  A prompt that shares more of a longer snapshot than its last
        alias below the divergence restores up to the last whole shared block,
        as vLLM's own prefix cache would: the stored token ids after the match
        (at most ``alias_stride`` of them) are read verified from the first of
        ``ranks`` (every one of which must be able to restore them) and compared.
        Returns ``match`` itself when nothing more is shared.  A segment failing
        its checks is quarantined and raises CorruptSnapshot (a vanished snapshot
        NotFound): the match is then no longer a hit.
        """
        return lookups.grow(self.core, match, token_ids, alias_stride=self.alias_stride,
                            ranks=ranks)

    # -- read (sparkcache.reader) -----------------------------------------------------

    def read(self, match: Match, rank: int, *, n_tokens: int | None = None) -> list[np.ndarray]:
        """Verified pages of the first ``n_tokens`` (default all matched) for ``rank``.

        One uint8 array ``[n_blocks, page_nbytes]`` per layer (fresh memory).
        Raises CorruptSnapshot (snapshot quarantined) or NotFound: both a miss.
        """
        return reader.read_pages(self.core, match, rank, n_tokens, touch=True)

    def read_into(
        self, match: Match, rank: int, out: Sequence[Any], *, n_tokens: int | None = None,
        start_tokens: int | Sequence[int] = 0, on_layer: Callable[[int], None] | None = None,
        threads: int = 1, cpus: Sequence[int] = (),
    ) -> int:
        """Verify and copy tokens ``[start_tokens, n_tokens)`` into ``out``.

        ``out`` holds one writable destination per layer - a buffer, or a list
        of buffers written as one (runs of KV-cache blocks) - of at least
        ``n_blocks * page_nbytes`` bytes, where ``n_blocks = (n_tokens -
        start_tokens) // block_size``; page 0 of each receives block
        ``start_tokens // block_size`` of the snapshot.  ``n_tokens`` defaults
        to the whole match; ``start_tokens`` (a multiple of the block size below
        ``n_tokens``, default 0) skips blocks the caller already holds, e.g.
        from vLLM's own prefix cache: their payload is never read, while every
        link's header, identity and token ids are still checked (before any
        payload is copied), so the whole prefix is proven.  Every copied byte is
        verified first (a 1 MiB chunk straddling ``start_tokens`` is verified
        whole).  Layers are copied in order; ``on_layer(i)`` is called as soon
        as layer ``i`` is complete, so a consumer can use it while the rest is
        read; ``start_tokens`` may be one start per layer (a sliding-window
        layer needs only its window: page 0 of its destination is then its own
        start's block); ``threads`` > 1 shares the layers among that many threads (still
        reported in order), each pinned to its own CPU of ``cpus`` for the copy
        when given (thread ``k`` on ``cpus[k % len(cpus)]``).  Returns the
        number of blocks copied; ``restored_tokens`` / ``restored_bytes`` count
        only the copied range.  Raises InvalidArgument
        on bad arguments or buffer sizes; CorruptSnapshot (snapshot
        quarantined) or NotFound are a miss, and may leave ``out`` partly
        written with *verified* bytes only.
        """
        return reader.read_into(self.core, match, rank, out, n_tokens=n_tokens,
                                start_tokens=start_tokens, on_layer=on_layer, threads=threads,
                                cpus=cpus)

    # -- maintenance (sparkcache.maintenance, sparkcache.retention) ----------------------

    def quarantine(self, snapshot_id: int, reason: str) -> None:
        """Never offer this snapshot (nor its descendants) again; count the reason."""
        maintenance.quarantine(self.core, snapshot_id, reason)

    def pin(self, snapshot_id: int, pinned: bool = True) -> None:
        """Pinned snapshots are never evicted."""
        with self.core.write() as conn:
            conn.execute(q.SET_PINNED, (int(pinned), snapshot_id))
            if conn.changes() != 1:
                raise NotFound(f"no snapshot {snapshot_id}")

    def acquire_lease(
        self, snapshot_id: int, *, kind: str = "read", ttl: float = 60.0, holder: str | None = None
    ) -> int:
        """Protect a snapshot from eviction and deletion for ``ttl`` seconds (or
        until its holder, by default this process, dies).

        Returns the lease id for :meth:`release_lease`.
        """
        if not ttl > 0:
            raise InvalidArgument(f"ttl must be positive seconds, got {ttl!r}")
        now = self.core.clock()
        with self.core.write() as conn:
            if self.core.snapshot(conn, snapshot_id) is None:
                raise NotFound(f"no snapshot {snapshot_id}")
            return scalar(conn, q.INSERT_LEASE,
                          (snapshot_id, holder or this_holder(), kind, now, now + ttl))

    def release_lease(self, lease_id: int) -> bool:
        """Release a lease; False when it had already gone."""
        with self.core.write() as conn:
            conn.execute(q.DELETE_LEASE, (lease_id,))
            return bool(conn.changes())

    def delete(self, snapshot_id: int, *, force: bool = False) -> list[int]:
        """Delete a snapshot and its descendants (they cannot be restored without it).

        Refuses (LeaseError) while any of them holds an unexpired lease, unless
        ``force``.  Files go after the commit.  Returns the deleted ids.
        """
        return maintenance.delete_snapshots(self.core, [snapshot_id], force=force,
                                            reason="deleted")

    def evict(
        self, *, model: ModelIdentity | None = None, count: int | None = 1,
        free_bytes: int | None = None, older_than: float | None = None, reason: str = "lru",
    ) -> list[int]:
        """Delete least recently used evictable snapshots: see
        :func:`sparkcache.maintenance.evict_lru` for the rules."""
        return maintenance.evict_lru(self.core, model=model, count=count, free_bytes=free_bytes,
                                     older_than=older_than, reason=reason)

    def check(self, *, fix: bool = False) -> CheckReport:
        """Compare index and files; with ``fix`` repair (see :mod:`sparkcache.maintenance`)."""
        return maintenance.check(self.core, fix=fix)

    def sweep(self, retention: Retention | None = None) -> SweepReport:
        """One retention pass (deleted models, age, disk margin, total) with
        ``retention``, by default the store's own; see :meth:`Retention.sweep`."""
        retention = retention or self.retention
        if retention is None:
            raise InvalidArgument("this store has no retention limits; pass retention=")
        return retention.sweep(self.core)

    def start_sweeper(self) -> Sweeper:
        """Start :meth:`sweep` with the store's retention every ``sweep_seconds``
        in the background (:class:`~sparkcache.retention.Sweeper`), once per host:
        the connector does it in its scheduler process, on a store of its own (a
        long sweep never holds the lock its lookups take).  ``close`` stops it.
        Needs ``retention``; a second call returns the running sweeper."""
        if self.retention is None:
            raise InvalidArgument("this store has no retention limits: open it with retention=")
        if self._sweeper is None:
            self._sweeper = Sweeper(self.core, self.retention).start()
        return self._sweeper

    # -- the shared tier (sparkcache.shared) ---------------------------------------------

    def _tier(self) -> SharedTier:
        if self.shared is None:
            raise InvalidArgument(
                "this store was opened without a shared tier: pass shared= (the CLI's "
                "--shared, or SPARK_KV_CACHE_SHARED)")
        return self.shared

    def upload(self, *, limit: int | None = None) -> UploadReport:
        """Upload the ready snapshots not uploaded yet, parents first, now: see
        :func:`sparkcache.shared.upload_pending`.  Needs ``shared``."""
        return upload_pending(self.core, self._tier(), limit=limit)

    def fetch(
        self,
        identity: ModelIdentity,
        token_ids: Sequence[int] | np.ndarray,
        *,
        scope: RequestScope | None = None,
        breakpoints: Sequence[int] = (),
        hashes: Sequence[bytes] | None = None,
        min_tokens: int = 1,
    ) -> FetchResult:
        """Ask the shared tier for the longest prefix of ``token_ids`` it holds
        and make it local: see :func:`sparkcache.shared.fetch_prefix`.  Afterwards
        :meth:`lookup` (and :meth:`grow`) find it as any local snapshot.

        A bounded probe (HEADs of aliases at the tier's stride boundaries,
        by binary search; never a listing), then the manifests, then every
        link's segments, each verified (size, digest, identity, rank, token
        ids, key) before it is published here through :meth:`publish`'s path
        (this store's retention applies).  ``breakpoints`` (the request's token
        positions) are probed too.  For a sliding-window identity only the
        manifests of snapshots ending inside the prompt are asked for - at its
        last whole block, at the end its best stride alias names, at a
        breakpoint - (a window is stored at its snapshot's end only).  Returns
        a :class:`FetchResult`: a miss, a prefix fetched or already local, or
        ``refused`` (an object failed
        verification: nothing of it is published).  Raises a SparkCacheError
        when the tier is unreachable or refuses access.  Needs ``shared``.
        """
        return fetch_prefix(self.core, self._tier(), identity, token_ids, scope=scope,
                            breakpoints=breakpoints, hashes=hashes,
                            alias_stride=self.alias_stride, max_chain=self.max_chain,
                            policy=self.retention, min_tokens=min_tokens)

    def start_uploader(self, *, wait_seconds: float = DEFAULT_UPLOAD_WAIT_SECONDS,
                       poll_seconds: float | None = None) -> Uploader:
        """Start uploading in the background (:class:`~sparkcache.shared.Uploader`),
        once per host: the connector does it in its scheduler process.  ``close``
        stops it, after waiting up to ``wait_seconds`` for its queue.  Needs
        ``shared``; a second call returns the running uploader."""
        tier = self._tier()
        if not wait_seconds >= 0:
            raise InvalidArgument(f"wait_seconds must be >= 0, got {wait_seconds!r}")
        if self._uploader is None:
            self._uploader = Uploader(
                self.core, tier,
                poll_seconds=DEFAULT_POLL_SECONDS if poll_seconds is None else poll_seconds,
            ).start()
        self._upload_wait = wait_seconds
        return self._uploader

    # -- inspection ---------------------------------------------------------------------

    def snapshots(self, model: ModelIdentity | None = None) -> list[SnapshotInfo]:
        with self.core.read() as conn:
            if model is None:
                return select_all(conn, q.LIST_SNAPSHOTS, into=SnapshotInfo)
            model_id = self.core.model_id(conn, model)
            if model_id is None:
                return []
            return select_all(conn, q.ADMIN_MODEL_SNAPSHOTS, (model_id,), into=SnapshotInfo)

    def snapshot(self, snapshot_id: int) -> SnapshotInfo:
        with self.core.read() as conn:
            info = self.core.snapshot(conn, snapshot_id)
        if info is None:
            raise NotFound(f"no snapshot {snapshot_id}")
        return info

    def stats(self, model: ModelIdentity | None = None) -> dict[str, int]:
        """Counters (hits, misses, written/restored tokens and bytes, evictions.*,
        quarantined.*), summed over models unless ``model`` is given."""
        if model is None:
            return self.core.counter_totals()
        with self.core.read() as conn:
            model_id = self.core.model_id(conn, model)
        return {} if model_id is None else self.core.counter_totals(model_id)

    # -- the request log (sparkcache.requestlog) ------------------------------------------

    def log_requests(self, rows: Sequence[Mapping[str, Any]], *, keep: int) -> None:
        """Record request log rows and keep the newest ``keep``: see
        :func:`sparkcache.requestlog.record`."""
        requestlog.record(self.core, rows, keep=keep)

    def requests(self, *, model_id: int | None = None, limit: int = 50,
                 after_seq: int | None = None) -> list[RequestRow]:
        """The newest logged requests, or those after ``after_seq`` oldest first:
        see :func:`sparkcache.requestlog.requests`."""
        return requestlog.requests(self.core, model_id=model_id, limit=limit,
                                   after_seq=after_seq)

    def request(self, request_id: str) -> RequestRow | None:
        """One logged request, or None."""
        return requestlog.request(self.core, request_id)

    def request_summary(self, *, model_id: int | None = None) -> LogSummary:
        """Requests and token sums over the request log (of one model)."""
        return requestlog.summary(self.core, model_id=model_id)

    def requests_by_key(self, *, model_id: int | None = None) -> list[KeySummary]:
        """The request log summed per ``prompt_cache_key``, most requests first."""
        return requestlog.by_cache_key(self.core, model_id=model_id)
