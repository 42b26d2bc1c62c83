"""Restore from a slow or fast shared tier, or recompute: TTFT with the cost model on and off.

    .venv/bin/python bench/tier_bench.py [--tokens 3000] [--reps 3] [--deadline 2]
                                         [--quick] [--dir DIR] [--json]

One table, measured in one run: rows are three shared tiers, moto's S3 server
on 127.0.0.1 reached through a TCP proxy that limits its bandwidth (both ways,
all connections together) to 1 MB/s, to 10 MB/s, or not at all; columns are
the time to first token of a ``--tokens`` prompt that only the tier holds,
with the connector's ``cost_model`` on, with it off, and on plain vLLM (no
connector: a recompute), each with its ratio to plain vLLM.

The model is bench/connector_bench.py's random-weight Llama (12 layers, 8 KV
heads of 64, fp32: 48 KiB of KV per token, about 147 MB for 3000 tokens);
vLLM on CPU, every engine a process of its own, warmed up before it is
timed (two short requests, then one ``--tokens`` prompt the tier does not
hold, which also gives the cost model this engine's prefill rate).  The
proxy runs in each engine's script; the unthrottled tier goes through it
too, with no limit (its copy costs ~10% of moto's ~130 MB/s on loopback).

1. Host 1 answers the prompts once and ``SnapshotStore.upload`` puts their
   snapshots into the tier.
2. Plain vLLM answers the measured prompts (``--reps`` of them, each a new
   random prompt, vLLM's prefix cache reset before each): one engine before
   the others and one after them, their repetitions pooled, so that the
   baseline spans the run's drift as the other columns do.
3. Cost model on: one engine per tier, on a new host folder (``mode:
   restore-only``: it saves nothing, so only the tier holds a prompt).  As in
   a long-running server, it has seen the tier's speed before the measured
   prompts: one earlier request of another prompt the tier holds ("seen").
4. Cost model off: one engine for the three tiers (it keeps nothing of a
   tier's speed; the proxy's rate is changed between them), with the same
   "seen" request per tier.  A request waits for the tier up to
   ``shared_deadline_seconds`` (``--deadline``, the connector's default 2 s),
   then recomputes; a fetch left behind goes on in the background.  Before
   each of its requests the proxy is opened up until that fetch has ended
   and the host folder is emptied, so that each one finds the tier answering
   (not in the fetcher's pause after a missed deadline) and nothing local:
   the column is the cost of a request that waits for the tier.

Before every measured request vLLM's prefix cache is reset and the host
folder's snapshots are deleted: only the tier holds the prompt.  The table shows medians of the
repetitions and, from the request log (``SnapshotStore.requests``), what each
engine did (``restore_reason``, tokens from the tier, time queued for it).
Targets (exit status 1 when missed): with the cost model, TTFT <= 1.2x plain
vLLM on every tier; on the unthrottled tier its gain over plain vLLM >= 0.9x
the gain of the cost-model-off restore.  Every ratio is of this run (STYLE
habit 10).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from common import grid, log, machine  # noqa: E402
from connector_bench import MAX_MODEL_LEN, build_model  # noqa: E402
from tiny_model import (  # noqa: E402
    MISSING,
    SKIP_REASON,
    run_engine_script,
    token_prompt,
)

from sparkcache import SnapshotStore  # noqa: E402
from tests.s3server import S3Server  # noqa: E402

MB = 1_000_000
#: (row name, the proxy's bytes per second; None: no limit).
TIERS: tuple[tuple[str, float | None], ...] = (
    ("1 MB/s", 1 * MB), ("10 MB/s", 10 * MB), ("unthrottled", None))
#: TTFT with the cost model over plain vLLM's, at most, on every tier.
WORST = 1.2
#: On the unthrottled tier: the cost model's gain over plain vLLM, at least
#: this share of the gain of the restore with the cost model off.
GAIN = 0.9
ENGINE = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4}
#: The request log's columns shown per measured request.
LOGGED = ("live_tokens", "restored_tokens", "remote_tokens", "restore_reason", "queue_s",
          "restore_s")

#: What every engine script shares: the repository on the path, a timed
#: answer (max_tokens=1, vLLM's prefix cache reset first, named in the
#: request log), the warm-up, and emptying the host folder.
HELPERS = """
import sys, time
sys.path.insert(0, args["root"])
from vllm import SamplingParams
from sparkcache import SnapshotStore
from tests.s3server import DelayProxy
from tiny_model import connector_config

def answer(llm, prompt, name):
    for _ in range(100):  # False while blocks are held
        if llm.reset_prefix_cache() is not False:
            break
        time.sleep(0.02)
    extra = {"kv_transfer_params": {"sparkcache": {"id": name}}} if args.get("folder") else None
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=1, extra_args=extra)
    started = time.perf_counter()
    (o,) = llm.generate([{"prompt_token_ids": prompt}], sp)
    s = time.perf_counter() - started
    return {"name": name, "s": s, "cached": o.num_cached_tokens,
            "token": o.outputs[0].token_ids[0]}

def warm_up(llm):
    for seed in (1, 2):  # the first request also compiles a helper
        answer(llm, [seed] * 40 + list(range(100, 140)), f"warm-{seed}")
    return answer(llm, args["prompts"]["warm"], "warm-prefill")

def empty(store):
    for s in store.snapshots():
        store.delete(s.id, force=True)

def engine(proxy, cost_model):
    cfg = connector_config(args["folder"], shared_options={"endpoint_url": proxy.endpoint},
                           cost_model=cost_model, **args["extra"])
    return make_llm(args["model"], kv_transfer_config=cfg, **args["engine"])

def logged(store):
    rows = {r.request_id: r for r in store.requests(limit=1000)}
    return {k: {c: getattr(r, c) for c in args["logged"]} for k, r in rows.items()}
"""

#: Host 1: answers the prompts to store and waits until their snapshots are ready.
HOST1 = HELPERS + """
from tiny_model import settle
cfg = connector_config(args["folder"])
llm = make_llm(args["model"], kv_transfer_config=cfg, **args["engine"])
for i, prompt in enumerate(args["stored"]):
    answer(llm, prompt, f"store-{i}")
with SnapshotStore(args["folder"]) as store:
    settle(llm, store, len(args["stored"]), timeout=300)
    report({"ready": [s.n_tokens for s in store.snapshots() if s.state == "ready"]})
"""

#: Plain vLLM: no connector, the measured prompts recomputed.
PLAIN = HELPERS + """
llm = make_llm(args["model"], **args["engine"])
warm = warm_up(llm)
report({"warm": warm,
        "reps": [answer(llm, p, f"rep-{i}") for i, p in enumerate(args["prompts"]["reps"])]})
"""

#: Cost model on, one tier: the engine sees the tier once, then the measured prompts.
COST_ON = HELPERS + """
proxy = DelayProxy(args["s3_port"], rate=args["rate"])
store = SnapshotStore(args["folder"])
llm = engine(proxy, True)
out = {"warm": warm_up(llm), "seen": answer(llm, args["prompts"]["seen"], "seen"), "reps": []}
for i, prompt in enumerate(args["prompts"]["reps"]):
    empty(store)
    out["reps"].append(answer(llm, prompt, f"rep-{i}"))
proxy.stop()  # measured: a fetch still in flight fails, adding nothing to the rates kept
llm.llm_engine.engine_core.shutdown()  # the rates are written at shutdown
out["log"] = logged(store)
out["costs"] = [[c.source, c.bucket, c.unit_s, c.latency_s, c.samples] for c in store.costs()]
report(out)
"""

#: Cost model off, every tier in turn through one proxy whose rate changes.
COST_OFF = HELPERS + """
proxy = DelayProxy(args["s3_port"])
store = SnapshotStore(args["folder"])
llm = engine(proxy, False)
warm = warm_up(llm)

def settled(rate):  # what a request left in flight has ended; nothing local
    proxy.rate = None
    proxy.wait_idle(1.0, timeout=300)
    empty(store)
    proxy.rate = rate

out = {"warm": warm}
for tier, rate in args["tiers"]:
    settled(rate)
    rec = {"seen": answer(llm, args["prompts"]["seen"], f"{tier} seen"), "reps": []}
    for i, prompt in enumerate(args["prompts"]["reps"]):
        settled(rate)
        rec["reps"].append(answer(llm, prompt, f"{tier} rep-{i}"))
    out[tier] = rec
proxy.stop()
out["log"] = logged(store)
report(out)
"""


def phase(name: str, body: str, **args: Any) -> dict[str, Any]:
    """Run one engine script (``args`` besides the shared ones), timed, logged."""
    started = time.perf_counter()
    shared = {"root": str(ROOT), "engine": ENGINE, "logged": LOGGED}
    result: dict[str, Any] = run_engine_script(body, args={**shared, **args}, timeout=3600)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result.pop("_log", None)  # the engine's output (shown when a script fails)
    reps = result.get("reps") or []
    log(f"{name}: {[round(r['s'], 3) for r in reps]} s (process {result['wall_s']:.0f} s)")
    return result


def store_in_tier(work: Path, model: Path, server: S3Server, url: str,
                  prompts: dict[str, Any]) -> dict[str, Any]:
    """Host 1 answers the prompts the tier is to hold; their snapshots go up."""
    folder = work / "host1"
    stored = [prompts["seen"], *prompts["reps"]]
    done = phase("host 1 answers the prompts", HOST1, model=str(model), tmp=str(work),
                 folder=str(folder), stored=stored, prompts=prompts)
    started = time.perf_counter()
    with SnapshotStore(folder, shared=url,
                       shared_options={"endpoint_url": server.endpoint}) as store:
        report = store.upload()
        nbytes = [s.nbytes for s in store.snapshots()]
    if len(report.uploaded) < len(stored):
        raise SystemExit(f"host 1 uploaded {len(report.uploaded)} of {len(stored)} snapshots "
                         f"({report}); ready: {done['ready']}")
    return {"uploaded": len(report.uploaded), "upload_s": round(time.perf_counter() - started, 1),
            "snapshot_mb": round(statistics.median(nbytes) / MB, 1)}


def run_all(work: Path, tokens: int, reps: int, deadline: float) -> dict[str, Any]:
    """Every engine of the table, in order: host 1, plain vLLM, the cost model
    off (all tiers), the cost model on (one engine per tier), plain vLLM again."""
    model = build_model(work / "model")
    prompts = {"warm": token_prompt(tokens, seed=70), "seen": token_prompt(tokens, seed=71),
               "reps": [token_prompt(tokens, seed=80 + i) for i in range(reps)]}
    server = S3Server()
    try:
        url = f"s3://{server.bucket()}/kv"
        out: dict[str, Any] = {"tier": store_in_tier(work, model, server, url, prompts)}
        common = {"model": str(model), "tmp": str(work), "prompts": prompts,
                  "s3_port": server.port}
        extra = {"mode": "restore-only", "shared": url, "upload_wait_seconds": 0,
                 "shared_deadline_seconds": deadline}
        out["plain"] = phase("plain vLLM", PLAIN, **common)
        out["off"] = phase("cost model off, every tier", COST_OFF, **common, extra=extra,
                           folder=str(work / "host-off"), tiers=TIERS)
        for tier, _rate in TIERS:
            log(f"  cost model off, {tier}: "
                f"{[round(r['s'], 3) for r in out['off'][tier]['reps']]} s")
        for i, (tier, rate) in enumerate(TIERS):
            out[f"on {tier}"] = phase(f"cost model on, {tier}", COST_ON, **common, extra=extra,
                                      folder=str(work / f"host-on-{i}"), rate=rate)
        out["plain again"] = phase("plain vLLM again", PLAIN, **common)
    finally:
        server.stop()
    return out


# -- the table ---------------------------------------------------------------------------


def med(reps: list[dict[str, Any]]) -> float:
    """The median TTFT of timed answers."""
    return float(statistics.median(r["s"] for r in reps))


def did(log_rows: dict[str, dict[str, Any]], names: list[str]) -> str:
    """What the request log says the engine did for the requests ``names``."""
    rows = [log_rows.get(n) or {} for n in names]
    reasons: dict[str, int] = {}
    for r in rows:
        reason = r.get("restore_reason") or (
            "restored" if r.get("restored_tokens") else "recomputed")
        reasons[reason] = reasons.get(reason, 0) + 1
    queued = statistics.median(r.get("queue_s") or 0.0 for r in rows)
    remote = statistics.median(r.get("remote_tokens") or 0 for r in rows)
    said = ", ".join(f"{k} {v}/{len(rows)}" for k, v in sorted(reasons.items()))
    return f"{said}; queued {queued:.2f} s; {remote:.0f} tokens from the tier"


def row(tier: str, out: dict[str, Any]) -> dict[str, Any]:
    """One tier's medians, ratios, targets and what each engine did."""
    plain = out["plain"]["reps"] + out["plain again"]["reps"]
    on, off = out[f"on {tier}"]["reps"], out["off"][tier]["reps"]
    p, a, b = med(plain), med(on), med(off)
    names = [r["name"] for r in on]
    passed = a <= WORST * p
    target = f"on <= {WORST}x plain"
    if dict(TIERS)[tier] is None:
        target += f"; on's gain >= {GAIN}x off's"
        passed = passed and p - a >= GAIN * (p - b)
    tokens = [r["token"] for r in out["plain"]["reps"]]
    differ = sum(r["token"] != t for reps in (on, off) for r, t in zip(reps, tokens, strict=True))
    return {
        "tier": tier, "on_s": a, "off_s": b, "plain_s": p, "on_x": a / p, "off_x": b / p,
        "seen_on_s": out[f"on {tier}"]["seen"]["s"], "target": target, "passed": passed,
        "on_did": did(out[f"on {tier}"]["log"], names),
        "off_did": did(out["off"]["log"], [f"{tier} {n}" for n in names]),
        "first_token_differs": differ,
    }


def render(rows: list[dict[str, Any]]) -> str:
    """The table: a row per tier, TTFT medians and their ratios to plain vLLM."""
    head = ["tier", "cost model on s", "x plain", "cost model off s", "x plain", "plain vLLM s",
            "target", "result", "cost model on did", "cost model off did"]
    body = [[r["tier"], f"{r['on_s']:.3f}", f"{r['on_x']:.2f}x", f"{r['off_s']:.3f}",
             f"{r['off_x']:.2f}x", f"{r['plain_s']:.3f}", r["target"],
             "PASS" if r["passed"] else "MISS", r["on_did"], r["off_did"]] for r in rows]
    return grid(head, body)


def main(argv: list[str] | None = None) -> int:
    """Run every engine, print the table (or ``--json``); 1 when a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="prompt tokens (3000)")
    parser.add_argument("--reps", type=int, default=None, help="measured prompts per cell (3)")
    parser.add_argument("--deadline", type=float, default=2.0,
                        help="shared_deadline_seconds of every engine (the default, 2)")
    parser.add_argument("--quick", action="store_true",
                        help="1000 tokens, 1 rep: a check that it works (~8 min)")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    opts = parser.parse_args(argv)
    tokens = opts.tokens or (1000 if opts.quick else 3000)
    reps = opts.reps or (1 if opts.quick else 3)
    if MISSING:
        print(SKIP_REASON, file=sys.stderr)
        return 2
    work = opts.dir or Path(tempfile.mkdtemp(prefix="sparkcache-tier-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    try:
        out = run_all(work, tokens, reps, opts.deadline)
    finally:
        if opts.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    rows = [row(tier, out) for tier, _ in TIERS]
    info = machine()
    info["load average"] = f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1-minute)"
    command = " ".join([".venv/bin/python bench/tier_bench.py",
                        *(argv if argv is not None else sys.argv[1:])])
    elapsed = time.perf_counter() - started
    ok = all(r["passed"] for r in rows)
    if opts.json:
        print(json.dumps({"machine": info, "command": command, "seconds": round(elapsed),
                          "tokens": tokens, "reps": reps, "deadline": opts.deadline,
                          "rows": rows, "runs": out, "ok": ok}, indent=1, default=str))
        return 0 if ok else 1
    for key, value in info.items():
        print(f"{key}: {value}")
    print(f"command: {command}  ({elapsed:.0f} s)")
    print(f"prompt {tokens} tokens, its snapshot {out['tier']['snapshot_mb']} MB in the tier; "
          f"medians of {reps} prompt(s) per cell; shared_deadline_seconds {opts.deadline}\n")
    print(render(rows))
    seen = ", ".join(f"{r['tier']} {r['seen_on_s']:.2f} s" for r in rows)
    print(f"\nthe cost model's engines' first request through their tier (seen): {seen}")
    if any(r["first_token_differs"] for r in rows):
        print("first token differs from plain vLLM's: "
              + ", ".join(f"{r['tier']} {r['first_token_differs']}" for r in rows))
    print("targets: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
