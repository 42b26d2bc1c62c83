"""Measurements 1 and 2: publish throughput and verified restore.

    .venv/bin/python bench/bench_publish.py [--quick] [--json] [--plans] [--dir FOLDER]

1. ``publish`` of one rank's segment  vs  temp file + write + fsync + rename +
   folder fsync of the same buffers, in the same folder, alternated with the
   publishes;
2. verified restore (``lookup`` + ``read_into``)  vs  mmap + np.copyto of the same
   bytes from the same file, both warm in the page cache.

Part ``publish`` of bench/store_bench.py; docs/benchmarks.md describes it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from common import (
    Part,
    Row,
    Sizes,
    gbs,
    main,
    median,
    ms,
    open_index,
    paired,
    timer,
)

from sparkcache import ModelIdentity, SnapshotStore
from sparkcache import segment as seg
from sparkcache.index.db import Database

# One block of one layer: (kv heads, 2 * block_size rows, head dim) in fp16 = 64 KiB,
# the layout of vLLM's CPU backend.
BLOCK = 32
PAGE_SHAPE = (8, 2 * BLOCK, 64)
# Where a snapshot's rank-0 segment lies, and the digest of its header.
SEGMENT_FILE = "SELECT object_key, digest FROM segments WHERE snapshot_id = ? AND rank = 0"


def publish_identity(layers: int) -> ModelIdentity:
    return ModelIdentity(
        model="bench/llama-like-8kv", revision="r1", num_layers=layers, num_kv_heads=8,
        head_size=64, dtype="float16", kv_cache_dtype="float16", block_size=BLOCK,
        page_shape=PAGE_SHAPE,
    )


def segment_file(store: SnapshotStore, index: Database, snapshot_id: int) -> tuple[Path, str]:
    """The rank-0 segment file of a snapshot and its header digest."""
    with index.read() as conn:
        ((key, digest),) = conn.execute(SEGMENT_FILE, (snapshot_id,)).fetchall()
    return store.root / key, str(digest)


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_put(folder: Path, name: str, chunks: Sequence[np.ndarray]) -> int:
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
    fsync_folder(folder)
    return total


def bench_publish_restore(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    ident = publish_identity(sz.layers)
    n_tokens = sz.blocks * BLOCK
    shape = (sz.blocks, *PAGE_SHAPE)
    pages = [rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
             for _ in range(sz.layers)]
    payload = sum(p.nbytes for p in pages)
    store = SnapshotStore(root / "publish")
    index = open_index(root / "publish")

    def fresh_tokens() -> np.ndarray:  # a new prompt each time: nothing deduplicates
        return rng.integers(0, 128_000, n_tokens, dtype=np.uint32)

    # Warm-up (untimed): creates the model folder and gives the raw writer a folder.
    warm = store.publish(ident, 0, fresh_tokens(), pages)
    folder = segment_file(store, index, warm.snapshot_id)[0].parent
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
                with timer() as t:
                    res = store.publish(ident, 0, toks, pages)
                if res.deduplicated or res.state != "ready":
                    raise SystemExit(f"publish did not write a fresh snapshot: {res}")
                pub_t += t
                pub_bytes.append(res.bytes_written)
                folder = segment_file(store, index, res.snapshot_id)[0].parent
                with timer() as t:  # also keeps the disk and the page cache flat
                    store.delete(res.snapshot_id)
                del_t += t
            else:
                with timer() as t:
                    raw_bytes.append(raw_put(folder, f"raw-{rep}.bin", [*pages, toks]))
                raw_t += t
                os.unlink(folder / f"raw-{rep}.bin")
    pub_tp = [b / s for b, s in zip(pub_bytes, pub_t, strict=True)]
    raw_tp = [b / s for b, s in zip(raw_bytes, raw_t, strict=True)]
    ratio = paired(pub_tp, raw_tp)

    # Where a publish's time goes besides the write: the chunk digests, in memory.
    views = [seg.as_byte_view(p) for p in pages]
    toks = fresh_tokens()
    meta = {"model": ident.digest(), "rank": 0, "snap_key": "0" * 32, "token_start": 0,
            "token_end": n_tokens, "block_size": BLOCK}
    hdr_t: list[float] = []
    for _ in range(5):
        with timer() as t:
            seg.build_header(meta, views, toks, ident.page_shape, ident.kv_cache_dtype)
        hdr_t += t

    rows = [
        Row(f"1. publish {payload / 1e6:.0f} MB (throughput)",
            f"{median(pub_tp) / 1e9:.3f} GB/s",
            f"{median(raw_tp) / 1e9:.3f} GB/s write+fsync+rename", f"{ratio:.2f}x",
            ">= 0.80x", ratio >= 0.8,
            f"median of {sz.publish_reps} back-to-back pairs; p50 {ms(median(pub_t))} vs "
            f"{ms(median(raw_t))}",
            {"publish_s": pub_t, "raw_s": raw_t, "bytes": payload}),
        Row("   publish: chunk digests + header", ms(median(hdr_t)),
            note=f"in memory, {gbs(payload, median(hdr_t))}; "
            f"{median(hdr_t) / median(pub_t):.0%} of a publish", raw={"header_s": hdr_t}),
        Row(f"   delete a {payload / 1e6:.0f} MB snapshot", ms(median(del_t)),
            note="rows + commit + unlink of the durable segment file (what eviction pays)",
            raw={"delete_s": del_t}),
    ]
    rows += bench_restore(store, index, ident, pages, fresh_tokens(), sz)
    store.close()
    index.close()
    return rows


def bench_restore(store: SnapshotStore, index: Database, ident: ModelIdentity,
                  pages: list[np.ndarray], toks: np.ndarray, sz: Sizes) -> list[Row]:
    res = store.publish(ident, 0, toks, pages)
    path, digest = segment_file(store, index, res.snapshot_id)
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
            with timer() as t:
                fn()
            (ver_t if fn is verified else raw_t).extend(t)
        with timer() as t:
            store.read_into(match, 0, dests)
        only_t += t
        with timer() as t:  # one small write transaction, like the touch after a read
            store.pin(res.snapshot_id, False)
        commit_t += t
    ratio = paired(raw_t, ver_t)
    return [
        Row(f"2. verified restore {nbytes / 1e6:.0f} MB (lookup + read_into)",
            gbs(nbytes, median(ver_t)), f"{gbs(nbytes, median(raw_t))} mmap + np.copyto",
            f"{ratio:.2f}x", ">= 0.50x", ratio >= 0.5,
            f"median of {sz.restore_reps} back-to-back pairs, warm; p50 {ms(median(ver_t))} vs "
            f"{ms(median(raw_t))}",
            {"verified_s": ver_t, "plain_s": raw_t, "bytes": nbytes}),
        Row("   restore: read_into alone", gbs(nbytes, median(only_t)),
            note=f"p50 {ms(median(only_t))}", raw={"read_into_s": only_t}),
        Row("   index: one write transaction", ms(median(commit_t)),
            note="synchronous=FULL commit (read_into does one to record the use)",
            raw={"commit_s": commit_t}),
    ]


PART = Part("publish", "publish and restore", bench_publish_restore)

if __name__ == "__main__":
    raise SystemExit(main([PART], script="bench_publish.py"))
