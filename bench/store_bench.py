"""Benchmark the snapshot store against the raw work it wraps, in one run.

    .venv/bin/python bench/store_bench.py [--quick] [--json] [--plans] [--dir FOLDER] [--only PART]

Five measurements, each a median (or a percentile) of several repetitions and
each compared with a baseline or a budget *measured in the same run* (STYLE
habit 10: this machine is noisy, a number from another run means little).  One
file holds each part, and runs it alone with the same flags (no ``--only``):

1. ``publish`` (bench_publish.py): publish throughput  vs  temp file + write +
   fsync + rename + folder fsync of the same buffers, in the same folder,
   alternated with the publishes;
2. ``publish`` (bench_publish.py): verified restore (lookup + read_into)  vs
   mmap + np.copyto of the same bytes from the same file, both warm;
3. ``lookup`` (bench_lookup.py): lookup latency of a 128k-token prompt
   (block_size 16) against an index of >= 1M boundary rows, with and without
   precomputed hashes, hit and miss;
4. ``evict`` (bench_evict.py): evicting 100 snapshots from a 10k-snapshot and
   from a 100k-snapshot store;
5. ``sweep`` (bench_sweep.py): ``Retention.sweep`` over the same two kinds of
   store: 100 and 1000 snapshots due by age, 100 over ``total_mb``, and nothing
   due, each 100k-store sweep against the same sweep of the 10k store.

The stores of (3), (4) and (5) are filled partly with bulk SQL (publishing a
million boundary rows one at a time would take an hour): rows shaped exactly
like the ones ``publish`` writes, inserted with the statements of
``sparkcache.index.queries`` through the benchmark's own connection to the
index (bench/common.py).  What is real and what is bulk-inserted is printed in
the table and described in docs/benchmarks.md.  Everything runs in a scratch
folder that is removed after.  Exit status 1 when a target is missed.
"""

from __future__ import annotations

import bench_evict
import bench_lookup
import bench_publish
import bench_sweep
from common import main

PARTS = [bench_publish.PART, bench_lookup.PART, bench_evict.PART, bench_sweep.PART]

if __name__ == "__main__":
    raise SystemExit(main(PARTS, script="store_bench.py"))
