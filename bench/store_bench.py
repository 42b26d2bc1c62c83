"""Benchmark the snapshot store against the raw work it wraps, in one run.

    .venv/bin/python bench/store_bench.py [--quick] [--json] [--plans] [--dir FOLDER] [--only PART]

Five measurements, each a median (or a percentile) of several repetitions and
each compared with a baseline or a budget *measured in the same run* (STYLE
habit 10: this machine is noisy, a number from another run means little):

1. publish throughput  vs  temp file + write + fsync + rename + folder fsync of
   the same buffers, in the same folder, alternated with the publishes;
2. verified restore (lookup + read_into)  vs  mmap + np.copyto of the same
   bytes from the same file, both warm in the page cache;
3. lookup latency of a 128k-token prompt (block_size 16) against an index of
   >= 1M boundary rows, with and without precomputed hashes, hit and miss;
4. evicting 100 snapshots from a 10k-snapshot and from a 100k-snapshot store;
5. ``Retention.sweep`` over the same two kinds of store (``--only sweep``): 100
   and 1000 snapshots due by age, 100 over ``total_mb``, and nothing due, each
   100k-store sweep against the same sweep of the 10k store.

The stores of (3), (4) and (5) are filled partly with bulk SQL through
``store.db.write()`` (publishing a million boundary rows one at a time would
take an hour): rows shaped exactly like the ones ``publish`` writes.  What is
real and what is bulk-inserted is printed in the table and described in
docs/benchmarks.md.  Everything runs in a scratch folder that is removed after.
Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import xxhash

import sparkcache
from sparkcache import ModelIdentity, SnapshotStore, prefix_hashes, prefix_seed
from sparkcache import segment as seg
from sparkcache.retention import MB, DiskUsage, Retention, RetentionSettings

# -- sizes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Everything that scales the run.  ``FULL`` takes ~3 min here, ``QUICK`` ~1 min."""

    layers: int = 12
    blocks: int = 128  # per publish: 12 layers x 128 blocks x 64 KiB pages = 100.7 MB
    publish_reps: int = 8  # even: each order (publish first, raw first) equally often
    restore_reps: int = 10
    prompt_tokens: int = 131_072  # 128k tokens; block_size 16 -> 8192 block hashes
    hit_tokens: int = 100_000  # the real snapshot the probe prompt hits
    boundary_rows: int = 1_000_000
    lookup_reps: int = 400
    hash_reps: int = 40
    evict_sizes: tuple[int, int] = (10_000, 100_000)
    evict_count: int = 100
    evict_reps: int = 8
    # The sweep runs on stores of evict_sizes (plus what it deletes): snapshots due
    # by age per sweep and the repetitions of each, then the total, then no-ops.
    sweep_age: tuple[int, ...] = (100, 1000)
    sweep_age_reps: tuple[int, ...] = (6, 2)
    sweep_total: int = 100
    sweep_total_reps: int = 6
    sweep_noop_reps: int = 20  # before the other sweeps, and as many again after


FULL = Sizes()
QUICK = replace(
    FULL, blocks=64, publish_reps=4, restore_reps=6, boundary_rows=200_000, lookup_reps=150,
    hash_reps=15, evict_sizes=(2_000, 20_000), evict_reps=4, sweep_age=(100, 500),
    sweep_age_reps=(4, 2), sweep_total_reps=4, sweep_noop_reps=10,
)

# One block of one layer for the publish/restore identity: (kv heads, 2 * block_size
# rows, head dim) in fp16 = 64 KiB, the layout of vLLM's CPU backend.
BLOCK = 32
PAGE_SHAPE = (8, 2 * BLOCK, 64)
# The lookup and eviction identities keep pages tiny: those benchmarks time the index.
LOOKUP_BLOCK = 16
TINY_PAGE = (1, 2, 8)
SYSTEM_PROMPT_TOKENS = 2048
LOOKUP_BUDGET_S = 2e-3

# -- results ----------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table; ``passed`` is None for information rows."""

    name: str
    value: str
    baseline: str = ""
    ratio: str = ""
    target: str = ""
    passed: bool | None = None
    note: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _pct(xs: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def _paired(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """Median of the ratios of back-to-back pairs: robust to the machine drifting."""
    return _median([a / b for a, b in zip(ours, theirs, strict=True)])


def _gbs(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _lat(xs: Sequence[float]) -> str:
    return f"p50 {_ms(_pct(xs, 50))}, p99 {_ms(_pct(xs, 99))}"


def _log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


@contextmanager
def _timer() -> Iterator[list[float]]:
    """Appends the elapsed seconds to the yielded list on exit."""
    out: list[float] = []
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - t0)


@contextmanager
def _trace_sql(store: SnapshotStore) -> Iterator[list[tuple[str, Any]]]:
    """Every statement (with its bindings) the store runs inside the block."""
    seen: list[tuple[str, Any]] = []
    conn = store.db.connection

    def tracer(_cursor: Any, sql: str, bindings: Any) -> bool:
        seen.append((sql, bindings))
        return True

    conn.exec_trace = tracer
    try:
        yield seen
    finally:
        conn.exec_trace = None


def _plans(store: SnapshotStore, statements: list[tuple[str, Any]]) -> dict[str, str]:
    """EXPLAIN QUERY PLAN of each distinct SELECT seen, keyed by its first words."""
    plans: dict[str, str] = {}
    with store.db.read() as conn:
        for sql, bindings in statements:
            text = " ".join(sql.split())
            if not text.upper().startswith(("SELECT", "WITH")) or text[:90] in plans:
                continue
            rows = conn.execute("EXPLAIN QUERY PLAN " + sql, bindings).fetchall()
            plans[text[:90]] = "; ".join(str(r[-1]) for r in rows)
    return plans


def _count(store: SnapshotStore, table: str) -> int:
    with store.db.read() as conn:
        ((n,),) = conn.execute(f"SELECT count(*) FROM {table}").fetchall()
    return int(n)


# -- 1 and 2: publish and restore ---------------------------------------------------------


def _publish_identity(layers: int) -> ModelIdentity:
    return ModelIdentity(
        model="bench/llama-like-8kv", revision="r1", num_layers=layers, num_kv_heads=8,
        head_size=64, dtype="float16", kv_cache_dtype="float16", block_size=BLOCK,
        page_shape=PAGE_SHAPE,
    )


def _segment(store: SnapshotStore, snapshot_id: int) -> tuple[Path, str]:
    """The rank-0 segment file of a snapshot and its header digest."""
    with store.db.read() as conn:
        ((key, digest),) = conn.execute(
            "SELECT object_key, digest FROM segments WHERE snapshot_id = ? AND rank = 0",
            (snapshot_id,),
        ).fetchall()
    return store.root / key, str(digest)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_put(folder: Path, name: str, chunks: Sequence[np.ndarray]) -> int:
    """What a plain durable writer does: temp file, write, fsync, rename, fsync folder."""
    tmp, final = folder / f"{name}.tmp", folder / name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    total = 0
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            total += done
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    _fsync_folder(folder)
    return total


def bench_publish_restore(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    ident = _publish_identity(sz.layers)
    n_tokens = sz.blocks * BLOCK
    shape = (sz.blocks, *PAGE_SHAPE)
    pages = [rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
             for _ in range(sz.layers)]
    payload = sum(p.nbytes for p in pages)
    store = SnapshotStore(root / "publish")

    def fresh_tokens() -> np.ndarray:  # a new prompt each time: nothing deduplicates
        return rng.integers(0, 128_000, n_tokens, dtype=np.uint32)

    # Warm-up (untimed): creates the model folder and gives the raw writer a folder.
    warm = store.publish(ident, 0, fresh_tokens(), pages)
    folder = _segment(store, warm.snapshot_id)[0].parent
    store.delete(warm.snapshot_id)

    pub_t: list[float] = []
    del_t: list[float] = []
    pub_bytes: list[int] = []
    raw_t: list[float] = []
    raw_bytes: list[int] = []
    for rep in range(sz.publish_reps):
        for which in ("publish", "raw") if rep % 2 == 0 else ("raw", "publish"):
            toks = fresh_tokens()
            if which == "publish":
                with _timer() as t:
                    res = store.publish(ident, 0, toks, pages)
                if res.deduplicated or res.state != "ready":
                    raise SystemExit(f"publish did not write a fresh snapshot: {res}")
                pub_t += t
                pub_bytes.append(res.bytes_written)
                folder = _segment(store, res.snapshot_id)[0].parent
                with _timer() as t:  # also keeps the disk and the page cache flat
                    store.delete(res.snapshot_id)
                del_t += t
            else:
                with _timer() as t:
                    raw_bytes.append(_raw_put(folder, f"raw-{rep}.bin", [*pages, toks]))
                raw_t += t
                os.unlink(folder / f"raw-{rep}.bin")
    pub_tp = [b / s for b, s in zip(pub_bytes, pub_t, strict=True)]
    raw_tp = [b / s for b, s in zip(raw_bytes, raw_t, strict=True)]
    ratio = _paired(pub_tp, raw_tp)

    # Where a publish's time goes besides the write: the chunk digests, in memory.
    views = [seg.as_byte_view(p) for p in pages]
    toks = fresh_tokens()
    meta = {"model": ident.digest(), "rank": 0, "snap_key": "0" * 32, "token_start": 0,
            "token_end": n_tokens, "block_size": BLOCK}
    hdr_t: list[float] = []
    for _ in range(5):
        with _timer() as t:
            seg.build_header(meta, views, toks, ident.page_shape, ident.kv_cache_dtype)
        hdr_t += t

    rows = [
        Row(f"1. publish {payload / 1e6:.0f} MB (throughput)",
            f"{_median(pub_tp) / 1e9:.3f} GB/s",
            f"{_median(raw_tp) / 1e9:.3f} GB/s write+fsync+rename", f"{ratio:.2f}x",
            ">= 0.80x", ratio >= 0.8,
            f"median of {sz.publish_reps} back-to-back pairs; p50 {_ms(_median(pub_t))} vs "
            f"{_ms(_median(raw_t))}",
            {"publish_s": pub_t, "raw_s": raw_t, "bytes": payload}),
        Row("   publish: chunk digests + header", _ms(_median(hdr_t)),
            note=f"in memory, {_gbs(payload, _median(hdr_t))}; "
            f"{_median(hdr_t) / _median(pub_t):.0%} of a publish", raw={"header_s": hdr_t}),
        Row(f"   delete a {payload / 1e6:.0f} MB snapshot", _ms(_median(del_t)),
            note="rows + commit + unlink of the durable segment file (what eviction pays)",
            raw={"delete_s": del_t}),
    ]
    rows += _bench_restore(store, ident, pages, fresh_tokens(), sz)
    store.close()
    return rows


def _bench_restore(store: SnapshotStore, ident: ModelIdentity, pages: list[np.ndarray],
                   toks: np.ndarray, sz: Sizes) -> list[Row]:
    res = store.publish(ident, 0, toks, pages)
    path, digest = _segment(store, res.snapshot_id)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        header = seg.parse_header(view, digest)
        view.release()
    spans = [header.tensors[f"layer.{i}"] for i in range(len(pages))]
    nbytes = sum(n for _o, n in spans)
    dests = [np.empty(p.nbytes, np.uint8) for p in pages]  # preallocated, reused

    def verified() -> None:
        match = store.lookup(ident, toks)
        if match is None or match.n_tokens != toks.size:
            raise SystemExit(f"restore lookup missed: {match}")
        store.read_into(match, 0, dests)

    def plain() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        src = np.frombuffer(mapped, np.uint8)
        for dest, (off, n) in zip(dests, spans, strict=True):
            np.copyto(dest[:n], src[off:off + n])
        del src
        mapped.close()

    verified()  # warm both: the file is in the page cache, the destinations faulted in
    plain()
    verified()
    if not all(np.array_equal(d, seg.as_byte_view(p)) for d, p in zip(dests, pages, strict=True)):
        raise SystemExit("restored bytes differ from the published pages")
    match = store.lookup(ident, toks)
    assert match is not None
    ver_t: list[float] = []
    raw_t: list[float] = []
    only_t: list[float] = []
    commit_t: list[float] = []
    for rep in range(sz.restore_reps):
        for fn in (verified, plain) if rep % 2 == 0 else (plain, verified):
            with _timer() as t:
                fn()
            (ver_t if fn is verified else raw_t).extend(t)
        with _timer() as t:
            store.read_into(match, 0, dests)
        only_t += t
        with _timer() as t:  # one small write transaction, like the touch after a read
            store.pin(res.snapshot_id, False)
        commit_t += t
    ratio = _paired(raw_t, ver_t)
    return [
        Row(f"2. verified restore {nbytes / 1e6:.0f} MB (lookup + read_into)",
            _gbs(nbytes, _median(ver_t)), f"{_gbs(nbytes, _median(raw_t))} mmap + np.copyto",
            f"{ratio:.2f}x", ">= 0.50x", ratio >= 0.5,
            f"median of {sz.restore_reps} back-to-back pairs, warm; p50 {_ms(_median(ver_t))} vs "
            f"{_ms(_median(raw_t))}",
            {"verified_s": ver_t, "plain_s": raw_t, "bytes": nbytes}),
        Row("   restore: read_into alone", _gbs(nbytes, _median(only_t)),
            note=f"p50 {_ms(_median(only_t))}", raw={"read_into_s": only_t}),
        Row("   index: one write transaction", _ms(_median(commit_t)),
            note="synchronous=FULL commit (read_into does one to record the use)",
            raw={"commit_s": commit_t}),
    ]


# -- bulk rows ----------------------------------------------------------------------------

INSERT_SNAPSHOT_ROW = (
    "INSERT INTO snapshots (id, model_id, snap_key, n_tokens, start_token, parent_id, depth, "
    "world_size, nbytes, state, reason, pinned, created_at, last_used, use_count) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, 'ready', NULL, 0, ?, ?, 1)"
)
INSERT_SEGMENT_ROW = (
    "INSERT INTO segments (snapshot_id, rank, object_key, token_start, token_end, nbytes, "
    "digest, state, created_at) VALUES (?, 0, ?, ?, ?, ?, ?, 'ready', ?)"
)
INSERT_BOUNDARY_ROW = (
    "INSERT OR IGNORE INTO boundaries (prefix_hash, snapshot_id, model_id, n_tokens, kind) "
    "VALUES (?, ?, ?, ?, ?)"
)
BULK_FLUSH_ROWS = 200_000


def _tiny_identity(name: str) -> ModelIdentity:
    return ModelIdentity(
        model=name, revision="r1", num_layers=2, num_kv_heads=1, head_size=8,
        dtype="float16", kv_cache_dtype="float16", block_size=LOOKUP_BLOCK,
        page_shape=TINY_PAGE,
    )


def _tiny_pages(ident: ModelIdentity, n_tokens: int) -> list[np.ndarray]:
    n = n_tokens // ident.block_size * ident.page_nbytes
    return [np.full(n, layer + 1, np.uint8) for layer in range(ident.num_layers)]


def _model_row(store: SnapshotStore, ident: ModelIdentity) -> tuple[int, str, int]:
    """(model id, object folder, next free snapshot id)."""
    with store.db.read() as conn:
        ((model_id, folder),) = conn.execute(
            "SELECT id, folder FROM models WHERE digest = ?", (ident.digest(),)
        ).fetchall()
        ((top,),) = conn.execute("SELECT coalesce(max(id), 0) FROM snapshots").fetchall()
    return int(model_id), str(folder), int(top) + 1


@dataclass
class _Bulk:
    """Ready snapshots as rows, buffered for executemany: one segment each, a
    stride alias row every ``stride_blocks`` blocks and the end row -- what
    ``publish`` inserts.  Hashes are random (an unrelated prompt's hashes are
    indistinguishable from random) except for a shared prefix."""

    model_id: int
    folder: str
    next_id: int
    stride_blocks: int
    block_size: int
    rng: np.random.Generator
    snapshots: list[tuple[Any, ...]] = field(default_factory=list)
    segments: list[tuple[Any, ...]] = field(default_factory=list)
    boundaries: list[tuple[Any, ...]] = field(default_factory=list)
    inserted_rows: int = 0

    def add(self, n_blocks: int, last_used: float, shared: Mapping[int, bytes] | None = None,
            n_shared: int = 0, parent: tuple[int, int, int] | None = None,
            ) -> tuple[int, dict[int, bytes]]:
        """Add one snapshot of ``n_blocks`` blocks whose hashes at block indices
        below ``n_shared`` come from ``shared`` (block index -> hash); ``parent``
        is (id, n_blocks, depth) for a copy-on-write child.  Returns its id and
        its hashes at the rows' block indices."""
        sid = self.next_id
        self.next_id += 1
        bs, s = self.block_size, self.stride_blocks
        at = [*range(s - 1, n_blocks - 1, s), n_blocks - 1]
        fresh = self.rng.bytes(16 * len(at))
        hashes = {i: shared[i] if shared is not None and i < n_shared
                  else fresh[16 * j:16 * j + 16] for j, i in enumerate(at)}
        start, pid, depth = (0, None, 0) if parent is None else (
            parent[1] * bs, parent[0], parent[2] + 1)
        key = hashes[n_blocks - 1].hex()
        self.snapshots.append((sid, self.model_id, key, n_blocks * bs, start, pid, depth,
                               4096, last_used, last_used))
        self.segments.append((sid, f"{self.folder}/{key[:2]}/{key}-bulk.r0.safetensors",
                              start, n_blocks * bs, 4096, "0" * 32, last_used))
        for i in at:
            kind = "end" if i == n_blocks - 1 else "stride"
            self.boundaries.append((hashes[i], sid, self.model_id, (i + 1) * bs, kind))
        return sid, hashes

    def pending_rows(self) -> int:
        return len(self.boundaries)

    def flush(self, store: SnapshotStore) -> None:
        with store.db.write() as conn:
            conn.executemany(INSERT_SNAPSHOT_ROW, self.snapshots)
            conn.executemany(INSERT_SEGMENT_ROW, self.segments)
            conn.executemany(INSERT_BOUNDARY_ROW, self.boundaries)
        self.inserted_rows += len(self.boundaries)
        self.snapshots.clear()
        self.segments.clear()
        self.boundaries.clear()


# -- 3: lookup ---------------------------------------------------------------------------


@dataclass
class LookupFixture:
    """A populated lookup store and the prompts that probe it."""

    store: SnapshotStore
    ident: ModelIdentity
    real_id: int
    stride: int
    prompt: np.ndarray
    hashes: list[bytes]
    miss_prompt: np.ndarray
    miss_hashes: list[bytes]
    sys_prompt: np.ndarray
    sys_hashes: list[bytes]
    rows_total: int
    snaps_total: int
    turns: int
    siblings: int


def lookup_fixture(root: Path, sz: Sizes, rng: np.random.Generator) -> LookupFixture:
    """An index of >= ``sz.boundary_rows`` boundary rows for one model.

    Real: one publish of the probe prompt's first ``hit_tokens`` tokens, so the
    hit is genuine.  Bulk-inserted: 24 earlier turns of the same conversation
    (prefixes of the prompt; half of them diverge after the shared part), one
    conversation in a hundred sharing the prompt's 2k-token system prompt, and
    unrelated conversations of 512 to 16k tokens.
    """
    ident = _tiny_identity("bench/lookup-model")
    bs = ident.block_size
    store = SnapshotStore(root / "lookup")
    stride = max(1, store.alias_stride // bs)
    prompt = rng.integers(0, 128_000, sz.prompt_tokens, dtype=np.uint32)
    seed = prefix_seed(ident)
    hashes = prefix_hashes(seed, prompt, bs)
    shared = dict(enumerate(hashes))
    hit_blocks = sz.hit_tokens // bs

    real = store.publish(ident, 0, prompt[:sz.hit_tokens], _tiny_pages(ident, sz.hit_tokens))
    model_id, folder, next_id = _model_row(store, ident)
    bulk = _Bulk(model_id, folder, next_id, stride, bs, rng)
    bulk.inserted_rows = _count(store, "boundaries")
    t0 = time.time() - 30 * 86400
    system_blocks = SYSTEM_PROMPT_TOKENS // bs
    turns = siblings = 0
    for j in range(1, 25):
        k = j * (hit_blocks - 1) // 25
        n = k if j % 2 == 0 else k + int(rng.integers(1, 2000))
        bulk.add(n, t0 + float(rng.random()) * 86400, shared, k)
        turns += 1
    while bulk.inserted_rows + bulk.pending_rows() < sz.boundary_rows:
        used = t0 + float(rng.random()) * 30 * 86400
        if rng.random() < 0.01:
            bulk.add(system_blocks + int(rng.integers(1, 1024)), used, shared, system_blocks)
            siblings += 1
        else:
            bulk.add(int(rng.integers(32, 1025)), used)
        if bulk.pending_rows() >= BULK_FLUSH_ROWS:
            bulk.flush(store)
    bulk.flush(store)
    rows_total = _count(store, "boundaries")
    snaps_total = _count(store, "snapshots")
    _log(f"lookup store: {snaps_total:,} snapshots, {rows_total:,} boundary rows")

    miss_prompt = rng.integers(0, 128_000, sz.prompt_tokens, dtype=np.uint32)
    sys_prompt = np.concatenate([
        prompt[:SYSTEM_PROMPT_TOKENS],
        rng.integers(0, 128_000, sz.prompt_tokens - SYSTEM_PROMPT_TOKENS, dtype=np.uint32)])
    return LookupFixture(
        store, ident, real.snapshot_id, stride, prompt, hashes, miss_prompt,
        prefix_hashes(seed, miss_prompt, bs), sys_prompt, prefix_hashes(seed, sys_prompt, bs),
        rows_total, snaps_total, turns, siblings)


def _calibrated_task(target_s: float) -> Callable[[], None]:
    """A fixed CPU-bound task of about ``target_s``: the machine's own jitter."""
    n = 1000
    while True:
        with _timer() as t:
            sum(range(n))
        if t[0] >= target_s / 4:
            break
        n *= 2
    n = int(n * target_s / t[0])

    def task() -> None:
        sum(range(n))

    return task


def bench_lookup(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    fx = lookup_fixture(root, sz, rng)
    store, ident, bs = fx.store, fx.ident, fx.ident.block_size
    seed = prefix_seed(ident)

    def hit() -> None:
        m = store.lookup(ident, fx.prompt, hashes=fx.hashes)
        if m is None or m.snapshot_id != fx.real_id or m.n_tokens != sz.hit_tokens:
            raise SystemExit(f"the probe prompt should hit snapshot {fx.real_id}: {m}")

    def miss() -> None:
        if store.lookup(ident, fx.miss_prompt, hashes=fx.miss_hashes) is not None:
            raise SystemExit("a random prompt should miss")

    def system_only() -> None:
        m = store.lookup(ident, fx.sys_prompt, hashes=fx.sys_hashes)
        if m is None or m.n_tokens != SYSTEM_PROMPT_TOKENS:
            raise SystemExit(f"the system-prompt prompt should hit 2048 tokens: {m}")

    def hashing() -> None:
        prefix_hashes(seed, fx.prompt, bs)

    def hit_with_hashing() -> None:
        m = store.lookup(ident, fx.prompt)
        if m is None or m.n_tokens != sz.hit_tokens:
            raise SystemExit(f"the probe prompt should hit: {m}")

    with _trace_sql(store) as statements:
        hit()
        miss()
    plans = _plans(store, statements)
    for fn in (system_only, hashing, hit_with_hashing):
        fn()  # warm
    with _timer() as t:
        hit()
    noise = _calibrated_task(max(t[0], 2e-4))
    every: list[Callable[[], None]] = [hit, miss, system_only, noise]
    times: dict[Callable[[], None], list[float]] = {
        fn: [] for fn in (*every, hashing, hit_with_hashing)}
    for i in range(sz.lookup_reps):
        fns = every + ([hashing, hit_with_hashing] if i % (sz.lookup_reps // sz.hash_reps) == 0
                       else [])
        for fn in fns:
            with _timer() as t:
                fn()
            times[fn] += t
    store.close()

    a, c = times[hit], times[hit_with_hashing]
    probes = len(range(fx.stride - 1, len(fx.hashes), fx.stride))
    budget = LOOKUP_BUDGET_S

    def vs_budget(xs: list[float]) -> str:
        return f"p99 {_pct(xs, 99) / budget:.2f}x budget"

    return [
        Row("3a. lookup 128k tokens, hashes given: hit", _lat(a), "budget 2 ms", vs_budget(a),
            "p99 <= 2 ms", _pct(a, 99) <= budget,
            f"{len(a)} reps; hits the real {sz.hit_tokens:,}-token snapshot; "
            f"{len(fx.hashes)} blocks, {probes} stride positions",
            {"hit_s": a, "plans": plans}),
        Row("3b. prefix_hashes of 128k tokens", _lat(times[hashing]), note=(
            f"{len(fx.hashes)} chained xxh3_128 calls, {len(times[hashing])} reps"),
            raw={"hash_s": times[hashing]}),
        Row("3c. lookup 128k tokens with hashing: hit", _lat(c), "budget 2 ms", vs_budget(c),
            "info (p99 <= 2 ms)", None, f"{len(c)} reps; 3a + 3b",
            {"hit_hash_s": c}),
        Row("3d. lookup 128k tokens, hashes given: miss", _lat(times[miss]), "budget 2 ms",
            vs_budget(times[miss]), "info (p99 <= 2 ms)", None, "a random prompt",
            {"miss_s": times[miss]}),
        Row("3e. lookup sharing only a 2k system prompt", _lat(times[system_only]),
            "budget 2 ms", vs_budget(times[system_only]), "info (p99 <= 2 ms)", None,
            f"{fx.siblings + fx.turns + 1} snapshots share those {SYSTEM_PROMPT_TOKENS} tokens",
            {"system_s": times[system_only]}),
        Row("    noise floor: fixed CPU task", _lat(times[noise]), note=(
            "pure-Python loop sized like 3a, timed in the same loop: the machine's jitter"),
            raw={"noise_s": times[noise]}),
        Row("    lookup index", f"{fx.rows_total:,} rows", note=(
            f"{fx.snaps_total:,} snapshots: 1 published, the rest bulk-inserted "
            f"({fx.turns} earlier turns, {fx.siblings} system-prompt siblings)")),
    ]


# -- 4: eviction ---------------------------------------------------------------------------


def evict_fixture(root: Path, n_snapshots: int, n_files: int,
                  rng: np.random.Generator) -> tuple[SnapshotStore, int]:
    """A store of one published snapshot (the newest) and ``n_snapshots``
    bulk-inserted ready ones of 512 to 4k tokens, one in ten a copy-on-write
    child of a recent one, used over 30 days.  A 4 KiB file exists for each of the
    ``n_files`` least recently used (the ones eviction takes first; the rest point
    at files that do not exist), fsynced like a published segment: unlinking a
    file whose blocks are on disk costs far more than one still in the page cache.
    Returns the store and the files made."""
    ident = _tiny_identity("bench/evict-model")
    bs = ident.block_size
    store = SnapshotStore(root)
    toks = rng.integers(0, 128_000, 512, dtype=np.uint32)
    store.publish(ident, 0, toks, _tiny_pages(ident, toks.size))
    model_id, folder, next_id = _model_row(store, ident)
    bulk = _Bulk(model_id, folder, next_id, max(1, store.alias_stride // bs), bs, rng)
    used = np.sort(rng.random(n_snapshots)) * 30 * 86400 + time.time() - 31 * 86400
    recent: list[tuple[tuple[int, int, int], dict[int, bytes]]] = []
    for i in range(n_snapshots):
        if recent and rng.random() < 0.1:
            (pid, p_blocks, p_depth), p_hashes = recent[int(rng.integers(len(recent)))]
            n = p_blocks + int(rng.integers(8, 128))
            sid, hashes = bulk.add(n, float(used[i]), p_hashes, p_blocks,
                                   parent=(pid, p_blocks, p_depth))
            recent.append(((sid, n, p_depth + 1), hashes))
        else:
            n = int(rng.integers(32, 257))
            sid, hashes = bulk.add(n, float(used[i]))
            recent.append(((sid, n, 0), hashes))
        del recent[:-1000]
        if bulk.pending_rows() >= BULK_FLUSH_ROWS:
            bulk.flush(store)
    bulk.flush(store)
    with store.db.read() as conn:
        keys = [k for (k,) in conn.execute(
            "SELECT g.object_key FROM segments AS g JOIN snapshots AS s "
            "ON s.id = g.snapshot_id ORDER BY s.last_used LIMIT ?", (n_files,))]
    block = b"\0" * 4096
    for key in keys:
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
    store.db.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return store, len(keys)


def bench_evict(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    small, large = sz.evict_sizes
    # Parents whose child is still there are skipped, hence the margin.
    n_files = sz.evict_reps * sz.evict_count * 2 + 200
    stores: dict[int, SnapshotStore] = {}
    for n in sz.evict_sizes:
        stores[n], made = evict_fixture(root / f"evict-{n}", n, n_files, rng)
        _log(f"eviction store: {_count(stores[n], 'snapshots'):,} snapshots, "
             f"{_count(stores[n], 'boundaries'):,} boundary rows, {made} files")
    times: dict[int, list[float]] = {n: [] for n in sz.evict_sizes}
    unlinked: dict[int, int] = {}
    plans: dict[str, str] = {}
    for rep in range(sz.evict_reps):
        for n in sz.evict_sizes if rep % 2 == 0 else sz.evict_sizes[::-1]:
            store = stores[n]
            before = sum(1 for _ in store.root.rglob("*-bulk.r0.safetensors"))
            tracing = n == large and not plans  # the plans of one eviction
            with (_trace_sql(store) if tracing else nullcontext([])) as statements, \
                    _timer() as t:
                ids = store.evict(count=sz.evict_count)
            if len(ids) != sz.evict_count:
                raise SystemExit(f"evicted {len(ids)} of {sz.evict_count} from the {n:,} store")
            times[n] += t
            after = sum(1 for _ in store.root.rglob("*-bulk.r0.safetensors"))
            unlinked[n] = unlinked.get(n, 0) + before - after
            if tracing:
                plans = _plans(store, statements)
    for store in stores.values():
        store.close()
    ratio = _median(times[large]) / _median(times[small])
    evicted = sz.evict_reps * sz.evict_count
    return [
        Row(f"4. evict {sz.evict_count} of {large:,} snapshots", _ms(_median(times[large])),
            f"{_ms(_median(times[small]))} of {small:,}", f"{ratio:.2f}x", "<= 2.00x",
            ratio <= 2.0,
            f"{sz.evict_reps} reps each, alternated; files unlinked: {unlinked[large]}/"
            f"{evicted} and {unlinked[small]}/{evicted}",
            {"small_s": times[small], "large_s": times[large], "plans": plans}),
        Row("   evict: per snapshot", _ms(_median(times[large]) / sz.evict_count),
            note="rows (cascading to segments and boundaries), commit, then unlink 4 KiB files"),
    ]


# -- 5: the retention sweep ---------------------------------------------------------------


def _fake_disk(_path: Path) -> DiskUsage:
    """A disk that is never short of space: the margin step never evicts."""
    return DiskUsage(total=10**13, free=5 * 10**12)


def _sweep_plan(sz: Sizes) -> list[tuple[str, int, int]]:
    """(kind, snapshots it must delete, repetitions) in the order they run."""
    return [("noop", 0, sz.sweep_noop_reps),
            *(("age", n, r) for n, r in zip(sz.sweep_age, sz.sweep_age_reps, strict=True)),
            ("total", sz.sweep_total, sz.sweep_total_reps),
            ("noop", 0, sz.sweep_noop_reps)]


@dataclass
class _SweepStore:
    """An eviction store reopened with a Retention, an injected clock and a ballast."""

    store: SnapshotStore
    now: list[float]  # the injected clock reads now[0]
    ballast: int  # a pinned snapshot whose nbytes tunes the total exactly
    built: int  # snapshots when the sweeps started


def _age_cutoff(store: SnapshotStore, due: int) -> float:
    """A ``last_used`` cutoff below which exactly ``due`` snapshots can go.

    A snapshot goes by age when it and every descendant were last used before
    the cutoff (a parent waits for its children) and none of them is pinned:
    the subtree's latest use, computed deepest first, is the key."""
    with store.db.read() as conn:
        rows = conn.execute(
            "SELECT id, parent_id, depth, last_used, pinned FROM snapshots "
            "WHERE state = 'ready' ORDER BY depth DESC").fetchall()
    latest: dict[int, float] = {}
    for sid, pid, _depth, used, pinned in rows:
        mine = max(latest.get(sid, float("-inf")), float("inf") if pinned else used)
        latest[sid] = mine
        if pid is not None:
            latest[pid] = max(latest.get(pid, float("-inf")), mine)
    keys = sorted(latest.values())
    if len(keys) <= due or keys[due - 1] == keys[due]:
        raise SystemExit(f"cannot make exactly {due} snapshots due by age")
    return (keys[due - 1] + keys[due]) / 2


def _set_total(sw: _SweepStore, over: int) -> int:
    """Resize the pinned ballast so that the store's total is a whole number of MB
    plus ``over`` bytes; returns that number of MB (the total_mb to set)."""
    store = sw.store
    with store.db.write() as conn:
        ((total,),) = conn.execute("SELECT coalesce(sum(nbytes), 0) FROM model_usage").fetchall()
        ((mine,),) = conn.execute("SELECT nbytes FROM snapshots WHERE id = ?",
                                  (sw.ballast,)).fetchall()
        rest = int(total) - int(mine)
        total_mb = -(-(rest - over) // MB)
        conn.execute("UPDATE snapshots SET nbytes = ? WHERE id = ?",
                     (total_mb * MB + over - rest, sw.ballast))
    return total_mb


def sweep_fixture(root: Path, n_snapshots: int, n_files: int,
                  rng: np.random.Generator) -> tuple[_SweepStore, int]:
    """The eviction store of (4), closed and reopened with a Retention whose disk
    probe is a fake with room to spare and whose clock is injected; the one
    published snapshot (the newest) is pinned and serves as the ballast."""
    built, made = evict_fixture(root, n_snapshots, n_files, rng)
    with built.db.read() as conn:
        ((ballast,),) = conn.execute(
            "SELECT id FROM snapshots ORDER BY last_used DESC LIMIT 1").fetchall()
    built.pin(int(ballast))
    count = _count(built, "snapshots")
    built.close()
    now = [time.time()]
    settings = RetentionSettings(folder=root, max_age_hours=168.0, total_mb=0, min_free_mb=0)
    retention = Retention(settings, disk_usage=_fake_disk, ram_bytes=lambda: 64 * 2**30)
    store = SnapshotStore(root, retention=retention, clock=lambda: now[0])
    return _SweepStore(store, now, int(ballast), count), made


def _prepare_sweep(sw: _SweepStore, kind: str, due: int) -> None:
    """Settings and clock so that the next sweep deletes exactly ``due`` snapshots."""
    store = sw.store
    assert store.retention is not None
    hours = 168.0
    if kind == "age":
        sw.now[0] = _age_cutoff(store, due) + hours * 3600
        store.retention = store.retention.with_settings(max_age_hours=hours, total_mb=0)
    elif kind == "total":
        total_mb = _set_total(sw, due * 4096)  # every bulk snapshot is 4096 bytes
        store.retention = store.retention.with_settings(max_age_hours=0.0, total_mb=total_mb)
    else:  # nothing due: every rule runs, none finds anything
        with store.db.read() as conn:
            ((oldest,),) = conn.execute("SELECT min(last_used) FROM snapshots").fetchall()
        sw.now[0] = float(oldest) + hours * 3600 - 3600
        total_mb = _set_total(sw, 0) + 1
        store.retention = store.retention.with_settings(max_age_hours=hours, total_mb=total_mb)


def bench_sweep(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    plan = _sweep_plan(sz)
    deletes = sum(due * reps for _kind, due, reps in plan)
    # Files for the least recently used: what age and the total take, plus the
    # parents that wait for a younger child (hence the margin).
    n_files = deletes + deletes // 4 + 500
    stores: dict[int, _SweepStore] = {}
    for n in sz.evict_sizes:
        # n + what the sweeps delete: the store never holds fewer than n snapshots.
        stores[n], made = sweep_fixture(root / f"sweep-{n}", n + deletes, n_files, rng)
        _log(f"sweep store: {stores[n].built:,} snapshots, "
             f"{_count(stores[n].store, 'boundaries'):,} boundary rows, {made} files")
    small, large = sz.evict_sizes
    times: dict[tuple[str, int, int], list[float]] = {}
    unlinked: dict[tuple[str, int, int], int] = {}
    plans: dict[str, str] = {}
    for kind, due, reps in plan:
        for rep in range(reps):
            for n in sz.evict_sizes if rep % 2 == 0 else sz.evict_sizes[::-1]:
                sw = stores[n]
                store = sw.store
                assert store.retention is not None
                _prepare_sweep(sw, kind, due)
                before = sum(1 for _ in store.root.rglob("*-bulk.r0.safetensors"))
                tracing = n == large and kind == "age" and not plans
                with (_trace_sql(store) if tracing else nullcontext([])) as statements, \
                        _timer() as t:
                    report = store.retention.sweep(store)
                want = {kind: due} if due else {}
                if report.counts() != want or report.folders_removed:
                    raise SystemExit(f"{kind} sweep of the {n:,} store deleted "
                                     f"{report.counts()} (and folders {report.folders_removed})"
                                     f", expected {want}")
                key = (kind, due, n)
                times.setdefault(key, []).extend(t)
                after = sum(1 for _ in store.root.rglob("*-bulk.r0.safetensors"))
                unlinked[key] = unlinked.get(key, 0) + before - after
                if tracing:
                    plans = _plans(store, statements)
    left = {n: _count(sw.store, "snapshots") for n, sw in stores.items()}
    for sw in stores.values():
        sw.store.close()

    rows: list[Row] = []
    seen_noop = 0
    for kind, due, reps in plan:
        if kind == "noop":
            seen_noop += 1
            if seen_noop == 2:  # the two no-op passes (before and after) make one row
                continue
            a = times[(kind, due, large)]
            b = times[(kind, due, small)]
            name = "5d. sweep, nothing due (no-op)"
            note = (f"{2 * reps} sweeps each (before and after the others); every rule runs "
                    "and finds nothing")
        else:
            a, b = times[(kind, due, large)], times[(kind, due, small)]
            done = reps * due
            what = ("due by age (max_age_hours)" if kind == "age"
                    else "over total_mb (LRU)")
            letter = {"age": "5a" if due == sz.sweep_age[0] else "5b", "total": "5c"}[kind]
            name = f"{letter}. sweep, {due} {what}"
            note = (f"{reps} sweeps each, alternated; {_ms(_median(a) / due)} vs "
                    f"{_ms(_median(b) / due)} per deleted snapshot; files unlinked: "
                    f"{unlinked[(kind, due, large)]}/{done} and "
                    f"{unlinked[(kind, due, small)]}/{done}")
        ratio = _median(a) / _median(b)
        raw: dict[str, Any] = {"large_s": a, "small_s": b}
        if kind == "age" and due == sz.sweep_age[0]:
            raw["plans"] = plans  # of the first age sweep of the large store
        rows.append(Row(f"{name}: {large:,} store", _ms(_median(a)),
                        f"{_ms(_median(b))} of {small:,}", f"{ratio:.2f}x", "<= 2.00x",
                        ratio <= 2.0, note, raw))
    per = max(sz.sweep_age)
    a = times[("age", per, large)]
    rows.append(Row(
        "   sweep: per deleted snapshot", _ms(_median(a) / per),
        note=(f"{per} by age from the {large:,} store; stores held {stores[large].built:,} -> "
              f"{left[large]:,} and {stores[small].built:,} -> {left[small]:,} snapshots")))
    return rows


# -- driver -------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                             cwd=Path(sparkcache.__file__).parent)
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out.stdout.strip()


def machine() -> dict[str, str]:
    """What the results depend on, including the code measured."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    package = Path(sparkcache.__file__).parent
    digest = xxhash.xxh3_64()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    dirty = bool(_git("status", "--porcelain", "--", "."))
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "memory": f"{mem_kib / 2**20:.1f} GiB",
        "python": platform.python_version(),
        "sqlite (apsw)": apsw.sqlite_lib_version(),
        "numpy": np.__version__,
        "kernel": platform.release(),
        "sparkcache": f"{package} git {_git('rev-parse', '--short', 'HEAD')}"
                      f"{' +uncommitted' if dirty else ''}, sources xxh3 {digest.hexdigest()}",
    }


def table(rows: list[Row]) -> str:
    head = ["measurement", "sparkcache", "baseline", "ratio", "target", "result", "notes"]
    body = [[r.name, r.value, r.baseline, r.ratio, r.target,
             "" if r.passed is None else ("PASS" if r.passed else "MISS"), r.note]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(b) for b in body)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Time the snapshot store against same-run baselines (docs/benchmarks.md).")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes, under a minute (ratios are less favourable)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (machine, sizes, every sample) instead of the table")
    parser.add_argument("--plans", action="store_true",
                        help="also print the query plans of the lookup and eviction statements")
    parser.add_argument("--dir", type=Path, default=None,
                        help="parent of the scratch folder (default: the temp folder); put "
                        "it on the disk you mean to measure")
    parser.add_argument("--only", choices=["publish", "lookup", "evict", "sweep"],
                        action="append",
                        help="run only this part (repeatable)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    args = parser.parse_args(argv)
    sz = QUICK if args.quick else FULL
    parts = args.only or ["publish", "lookup", "evict", "sweep"]
    rng = np.random.default_rng(args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=args.dir))
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[Row] = []
    try:
        if "publish" in parts:
            _log("publish and restore")
            rows += bench_publish_restore(scratch, sz, rng)
        if "lookup" in parts:
            _log("lookup")
            rows += bench_lookup(scratch, sz, rng)
        if "evict" in parts:
            _log("eviction")
            rows += bench_evict(scratch, sz, rng)
        if "sweep" in parts:
            _log("retention sweep")
            rows += bench_sweep(scratch, sz, rng)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - started
    info = machine()
    info["load average"] = (f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after "
                            "(1-minute)")
    command = " ".join([".venv/bin/python bench/store_bench.py",
                        *(argv if argv is not None else sys.argv[1:])])
    if args.json:
        print(json.dumps({"machine": info, "command": command, "seconds": round(elapsed, 1),
                          "scratch": str(scratch.parent), "sizes": asdict(sz),
                          "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
        print(f"command: {command}  ({elapsed:.0f} s, scratch under {scratch.parent})\n")
        print(table(rows))
        if args.plans:
            print("\nquery plans:")
            for row in rows:
                for sql, plan in row.raw.get("plans", {}).items():
                    print(f"  [{row.name.split('.')[0]}] {sql}\n      -> {plan}")
    return 1 if any(r.passed is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
