"""What the store benchmarks share: sizes, table rows, timing, the index, bulk-filled
stores and the command line.

Each ``bench/bench_*.py`` is one measurement and runs alone; ``bench/store_bench.py``
runs them all into one table (docs/benchmarks.md).  They drive the store through
its public API only.  What they fill in bulk or inspect, they reach through their
own connection to the store's index (:class:`~sparkcache.index.db.Database` on
``<root>/index.sqlite``), inserting with the statements of
:mod:`sparkcache.index.queries`, so a bulk row that stopped matching the schema
fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import xxhash

import sparkcache
from sparkcache import ModelIdentity, SnapshotStore
from sparkcache.index import queries
from sparkcache.index.db import Database

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

# The lookup, eviction and sweep identities keep pages tiny: those benchmarks time
# the index.
LOOKUP_BLOCK = 16
TINY_PAGE = (1, 2, 8)
# Every bulk snapshot's size, in its row and in the file made for it.
BULK_NBYTES = 4096
BULK_FLUSH_ROWS = 200_000
# A store's index file inside its root (the store's on-disk layout).
INDEX_FILE = "index.sqlite"

# What the benchmarks read of the index besides the store's own statements.
COUNT_ROWS = "SELECT count(*) FROM {table}"
MODEL_ID_FOLDER = "SELECT id, folder FROM models WHERE digest = ?"
LRU_SEGMENT_KEYS = (
    "SELECT g.object_key FROM segments AS g JOIN snapshots AS s "
    "ON s.id = g.snapshot_id ORDER BY s.last_used LIMIT ?"
)

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


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def pct(xs: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def paired(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """Median of the ratios of back-to-back pairs: robust to the machine drifting."""
    return median([a / b for a, b in zip(ours, theirs, strict=True)])


def gbs(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def lat(xs: Sequence[float]) -> str:
    return f"p50 {ms(pct(xs, 50))}, p99 {ms(pct(xs, 99))}"


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


@contextmanager
def timer() -> Iterator[list[float]]:
    """Appends the elapsed seconds to the yielded list on exit."""
    out: list[float] = []
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - t0)


# -- the index, through the benchmark's own connection ------------------------------------

# Every apsw connection this process opens, so that trace_sql can watch the one a
# store opened without reaching into the store.  Registered at import, before any
# benchmark opens a store.
_CONNECTIONS: weakref.WeakSet[apsw.Connection] = weakref.WeakSet()
apsw.connection_hooks.append(_CONNECTIONS.add)


def open_index(root: Path) -> Database:
    """The benchmark's own connection to the index of the store at ``root``.

    Its writes empty the page cache of the store's connection (SQLite sees the
    file changed), so the benchmarks write through it only while building a store
    or when a value really changes.
    """
    return Database(root / INDEX_FILE)


def count_rows(index: Database, table: str) -> int:
    with index.read() as conn:
        ((n,),) = conn.execute(COUNT_ROWS.format(table=table)).fetchall()
    return int(n)


@contextmanager
def trace_sql(index: Database) -> Iterator[list[tuple[str, Any]]]:
    """Every statement (with its bindings) run inside the block on this process's
    connections to ``index``'s file: the store's own, and the benchmark's, which
    runs nothing inside the block."""
    target = os.path.realpath(index.path)
    conns: list[apsw.Connection] = []
    for conn in list(_CONNECTIONS):
        try:
            if os.path.realpath(conn.filename) == target:
                conns.append(conn)
        except apsw.ConnectionClosedError:
            continue
    seen: list[tuple[str, Any]] = []

    def tracer(_cursor: Any, sql: str, bindings: Any) -> bool:
        seen.append((sql, bindings))
        return True

    if not conns:
        log(f"no open connection to {index.path} to trace: no query plans")
    for conn in conns:
        conn.exec_trace = tracer
    try:
        yield seen
    finally:
        for conn in conns:
            conn.exec_trace = None


def plans(index: Database, statements: list[tuple[str, Any]]) -> dict[str, str]:
    """EXPLAIN QUERY PLAN of each distinct SELECT seen, keyed by its first words."""
    found: dict[str, str] = {}
    with index.read() as conn:
        for sql, bindings in statements:
            text = " ".join(sql.split())
            if not text.upper().startswith(("SELECT", "WITH")) or text[:90] in found:
                continue
            rows = conn.execute("EXPLAIN QUERY PLAN " + sql, bindings).fetchall()
            found[text[:90]] = "; ".join(str(r[-1]) for r in rows)
    return found


# -- bulk-filled stores (lookup, eviction, sweep) -------------------------------------------

# How every bulk segment's object key ends, to count the files left.
BULK_SUFFIX = "-bulk.r0.safetensors"


def bulk_files(root: Path) -> int:
    """How many bulk segment files are left under ``root``."""
    return sum(1 for _ in root.rglob(f"*{BULK_SUFFIX}"))


def tiny_identity(name: str) -> ModelIdentity:
    return ModelIdentity(
        model=name, revision="r1", num_layers=2, num_kv_heads=1, head_size=8,
        dtype="float16", kv_cache_dtype="float16", block_size=LOOKUP_BLOCK,
        page_shape=TINY_PAGE,
    )


def tiny_pages(ident: ModelIdentity, n_tokens: int) -> list[np.ndarray]:
    n = n_tokens // ident.block_size * ident.page_nbytes
    return [np.full(n, layer + 1, np.uint8) for layer in range(ident.num_layers)]


@dataclass
class Bulk:
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
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    boundaries: list[tuple[Any, ...]] = field(default_factory=list)
    inserted_rows: int = 0
    first: dict[str, Any] | None = None  # the first snapshot row, for check()

    @classmethod
    def of_model(cls, store: SnapshotStore, index: Database, ident: ModelIdentity,
                 rng: np.random.Generator) -> Bulk:
        """Rows for the model ``ident``, already published once in ``store``."""
        with index.read() as conn:
            ((model_id, folder),) = conn.execute(MODEL_ID_FOLDER,
                                                 (ident.digest(),)).fetchall()
            ((next_id,),) = conn.execute(queries.BULK_NEXT_SNAPSHOT_ID).fetchall()
        stride = max(1, store.alias_stride // ident.block_size)
        return cls(int(model_id), str(folder), int(next_id), stride, ident.block_size, rng)

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
        self.snapshots.append({
            "id": sid, "model_id": self.model_id, "snap_key": key, "n_tokens": n_blocks * bs,
            "start_token": start, "parent_id": pid, "depth": depth, "world_size": 1,
            "nbytes": BULK_NBYTES, "state": "ready", "reason": None, "pinned": 0,
            "created_at": last_used, "last_used": last_used, "use_count": 1,
            "scope_json": None, "uploaded_at": None, "tenant": None})
        self.segments.append({
            "snapshot_id": sid, "rank": 0,
            "object_key": f"{self.folder}/{key[:2]}/{key}{BULK_SUFFIX}",
            "token_start": start, "token_end": n_blocks * bs, "nbytes": BULK_NBYTES,
            "digest": "0" * 32, "state": "ready", "created_at": last_used})
        if self.first is None:
            self.first = self.snapshots[-1]
        for i in at:
            kind = "end" if i == n_blocks - 1 else "stride"
            self.boundaries.append((hashes[i], sid, self.model_id, (i + 1) * bs, kind))
        return sid, hashes

    def pending_rows(self) -> int:
        return len(self.boundaries)

    def flush(self, index: Database) -> None:
        with index.write() as conn:
            conn.executemany(queries.BULK_INSERT_SNAPSHOT, self.snapshots)
            conn.executemany(queries.BULK_INSERT_SEGMENT, self.segments)
            conn.executemany(queries.INSERT_BOUNDARY, self.boundaries)
        self.inserted_rows += len(self.boundaries)
        self.snapshots.clear()
        self.segments.clear()
        self.boundaries.clear()

    def check(self, store: SnapshotStore) -> None:
        """The store reads the first bulk row back as it was meant (its columns
        were not shifted): rows that do not match the schema fail the run."""
        if self.first is None:
            return
        seen = asdict(store.snapshot(self.first["id"]))
        wrong = {k: (v, seen.get(k)) for k, v in self.first.items() if seen.get(k) != v}
        if wrong:
            raise SystemExit(f"a bulk snapshot row reads back otherwise (meant, read): {wrong}")


@dataclass
class BulkStore:
    """A store of one published snapshot and many bulk-inserted ones."""

    store: SnapshotStore
    index: Database  # the benchmark's own connection to its index
    published: int  # the published snapshot's id (the most recently used)
    files: int  # bulk segment files made


def evict_fixture(root: Path, n_snapshots: int, n_files: int,
                  rng: np.random.Generator) -> BulkStore:
    """A store of one published snapshot (the newest) and ``n_snapshots``
    bulk-inserted ready ones of 512 to 4k tokens, one in ten a copy-on-write
    child of a recent one, used over 30 days.  A 4 KiB file exists for each of the
    ``n_files`` least recently used (the ones eviction takes first; the rest point
    at files that do not exist), fsynced like a published segment: unlinking a
    file whose blocks are on disk costs far more than one still in the page cache.
    """
    ident = tiny_identity("bench/evict-model")
    store = SnapshotStore(root)
    index = open_index(root)
    toks = rng.integers(0, 128_000, 512, dtype=np.uint32)
    published = store.publish(ident, 0, toks, tiny_pages(ident, toks.size)).snapshot_id
    bulk = Bulk.of_model(store, index, ident, rng)
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
            bulk.flush(index)
    bulk.flush(index)
    bulk.check(store)
    with index.read() as conn:
        keys = [k for (k,) in conn.execute(LRU_SEGMENT_KEYS, (n_files,))]
    block = b"\0" * BULK_NBYTES
    for key in keys:
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
    index.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return BulkStore(store, index, published, len(keys))


# -- the machine and the table --------------------------------------------------------------


def git(*args: str) -> str:
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
    dirty = bool(git("status", "--porcelain", "--", "."))
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "memory": f"{mem_kib / 2**20:.1f} GiB",
        "python": platform.python_version(),
        "sqlite (apsw)": apsw.sqlite_lib_version(),
        "numpy": np.__version__,
        "kernel": platform.release(),
        "sparkcache": f"{package} git {git('rev-parse', '--short', 'HEAD')}"
                      f"{' +uncommitted' if dirty else ''}, sources xxh3 {digest.hexdigest()}",
    }


def table(rows: list[Row]) -> str:
    head = ["measurement", "sparkcache", "baseline", "ratio", "target", "result", "notes"]
    return grid(head, [[r.name, r.value, r.baseline, r.ratio, r.target,
                        "" if r.passed is None else ("PASS" if r.passed else "MISS"), r.note]
                       for r in rows])


def grid(head: list[str], body: list[list[str]]) -> str:
    """A Markdown table of ``head`` and the rows of ``body``, columns aligned."""
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(b) for b in body)])


# -- the command line -------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One measurement: what ``--only`` calls it, its progress line, and the run."""

    name: str
    label: str
    run: Callable[[Path, Sizes, np.random.Generator], list[Row]]


@contextmanager
def scratch_folder(parent: Path | None) -> Iterator[Path]:
    """A temporary folder under ``parent`` (the disk measured), removed after."""
    scratch = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(parts: Sequence[Part], argv: list[str] | None = None, *, script: str) -> int:
    """Run ``parts`` (all, or those named by ``--only``) in one scratch folder and
    print one table; 1 when a target is missed.  ``script`` is the file run."""
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
    if len(parts) > 1:
        parser.add_argument("--only", choices=[p.name for p in parts], action="append",
                            help="run only this part (repeatable)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    args = parser.parse_args(argv)
    sz = QUICK if args.quick else FULL
    only = getattr(args, "only", None) or [p.name for p in parts]
    rng = np.random.default_rng(args.seed)
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[Row] = []
    with scratch_folder(args.dir) as scratch:
        for part in parts:
            if part.name in only:
                log(part.label)
                rows += part.run(scratch, sz, rng)
    elapsed = time.perf_counter() - started
    info = machine()
    info["load average"] = (f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after "
                            "(1-minute)")
    command = " ".join([f".venv/bin/python bench/{script}",
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
