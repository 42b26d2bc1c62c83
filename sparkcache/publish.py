"""Publishing one rank's segment of a snapshot, in four steps.

1. **plan** (:func:`_plan`): hash the tokens, check the parent (ready, same
   model, a prefix of these tokens) and decide whether the chain is compacted;
2. **reserve** (:func:`_reserve`, one write transaction): find or create the
   snapshot row (``pending``), insert this rank's segment row (``writing``, its
   object key chosen) and a ``publish.r<rank>`` lease held by this process;
   a rank already published is deduplicated here;
3. **write** (:func:`_write`): the segment file, durably (temp file, fsync,
   rename, folder fsync), the parent's rows first when compacting; on any
   failure the reservation is undone;
4. **finish** (:func:`_finish`, one write transaction): the segment becomes
   ``ready``; once every rank of the topology is, the snapshot becomes
   ``ready`` and its boundary rows (end, stride aliases, breakpoints) appear.

So the index names every file before it exists and exposes a snapshot only
after all of its bytes are durable.  A crash between the steps leaves a
``pending`` snapshot whose lease names a dead process, which ``check(fix=True)``
and a later publish of the same snapshot reclaim.
"""

from __future__ import annotations

import functools
import itertools
import operator
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkcache import segment as seg
from sparkcache.backends import BufferLike
from sparkcache.buffers import as_byte_view
from sparkcache.core import (
    Conn,
    Core,
    Match,
    PublishPolicy,
    SnapshotInfo,
    model_folder,
    scalar,
    select_one,
)
from sparkcache.errors import InvalidArgument, NotFound, SparkCacheError
from sparkcache.hashing import as_token_array, prefix_hashes, prefix_seed
from sparkcache.holders import this_holder
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.maintenance import drop_snapshot, insert_boundaries, publish_abandoned
from sparkcache.reader import read_pages

__all__ = ["PUBLISH_LEASE_SECONDS", "Encoded", "Offload", "PublishResult", "block_tokens",
           "publish"]

#: Runs a publish's write step (hashing, the segment file, its fsync) and returns
#: its result: e.g. on a thread of lower priority, the transactions staying on
#: the caller's thread (:mod:`sparkcache.connector.publisher`).
Offload = Callable[[Callable[[], Any]], Any]

#: How long a publish may take before its lease expires and others may clean up.
PUBLISH_LEASE_SECONDS = 600.0


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
class Encoded:
    """A segment already encoded (one fetched from the shared tier), published as
    it is instead of pages: its ``header`` bytes (length prefix included, checked
    against ``digest`` and the plan by the publish), then its layers' bytes in
    order (``layer_nbytes`` in all) as ``layers`` yields them, each piece
    verified by the producer before it is yielded; the token ids are the
    publish's own.  A producer that raises undoes the publish: the temp file is
    removed and nothing becomes visible.  Never compacted: publish it only where
    the chain has room (``parent.depth + 1 < max_chain``)."""

    header: bytes
    digest: str
    layers: Iterable[BufferLike]
    layer_nbytes: int


@dataclass(frozen=True)
class _Plan:
    """What the steps of one publish share."""

    identity: ModelIdentity
    rank: int
    tokens: np.ndarray
    scope_json: str  # the request scope's canonical JSON, recorded with the snapshot
    hashes: list[bytes]
    marks: list[int]  # breakpoints, in tokens, on block boundaries
    parent: int | None
    start: int  # first token this segment holds (the parent's end, unless compacted)
    depth: int
    compact: bool
    tail_start: int  # first token of the pages the caller passed (the parent's end)
    holder: str
    tenant: str | None = None  # the scope's tenant, recorded with the snapshot

    @property
    def n(self) -> int:
        return int(self.tokens.size)

    @property
    def snap_key(self) -> str:
        return self.hashes[-1].hex()

    @property
    def lease_kind(self) -> str:
        return f"publish.r{self.rank}"


@dataclass(frozen=True)
class _Reserved:
    model_id: int
    snapshot_id: int
    object_key: str


def block_tokens(identity: ModelIdentity, token_ids: Any) -> np.ndarray:
    """``token_ids`` as uint32, checked to be a positive number of whole blocks."""
    tokens = as_token_array(token_ids)
    if tokens.size == 0 or tokens.size % identity.block_size:
        raise InvalidArgument(
            f"a snapshot holds whole blocks: {tokens.size} tokens is not a positive "
            f"multiple of block_size={identity.block_size}; pass tokens[: n // bs * bs]"
        )
    return tokens


def publish(
    core: Core, identity: ModelIdentity, rank: int, token_ids: Sequence[int] | np.ndarray,
    pages: Sequence[Any] | Encoded, *, parent: int | None, scope: RequestScope | None,
    breakpoints: Iterable[int], alias_stride: int, max_chain: int,
    policy: PublishPolicy | None, offload: Offload | None = None,
) -> PublishResult:
    """Publish this rank's segment; see :meth:`sparkcache.store.SnapshotStore.publish`
    (``offload`` runs step 3, the write, and returns what it returned)."""
    plan = _plan(core, identity, identity.check_rank(rank), block_tokens(identity, token_ids),
                 parent, scope, breakpoints, max_chain)
    bs = identity.block_size
    views = (pages if isinstance(pages, Encoded)
             else _page_views(identity, pages, plan.tail_start // bs, plan.n // bs))
    if isinstance(views, Encoded) and plan.compact:
        raise InvalidArgument("an encoded segment is written as it is, never compacted: "
                              "publish its pages, or under a parent with a shorter chain")
    if policy is not None:
        if isinstance(views, Encoded):
            nbytes = views.layer_nbytes
        elif identity.window_blocks:
            nbytes = sum(v.size for v in views)
        else:
            nbytes = (plan.n - plan.start) // bs * identity.page_nbytes * len(views)
        why = policy.refuse(core, plan.n, nbytes)
        if why is not None:
            with core.write() as conn:
                conn.execute(q.BUMP_COUNTER, (core.ensure_model(conn, identity), "skipped", 1))
            return PublishResult(0, plan.n, "skipped", 0, False, skipped=why)
    reserved = _reserve(core, plan)
    if isinstance(reserved, PublishResult):
        return reserved
    write = functools.partial(_write, core, plan, reserved, views)
    written, digest = write() if offload is None else offload(write)
    with core.write() as conn:
        conn.execute(q.FINISH_SEGMENT, (written, digest, reserved.snapshot_id, plan.rank))
        lost = conn.changes() != 1
        if not lost:
            state = _finish(core, conn, plan, reserved, written, alias_stride)
    if lost:
        # Someone (check --fix) removed our rows meanwhile: nothing became visible.
        core.delete_object(reserved.object_key)
        raise SparkCacheError(
            f"snapshot {reserved.snapshot_id} was removed while rank {plan.rank} published "
            "it; retry"
        )
    if policy is not None:
        policy.after_publish(core, reserved.model_id, reserved.snapshot_id)
    return PublishResult(reserved.snapshot_id, plan.n, state, written, False, plan.compact)


def _plan(
    core: Core, identity: ModelIdentity, rank: int, tokens: np.ndarray, parent: int | None,
    scope: RequestScope | None, breakpoints: Iterable[int], max_chain: int,
) -> _Plan:
    """Hash the tokens and check the parent (step 1)."""
    bs = identity.block_size
    n = int(tokens.size)
    scope = scope or RequestScope()
    hashes = prefix_hashes(prefix_seed(identity, scope), tokens, bs)
    # Breakpoints round down to whole blocks; one below the first block marks nothing.
    marks = sorted({b // bs * bs for b in _token_counts(breakpoints) if bs <= b <= n})
    start, depth, compact, tail_start = 0, 0, False, 0
    if parent is not None and identity.window_blocks:
        raise InvalidArgument("a model whose layers keep a window of blocks (sliding-window "
                              "attention) publishes whole snapshots: pass parent=None")
    if parent is not None:
        with core.read() as conn:
            p = core.snapshot(conn, parent)
            model_id = core.model_id(conn, identity)
        if p is None or p.state != "ready":
            raise NotFound(f"parent snapshot {parent} is not restorable; publish without parent")
        if p.model_id != model_id:
            raise InvalidArgument(f"parent snapshot {parent} belongs to another model identity")
        # A child's hashes continue its parent's, so it lives in its parent's scope.
        # (A parent published before scopes were recorded is checked by its key.)
        if p.scope_json is not None and p.scope_json != scope.canonical():
            raise InvalidArgument(
                f"parent snapshot {parent} was published in another request scope "
                f"({p.scope_json}); publish the child with its parent's scope"
            )
        if not 0 < p.n_tokens < n or hashes[p.n_tokens // bs - 1].hex() != p.snap_key:
            raise InvalidArgument(
                f"parent snapshot {parent} is not a prefix of these tokens in this scope"
            )
        tail_start = p.n_tokens
        compact = p.depth + 1 >= max_chain
        if not compact:
            start, depth = p.n_tokens, p.depth + 1
    return _Plan(identity, rank, tokens, scope.canonical(), hashes, marks, parent, start, depth,
                 compact, tail_start, this_holder(), scope.tenant)


def _token_counts(breakpoints: Iterable[int]) -> list[int]:
    try:
        counts = [operator.index(b) for b in breakpoints]
    except TypeError as exc:
        raise InvalidArgument(
            f"breakpoints must be token counts (integers), got {breakpoints!r}") from exc
    return counts


def _page_views(identity: ModelIdentity, pages: Sequence[Any], start_block: int,
                end_block: int) -> list[np.ndarray]:
    if isinstance(pages, (bytes, bytearray, memoryview, np.ndarray)) or not pages:
        raise InvalidArgument("pages must be a non-empty sequence of per-layer buffers")
    if len(pages) != identity.num_layers:
        raise InvalidArgument(
            f"pages holds {len(pages)} layers; the identity says num_layers="
            f"{identity.num_layers}: pass one buffer per layer"
        )
    views = [as_byte_view(p) for p in pages]
    for i, view in enumerate(views):
        n_blocks = end_block - identity.first_stored_block(i, start_block, end_block)
        want = n_blocks * identity.page_nbytes
        if view.size != want:
            raise InvalidArgument(
                f"layer {i} holds {view.size} bytes; {n_blocks} blocks of page_shape "
                f"{identity.page_shape} in {identity.kv_cache_dtype} need {want}"
            )
    return views


def _reserve(core: Core, plan: _Plan) -> _Reserved | PublishResult:
    """Step 2: the snapshot row, this rank's segment row and the publish lease; or
    the result of a rank already published (deduplicated)."""
    now = core.clock()
    start = plan.start
    with core.write() as conn:
        model_id = core.ensure_model(conn, plan.identity)
        if plan.parent is not None:  # checked again under the write lock: it may have gone
            p = core.snapshot(conn, plan.parent)
            if p is None or p.state != "ready":
                raise NotFound(
                    f"parent snapshot {plan.parent} is not restorable; publish without parent"
                )
        snapshot_id: int | None = None
        info = select_one(conn, q.LIVE_SNAPSHOT_BY_KEY, (model_id, plan.snap_key),
                         into=SnapshotInfo)
        if info is not None:
            if info.n_tokens != plan.n:  # pragma: no cover - a 128-bit hash collision
                raise InvalidArgument("snapshot key collision; not publishing")
            other_parent = ((info.parent_id, info.start_token)
                            != ((plan.parent if start else None), start))
            if other_parent and publish_abandoned(core, conn, info, now):
                # Started with another parent by ranks that never finished, and
                # whose publishers are gone: start afresh, every rank again.
                drop_snapshot(core, conn, info.id, "abandoned")
                info = None
        if info is not None:
            segment = core.segment(conn, info.id, plan.rank)
            if segment is not None:
                if segment.state == "ready" or core.leased(conn, info.id, now, plan.lease_kind):
                    return PublishResult(info.id, plan.n, info.state, 0, True)
                _drop_segment(core, conn, info.id, plan.rank, segment.object_key)
            if other_parent:
                if scalar(conn, q.COUNT_SEGMENTS, (info.id,)):
                    raise InvalidArgument(
                        f"snapshot {info.id} was started by another rank with parent "
                        f"{info.parent_id}; every rank must publish with the same parent"
                    )
                # No rank has a segment left: its publishers died.  Start afresh.
                drop_snapshot(core, conn, info.id, "abandoned")
            else:
                snapshot_id = info.id
        if snapshot_id is None:
            snapshot_id = scalar(
                conn, q.INSERT_SNAPSHOT,
                (model_id, plan.snap_key, plan.n, start, plan.parent if start else None,
                 plan.depth, plan.identity.world_size, now, now, plan.scope_json, plan.tenant))
        object_key = (
            f"{model_folder(plan.identity)}/{plan.snap_key[:2]}/{plan.snap_key}-"
            f"{secrets.token_hex(4)}.r{plan.rank}.safetensors"
        )
        conn.execute(q.INSERT_SEGMENT, (snapshot_id, plan.rank, object_key, start, plan.n, now))
        conn.execute(q.INSERT_LEASE, (snapshot_id, plan.holder, plan.lease_kind, now,
                                      now + PUBLISH_LEASE_SECONDS))
    return _Reserved(model_id, snapshot_id, object_key)


def _write(core: Core, plan: _Plan, reserved: _Reserved,
           views: list[np.ndarray] | Encoded) -> tuple[int, str]:
    """Step 3: the segment file, durable when this returns: (bytes written, digest).

    A compacting publish first reads the parent's chain (verified) so that the
    file holds the whole prefix.  An :class:`Encoded` segment is written as its
    layers arrive, after its header is checked against the plan.  On any
    failure (of the producer too) the reservation is undone."""
    try:
        if isinstance(views, Encoded):
            return _write_encoded(core, plan, reserved, views)
        if plan.compact:
            views = _compacted(core, plan, views)
        start = plan.start
        tokens = plan.tokens[start:]
        meta = {
            "model": plan.identity.digest(), "rank": plan.rank, "snap_key": plan.snap_key,
            "token_start": start, "token_end": plan.n, "block_size": plan.identity.block_size,
        }
        header, digest = seg.build_header(
            meta, views, tokens, plan.identity.page_shape, plan.identity.kv_cache_dtype
        )
        written = core.backend.put(reserved.object_key,
                                   [header, *views, tokens.view(np.uint8)])
    except BaseException:
        _abandon(core, plan, reserved)
        raise
    return written, digest


def _write_encoded(core: Core, plan: _Plan, reserved: _Reserved,
                   enc: Encoded) -> tuple[int, str]:
    tokens = plan.tokens[plan.start:].view(np.uint8)
    size = len(enc.header) + enc.layer_nbytes + tokens.size
    header = seg.check_header(memoryview(enc.header), enc.digest, plan.identity, plan.rank,
                              plan.snap_key, plan.start, plan.n, size=size)
    if header.tensors["tokens"][0] != len(enc.header) + enc.layer_nbytes:
        raise InvalidArgument(f"an encoded segment's layers hold {enc.layer_nbytes} bytes, "
                              "its header says otherwise")
    written = core.backend.put(reserved.object_key,
                               itertools.chain([enc.header], enc.layers, [tokens]))
    if written != size:
        raise SparkCacheError(f"an encoded segment's layers yielded {written} bytes in all, "
                              f"its header says {size}")
    return written, enc.digest


def _compacted(core: Core, plan: _Plan, tail: list[np.ndarray]) -> list[np.ndarray]:
    """Parent chain rows (verified) followed by the tail: a full segment."""
    assert plan.parent is not None
    match = Match(plan.parent, plan.tail_start, plan.identity, plan.tokens[:plan.tail_start])
    head = read_pages(core, match, plan.rank, None, touch=False)
    return [np.concatenate([h.reshape(-1), t]) for h, t in zip(head, tail, strict=True)]


def _finish(core: Core, conn: Conn, plan: _Plan, reserved: _Reserved, written: int,
            alias_stride: int) -> str:
    """Step 4, inside the finishing transaction: snapshot ready once all ranks are."""
    snapshot_id = reserved.snapshot_id
    conn.execute(q.ADD_SNAPSHOT_BYTES, (written, snapshot_id))
    for lease in core.leases(conn, snapshot_id):
        if lease.kind == plan.lease_kind and lease.holder == plan.holder:
            conn.execute(q.DELETE_LEASE, (lease.id,))
    ready = scalar(conn, q.COUNT_READY_SEGMENTS, (snapshot_id,))
    state = "pending"
    if ready >= plan.identity.world_size:
        now = core.clock()
        conn.execute(q.MARK_READY, (now, now, snapshot_id))
        insert_boundaries(conn, reserved.snapshot_id, reserved.model_id, plan.hashes,
                          plan.identity.block_size, alias_stride, plan.marks)
        state = "ready"
    for name, value in (("publishes", 1), ("written_tokens", plan.n - plan.start),
                        ("written_bytes", written)):
        conn.execute(q.BUMP_COUNTER, (reserved.model_id, name, value))
    return state


def _drop_segment(core: Core, conn: Conn, snapshot_id: int, rank: int, key: str) -> None:
    """Forget a rank's segment row and its publish leases; its file goes after commit."""
    conn.execute(q.DELETE_SEGMENT, (snapshot_id, rank))
    for lease in core.leases(conn, snapshot_id):
        if lease.kind == f"publish.r{rank}":
            conn.execute(q.DELETE_LEASE, (lease.id,))
    core.delete_after_commit([key])


def _abandon(core: Core, plan: _Plan, reserved: _Reserved) -> None:
    """Undo a failed publish: no row, no file, nothing visible."""
    snapshot_id = reserved.snapshot_id
    try:
        with core.write() as conn:
            _drop_segment(core, conn, snapshot_id, plan.rank, reserved.object_key)
            if scalar(conn, q.COUNT_SEGMENTS, (snapshot_id,)) == 0:
                info = core.snapshot(conn, snapshot_id)
                if info is not None and info.state == "pending":
                    conn.execute(q.DELETE_SNAPSHOT, (snapshot_id,))
    except SparkCacheError:
        pass  # the index is unreachable: check(fix=True) reclaims the rows later
