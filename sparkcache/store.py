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
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sparkcache import reader
from sparkcache import segment as seg
from sparkcache.backends import Backend, open_backend
from sparkcache.errors import (
    InvalidArgument,
    LeaseError,
    NotFound,
    SparkCacheError,
    StoreClosed,
)
from sparkcache.hashing import as_token_array, prefix_hashes, prefix_seed
from sparkcache.holders import holder_alive, this_holder
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.index.db import Database

if TYPE_CHECKING:
    from sparkcache.retention import Retention

__all__ = ["Match", "PublishResult", "SnapshotInfo", "SnapshotStore"]

INDEX_FILE = "index.sqlite"
OBJECTS = "objects"
#: Default sparse alias stride in tokens (rounded down to whole blocks).
DEFAULT_ALIAS_STRIDE = 256
#: Default bound on copy-on-write chain length; longer chains are compacted.
DEFAULT_MAX_CHAIN = 8
#: How long a publish may take before its lease expires and others may clean up.
PUBLISH_LEASE_SECONDS = 600.0


@dataclass(frozen=True)
class Match:
    """A lookup hit: ``n_tokens`` of the prompt can be restored from ``snapshot_id``."""

    snapshot_id: int
    n_tokens: int
    identity: ModelIdentity
    token_ids: np.ndarray  # the prompt's first n_tokens, uint32
    scope: RequestScope | None = None

    @property
    def n_blocks(self) -> int:
        return self.n_tokens // self.identity.block_size


@dataclass(frozen=True)
class PublishResult:
    """What one rank's publish did."""

    snapshot_id: int
    n_tokens: int
    state: str  # 'ready' once every rank has published, else 'pending'
    bytes_written: int
    deduplicated: bool  # True when this rank's segment was already there (nothing written)
    compacted: bool = False
    skipped: str | None = None  # why retention refused to save it (state 'skipped')


@dataclass(frozen=True)
class SnapshotInfo:
    id: int
    model_id: int
    snap_key: str
    n_tokens: int
    start_token: int
    parent_id: int | None
    depth: int
    world_size: int
    nbytes: int
    state: str
    reason: str | None
    pinned: bool
    created_at: float
    last_used: float
    use_count: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> SnapshotInfo:
        (id_, model_id, snap_key, n_tokens, start_token, parent_id, depth, world_size, nbytes,
         state, reason, pinned, created_at, last_used, use_count) = row
        return cls(id_, model_id, snap_key, n_tokens, start_token, parent_id, depth, world_size,
                   nbytes, state, reason, bool(pinned), created_at, last_used, use_count)


def _expected_ranks(identity: ModelIdentity, ranks: Iterable[int] | None) -> list[int]:
    """``ranks`` checked and sorted; by default every rank of the topology."""
    expected = sorted({identity.check_rank(r) for r in ranks} if ranks is not None
                      else range(identity.world_size))
    if not expected:
        raise InvalidArgument("ranks must name at least one rank")
    return expected


class SnapshotStore:
    """The one API over the index and the payload backend.

    ``root`` is a local folder (the index must be on a local filesystem);
    ``storage`` optionally puts payloads elsewhere (a path or any backend URL,
    see :func:`sparkcache.backends.open_backend`).  ``alias_stride`` and
    ``max_chain`` are fixed when the store is created and recorded in its
    settings table.  ``clock`` is injectable for tests.  With ``retention``
    (:class:`~sparkcache.retention.Retention`) every publish obeys Spark's limits
    and trims its own model; without it nothing is evicted automatically.  Safe to share between
    threads; each process opens its own store (connections reopen after fork).
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
    ) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgument(f"cannot create the store folder {self.root}: {exc}") from exc
        self._clock = clock
        self.retention = retention
        self._lock = threading.RLock()
        self._unsaved: Counter[tuple[int, str]] = Counter()
        self._db: Database | None = Database(
            self.root / INDEX_FILE, busy_timeout_ms=busy_timeout_ms
        )
        if storage is None:
            self.backend: Backend = open_backend(str(self.root))
        elif isinstance(storage, (str, os.PathLike)):
            self.backend = open_backend(storage)
        else:
            self.backend = storage
        self.alias_stride = self._fixed_setting("alias_stride", alias_stride, DEFAULT_ALIAS_STRIDE)
        self.max_chain = self._fixed_setting("max_chain", max_chain, DEFAULT_MAX_CHAIN)

    # -- plumbing ---------------------------------------------------------------

    @property
    def db(self) -> Database:
        if self._db is None:
            raise StoreClosed("this SnapshotStore was closed; open a new one")
        return self._db

    @contextmanager
    def _write(self) -> Iterator[Any]:
        after: list[Callable[[], object]] = []
        with self._lock, self.db.write(after) as conn:
            if self._unsaved:
                for (model_id, name), value in self._unsaved.items():
                    conn.execute(q.BUMP_COUNTER, (model_id, name, value))
                self._unsaved.clear()
            yield conn
        # The files the transaction stopped naming go once both locks are free:
        # lookups in other threads need not wait for the unlinks.
        self.db._run_callbacks(after)

    @contextmanager
    def _read(self) -> Iterator[Any]:
        with self._lock, self.db.read() as conn:
            yield conn

    def _fixed_setting(self, key: str, given: int | None, default: int) -> int:
        if given is not None and (not isinstance(given, int) or given <= 0):
            raise InvalidArgument(f"{key} must be a positive integer, got {given!r}")
        with self._write() as conn:
            row = conn.execute(q.GET_SETTING, (key,)).fetchone()
            if row is None:
                value = default if given is None else given
                conn.execute(q.PUT_SETTING, (key, str(value), self._clock()))
                return value
        stored = int(row[0])
        if given is not None and given != stored:
            raise InvalidArgument(
                f"this store was created with {key}={stored}; open it without {key} "
                f"(or with {key}={stored}), or use another folder for {key}={given}"
            )
        return stored

    def _count(self, model_id: int, name: str, value: int = 1) -> None:
        """Count outside a transaction; saved with the next write."""
        with self._lock:
            self._unsaved[(model_id, name)] += value

    def close(self) -> None:
        """Save pending counters and close the index.  Idempotent."""
        if self._db is None:
            return
        try:
            if self._unsaved:
                with self._write():
                    pass
        finally:
            self._db.close()
            self._db = None
            self.backend.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------

    @staticmethod
    def _folder(identity: ModelIdentity) -> str:
        return f"{OBJECTS}/m-{identity.digest()}"

    def _ensure_model(self, conn: Any, identity: ModelIdentity) -> int:
        row = conn.execute(
            q.INSERT_MODEL,
            (identity.digest(), identity.model, self._folder(identity), identity.canonical(),
             self._clock()),
        ).fetchone()
        return int(row[0])

    def _model_id(self, conn: Any, identity: ModelIdentity) -> int | None:
        row = conn.execute(q.MODEL_BY_DIGEST, (identity.digest(),)).fetchone()
        return None if row is None else int(row[0])

    def _stride_blocks(self, identity: ModelIdentity) -> int:
        return max(1, self.alias_stride // identity.block_size)

    @staticmethod
    def _page_views(
        identity: ModelIdentity, pages: Sequence[Any], n_blocks: int
    ) -> list[np.ndarray]:
        if isinstance(pages, (bytes, bytearray, memoryview, np.ndarray)) or not pages:
            raise InvalidArgument("pages must be a non-empty sequence of per-layer buffers")
        want = n_blocks * identity.page_nbytes
        views = [seg.as_byte_view(p) for p in pages]
        for i, view in enumerate(views):
            if view.size != want:
                raise InvalidArgument(
                    f"layer {i} holds {view.size} bytes; {n_blocks} blocks of page_shape "
                    f"{identity.page_shape} in {identity.kv_cache_dtype} need {want}"
                )
        return views

    def _tokens(self, identity: ModelIdentity, token_ids: Any) -> np.ndarray:
        tokens = as_token_array(token_ids)
        if tokens.size == 0 or tokens.size % identity.block_size:
            raise InvalidArgument(
                f"a snapshot holds whole blocks: {tokens.size} tokens is not a positive "
                f"multiple of block_size={identity.block_size}; pass tokens[: n // bs * bs]"
            )
        return tokens

    # -- publish ------------------------------------------------------------------

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
        segment is written.  Returns once this rank's bytes are durable; the
        snapshot is restorable when every rank has published.
        """
        rank = identity.check_rank(rank)
        tokens = self._tokens(identity, token_ids)
        bs = identity.block_size
        n = int(tokens.size)
        hashes = prefix_hashes(prefix_seed(identity, scope), tokens, bs)
        snap_key = hashes[-1].hex()
        # Breakpoints round down to whole blocks; one below the first block marks nothing.
        marks = sorted({int(b) // bs * bs for b in breakpoints if bs <= int(b) <= n})

        start, depth, compact, tail_start = 0, 0, False, 0
        if parent is not None:
            with self._read() as conn:
                prow = conn.execute(q.SNAPSHOT_BY_ID, (parent,)).fetchone()
                model_id = self._model_id(conn, identity)
            if prow is None or prow[9] != "ready":
                raise NotFound(
                    f"parent snapshot {parent} is not restorable; publish without parent"
                )
            p = SnapshotInfo.from_row(prow)
            if p.model_id != model_id:
                raise InvalidArgument(f"parent snapshot {parent} belongs to another model identity")
            if not 0 < p.n_tokens < n or hashes[p.n_tokens // bs - 1].hex() != p.snap_key:
                raise InvalidArgument(
                    f"parent snapshot {parent} is not a prefix of these tokens in this scope"
                )
            tail_start = p.n_tokens
            compact = p.depth + 1 >= self.max_chain
            if not compact:
                start, depth = p.n_tokens, p.depth + 1
        views = self._page_views(identity, pages, (n - tail_start) // bs)
        if self.retention is not None:
            nbytes = (n // bs if compact else (n - tail_start) // bs) * identity.page_nbytes
            why = self.retention.refuse(self, n, nbytes * len(views))
            if why is not None:
                with self._write() as conn:
                    conn.execute(q.BUMP_COUNTER, (self._ensure_model(conn, identity),
                                                  "skipped", 1))
                return PublishResult(0, n, "skipped", 0, False, skipped=why)

        now = self._clock()
        holder = this_holder()
        lease_kind = f"publish.r{rank}"
        doomed: list[str] = []
        with self._write() as conn:
            model_id = self._ensure_model(conn, identity)
            if parent is not None:  # checked again under the write lock: it may have gone
                prow = conn.execute(q.SNAPSHOT_BY_ID, (parent,)).fetchone()
                if prow is None or prow[9] != "ready":
                    raise NotFound(
                        f"parent snapshot {parent} is not restorable; publish without parent"
                    )
            existing = conn.execute(q.LIVE_SNAPSHOT_BY_KEY, (model_id, snap_key)).fetchone()
            if existing is not None:
                info = SnapshotInfo.from_row(existing)
                if info.n_tokens != n:  # pragma: no cover - a 128-bit hash collision
                    raise InvalidArgument("snapshot key collision; not publishing")
                row = conn.execute(q.SEGMENT, (info.id, rank)).fetchone()
                if row is not None:
                    if row[5] == "ready" or self._publisher_alive(conn, info.id, lease_kind, now):
                        return PublishResult(info.id, n, info.state, 0, True)
                    self._drop_segment(conn, info.id, rank, lease_kind, row[0], doomed)
                if (info.parent_id, info.start_token) != ((parent if start else None), start):
                    if conn.execute(q.COUNT_SEGMENTS, (info.id,)).fetchone()[0]:
                        raise InvalidArgument(
                            f"snapshot {info.id} was started by another rank with parent "
                            f"{info.parent_id}; every rank must publish with the same parent"
                        )
                    # No rank has a segment left: its publishers died.  Start afresh.
                    conn.execute(q.DELETE_SNAPSHOT, (info.id,))
                    existing = None
            if existing is not None:
                snapshot_id = info.id
            else:
                snapshot_id = int(conn.execute(
                    q.INSERT_SNAPSHOT,
                    (model_id, snap_key, n, start, parent if start else None, depth,
                     identity.world_size, now, now),
                ).fetchone()[0])
            object_key = (
                f"{self._folder(identity)}/{snap_key[:2]}/{snap_key}-{secrets.token_hex(4)}"
                f".r{rank}.safetensors"
            )
            conn.execute(q.INSERT_SEGMENT, (snapshot_id, rank, object_key, start, n, now))
            conn.execute(q.INSERT_LEASE, (snapshot_id, holder, lease_kind, now,
                                          now + PUBLISH_LEASE_SECONDS))
            for key in doomed:
                self.db.on_commit(functools.partial(self._delete_object, key))

        try:
            if compact:
                views = self._compacted(identity, rank, parent, tokens, views)  # type: ignore[arg-type]
            meta = {
                "model": identity.digest(), "rank": rank, "snap_key": snap_key,
                "token_start": start, "token_end": n, "block_size": bs,
            }
            header, digest = seg.build_header(
                meta, views, tokens[start:], identity.page_shape, identity.kv_cache_dtype
            )
            written = self.backend.put(
                object_key, [header, *views, tokens[start:].view(np.uint8)]
            )
        except BaseException:
            self._abandon(snapshot_id, rank, lease_kind, object_key)
            raise

        with self._write() as conn:
            conn.execute(q.FINISH_SEGMENT, (written, digest, snapshot_id, rank))
            lost = conn.changes() != 1
            if not lost:
                state = self._finish(conn, identity, model_id, snapshot_id, lease_kind, holder,
                                     hashes, marks, n - start, written)
        if lost:
            # Someone (check --fix) removed our rows meanwhile: nothing became visible.
            self._delete_object(object_key)
            raise SparkCacheError(
                f"snapshot {snapshot_id} was removed while rank {rank} published it; retry"
            )
        if self.retention is not None:
            self.retention.trim_model(self, model_id, keep=snapshot_id)
        return PublishResult(snapshot_id, n, state, written, False, compact)

    def _finish(
        self, conn: Any, identity: ModelIdentity, model_id: int, snapshot_id: int,
        lease_kind: str, holder: str, hashes: list[bytes], marks: list[int],
        new_tokens: int, written: int,
    ) -> str:
        """Second publish transaction: segment ready; snapshot ready once all ranks are."""
        conn.execute(q.ADD_SNAPSHOT_BYTES, (written, snapshot_id))
        self._release_kind(conn, snapshot_id, lease_kind, holder)
        ready = conn.execute(q.COUNT_READY_SEGMENTS, (snapshot_id,)).fetchone()[0]
        state = "pending"
        if ready >= identity.world_size:
            now = self._clock()
            conn.execute(q.MARK_READY, (now, now, snapshot_id))
            self._insert_boundaries(conn, identity, model_id, snapshot_id, hashes, marks)
            state = "ready"
        for name, value in (("publishes", 1), ("written_tokens", new_tokens),
                            ("written_bytes", written)):
            conn.execute(q.BUMP_COUNTER, (model_id, name, value))
        return state

    def _insert_boundaries(
        self, conn: Any, identity: ModelIdentity, model_id: int, snapshot_id: int,
        hashes: list[bytes], marks: list[int],
    ) -> None:
        bs = identity.block_size
        n_blocks = len(hashes)
        stride = self._stride_blocks(identity)
        rows: dict[int, str] = {i: "stride" for i in range(stride - 1, n_blocks, stride)}
        for mark in marks:
            rows.setdefault(mark // bs - 1, "breakpoint")
        rows[n_blocks - 1] = "end"
        conn.executemany(
            q.INSERT_BOUNDARY,
            [(hashes[i], snapshot_id, model_id, (i + 1) * bs, kind) for i, kind in rows.items()],
        )

    def _compacted(
        self, identity: ModelIdentity, rank: int, parent: int, tokens: np.ndarray,
        tail: list[np.ndarray],
    ) -> list[np.ndarray]:
        """Parent chain rows (verified) followed by the tail: a full segment."""
        with self._read() as conn:
            p_tokens = int(conn.execute(q.SNAPSHOT_BY_ID, (parent,)).fetchone()[3])
        match = Match(parent, p_tokens, identity, tokens[:p_tokens])
        head = reader.read_pages(self, match, rank, None, touch=False)
        return [np.concatenate([h.reshape(-1), t]) for h, t in zip(head, tail, strict=True)]

    def _publisher_alive(self, conn: Any, snapshot_id: int, kind: str, now: float) -> bool:
        for _id, holder, expires in conn.execute(q.LEASE_OF_KIND, (snapshot_id, kind)):
            if expires > now and holder_alive(holder) is not False:
                return True
        return False

    def _drop_segment(
        self, conn: Any, snapshot_id: int, rank: int, lease_kind: str, key: str,
        doomed: list[str],
    ) -> None:
        conn.execute(q.DELETE_SEGMENT, (snapshot_id, rank))
        leases = conn.execute(q.LEASE_OF_KIND, (snapshot_id, lease_kind)).fetchall()
        for lease_id, _holder, _exp in leases:
            conn.execute(q.DELETE_LEASE, (lease_id,))
        doomed.append(key)

    def _release_kind(self, conn: Any, snapshot_id: int, kind: str, holder: str) -> None:
        leases = conn.execute(q.LEASE_OF_KIND, (snapshot_id, kind)).fetchall()
        for lease_id, lease_holder, _exp in leases:
            if lease_holder == holder:
                conn.execute(q.DELETE_LEASE, (lease_id,))

    def _abandon(self, snapshot_id: int, rank: int, lease_kind: str, object_key: str) -> None:
        """Undo a failed publish: no row, no file, nothing visible."""
        try:
            with self._write() as conn:
                doomed: list[str] = []
                self._drop_segment(conn, snapshot_id, rank, lease_kind, object_key, doomed)
                if conn.execute(q.COUNT_SEGMENTS, (snapshot_id,)).fetchone()[0] == 0:
                    row = conn.execute(q.SNAPSHOT_BY_ID, (snapshot_id,)).fetchone()
                    if row is not None and row[9] == "pending":
                        conn.execute(q.DELETE_SNAPSHOT, (snapshot_id,))
                self.db.on_commit(lambda: self._delete_object(object_key))
        except SparkCacheError:
            pass  # the index is unreachable: check(fix=True) reclaims the rows later

    def _delete_object(self, key: str) -> None:
        # On failure the file is an orphan: check(fix=True) and the sweeper reclaim it.
        with contextlib.suppress(OSError, SparkCacheError):
            self.backend.delete(key)

    # -- lookup -------------------------------------------------------------------

    def lookup(
        self,
        identity: ModelIdentity,
        token_ids: Sequence[int] | np.ndarray,
        *,
        scope: RequestScope | None = None,
        ranks: Iterable[int] | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Match | None:
        """The longest stored prefix of ``token_ids`` that every rank in ``ranks``
        (default: all ranks of the topology) can restore, or None.

        ``hashes`` may pass precomputed :func:`~sparkcache.hashing.prefix_hashes`.
        Read-only: it takes no write lock.  Token ids are compared on ``read``.
        """
        tokens = as_token_array(token_ids)
        expected = _expected_ranks(identity, ranks)
        bs = identity.block_size
        if hashes is None:
            hashes = prefix_hashes(prefix_seed(identity, scope), tokens, bs)
        elif len(hashes) != tokens.size // bs:
            raise InvalidArgument("hashes must hold one hash per full block of token_ids")
        n_blocks = len(hashes)
        if n_blocks == 0:
            return None
        stride = self._stride_blocks(identity)
        with self._read() as conn:
            model_id = self._model_id(conn, identity)
            if model_id is None:
                return None
            probe = list(range(stride - 1, n_blocks, stride))
            matched = self._matched_strides(conn, model_id, hashes, probe, bs)
            top = probe[matched - 1] + 1 if matched else 0  # blocks matched at a stride
            window = [i for i in range(top, min(n_blocks, top + stride)) if (i + 1) % stride]
            # Every candidate of top * bs tokens or more has a row at the top stride or
            # in the window; the shorter ones are read only if none of those restores.
            found = self._find(conn, model_id, hashes, probe[matched - 1:matched] + window, bs)
            ranks_json = json.dumps(expected)
            unrestorable = False
            for shorter in (False, True):
                if shorter:
                    found = self._find(conn, model_id, hashes, probe[:max(0, matched - 1)], bs)
                found.sort(key=lambda c: (-c[1], -c[0]))
                for snapshot_id, n in found:
                    if self._restorable(conn, snapshot_id, n, ranks_json, len(expected)):
                        return Match(snapshot_id, n, identity, tokens[:n].copy(), scope)
                unrestorable = unrestorable or bool(found)
            if unrestorable:
                self._count(model_id, "misses.unrestorable")
            self._count(model_id, "misses")
        return None

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
        tokens = as_token_array(token_ids)
        identity = match.identity
        bs = identity.block_size
        n = match.n_tokens
        if not n < tokens.size < n + bs:
            raise InvalidArgument(f"token_ids must extend the match by 1 to {bs - 1} tokens "
                                  f"(it has {n}), got {tokens.size}")
        if not np.array_equal(tokens[:n], match.token_ids):
            raise InvalidArgument("token_ids must begin with the match's token ids")
        expected = _expected_ranks(identity, ranks)
        with self._read() as conn:
            if not self._restorable(conn, match.snapshot_id, n + bs, json.dumps(expected),
                                    len(expected)):
                return None
        stored = reader.tail_tokens(self, match, expected[0], n + bs)
        if stored is None or not np.array_equal(stored[:tokens.size - n], tokens[n:]):
            return None
        return Match(match.snapshot_id, n + bs, identity,
                     np.concatenate([tokens, stored[tokens.size - n:]]), match.scope)

    @staticmethod
    def _matched_strides(
        conn: Any, model_id: int, hashes: Sequence[bytes], probe: list[int], bs: int
    ) -> int:
        """How many leading stride probes have a boundary row, by binary search.

        Stride rows are prefix-closed: a snapshot sharing the prompt's first p
        tokens has a row at every stride position up to p, so the matched probes
        are a prefix of ``probe``.  log2(len(probe)) point queries, instead of
        reading every row of every snapshot that shares a prefix with the prompt.
        """
        lo, hi = 0, len(probe)
        while lo < hi:
            mid = (lo + hi) // 2
            i = probe[mid]
            if conn.execute(q.HAS_BOUNDARY, (hashes[i], model_id, (i + 1) * bs)).fetchone():
                lo = mid + 1
            else:
                hi = mid
        return lo

    @staticmethod
    def _find(
        conn: Any, model_id: int, hashes: Sequence[bytes], blocks: list[int], bs: int
    ) -> list[tuple[int, int]]:
        """(snapshot id, n_tokens) of every boundary row at the given block indices."""
        if not blocks:
            return []
        position = {hashes[i]: (i + 1) * bs for i in blocks}
        rows = conn.execute(q.FIND_BOUNDARIES, (json.dumps([h.hex() for h in position]), model_id))
        # A row's position must agree with where the prompt has that hash.
        return [
            (int(snapshot_id), int(n))
            for prefix_hash, snapshot_id, n in rows
            if position.get(bytes(prefix_hash)) == n
        ]

    @staticmethod
    def _restorable(conn: Any, snapshot_id: int, n: int, ranks_json: str, n_ranks: int) -> bool:
        for link_id, start, _end, _key, state in conn.execute(q.CHAIN, (snapshot_id,)).fetchall():
            if start >= n:
                continue
            if state != "ready":
                return False
            if conn.execute(q.READY_RANKS, (link_id, ranks_json)).fetchone()[0] != n_ranks:
                return False
        return True

    # -- read (sparkcache.reader) ------------------------------------------------------

    def read(self, match: Match, rank: int, *, n_tokens: int | None = None) -> list[np.ndarray]:
        """Verified pages of the first ``n_tokens`` (default all matched) for ``rank``.

        One uint8 array ``[n_blocks, page_nbytes]`` per layer (fresh memory).
        Raises CorruptSnapshot (snapshot quarantined) or NotFound: both a miss.
        """
        return reader.read_pages(self, match, rank, n_tokens, touch=True)

    def read_into(
        self, match: Match, rank: int, out: Sequence[Any], *, n_tokens: int | None = None,
        start_tokens: int = 0, on_layer: Callable[[int], None] | None = None,
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
        read; ``threads`` > 1 shares the layers among that many threads (still
        reported in order), each pinned to its own CPU of ``cpus`` for the copy
        when given (thread ``k`` on ``cpus[k % len(cpus)]``).  Returns the
        number of blocks copied; ``restored_tokens`` / ``restored_bytes`` count
        only the copied range.  Raises InvalidArgument
        on bad arguments or buffer sizes; CorruptSnapshot (snapshot
        quarantined) or NotFound are a miss, and may leave ``out`` partly
        written with *verified* bytes only.
        """
        return reader.read_into(self, match, rank, out, n_tokens=n_tokens,
                                start_tokens=start_tokens, on_layer=on_layer, threads=threads,
                                cpus=cpus)

    # -- maintenance (see also sparkcache.maintenance) ---------------------------------

    def quarantine(self, snapshot_id: int, reason: str) -> None:
        """Never offer this snapshot (nor its descendants) again; count the reason."""
        with self._write() as conn:
            row = conn.execute(q.SNAPSHOT_BY_ID, (snapshot_id,)).fetchone()
            if row is None:
                return
            for (sub_id,) in conn.execute(q.SUBTREE, (snapshot_id,)).fetchall():
                why = reason if sub_id == snapshot_id else "parent"
                conn.execute(q.QUARANTINE, (why, sub_id))
                conn.execute(q.DELETE_BOUNDARIES, (sub_id,))
            conn.execute(q.BUMP_COUNTER, (row[1], f"quarantined.{reason}", 1))

    def pin(self, snapshot_id: int, pinned: bool = True) -> None:
        """Pinned snapshots are never evicted."""
        with self._write() as conn:
            conn.execute(q.SET_PINNED, (int(pinned), snapshot_id))
            if conn.changes() != 1:
                raise NotFound(f"no snapshot {snapshot_id}")

    def acquire_lease(
        self, snapshot_id: int, *, kind: str = "read", ttl: float = 60.0, holder: str | None = None
    ) -> int:
        """Protect a snapshot from eviction and deletion for ``ttl`` seconds.

        Returns the lease id for :meth:`renew_lease` and :meth:`release_lease`.
        """
        if not ttl > 0:
            raise InvalidArgument(f"ttl must be positive seconds, got {ttl!r}")
        now = self._clock()
        with self._write() as conn:
            if conn.execute(q.SNAPSHOT_BY_ID, (snapshot_id,)).fetchone() is None:
                raise NotFound(f"no snapshot {snapshot_id}")
            row = conn.execute(
                q.INSERT_LEASE, (snapshot_id, holder or this_holder(), kind, now, now + ttl)
            ).fetchone()
            return int(row[0])

    def renew_lease(self, lease_id: int, ttl: float = 60.0) -> None:
        now = self._clock()
        with self._write() as conn:
            conn.execute(q.RENEW_LEASE, (now + ttl, lease_id, now))
            if conn.changes() != 1:
                raise LeaseError(f"lease {lease_id} expired or was released; acquire a new one")

    def release_lease(self, lease_id: int) -> bool:
        """Release a lease; False when it had already gone."""
        with self._write() as conn:
            conn.execute(q.DELETE_LEASE, (lease_id,))
            return bool(conn.changes())

    def delete(self, snapshot_id: int, *, force: bool = False) -> list[int]:
        """Delete a snapshot and its descendants (they cannot be restored without it).

        Refuses (LeaseError) while any of them holds an unexpired lease, unless
        ``force``.  Files go after the commit.  Returns the deleted ids.
        """
        from sparkcache.maintenance import delete_snapshots

        return delete_snapshots(self, [snapshot_id], force=force, reason="deleted")

    def evict(
        self, *, model: ModelIdentity | None = None, count: int | None = 1,
        free_bytes: int | None = None, older_than: float | None = None, reason: str = "lru",
    ) -> list[int]:
        """Delete least recently used evictable snapshots: see
        :func:`sparkcache.maintenance.evict_lru` for the rules."""
        from sparkcache.maintenance import evict_lru

        return evict_lru(self, model=model, count=count, free_bytes=free_bytes,
                         older_than=older_than, reason=reason)

    def _evict(self, **kwargs: Any) -> list[int]:
        from sparkcache.maintenance import evict_lru

        return evict_lru(self, **kwargs)

    def check(self, *, fix: bool = False) -> Any:
        """Compare index and files; with ``fix`` repair (see :mod:`sparkcache.maintenance`)."""
        from sparkcache.maintenance import check

        return check(self, fix=fix)

    # -- inspection ----------------------------------------------------------------------

    def snapshots(self, model: ModelIdentity | None = None) -> list[SnapshotInfo]:
        with self._read() as conn:
            if model is None:
                rows = conn.execute(q.LIST_SNAPSHOTS).fetchall()
            else:
                model_id = self._model_id(conn, model)
                rows = [] if model_id is None else conn.execute(
                    q.LIST_SNAPSHOTS + " WHERE model_id = ?", (model_id,)).fetchall()
        return [SnapshotInfo.from_row(r) for r in rows]

    def snapshot(self, snapshot_id: int) -> SnapshotInfo:
        with self._read() as conn:
            row = conn.execute(q.SNAPSHOT_BY_ID, (snapshot_id,)).fetchone()
        if row is None:
            raise NotFound(f"no snapshot {snapshot_id}")
        return SnapshotInfo.from_row(row)

    def stats(self, model: ModelIdentity | None = None) -> dict[str, int]:
        """Counters (hits, misses, written/restored tokens and bytes, evictions.*,
        quarantined.*), summed over models unless ``model`` is given."""
        with self._write() as conn:  # a write first saves the pending counters
            model_id = None if model is None else self._model_id(conn, model)
            totals: Counter[str] = Counter()
            for mid, name, value in conn.execute(q.COUNTERS):
                if model is None or mid == model_id:
                    totals[name] += value
        return dict(totals)
