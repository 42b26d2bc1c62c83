"""The shared tier's sweep on moto's S3 server (loopback): its cost per 1000 manifests.

    .venv/bin/python bench/bench_shared_sweep.py [--sizes 1000,4000] [--reps 3] [--json]

A tier of N snapshots of one model (N/2 chains of a root and a child; each with
one 4 KiB segment, one alias and a manifest, as an upload writes them) is
written straight into a new bucket.  For each N, in one run:

* ``first``: a pass that deletes nothing, with no manifest parsed before (one
  listing of the tier, a GET of every manifest);
* ``periodic``: the same pass with the manifests kept from the pass before
  (what the connector's sweeper pays every period: the listing only);
* ``plain``: s3fs's own ``find`` of the tier plus ``cat`` of every manifest,
  the least any catalogue of these objects costs (the baseline of ``first``);
* ``delete``: a pass that deletes everything by age (manifests, children
  first, then segments and aliases).

moto answers from one Python process on this machine's cores, so the absolute
times are moto's more than S3's; the ratios and the per-1000 costs are what
carry over.  docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from sparkcache.identity import RequestScope
from sparkcache.shared import SharedTier, TierLimits, sweep_tier
from sparkcache.shared.layout import (
    Alias,
    Manifest,
    SegmentEntry,
    alias_bytes,
    alias_key,
    manifest_bytes,
    manifest_key,
    segment_key,
)
from sparkcache.shared.sweep import ManifestCache

MODEL = "0123456789abcdef" * 2
SEGMENT_BYTES = 4096


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("moto's S3 server did not start")
        time.sleep(0.05)


def fill(endpoint: str, n: int) -> tuple[SharedTier, str]:
    """A new bucket holding ``n`` snapshots (n/2 chains), written concurrently."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    tier = SharedTier(f"s3://{bucket}/kv", {"endpoint_url": endpoint}, alias_stride=16)
    rng = np.random.default_rng(n)
    objects: dict[str, bytes] = {}
    for _ in range(n // 2):
        parent = None
        for start, end in ((0, 32), (32, 64)):
            key = rng.bytes(16).hex()
            digest = rng.bytes(16).hex()
            seg = segment_key(MODEL, key, 0, digest)
            prefix = rng.bytes(16).hex()
            objects[seg] = bytes(SEGMENT_BYTES)
            objects[alias_key(MODEL, prefix)] = alias_bytes(Alias(prefix, end, key, end))
            objects[manifest_key(MODEL, key)] = manifest_bytes(Manifest(
                MODEL, key, end, start, parent, RequestScope(), (), 1,
                (SegmentEntry(0, seg, SEGMENT_BYTES, digest, start, end),), ((end, prefix),)))
            parent = key
    fs.pipe({f"{bucket}/kv/{k}": v for k, v in objects.items()})
    return tier, bucket


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def plain_catalogue(fs: Any, bucket: str) -> int:
    """The baseline: s3fs's own listing of the tier and a GET of every manifest."""
    fs.invalidate_cache()
    found = fs.find(f"{bucket}/kv", detail=True)
    return len(fs.cat([p for p in found if "/snap/" in p]))


def measure(endpoint: str, n: int, reps: int) -> dict[str, Any]:
    tier, bucket = fill(endpoint, n)
    keep = TierLimits(max_age_hours=0)
    first, periodic, plain = [], [], []
    for _ in range(reps):
        cache: ManifestCache = {}
        seconds, report = timed(lambda c=cache: sweep_tier(tier, keep, cache=c))
        assert report.swept and report.count == 0 and report.manifests == n, report
        first.append(seconds)
        periodic.append(timed(lambda c=cache: sweep_tier(tier, keep, cache=c))[0])
        seconds, count = timed(lambda: plain_catalogue(tier.backend.fs, bucket))
        assert count == n
        plain.append(seconds)
    gone, report = timed(lambda: sweep_tier(tier, TierLimits(max_age_hours=1),
                                            clock=lambda: time.time() + 86400))
    assert report.count == n, report.counts()
    tier.close()
    per = 1000 / n
    return {"manifests": n, "objects": 3 * n, "reps": reps,
            "first_ms": statistics.median(first) * 1e3,
            "periodic_ms": statistics.median(periodic) * 1e3,
            "plain_ms": statistics.median(plain) * 1e3,
            "delete_ms": gone * 1e3, "deleted_objects": report.objects_deleted,
            "first_per_1000_ms": statistics.median(first) * 1e3 * per,
            "periodic_per_1000_ms": statistics.median(periodic) * 1e3 * per,
            "delete_per_1000_ms": gone * 1e3 * per}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,4000",
                        help="manifests in the tier, comma-separated (default 1000,4000)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the no-op passes")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    proc, endpoint = start_moto()
    try:
        rows = [measure(endpoint, int(n), args.reps) for n in args.sizes.split(",")]
    finally:
        proc.terminate()
        proc.wait(10)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| manifests | objects | first pass | per 1000 | plain find+cat | ratio | periodic "
          "pass | per 1000 | delete all | per 1000 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['manifests']:,} | {r['objects']:,} | {r['first_ms']:.0f} ms "
              f"| {r['first_per_1000_ms']:.0f} ms | {r['plain_ms']:.0f} ms "
              f"| {r['first_ms'] / r['plain_ms']:.2f}x | {r['periodic_ms']:.0f} ms "
              f"| {r['periodic_per_1000_ms']:.0f} ms | {r['delete_ms']:.0f} ms "
              f"| {r['delete_per_1000_ms']:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
