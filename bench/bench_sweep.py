"""Measurement 5: the retention sweep of a 100k-snapshot store against a 10k one.

    .venv/bin/python bench/bench_sweep.py [--quick] [--json] [--plans] [--dir FOLDER]

``store.sweep()`` (the store's own Retention) with 100 and 1000 snapshots due by age, 100
over ``total_mb``, and nothing due, each sweep of the large store against the
same sweep of the small one.  The stores are :func:`common.evict_fixture`'s plus
what the sweeps delete, reopened with a Retention, a fake disk and an injected
clock (see :func:`sweep_fixture`).

Part ``sweep`` of bench/store_bench.py; docs/benchmarks.md describes it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    BULK_NBYTES,
    Part,
    Row,
    Sizes,
    bulk_files,
    count_rows,
    evict_fixture,
    log,
    main,
    median,
    ms,
    plans,
    timer,
    trace_sql,
)

from sparkcache import SnapshotStore
from sparkcache.index import queries
from sparkcache.index.db import Database
from sparkcache.retention import MB, DiskUsage, Retention, RetentionSettings

# Each ready snapshot, deepest first, with what decides whether age takes it.
READY_DEEPEST_FIRST = (
    "SELECT id, parent_id, depth, last_used, pinned FROM snapshots "
    "WHERE state = 'ready' ORDER BY depth DESC"
)
OLDEST_USE = "SELECT min(last_used) FROM snapshots"
MAX_AGE_HOURS = 168.0


def fake_disk(_where: object) -> DiskUsage:
    """A disk that is never short of space: the margin step never evicts."""
    return DiskUsage(total=10**13, free=5 * 10**12)


def sweep_plan(sz: Sizes) -> list[tuple[str, int, int]]:
    """(kind, snapshots it must delete, repetitions) in the order they run."""
    return [("noop", 0, sz.sweep_noop_reps),
            *(("age", n, r) for n, r in zip(sz.sweep_age, sz.sweep_age_reps, strict=True)),
            ("total", sz.sweep_total, sz.sweep_total_reps),
            ("noop", 0, sz.sweep_noop_reps)]


@dataclass
class SweepStore:
    """An eviction store reopened with a Retention, an injected clock and a ballast."""

    store: SnapshotStore
    index: Database  # the benchmark's own connection to its index
    now: list[float]  # the injected clock reads now[0]
    ballast: int  # a pinned snapshot whose nbytes tunes the total exactly
    built: int  # snapshots when the sweeps started


def age_cutoff(sw: SweepStore, due: int) -> float:
    """A ``last_used`` cutoff below which exactly ``due`` snapshots can go.

    A snapshot goes by age when it and every descendant were last used before
    the cutoff (a parent waits for its children) and none of them is pinned:
    the subtree's latest use, computed deepest first, is the key.  Where the
    ``due``-th key and the next are equal (a parent and the child it waits for
    straddle the cutoff), the snapshot used at that moment is pinned, which keeps
    its ancestors too, and the keys are computed again."""
    while True:
        with sw.index.read() as conn:
            rows = conn.execute(READY_DEEPEST_FIRST).fetchall()
        latest: dict[int, float] = {}
        for sid, pid, _depth, used, pinned in rows:
            mine = max(latest.get(sid, float("-inf")), float("inf") if pinned else used)
            latest[sid] = mine
            if pid is not None:
                latest[pid] = max(latest.get(pid, float("-inf")), mine)
        keys = sorted(latest.values())
        if len(keys) <= due or keys[due] == float("inf"):
            raise SystemExit(f"cannot make exactly {due} snapshots due by age")
        if keys[due - 1] < keys[due]:
            return (keys[due - 1] + keys[due]) / 2
        tied = next(sid for sid, _pid, _depth, used, pinned in rows
                    if not pinned and used == keys[due])
        sw.store.pin(tied)
        log(f"pinned snapshot {tied}: it and a parent straddled the cutoff of {due} by age")


def set_total(sw: SweepStore, over: int) -> int:
    """Resize the pinned ballast so that the store's total is a whole number of MB
    plus ``over`` bytes; returns that number of MB (the total_mb to set)."""
    mine = sw.store.snapshot(sw.ballast).nbytes
    with sw.index.read() as conn:
        ((_snapshots, total),) = conn.execute(queries.TOTAL_USAGE).fetchall()
    rest = int(total) - mine
    total_mb = -(-(rest - over) // MB)
    # Written only when it changes: a write through the benchmark's connection
    # empties the store's page cache.
    if (grow := total_mb * MB + over - rest - mine) != 0:
        with sw.index.write() as conn:
            conn.execute(queries.ADD_SNAPSHOT_BYTES, (grow, sw.ballast))
    return total_mb


def sweep_fixture(root: Path, n_snapshots: int, n_files: int,
                  rng: np.random.Generator) -> tuple[SweepStore, int]:
    """The eviction store of (4), closed and reopened with a Retention whose disk
    probe is a fake with room to spare and whose clock is injected; the one
    published snapshot (the newest) is pinned and serves as the ballast.
    Returns the store and the files made."""
    built = evict_fixture(root, n_snapshots, n_files, rng)
    built.store.pin(built.published)
    count = count_rows(built.index, "snapshots")
    built.store.close()
    now = [time.time()]
    settings = RetentionSettings(folder=root, max_age_hours=MAX_AGE_HOURS, total_mb=0,
                                 min_free_mb=0)
    retention = Retention(settings, disk_usage=fake_disk, ram_bytes=lambda: 64 * 2**30)
    store = SnapshotStore(root, retention=retention, clock=lambda: now[0])
    return SweepStore(store, built.index, now, built.published, count), built.files


def prepare_sweep(sw: SweepStore, kind: str, due: int) -> None:
    """Settings and clock so that the next sweep deletes exactly ``due`` snapshots."""
    store = sw.store
    assert store.retention is not None
    hours = MAX_AGE_HOURS
    if kind == "age":
        sw.now[0] = age_cutoff(sw, due) + hours * 3600
        store.retention = store.retention.with_settings(max_age_hours=hours, total_mb=0)
    elif kind == "total":
        total_mb = set_total(sw, due * BULK_NBYTES)
        store.retention = store.retention.with_settings(max_age_hours=0.0, total_mb=total_mb)
    else:  # nothing due: every rule runs, none finds anything
        with sw.index.read() as conn:
            ((oldest,),) = conn.execute(OLDEST_USE).fetchall()
        sw.now[0] = float(oldest) + hours * 3600 - 3600
        total_mb = set_total(sw, 0) + 1
        store.retention = store.retention.with_settings(max_age_hours=hours, total_mb=total_mb)


def bench_sweep(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    plan = sweep_plan(sz)
    deletes = sum(due * reps for _kind, due, reps in plan)
    # Files for the least recently used: what age and the total take, plus the
    # parents that wait for a younger child (hence the margin).
    n_files = deletes + deletes // 4 + 500
    stores: dict[int, SweepStore] = {}
    for n in sz.evict_sizes:
        # n + what the sweeps delete: the store never holds fewer than n snapshots.
        stores[n], made = sweep_fixture(root / f"sweep-{n}", n + deletes, n_files, rng)
        log(f"sweep store: {stores[n].built:,} snapshots, "
            f"{count_rows(stores[n].index, 'boundaries'):,} boundary rows, {made} files")
    small, large = sz.evict_sizes
    times: dict[tuple[str, int, int], list[float]] = {}
    unlinked: dict[tuple[str, int, int], int] = {}
    seen_plans: dict[str, str] = {}
    for kind, due, reps in plan:
        for rep in range(reps):
            for n in sz.evict_sizes if rep % 2 == 0 else sz.evict_sizes[::-1]:
                sw = stores[n]
                store = sw.store
                assert store.retention is not None
                prepare_sweep(sw, kind, due)
                before = bulk_files(store.root)
                tracing = n == large and kind == "age" and not seen_plans
                with (trace_sql(sw.index) if tracing else nullcontext([])) as statements, \
                        timer() as t:
                    report = store.sweep()
                want = {kind: due} if due else {}
                if report.counts() != want or report.folders_removed:
                    raise SystemExit(f"{kind} sweep of the {n:,} store deleted "
                                     f"{report.counts()} (and folders {report.folders_removed})"
                                     f", expected {want}")
                key = (kind, due, n)
                times.setdefault(key, []).extend(t)
                unlinked[key] = unlinked.get(key, 0) + before - bulk_files(store.root)
                if tracing:
                    seen_plans = plans(sw.index, statements)
    left = {n: count_rows(sw.index, "snapshots") for n, sw in stores.items()}
    for sw in stores.values():
        sw.store.close()
        sw.index.close()

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
            note = (f"{reps} sweeps each, alternated; {ms(median(a) / due)} vs "
                    f"{ms(median(b) / due)} per deleted snapshot; files unlinked: "
                    f"{unlinked[(kind, due, large)]}/{done} and "
                    f"{unlinked[(kind, due, small)]}/{done}")
        ratio = median(a) / median(b)
        raw: dict[str, Any] = {"large_s": a, "small_s": b}
        if kind == "age" and due == sz.sweep_age[0]:
            raw["plans"] = seen_plans  # of the first age sweep of the large store
        rows.append(Row(f"{name}: {large:,} store", ms(median(a)),
                        f"{ms(median(b))} of {small:,}", f"{ratio:.2f}x", "<= 2.00x",
                        ratio <= 2.0, note, raw))
    per = max(sz.sweep_age)
    a = times[("age", per, large)]
    rows.append(Row(
        "   sweep: per deleted snapshot", ms(median(a) / per),
        note=(f"{per} by age from the {large:,} store; stores held {stores[large].built:,} -> "
              f"{left[large]:,} and {stores[small].built:,} -> {left[small]:,} snapshots")))
    return rows


PART = Part("sweep", "retention sweep", bench_sweep)

if __name__ == "__main__":
    raise SystemExit(main([PART], script="bench_sweep.py"))
