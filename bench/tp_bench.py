"""Time to first token across TP sizes: restores of a TP=2 snapshot in TP=2 and
TP=1 engines, against same-TP restores and recompute, in one run.

    .venv/bin/python bench/tp_bench.py [--tokens 2000] [--reps 3] [--dir DIR] [--json]

A random-weight Llama (hidden 512, 8 layers, 8 heads over 4 KV heads, fp32)
and a prompt of ``--tokens`` random token ids.  Every engine is a fresh
process (vLLM on CPU, enforce eager, block size 32); a TP=2 engine runs two
ranks with one core each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), a TP=1 engine
one rank on both (``0-1``):

1. recompute at TP=1 and TP=2 (no connector, prefix caching off);
2. publish: a TP=2 engine and a TP=1 engine each answer the prompt once into
   their own store;
3. restores, vLLM's prefix cache reset before every repetition so each one
   restores from disk: TP=2 from the TP=2 store and TP=1 from the TP=1 store
   (same TP), TP=1 from the TP=2 store (2 -> 1) and TP=2 from the TP=1 store
   (1 -> 2): a restore across TP sizes.

TTFT is the wall time of ``generate`` with ``max_tokens=1``; the table shows
the median, the ratio to recompute at the engine's own TP size and, for the
restores across TP sizes, to the same-TP restore of that engine's size, all
measured in this run.  Target: a restore across TP sizes <= 1.3x the same-TP
restore; exit status 1 if missed.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from connector_bench import PHASE  # the same timed engine script
from random_models import build_model
from tiny_model import MISSING, SKIP_REASON, connector_config, run_engine_script, token_prompt

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 512, 8, 8, 4, 1024
MAX_MODEL_LEN = 4096
#: One core per rank at TP=2; both cores to the one rank at TP=1.
BIND = {1: "0-1", 2: "0|1"}
TARGET = 1.3


def phase(name: str, tp: int, model: Path, tmp: Path, prompt: list[int], reps: int,
          store: Path | None, **engine: Any) -> dict[str, Any]:
    """One engine of ``tp`` ranks: ``reps`` timed answers of the prompt."""
    base: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
                            "tensor_parallel_size": tp}
    if tp > 1:
        base["distributed_executor_backend"] = "mp"
    if store is not None:
        base["kv_transfer_config"] = connector_config(store)
    started = time.perf_counter()
    result = run_engine_script(PHASE, args={
        "model": str(model), "tmp": str(tmp), "prompt": prompt, "reps": reps,
        "engine": {**base, **engine}, "store": str(store) if store else None,
    }, timeout=1800, env={"VLLM_CPU_OMP_THREADS_BIND": BIND[tp]})
    result["wall"] = time.perf_counter() - started
    result["tp"] = tp
    print(f"  {name}: {[round(t, 3) for t in result['times']]} s "
          f"(process {result['wall']:.0f} s)", file=sys.stderr)
    return result


def run_all(work: Path, tokens: int, reps: int) -> dict[str, dict[str, Any]]:
    model = work / "model"
    if not (model / "config.json").exists():
        build_model(model, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                    intermediate=INTERMEDIATE, max_model_len=MAX_MODEL_LEN)
    prompt = token_prompt(tokens, seed=11)
    stores = {tp: work / f"store-tp{tp}" for tp in (1, 2)}
    for folder in stores.values():
        shutil.rmtree(folder, ignore_errors=True)
    runs = {f"recompute, TP={tp}": phase(f"recompute TP={tp}", tp, model, work, prompt,
                                         reps, None, enable_prefix_caching=False)
            for tp in (2, 1)}
    for tp in (2, 1):
        phase(f"publish TP={tp}", tp, model, work, prompt, 1, stores[tp])
    crossed = {tp: work / f"store-from-tp{3 - tp}" for tp in (1, 2)}
    for tp, folder in crossed.items():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(stores[3 - tp], folder)
    for tp in (2, 1):
        runs[f"restore TP={tp} from TP={tp}"] = phase(
            f"restore TP={tp} <- TP={tp}", tp, model, work, prompt, reps, stores[tp])
        runs[f"restore TP={tp} from TP={3 - tp}"] = phase(
            f"restore TP={tp} <- TP={3 - tp}", tp, model, work, prompt, reps, crossed[tp])
    return runs


def table(runs: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    medians = {name: statistics.median(run["times"]) for name, run in runs.items()}
    rows, ok = [], True
    for name, run in runs.items():
        tp = run["tp"]
        ref_token = runs[f"recompute, TP={tp}"]["firsts"][0][0]
        row = {"phase": name, "tp": tp, "median_s": round(medians[name], 3),
               "min_s": round(min(run["times"]), 3), "n": len(run["times"]),
               "x_recompute": round(medians[name] / medians[f"recompute, TP={tp}"], 3),
               "cached": min(f[2] for f in run["firsts"]),
               "same_token": all(f[0] == ref_token for f in run["firsts"]), "x_same_tp": None}
        if name == f"restore TP={tp} from TP={3 - tp}":
            row["x_same_tp"] = round(medians[name] / medians[f"restore TP={tp} from TP={tp}"], 3)
            ok = ok and row["x_same_tp"] <= TARGET and row["cached"] > 0
        rows.append(row)
    return rows, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="work folder (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    opts = parser.parse_args()
    if MISSING:
        print(SKIP_REASON, file=sys.stderr)
        return 2
    work = opts.dir or Path(tempfile.mkdtemp(prefix="sparkcache-tp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        runs = run_all(work, opts.tokens, opts.reps)
    finally:
        if opts.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    rows, ok = table(runs)
    if opts.json:
        print(json.dumps({"rows": rows, "ok": ok}, indent=2))
        return 0 if ok else 1
    print(f"prompt {opts.tokens} tokens; Llama hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads "
          f"over {KV_HEADS} KV heads, fp32; {opts.reps} reps per engine")
    print(f"{'phase':<26}{'n':>3}{'median s':>10}{'min s':>8}{'x recompute':>13}"
          f"{'x same TP':>11}{'cached':>8}{'same token':>12}")
    for r in rows:
        same = "" if r["x_same_tp"] is None else f"{r['x_same_tp']:.3f}"
        print(f"{r['phase']:<26}{r['n']:>3}{r['median_s']:>10.3f}{r['min_s']:>8.3f}"
              f"{r['x_recompute']:>13.3f}{same:>11}{r['cached']:>8}{r['same_token']!s:>12}")
    print(f"target: a restore across TP sizes <= {TARGET}x the same-TP restore: "
          f"{'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
