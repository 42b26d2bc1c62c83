"""Restore vs recompute, and bytes stored per token, for a sliding-window model
and one of Spark's families, in bf16.

    .venv/bin/python bench/model_bench.py [--tokens 2000] [--reps 3] [--dir DIR] [--json]

Two random-weight models (``tests/vllm/random_models.py``), bf16 weights and
KV cache, vLLM on CPU (block size 32, enforce eager, hybrid KV cache manager
on), all engines in one process per model (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

* ``gemma3`` - Gemma-3's text architecture, 8 layers: 6 with a sliding window
  of :data:`WINDOW` tokens, 2 with full attention (vLLM gives it several KV
  cache groups; sparkcache stores each sliding layer's window only);
* ``llama`` - Llama, 8 layers of full attention (one group).

Both: hidden 512, 8 heads over 4 KV heads (head size 64).  Per model:

1. *recompute*: no connector, prefix caching off; ``--reps`` answers of the
   turn-2 prompt (turn 1 = ``--tokens`` random ids, then 64 more);
2. *publish*: with sparkcache, answers turn 1 once (max_tokens=1): the
   snapshot holds its whole blocks;
3. *restore*: a new engine answers the turn-2 prompt ``--reps`` times, vLLM's
   prefix cache reset before each: the stored turn is restored, the rest
   prefilled.

TTFT is the wall time of ``generate`` (max_tokens=1); the table shows medians,
the ratio to the same model's recompute measured in the same run, the cached
tokens, whether the first token matches recompute's, and the bytes the
snapshot stores per token (its file over its tokens), with the split per
layer kind.  A sliding-window layer stores ``ceil((W - 1) / 32)`` blocks
whatever the prompt's length: per token, far less than a full-attention layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from random_models import build_model
from tiny_model import MISSING, SKIP_REASON, run_engine_script, token_prompt

WINDOW = 512
LAYERS = 8
COMMON = {"hidden": 512, "heads": 8, "kv_heads": 4, "layers": LAYERS, "intermediate": 1024,
          "max_model_len": 4096}
MODELS: dict[str, dict[str, Any]] = {
    "gemma3": {"arch": "gemma3_text", "sliding_window": WINDOW,
               "layer_types": ["sliding_attention"] * 3 + ["full_attention"]
               + ["sliding_attention"] * 3 + ["full_attention"]},
    "llama": {"arch": "llama"},
}
ENGINE = {"dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 4,
          "distributed_executor_backend": "uni"}

SCRIPT = """
import statistics, time
from vllm import SamplingParams
from tiny_model import connector_config, in_process_engine
from sparkcache import SnapshotStore
from sparkcache.catalog import model_identity

sp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)

def warm(llm):
    for seed in (1, 2):
        llm.generate([{"prompt_token_ids": [seed] * 40 + list(range(100, 140))}], sp)

def timed(llm, prompt, reps):
    times, firsts = [], []
    for _ in range(reps):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
        times.append(time.perf_counter() - started)
        c = out.outputs[0]
        firsts.append([c.token_ids[0], c.logprobs[0][c.token_ids[0]].logprob,
                       out.num_cached_tokens])
    return {"times": times, "firsts": firsts}

def ready(store):
    return [s for s in store.snapshots() if s.state == "ready"]

folder = args["folder"]
turn1, turn2 = args["turn1"], args["turn1"] + args["tail"]
res = {}
with in_process_engine(args["model"], enable_prefix_caching=False, **args["engine"]) as llm:
    warm(llm)
    res["recompute"] = timed(llm, turn2, args["reps"])
store = SnapshotStore(folder)
with in_process_engine(args["model"], kv_transfer_config=connector_config(folder),
                       **args["engine"]) as llm:
    llm.generate([{"prompt_token_ids": turn1}], sp)
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not ready(store) or core.scheduler.has_requests()):
        llm.llm_engine.step()
        time.sleep(0.01)
(snap,) = ready(store)
ident = model_identity(store._core, snap.model_id)
res["snapshot"] = {"n_tokens": snap.n_tokens, "nbytes": snap.nbytes,
                   "page_nbytes": ident.page_nbytes, "block_size": ident.block_size,
                   "window_blocks": list(ident.window_blocks), "num_layers": ident.num_layers}
with in_process_engine(args["model"], kv_transfer_config=connector_config(folder),
                       **args["engine"]) as llm:
    warm(llm)
    res["restore"] = timed(llm, turn2, args["reps"])
    res["hma"] = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
report(res)
"""


def run_model(name: str, work: Path, turn1: list[int], tail: list[int],
              reps: int) -> dict[str, Any]:
    spec = dict(MODELS[name])
    arch = spec.pop("arch")
    folder = work / name
    if not (folder / "config.json").exists():
        build_model(folder, arch, **COMMON, **spec)
    store = work / f"store-{name}"
    if store.exists():
        import shutil
        shutil.rmtree(store)
    store.mkdir(parents=True)
    result = run_engine_script(SCRIPT, args={
        "tmp": str(work), "model": str(folder), "folder": str(store), "turn1": turn1,
        "tail": tail, "reps": reps, "engine": ENGINE,
    }, timeout=1800, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    print(f"  {name}: recompute {[round(t, 3) for t in result['recompute']['times']]} s, "
          f"restore {[round(t, 3) for t in result['restore']['times']]} s", file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="turn 1's length")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="work folder (default: a temp folder)")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    if MISSING:
        print(SKIP_REASON, file=sys.stderr)
        return 2
    work = opts.dir or Path(tempfile.mkdtemp(prefix="sparkcache-model-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    turn1, tail = token_prompt(opts.tokens, seed=81), token_prompt(64, seed=82)
    rows = []
    for name in MODELS:
        r = run_model(name, work, turn1, tail, opts.reps)
        snap = r["snapshot"]
        base = statistics.median(r["recompute"]["times"])
        rest = statistics.median(r["restore"]["times"])
        ref_token, ref_lp, _ = r["recompute"]["firsts"][0]
        per_full = snap["page_nbytes"] / snap["block_size"]
        windows = snap["window_blocks"] or [0] * snap["num_layers"]
        sliding = [w for w in windows if w]
        rows.append({
            "model": name, "hma": r["hma"], "recompute_s": round(base, 3),
            "restore_s": round(rest, 3), "ratio": round(rest / base, 3),
            "cached": min(f[2] for f in r["restore"]["firsts"]),
            "same_token": all(f[0] == ref_token for f in r["restore"]["firsts"]),
            "logprob_diff": max(abs(f[1] - ref_lp) for f in r["restore"]["firsts"]),
            "stored_tokens": snap["n_tokens"], "stored_bytes": snap["nbytes"],
            "bytes_per_token": round(snap["nbytes"] / snap["n_tokens"], 1),
            "full_layers": len(windows) - len(sliding),
            "full_layer_bytes_per_token": round(per_full, 1),
            "sliding_layers": len(sliding),
            "sliding_layer_bytes_per_token": round(
                sliding[0] * snap["page_nbytes"] / snap["n_tokens"], 1) if sliding else None,
        })
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"turn 1 {opts.tokens} tokens, turn 2 = turn 1 + 64; bf16, {LAYERS} layers, hidden 512, "
          f"8 heads / 4 KV heads; {opts.reps} reps; sliding window {WINDOW}")
    print(f"{'model':<8}{'recompute s':>12}{'restore s':>11}{'x recompute':>13}{'cached':>8}"
          f"{'same token':>12}{'|dlogprob|':>12}{'B/token':>10}  per layer (B/token)")
    for r in rows:
        split = f"{r['full_layers']} full x {r['full_layer_bytes_per_token']}"
        if r["sliding_layers"]:
            split += f", {r['sliding_layers']} sliding x {r['sliding_layer_bytes_per_token']}"
        print(f"{r['model']:<8}{r['recompute_s']:>12.3f}{r['restore_s']:>11.3f}"
              f"{r['ratio']:>13.3f}{r['cached']:>8}{r['same_token']!s:>12}"
              f"{r['logprob_diff']:>12.2e}{r['bytes_per_token']:>10}  {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
