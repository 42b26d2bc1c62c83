"""Measurement 4: evicting 100 snapshots from a 10k- and from a 100k-snapshot store.

    .venv/bin/python bench/bench_evict.py [--quick] [--json] [--plans] [--dir FOLDER]

``store.evict(count=100)`` on the two stores, alternated; the ratio of the
medians must stay under 2x (eviction must not grow with the store).  The stores
are :func:`common.evict_fixture`'s: one published snapshot, the rest bulk rows.

Part ``evict`` of bench/store_bench.py; docs/benchmarks.md describes it.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
from common import (
    BulkStore,
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


def bench_evict(root: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    small, large = sz.evict_sizes
    # Parents whose child is still there are skipped, hence the margin.
    n_files = sz.evict_reps * sz.evict_count * 2 + 200
    stores: dict[int, BulkStore] = {}
    for n in sz.evict_sizes:
        stores[n] = built = evict_fixture(root / f"evict-{n}", n, n_files, rng)
        log(f"eviction store: {count_rows(built.index, 'snapshots'):,} snapshots, "
            f"{count_rows(built.index, 'boundaries'):,} boundary rows, {built.files} files")
    times: dict[int, list[float]] = {n: [] for n in sz.evict_sizes}
    unlinked: dict[int, int] = {}
    seen_plans: dict[str, str] = {}
    for rep in range(sz.evict_reps):
        for n in sz.evict_sizes if rep % 2 == 0 else sz.evict_sizes[::-1]:
            store, index = stores[n].store, stores[n].index
            before = bulk_files(store.root)
            tracing = n == large and not seen_plans  # the plans of one eviction
            with (trace_sql(index) if tracing else nullcontext([])) as statements, \
                    timer() as t:
                ids = store.evict(count=sz.evict_count)
            if len(ids) != sz.evict_count:
                raise SystemExit(f"evicted {len(ids)} of {sz.evict_count} from the {n:,} store")
            times[n] += t
            unlinked[n] = unlinked.get(n, 0) + before - bulk_files(store.root)
            if tracing:
                seen_plans = plans(index, statements)
    for built in stores.values():
        built.store.close()
        built.index.close()
    ratio = median(times[large]) / median(times[small])
    evicted = sz.evict_reps * sz.evict_count
    return [
        Row(f"4. evict {sz.evict_count} of {large:,} snapshots", ms(median(times[large])),
            f"{ms(median(times[small]))} of {small:,}", f"{ratio:.2f}x", "<= 2.00x",
            ratio <= 2.0,
            f"{sz.evict_reps} reps each, alternated; files unlinked: {unlinked[large]}/"
            f"{evicted} and {unlinked[small]}/{evicted}",
            {"small_s": times[small], "large_s": times[large], "plans": seen_plans}),
        Row("   evict: per snapshot", ms(median(times[large]) / sz.evict_count),
            note="rows (cascading to segments and boundaries), commit, then unlink 4 KiB files"),
    ]


PART = Part("evict", "eviction", bench_evict)

if __name__ == "__main__":
    raise SystemExit(main([PART], script="bench_evict.py"))
