"""SnapshotStore: publish, look up and read verified KV-cache snapshots.

One store is a root folder holding ``index.sqlite`` (the per-host index) and,
unless another storage URL is given, the payload objects.  Every process (the
scheduler and each local worker) opens the same root; the index serialises
them.  A snapshot is visible only once every rank's bytes are durable, every
byte read is verified first: docs/architecture.md ("Publication protocol",
"Lookup", "Segment format and verification"); the tier: docs/shared.md.

A facade: it opens the :class:`~sparkcache.core.Core` (index, backend, clock,
counters) and calls down into the modules that do the work, each taking the
core, never the store.  Its upkeep verbs are :class:`~sparkcache.upkeep.StoreUpkeep`'s,
its request log :class:`~sparkcache.storelog.StoreLog`'s; ``catalog`` reads it
for people (:class:`~sparkcache.catalog.Catalog`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache import lookup as lookups
from sparkcache import reader, reshard
from sparkcache.backends import Backend
from sparkcache.catalog import Catalog
from sparkcache.core import (
    DEFAULT_INDEX_RESERVE,
    INDEX_FILE,
    Core,
    Match,
    SnapshotInfo,
    ids,
    select_all,
)
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.index.db import Database
from sparkcache.publish import Offload, PublishResult
from sparkcache.publish import publish as publish_segment
from sparkcache.recorded import open_shared, recorded_storage
from sparkcache.retention import Retention, Sweeper
from sparkcache.shared import (
    DEFAULT_POLL_SECONDS,
    FetchResult,
    SharedTier,
    Uploader,
    UploadReport,
    fetch_any_sharding,
    upload_pending,
)
from sparkcache.storelog import StoreLog
from sparkcache.upkeep import StoreUpkeep

__all__ = ["Match", "PublishResult", "SnapshotInfo", "SnapshotStore"]

#: Default sparse alias stride in tokens (rounded down to whole blocks).
DEFAULT_ALIAS_STRIDE = 256
#: Default bound on copy-on-write chain length; longer chains are compacted.
DEFAULT_MAX_CHAIN = 8
#: How long ``close`` waits by default for the uploader's queue.
DEFAULT_UPLOAD_WAIT_SECONDS = 30.0


class SnapshotStore(StoreUpkeep, StoreLog):
    """The one API over the index and the payload backend (docs/architecture.md).

    Safe to share between threads; each process opens its own store (connections
    reopen after fork).  Its upkeep verbs (pin, leases, delete, evict, check,
    sweep, verify, ...) are :class:`~sparkcache.upkeep.StoreUpkeep`'s, its
    request log's :class:`~sparkcache.storelog.StoreLog`'s.

    Args:
        root: a local folder holding ``index.sqlite`` (the index must be on a
            local filesystem), created if missing.
        storage: where payloads live when not in ``root``: a path, any backend URL
            (:func:`sparkcache.backends.open_backend`) or a Backend.  Recorded when
            the store is created (never credentials) and found again without it.
        alias_stride: sparse alias stride in tokens; fixed when the store is created.
        max_chain: longest copy-on-write chain before a publish compacts; fixed
            when the store is created.
        busy_timeout_ms: how long a write waits for the index's lock.
        clock: the time source (injectable for tests).
        retention: Spark's limits (:class:`~sparkcache.retention.Retention`,
            docs/retention.md); without it nothing is evicted automatically.
        upgrade: False never changes the index's schema (docs/index.md,
            "Migrations").
        relocate: record ``storage`` (or ``shared``) as the store's new one, after
            the payloads were moved there.
        index_reserve: bytes of the index's disk held back in ``index.reserve`` so
            that eviction can run when that disk is full.
        shared: the shared tier this process uploads to and fetches from
            (docs/shared.md, "The setting"), checked at once and recorded like
            ``storage``; without it the tier is neither contacted nor changed.
        shared_options: its filesystem's options (``endpoint_url``, ``profile``,
            ``client_kwargs``), never credentials.

    Raises:
        InvalidArgument: ``root`` cannot be created, or ``alias_stride`` /
            ``max_chain`` differ from the ones the store was created with.
        SchemaMismatch: the index is not one this sparkcache can use (or, with
            ``upgrade=False``, is behind it).
        StorageMismatch: ``storage`` or ``shared`` is not the recorded one and
            ``relocate`` is not given.
        SparkCacheError: the shared tier does not answer or refuses access.
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
        # The narrow core the store's helpers take (index, backend, clock, counters);
        # nothing above the store reads it (tests/test_layers.py).
        self._core = Core(root, db, backend, clock, index_reserve=index_reserve)
        self.alias_stride = self._fixed_setting("alias_stride", alias_stride, DEFAULT_ALIAS_STRIDE)
        self.max_chain = self._fixed_setting("max_chain", max_chain, DEFAULT_MAX_CHAIN)
        #: What the store holds, for people (read-only): models, snapshots, counters.
        self.catalog = Catalog(self._core)
        #: The shared tier this process uploads to, or None.
        self.shared: SharedTier | None = None
        self._uploader: Uploader | None = None
        self._sweeper: Sweeper | None = None
        self._upload_wait = DEFAULT_UPLOAD_WAIT_SECONDS
        if shared is not None:
            try:
                self.shared = open_shared(self._core, shared, shared_options,
                                           alias_stride=self.alias_stride, relocate=relocate,
                                           record=upgrade)
            except BaseException:
                self._core.close()
                raise
        self._core.keep_reserve()

    @property
    def root(self) -> Path:
        """The store's folder."""
        return self._core.root

    @property
    def backend(self) -> Backend:
        """Where the payloads live."""
        return self._core.backend

    @property
    def db(self) -> Database:
        """The index connection (StoreClosed once the store is closed)."""
        return self._core.db

    def _fixed_setting(self, key: str, given: int | None, default: int) -> int:
        if given is not None and (not isinstance(given, int) or given <= 0):
            raise InvalidArgument(f"{key} must be a positive integer, got {given!r}")
        # Read first: a store that has its settings opens without the write
        # lock, so a long write of another process does not time the open out.
        with self._core.read() as conn:
            found = ids(conn, q.GET_SETTING, (key,))
        if not found:
            with self._core.write() as conn:
                found = ids(conn, q.GET_SETTING, (key,))  # another process's, meanwhile
                if not found:
                    value = default if given is None else given
                    conn.execute(q.PUT_SETTING, (key, str(value), self._core.clock()))
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
        ``wait_seconds`` it was started with), save pending counters and close the
        index.  Idempotent.
        """
        sweeper, self._sweeper = self._sweeper, None
        uploader, self._uploader = self._uploader, None
        try:
            if sweeper is not None:
                sweeper.stop()
            if uploader is not None:
                uploader.close(self._upload_wait)
        finally:
            self._core.close()
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
        offload: Offload | None = None,
    ) -> PublishResult:
        """Publish this rank's segment of the snapshot of ``token_ids``, durably
        before the index shows it (docs/architecture.md, "Publication protocol").

        Restorable once every rank has published; a chain longer than ``max_chain``
        is compacted here (its parent's rows read verified, a whole segment written).

        Args:
            identity: the model part; its ``world_size`` ranks publish.
            rank: this rank.
            token_ids: the snapshot's tokens, from the first.
            pages: one buffer per layer with this rank's blocks, in the engine's
                layout, for tokens ``[parent's tokens, len(token_ids))``; a layer
                that keeps a window (``identity.window_blocks``) only the window's
                blocks ending at the snapshot's end, with no parent.
            parent: the snapshot it extends (copy-on-write: only the tail is written).
            scope: the request scope its hashes are seeded with (a child's is its
                parent's).
            breakpoints: token counts (rounded down to whole blocks) that get alias rows.
            offload: runs the write (hashing, the file) for the caller, e.g. on a
                thread of lower priority; the index transactions stay on this one.

        Returns:
            The outcome: ``ready``, ``pending`` (other ranks still to publish) or
            ``skipped`` (refused by the store's retention, with the reason).

        Raises:
            InvalidArgument: pages or tokens that do not fit ``identity``.
            NotFound: ``parent`` is gone.
            StoreFull: the disk filled while writing.
        """
        result = publish_segment(self._core, identity, rank, token_ids, pages, parent=parent,
                                 scope=scope, breakpoints=breakpoints,
                                 alias_stride=self.alias_stride, max_chain=self.max_chain,
                                 policy=self.retention, offload=offload)
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
        can restore (docs/architecture.md, "Lookup").  Read-only; token ids are
        compared on :meth:`read`.

        Args:
            identity: the model part.
            token_ids: the prompt.
            scope: its request scope (default: none).
            ranks: the ranks that must restore it (default: all of the topology).
            hashes: precomputed :func:`~sparkcache.hashing.prefix_hashes`.
            whole_first: among snapshots holding the same longest prefix prefer one
                that ends there (a copy-on-write parent) over the newest.
            ends_only: only a snapshot's end is a match (a sliding-window model's).

        Returns:
            The match, or None.
        """
        return lookups.lookup(self._core, identity, token_ids, alias_stride=self.alias_stride,
                              scope=scope, ranks=ranks, hashes=hashes, whole_first=whole_first,
                              ends_only=ends_only)

    def extend(
        self, match: Match, token_ids: Sequence[int] | np.ndarray, *,
        ranks: Iterable[int] | None = None,
    ) -> tuple[Match, int] | None:
        """``match`` grown by its snapshot's next stored block when that block
        begins with some of the rest of ``token_ids`` (docs/architecture.md,
        "Lookup"): a prompt that leaves the snapshot inside a block.

        Args:
            match: a lookup's match (whole blocks).
            token_ids: the prompt: the match's tokens and fewer than a block more.
            ranks: those that must restore the grown match (default: all); the
                stored tokens are read, verified, from the first.

        Returns:
            ``(grown, supplied)``: the grown match, whose ``token_ids`` are the
            match's followed by the stored block's, and how many of
            ``token_ids`` it supplies (the match's and those the block shares,
            at least one); or None when nothing is stored past the match or
            its first token differs.

        Raises:
            CorruptSnapshot: a segment failed its checks (quarantined): no hit.
            NotFound: the snapshot vanished: no hit.
        """
        return lookups.extend(self._core, match, token_ids, ranks=ranks)

    def grow(
        self, match: Match, token_ids: Sequence[int] | np.ndarray, *,
        ranks: Iterable[int] | None = None,
    ) -> Match:
        """``match`` grown by the whole blocks after it that its snapshot stores and
        ``token_ids`` share, as vLLM's own prefix cache would (docs/architecture.md,
        "Lookup").

        Args:
            match: a lookup's match.
            token_ids: the prompt, starting with the match's tokens.
            ranks: those that must restore the grown match (default: all); the
                stored tokens are read, verified, from the first.

        Returns:
            The grown match, or ``match`` itself when nothing more is shared.

        Raises:
            CorruptSnapshot: a segment failed its checks (quarantined): no hit.
            NotFound: the snapshot vanished: no hit.
        """
        return lookups.grow(self._core, match, token_ids, alias_stride=self.alias_stride,
                            ranks=ranks)

    # -- read (sparkcache.reader) -----------------------------------------------------

    def read(self, match: Match, rank: int, *, n_tokens: int | None = None) -> list[np.ndarray]:
        """Verified pages of a match for ``rank`` (docs/architecture.md, "Segment
        format and verification").

        Args:
            match: what :meth:`lookup` returned.
            rank: the rank whose rows to read.
            n_tokens: the first tokens to read (default: all matched).

        Returns:
            One fresh uint8 array ``[n_blocks, page_nbytes]`` per layer.

        Raises:
            CorruptSnapshot: a check failed (the snapshot is quarantined): a miss.
            NotFound: the snapshot vanished: a miss.
            InvalidArgument: a match of another model, or longer than its snapshot.
        """
        return reader.read_pages(self._core, match, rank, n_tokens, touch=True)

    def read_into(
        self, match: Match, rank: int, out: Sequence[Any], *, n_tokens: int | None = None,
        start_tokens: int | Sequence[int] = 0, on_layer: Callable[[int], None] | None = None,
        threads: int = 1, cpus: Sequence[int] = (), hit: bool = True, in_place: bool = False,
        record_later: bool = False,
    ) -> int:
        """Verify and copy tokens ``[start_tokens, n_tokens)`` of a match into ``out``;
        no unverified byte is copied, unless ``in_place`` (docs/architecture.md).

        Args:
            match: what :meth:`lookup` returned.
            rank: the rank whose rows to read.
            out: one writable destination per layer (a buffer, or a list of buffers
                written as one) of at least ``n_blocks * page_nbytes`` bytes; its
                page 0 receives block ``start_tokens // block_size``.
            n_tokens: the end (default: the whole match).
            start_tokens: blocks the caller already holds (a multiple of the block
                size), or one start per layer: their payload is never read, while
                every link's header, identity and token ids are still checked.
            on_layer: called with each layer's index as soon as it is complete.
            threads: threads sharing the layers (still reported in order).
            cpus: the CPUs the threads copy on (thread ``k`` on ``cpus[k % len]``).
            hit: False: the restored amounts count, not a hit (a restore's first part).
            in_place: nothing reads ``out`` before this returns: chunks land there first.
            record_later: the hit is kept for the caller's :meth:`save_counts`.

        Returns:
            The number of blocks copied (``restored_*`` count only those).

        Raises:
            InvalidArgument: bad arguments or buffer sizes.
            CorruptSnapshot: a check failed (quarantined): a miss; ``out`` holds
                verified bytes (``in_place``: unverified ones, never written).
            NotFound: the snapshot vanished: a miss.
        """
        return reader.read_into(self._core, match, rank, out, n_tokens=n_tokens,
                                start_tokens=start_tokens, on_layer=on_layer, threads=threads,
                                cpus=cpus, hit=hit, in_place=in_place, record_later=record_later)

    # -- the shared tier (sparkcache.shared) ---------------------------------------------

    def siblings(self, identity: ModelIdentity, total_kv_heads: int) -> list[ModelIdentity]:
        """The identities this store holds ``identity``'s KV under, sharded
        otherwise (docs/connector.md, "Tensor parallelism";
        :func:`sparkcache.reshard.siblings`).

        Args:
            identity: the engine's identity.
            total_kv_heads: the model's KV heads in all (0: unknown, none).
        """
        return reshard.siblings(self._core, identity, total_kv_heads)

    def read_resharded(self, match: Match, engine: ModelIdentity, tp_rank: int,
                       total_kv_heads: int, out: Sequence[Sequence[Any]], *,
                       pp_rank: int = 0, n_tokens: int | None = None, start_tokens: int = 0,
                       threads: int = 1, cpus: Sequence[int] = (), hit: bool = True) -> None:
        """Engine rank ``tp_rank``'s heads of a snapshot stored under another
        sharding of the same KV, verified: each stored rank's chunks checked, then
        their heads written to ``out`` (:func:`sparkcache.reshard.read_resharded`).

        Args:
            match: from :meth:`lookup` with a sibling identity.
            engine: the reading engine's identity.
            tp_rank: the reading rank's place in its tensor-parallel group.
            total_kv_heads: the model's KV heads in all.
            out: per layer, the destination pages (flat buffers, runs of KV
                blocks in order); page 0 receives block ``start_tokens // block_size``.
            pp_rank: the reading rank's pipeline stage.
            n_tokens: a prefix of the match (default: all of it).
            start_tokens: the first token copied (a multiple of the block size).
            threads: copying threads, as :meth:`read_into`.
            cpus: the cores they run on, as :meth:`read_into`.
            hit: one hit however many stored ranks are read; False: none (a first part).

        Raises:
            ShardingRefused: the pair of shardings is not supported.
            CorruptSnapshot, NotFound: as :meth:`read` (a miss); ``out`` may
                then hold some verified bytes: recompute them.
        """
        reshard.read_resharded(self._core, match, engine, tp_rank, total_kv_heads, out,
                               pp_rank=pp_rank, n_tokens=n_tokens, start_tokens=start_tokens,
                               threads=threads, cpus=cpus, hit=hit)

    def _tier(self) -> SharedTier:
        if self.shared is None:
            raise InvalidArgument(
                "this store was opened without a shared tier: pass shared= (the CLI's "
                "--shared, or SPARK_KV_CACHE_SHARED)")
        return self.shared

    def upload(self, *, limit: int | None = None) -> UploadReport:
        """Upload the ready snapshots not uploaded yet, parents first, now
        (docs/shared.md, "Replication").

        Args:
            limit: look at this many snapshots at most (default: all).

        Returns:
            What was uploaded, found there already or refused, and what is left.

        Raises:
            InvalidArgument: the store has no shared tier.
        """
        return upload_pending(self._core, self._tier(), limit=limit)

    def fetch(
        self, identity: ModelIdentity, token_ids: Sequence[int] | np.ndarray, *,
        scope: RequestScope | None = None, breakpoints: Sequence[int] = (),
        hashes: Sequence[bytes] | None = None, min_tokens: int = 1, total_kv_heads: int = 0,
    ) -> FetchResult:
        """Make the longest prefix of ``token_ids`` that the shared tier holds local,
        verified and published through :meth:`publish`'s path (docs/shared.md,
        "Restoring from the tier"); :meth:`lookup` then finds it.

        Args:
            identity: the model part.
            token_ids: the prompt.
            scope: its request scope.
            breakpoints: the request's breakpoint positions, probed too.
            hashes: precomputed :func:`~sparkcache.hashing.prefix_hashes`.
            min_tokens: a shorter prefix is a miss.
            total_kv_heads: the model's KV heads in all: on a miss, the tier's
                snapshots of other TP sizes are asked too (``shared.siblings``).

        Returns:
            A miss, a prefix fetched or already local, or ``refused`` (an object
            failed verification: nothing of it is published).

        Raises:
            InvalidArgument: the store has no shared tier.
            SparkCacheError: the tier is unreachable or refuses access.
        """
        return fetch_any_sharding(self._core, self._tier(), identity, token_ids,
                                  total_kv_heads=total_kv_heads, scope=scope,
                                  breakpoints=breakpoints, hashes=hashes,
                                  alias_stride=self.alias_stride, max_chain=self.max_chain,
                                  policy=self.retention, min_tokens=min_tokens)

    def start_uploader(self, *, wait_seconds: float = DEFAULT_UPLOAD_WAIT_SECONDS,
                       poll_seconds: float | None = None) -> Uploader:
        """Upload in the background, once per host (the connector does, in its
        scheduler process); ``close`` stops it.

        Args:
            wait_seconds: how long ``close`` waits for its queue.
            poll_seconds: how often it looks for snapshots to upload.

        Returns:
            The running :class:`~sparkcache.shared.Uploader` (the same one on a
            second call).

        Raises:
            InvalidArgument: no shared tier, or a negative ``wait_seconds``.
        """
        tier = self._tier()
        if not wait_seconds >= 0:
            raise InvalidArgument(f"wait_seconds must be >= 0, got {wait_seconds!r}")
        if self._uploader is None:
            self._uploader = Uploader(
                self._core, tier,
                poll_seconds=DEFAULT_POLL_SECONDS if poll_seconds is None else poll_seconds,
            ).start()
        self._upload_wait = wait_seconds
        return self._uploader

    # -- inspection ---------------------------------------------------------------------

    def snapshots(self, model: ModelIdentity | None = None) -> list[SnapshotInfo]:
        """Every snapshot row (of one model), oldest id first.

        Args:
            model: only this model's (default: every model's).
        """
        with self._core.read() as conn:
            if model is None:
                return select_all(conn, q.LIST_SNAPSHOTS, into=SnapshotInfo)
            model_id = self._core.model_id(conn, model)
            if model_id is None:
                return []
            return select_all(conn, q.ADMIN_MODEL_SNAPSHOTS, (model_id,), into=SnapshotInfo)

    def snapshot(self, snapshot_id: int) -> SnapshotInfo:
        """One snapshot row.

        Args:
            snapshot_id: the snapshot.

        Raises:
            NotFound: no such snapshot.
        """
        with self._core.read() as conn:
            info = self._core.snapshot(conn, snapshot_id)
        if info is None:
            raise NotFound(f"no snapshot {snapshot_id}")
        return info

    def ensure_model(self, identity: ModelIdentity) -> int:
        """The id of the model row of ``identity``, created when there is none.

        Args:
            identity: the model part.
        """
        with self._core.write() as conn:
            return self._core.ensure_model(conn, identity)

    def stats(self, model: ModelIdentity | None = None) -> dict[str, int]:
        """The counters (docs/index.md, "counters"), unsaved counts included.

        Args:
            model: only this model's (default: summed over models).

        Returns:
            Counter name -> value; empty for a model the store never saw.
        """
        if model is None:
            return self._core.counter_totals()
        with self._core.read() as conn:
            model_id = self._core.model_id(conn, model)
        return {} if model_id is None else self._core.counter_totals(model_id)
