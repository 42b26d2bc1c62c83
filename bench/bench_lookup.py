"""Measurement 3: lookup latency of a 128k-token prompt against >= 1M boundary rows.

    .venv/bin/python bench/bench_lookup.py [--quick] [--json] [--plans] [--dir FOLDER]

A prompt of 128k tokens (block_size 16) looked up with and without precomputed
hashes, hit and miss, sharing only a system prompt, and matching snapshot ends
only (a sliding-window model's lookup), against a budget;
interleaved with a noise floor (a fixed CPU task timed in the same loop).  One
real snapshot, the rest of the index bulk-inserted (see :func:`lookup_fixture`).

Part ``lookup`` of bench/store_bench.py; docs/benchmarks.md describes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import (
    BULK_FLUSH_ROWS,
    Bulk,
    Part,
    Row,
    Sizes,
    count_rows,
    lat,
    log,
    main,
    open_index,
    pct,
    plans,
    timer,
    tiny_identity,
    tiny_pages,
    trace_sql,
)

from sparkcache import ModelIdentity, SnapshotStore, prefix_hashes, prefix_seed
from sparkcache.index.db import Database

SYSTEM_PROMPT_TOKENS = 2048
LOOKUP_BUDGET_S = 2e-3


@dataclass
class LookupFixture:
    """A populated lookup store and the prompts that probe it."""

    store: SnapshotStore
    index: Database
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
    ident = tiny_identity("bench/lookup-model")
    bs = ident.block_size
    store = SnapshotStore(root / "lookup")
    index = open_index(root / "lookup")
    prompt = rng.integers(0, 128_000, sz.prompt_tokens, dtype=np.uint32)
    seed = prefix_seed(ident)
    hashes = prefix_hashes(seed, prompt, bs)
    shared = dict(enumerate(hashes))
    hit_blocks = sz.hit_tokens // bs

    real = store.publish(ident, 0, prompt[:sz.hit_tokens], tiny_pages(ident, sz.hit_tokens))
    bulk = Bulk.of_model(store, index, ident, rng)
    bulk.inserted_rows = count_rows(index, "boundaries")
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
            bulk.flush(index)
    bulk.flush(index)
    bulk.check(store)
    rows_total = count_rows(index, "boundaries")
    snaps_total = count_rows(index, "snapshots")
    log(f"lookup store: {snaps_total:,} snapshots, {rows_total:,} boundary rows")

    miss_prompt = rng.integers(0, 128_000, sz.prompt_tokens, dtype=np.uint32)
    sys_prompt = np.concatenate([
        prompt[:SYSTEM_PROMPT_TOKENS],
        rng.integers(0, 128_000, sz.prompt_tokens - SYSTEM_PROMPT_TOKENS, dtype=np.uint32)])
    return LookupFixture(
        store, index, ident, real.snapshot_id, bulk.stride_blocks, prompt, hashes, miss_prompt,
        prefix_hashes(seed, miss_prompt, bs), sys_prompt, prefix_hashes(seed, sys_prompt, bs),
        rows_total, snaps_total, turns, siblings)


def calibrated_task(target_s: float) -> Callable[[], None]:
    """A fixed CPU-bound task of about ``target_s``: the machine's own jitter."""
    n = 1000
    while True:
        with timer() as t:
            sum(range(n))
        if t[0] >= target_s / 4:
            break
        n *= 2
    n = int(n * target_s / t[0])

    def task() -> None:
        sum(range(n))

    return task


def _probes(fx: LookupFixture, sz: Sizes) -> tuple[dict[str, Callable[[], None]], int]:
    """The timed lookups, each checking its answer, by name; and the token at which
    the growing prompt leaves the real snapshot."""
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

    def ends_only() -> None:  # a sliding-window model's lookup: snapshot ends only
        m = store.lookup(ident, fx.prompt, hashes=fx.hashes, ends_only=True)
        if m is None or m.snapshot_id != fx.real_id or m.n_tokens != sz.hit_tokens:
            raise SystemExit(f"the probe prompt should end-match snapshot {fx.real_id}: {m}")

    # A prompt that leaves the real snapshot mid-stride: the lookup stops at the
    # stride alias below, grow() reaches the last whole block it shares.
    shared = sz.hit_tokens - 1000 + 137
    grow_prompt = fx.prompt.copy()
    grow_prompt[shared] += 1
    grow_hashes = prefix_hashes(seed, grow_prompt, bs)

    def hit_and_grow() -> None:
        m = store.lookup(ident, grow_prompt, hashes=grow_hashes)
        if m is None or m.snapshot_id != fx.real_id or m.n_tokens >= shared:
            raise SystemExit(f"the growing prompt should stop at a stride alias: {m}")
        m = store.grow(m, grow_prompt)
        if m.n_tokens != shared // bs * bs:
            raise SystemExit(f"grow should reach {shared // bs * bs} tokens: {m}")

    def hit_with_hashing() -> None:
        m = store.lookup(ident, fx.prompt)
        if m is None or m.n_tokens != sz.hit_tokens:
            raise SystemExit(f"the probe prompt should hit: {m}")

    probes = {"hit": hit, "miss": miss, "system_only": system_only, "hashing": hashing,
              "ends_only": ends_only, "hit_and_grow": hit_and_grow,
              "hit_with_hashing": hit_with_hashing}
    return probes, shared


def bench_lookup(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    fx = lookup_fixture(root, sz, rng)
    store = fx.store
    probe, shared = _probes(fx, sz)
    hit, miss, system_only, hashing = (probe["hit"], probe["miss"], probe["system_only"],
                                       probe["hashing"])
    ends_only, hit_and_grow, hit_with_hashing = (probe["ends_only"], probe["hit_and_grow"],
                                                 probe["hit_with_hashing"])
    with trace_sql(fx.index) as statements:
        hit()
        miss()
    seen_plans = plans(fx.index, statements)
    for fn in (system_only, hashing, hit_with_hashing, hit_and_grow, ends_only):
        fn()  # warm
    with timer() as t:
        hit()
    noise = calibrated_task(max(t[0], 2e-4))
    every: list[Callable[[], None]] = [hit, miss, system_only, hit_and_grow, ends_only, noise]
    times: dict[Callable[[], None], list[float]] = {
        fn: [] for fn in (*every, hashing, hit_with_hashing)}
    for i in range(sz.lookup_reps):
        fns = every + ([hashing, hit_with_hashing] if i % (sz.lookup_reps // sz.hash_reps) == 0
                       else [])
        for fn in fns:
            with timer() as t:
                fn()
            times[fn] += t
    store.close()
    fx.index.close()

    a, c = times[hit], times[hit_with_hashing]
    probes = len(range(fx.stride - 1, len(fx.hashes), fx.stride))
    budget = LOOKUP_BUDGET_S

    def vs_budget(xs: list[float]) -> str:
        return f"p99 {pct(xs, 99) / budget:.2f}x budget"

    return [
        Row("3a. lookup 128k tokens, hashes given: hit", lat(a), "budget 2 ms", vs_budget(a),
            "p99 <= 2 ms", pct(a, 99) <= budget,
            f"{len(a)} reps; hits the real {sz.hit_tokens:,}-token snapshot; "
            f"{len(fx.hashes)} blocks, {probes} stride positions",
            {"hit_s": a, "plans": seen_plans}),
        Row("3b. prefix_hashes of 128k tokens", lat(times[hashing]), note=(
            f"{len(fx.hashes)} chained xxh3_128 calls, {len(times[hashing])} reps"),
            raw={"hash_s": times[hashing]}),
        Row("3c. lookup 128k tokens with hashing: hit", lat(c), "budget 2 ms", vs_budget(c),
            "info (p99 <= 2 ms)", None, f"{len(c)} reps; 3a + 3b",
            {"hit_hash_s": c}),
        Row("3d. lookup 128k tokens, hashes given: miss", lat(times[miss]), "budget 2 ms",
            vs_budget(times[miss]), "info (p99 <= 2 ms)", None, "a random prompt",
            {"miss_s": times[miss]}),
        Row("3e. lookup sharing only a 2k system prompt", lat(times[system_only]),
            "budget 2 ms", vs_budget(times[system_only]), "info (p99 <= 2 ms)", None,
            f"{fx.siblings + fx.turns + 1} snapshots share those {SYSTEM_PROMPT_TOKENS} tokens",
            {"system_s": times[system_only]}),
        Row("3f. lookup + grow past the stride alias", lat(times[hit_and_grow]), "budget 2 ms",
            vs_budget(times[hit_and_grow]), "p99 <= 2 ms", pct(times[hit_and_grow], 99) <= budget,
            f"leaves the real snapshot at token {shared:,}: the lookup stops at the alias "
            "below, grow reads the stored ids after it (verified) up to the last shared block",
            {"grow_s": times[hit_and_grow]}),
        Row("3g. lookup 128k tokens, snapshot ends only: hit", lat(times[ends_only]),
            "budget 2 ms", vs_budget(times[ends_only]), "info (p99 <= 2 ms)", None,
            "ends_only (sliding-window models): the ends of the snapshots sharing the "
            "first stride, and the first stride's blocks", {"ends_s": times[ends_only]}),
        Row("    noise floor: fixed CPU task", lat(times[noise]), note=(
            "pure-Python loop sized like 3a, timed in the same loop: the machine's jitter"),
            raw={"noise_s": times[noise]}),
        Row("    lookup index", f"{fx.rows_total:,} rows", note=(
            f"{fx.snaps_total:,} snapshots: 1 published, the rest bulk-inserted "
            f"({fx.turns} earlier turns, {fx.siblings} system-prompt siblings)")),
    ]


PART = Part("lookup", "lookup", bench_lookup)

if __name__ == "__main__":
    raise SystemExit(main([PART], script="bench_lookup.py"))
