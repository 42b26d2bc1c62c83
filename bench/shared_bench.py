"""The shared tier against moto's S3 server on loopback: TTFT, throughput, miss cost.

    .venv/bin/python bench/shared_bench.py [--tokens 4000] [--reps 3] [--no-vllm]
                                           [--dir DIR] [--json]

Starts moto's S3 server (``moto[server]``) on 127.0.0.1 for the run and stops it.

1. **Throughput** (no vLLM): one snapshot of ``--tokens`` tokens with the
   benchmark model's KV layout (12 layers, 8 KV heads of 64, fp32, blocks of
   32: about 196 MB for 4000 tokens) is uploaded by host 1
   (``SnapshotStore.upload``) and fetched by host 2 with an empty store
   (``SnapshotStore.fetch``: probe, manifests, download, verification,
   publish), ``--reps`` times each into a fresh bucket / store; against a
   plain s3fs ``put_file`` and ``get_file`` of the same segment bytes between
   a local file and the same server, right beside each (both ends of both
   paths on the local disk, as the store's are).  The ratio is the median of
   the repetitions' ratios.  Target: >= 0.8x of plain s3fs both ways.
2. **Miss cost**: ``SnapshotStore.fetch`` for a 4000-token prompt the tier
   does not hold (the probe only: HEADs of aliases), median of 50, beside the
   local lookup's.  Target: <= 5 ms median on loopback.
3. **TTFT on real vLLM** (unless ``--no-vllm``; the random-weight Llama of
   bench/connector_bench.py, vLLM on CPU): recompute (no connector); host 1
   answers the prompt and waits until its snapshot is in the tier; host 2's engine, its store
   empty before each repetition (its snapshots deleted, vLLM's prefix cache
   reset), restores the prompt from the tier, then (prefix cache reset again)
   from its now local store: remote and local restore paired in one engine.

Every ratio is measured in the same run (STYLE habit 10).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from common import paired  # noqa: E402

from sparkcache import ModelIdentity, SnapshotStore  # noqa: E402
from sparkcache.hashing import prefix_hashes, prefix_seed  # noqa: E402
from tests.s3server import S3Server  # noqa: E402

LAYERS, KV_HEADS, HEAD, BS = 12, 8, 64, 32


def identity() -> ModelIdentity:
    return ModelIdentity(model="bench-llama", revision="r1", num_layers=LAYERS,
                         num_kv_heads=KV_HEADS, head_size=HEAD, dtype="float32",
                         kv_cache_dtype="float32", block_size=BS,
                         page_shape=(2, BS, KV_HEADS * HEAD), tp_size=1)


def pages(ident: ModelIdentity, n_tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (n_tokens // BS, ident.page_nbytes), np.uint8)
            for _ in range(LAYERS)]


def throughput(work: Path, server: S3Server, n_tokens: int, reps: int) -> dict[str, Any]:
    import s3fs

    ident = identity()
    toks = np.random.default_rng(1).integers(0, 30000, n_tokens).astype(np.uint32)
    toks = toks[:n_tokens // BS * BS]
    opts = {"endpoint_url": server.endpoint}
    fs = s3fs.S3FileSystem(**server.options)
    up, down, plain_up, plain_down, downloads = [], [], [], [], []
    nbytes = 0
    hosts: list[Path] = []
    for rep in range(reps):
        url = f"s3://{server.bucket()}/kv"
        one, two = work / f"one-{rep}", work / f"two-{rep}"
        hosts += [one, two]
        with SnapshotStore(one, shared=url, shared_options=opts) as a:
            a.publish(ident, 0, toks, pages(ident, toks.size))
            (snap,) = a.snapshots()
            with a._core.read() as conn:
                (seg,) = a._core.segments(conn, snap.id)
            with a.backend.open(seg.object_key) as blob:
                data = bytes(blob.buffer)
            nbytes = len(data)
            started = time.perf_counter()
            report = a.upload()
            up.append(time.perf_counter() - started)
            assert report.uploaded == [snap.id], report
        bucket = url.split("/")[2]
        local = work / f"plain-{rep}.bin"
        local.write_bytes(data)
        del data
        started = time.perf_counter()
        fs.put_file(str(local), f"{bucket}/plain/{rep}.bin")
        plain_up.append(time.perf_counter() - started)
        local.unlink()
        started = time.perf_counter()
        fs.get_file(f"{bucket}/plain/{rep}.bin", str(local))
        plain_down.append(time.perf_counter() - started)
        assert local.stat().st_size == nbytes
        local.unlink()
        with SnapshotStore(two, shared=url, shared_options=opts) as b:
            started = time.perf_counter()
            result = b.fetch(ident, toks)
            down.append(time.perf_counter() - started)
            downloads.append(result.download_seconds)
            assert result.outcome == "fetched", result
            match = b.lookup(ident, toks)
            assert match is not None and b.grow(match, toks).n_tokens == toks.size
        for host in (one, two):
            shutil.rmtree(host, ignore_errors=True)
    med = statistics.median
    return {
        "segment_mb": round(nbytes / 1e6, 1), "reps": reps,
        "upload_gbs": round(nbytes / med(up) / 1e9, 3),
        "plain_put_gbs": round(nbytes / med(plain_up) / 1e9, 3),
        # the median of each repetition's ratio: its plain copy ran right beside it
        "upload_ratio": round(paired(plain_up, up), 3),
        "fetch_gbs": round(nbytes / med(down) / 1e9, 3),
        "plain_get_gbs": round(nbytes / med(plain_down) / 1e9, 3),
        "fetch_ratio": round(paired(plain_down, down), 3),
        "download_gbs": round(nbytes / med(downloads) / 1e9, 3),
        "download_ratio": round(paired(plain_down, downloads), 3),
        "upload_s": [round(t, 3) for t in up],
        "plain_put_s": [round(t, 3) for t in plain_up],
        "fetch_s": [round(t, 3) for t in down],
        "download_s": [round(t, 3) for t in downloads],
        "plain_get_s": [round(t, 3) for t in plain_down],
    }


def miss_cost(work: Path, server: S3Server, n_tokens: int, reps: int = 50) -> dict[str, Any]:
    ident = identity()
    url = f"s3://{server.bucket()}/kv"
    opts = {"endpoint_url": server.endpoint}
    fetches, lookups, requests, heads = [], [], [], []
    with SnapshotStore(work / "miss", shared=url, shared_options=opts) as store:
        assert store.shared is not None
        backend = store.shared.backend
        for i in range(reps):  # the floor: one plain HEAD of a missing object
            started = time.perf_counter()
            assert backend.head(f"missing/{i}.json") is None
            heads.append(time.perf_counter() - started)
        for i in range(reps):
            toks = np.random.default_rng(100 + i).integers(0, 30000, n_tokens).astype(np.uint32)
            hashes = prefix_hashes(prefix_seed(ident, None), toks[:n_tokens // BS * BS], BS)
            started = time.perf_counter()
            assert store.lookup(ident, toks[:n_tokens // BS * BS], hashes=hashes) is None
            lookups.append(time.perf_counter() - started)
            started = time.perf_counter()
            result = store.fetch(ident, toks, hashes=hashes)
            fetches.append(time.perf_counter() - started)
            assert result.outcome == "miss"
            requests.append(result.requests)
    med = statistics.median
    return {"n": reps, "fetch_miss_ms": round(med(fetches) * 1e3, 2),
            "fetch_miss_p90_ms": round(sorted(fetches)[int(0.9 * reps)] * 1e3, 2),
            "local_lookup_ms": round(med(lookups) * 1e3, 3),
            "head_ms": round(med(heads) * 1e3, 2),
            "requests": int(med(requests))}


#: Host 1: answers the prompt once and waits until its snapshot is in the tier.
HOST1 = """
import time
from vllm import SamplingParams
from sparkcache import SnapshotStore
llm = make_llm(args["model"], **args["engine"])
sp = SamplingParams(temperature=0, max_tokens=1)
started = time.perf_counter()
llm.generate([{"prompt_token_ids": args["prompt"]}], sp)
ttft = time.perf_counter() - started
want = len(args["prompt"]) // 32 * 32
deadline = time.monotonic() + 600
with SnapshotStore(args["store"]) as store:
    while not any(s.state == "ready" and s.n_tokens >= want and s.uploaded_at
                  for s in store.snapshots()):
        assert time.monotonic() < deadline, "the prompt's snapshot never reached the tier"
        time.sleep(0.2)
    stats = store.stats()
report({"ttft": ttft, "stats": stats})
"""

#: Host 2: before each repetition its store is emptied (so the prompt comes from
#: the tier), then the prompt is answered again from its (now local) store.
HOST2 = """
import time
from vllm import SamplingParams
from sparkcache import SnapshotStore
llm = make_llm(args["model"], **args["engine"])
sp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
for seed in (1, 2):
    llm.generate([{"prompt_token_ids": [seed] * 40 + list(range(100, 140))}], sp)
store = SnapshotStore(args["store"])

def timed():
    llm.reset_prefix_cache()
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": args["prompt"]}], sp)[0]
    c = out.outputs[0]
    return time.perf_counter() - started, [c.token_ids[0], out.num_cached_tokens]

remote, local, firsts = [], [], []
for _ in range(args["reps"]):
    for s in store.snapshots():
        store.delete(s.id, force=True)
    t, first = timed()
    remote.append(t)
    firsts.append(first)
    t, first = timed()
    local.append(t)
    firsts.append(first)
stats = store.stats()
store.close()
ours = {m.name: m.value for m in llm.get_metrics()
        if "sparkcache" in m.name and isinstance(getattr(m, "value", None), (int, float))}
report({"remote": remote, "local": local, "firsts": firsts, "stats": stats, "connector": ours})
"""


def ttft(work: Path, server: S3Server, n_tokens: int, reps: int) -> dict[str, Any]:
    from connector_bench import MAX_MODEL_LEN, PHASE, build_model
    from tiny_model import MISSING, connector_config, run_engine_script, token_prompt

    if MISSING:
        return {"skipped": f"needs {', '.join(MISSING)}"}
    model = build_model(work / "model")
    prompt = token_prompt(n_tokens, seed=11)
    url = f"s3://{server.bucket()}/kv"
    shared = {"shared": url, "shared_options": {"endpoint_url": server.endpoint},
              "upload_wait_seconds": 120, "shared_deadline_seconds": 120}
    base = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4}

    def engine(body: str, name: str, **args: Any) -> dict[str, Any]:
        started = time.perf_counter()
        out = run_engine_script(body, args={"model": str(model), "tmp": str(work),
                                            "prompt": prompt, **args}, timeout=1800)
        print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        return out

    recompute = engine(PHASE, "recompute", reps=reps,
                       engine={**base, "enable_prefix_caching": False})
    one = work / "host1"
    engine(HOST1, "host 1 publishes and uploads", store=str(one),
           engine={**base, "kv_transfer_config": connector_config(one, **shared)})
    two = work / "host2"
    host2 = engine(HOST2, "host 2: from the tier, then local", reps=reps, store=str(two),
                   engine={**base, "kv_transfer_config": connector_config(two, **shared)})
    med = statistics.median
    base_s = med(recompute["times"])
    ref = recompute["firsts"][0][0]
    return {
        "recompute_s": round(base_s, 3),
        "remote_s": round(med(host2["remote"]), 3),
        "local_s": round(med(host2["local"]), 3),
        "remote_x_recompute": round(med(host2["remote"]) / base_s, 3),
        "local_x_recompute": round(med(host2["local"]) / base_s, 3),
        "remote_x_local": round(med(host2["remote"]) / med(host2["local"]), 3),
        "remote_times": [round(t, 3) for t in host2["remote"]],
        "local_times": [round(t, 3) for t in host2["local"]],
        "cached_remote": min(f[1] for f in host2["firsts"][0::2]),
        "cached_local": min(f[1] for f in host2["firsts"][1::2]),
        "same_token": all(f[0] == ref for f in host2["firsts"]),
        "fetches": host2["stats"].get("fetches"),
        "remote_hits": host2["connector"].get("vllm:sparkcache_remote_hits"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true", help="skip the TTFT part")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    opts = parser.parse_args()
    work = opts.dir or Path(tempfile.mkdtemp(prefix="sparkcache-shared-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    server = S3Server()
    try:
        out: dict[str, Any] = {
            "throughput": throughput(work, server, opts.tokens, opts.reps),
            "miss": miss_cost(work, server, opts.tokens),
        }
        if not opts.no_vllm:
            out["ttft"] = ttft(work, server, opts.tokens, opts.reps)
    finally:
        server.stop()
        if opts.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    t, m = out["throughput"], out["miss"]
    ok = t["upload_ratio"] >= 0.8 and t["fetch_ratio"] >= 0.8 and m["fetch_miss_ms"] <= 5
    out["ok"] = ok
    if opts.json:
        print(json.dumps(out, indent=2))
        return 0 if ok else 1
    print(f"moto S3 on loopback; one {t['segment_mb']} MB segment ({opts.tokens} tokens), "
          f"{t['reps']} reps each")
    print(f"{'':<26}{'sparkcache GB/s':>16}{'plain s3fs GB/s':>16}{'ratio':>8}")
    print(f"{'upload (put)':<26}{t['upload_gbs']:>16.3f}{t['plain_put_gbs']:>16.3f}"
          f"{t['upload_ratio']:>8.2f}")
    print(f"{'fetch (whole, durable)':<26}{t['fetch_gbs']:>16.3f}{t['plain_get_gbs']:>16.3f}"
          f"{t['fetch_ratio']:>8.2f}")
    print(f"{'  of it: get + verify':<26}{t['download_gbs']:>16.3f}{t['plain_get_gbs']:>16.3f}"
          f"{t['download_ratio']:>8.2f}")
    print(f"shared-tier miss on a {opts.tokens}-token prompt: median {m['fetch_miss_ms']} ms "
          f"(p90 {m['fetch_miss_p90_ms']} ms, {m['requests']} HEADs; one plain HEAD on this "
          f"server {m['head_ms']} ms); the local lookup {m['local_lookup_ms']} ms")
    if "ttft" in out:
        r = out["ttft"]
        if "skipped" in r:
            print(f"TTFT: skipped ({r['skipped']})")
        else:
            print(f"TTFT ({opts.tokens} tokens): recompute {r['recompute_s']} s; host 2 from "
                  f"the tier {r['remote_s']} s ({r['remote_x_recompute']}x recompute); host 2 "
                  f"local {r['local_s']} s ({r['local_x_recompute']}x); remote/local "
                  f"{r['remote_x_local']}x; cached (least) from the tier {r['cached_remote']}, "
                  f"local {r['cached_local']}; same first token {r['same_token']}; fetches "
                  f"{r['fetches']}, remote hits {r['remote_hits']}")
    print("targets: >= 0.8x plain s3fs both ways, miss <= 5 ms: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
