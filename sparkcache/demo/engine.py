"""One engine of the demo: vLLM with the sparkcache connector, in a process of its own.

:mod:`sparkcache.demo.chat` runs ``python -m sparkcache.demo.engine SPEC.json`` twice:
engine 1 holds the first turns of a chat, engine 2 — a new process on the same
store, i.e. the restart — continues it.  The spec (JSON) says what to ask; what
the engine measured goes to the JSON file the spec names, and the engine's own
log to the process's stdout/stderr (the demo sends them to a file).

Spec keys: ``model`` (folder), ``store`` (folder), ``block_size``,
``max_model_len``, ``max_tokens``, ``history`` (chat messages so far),
``questions`` (user messages, one turn each), ``recompute`` (also answer the
last turn's prompt with a cache salt: a full prefill of the identical tokens,
for comparison), ``out`` (result file).

vLLM spawns its engine core and workers, which re-import the main module: the
work runs only under ``if __name__ == "__main__":``.  vLLM is imported through
importlib, so neither ``import sparkcache`` nor mypy needs it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sparkcache import SnapshotStore

__all__ = ["ENGINE_ENV", "RECOMPUTE_SALT", "connector_config", "run"]


def _all_cpus() -> str:
    """Every CPU this process may run on, as VLLM_CPU_OMP_THREADS_BIND lists them."""
    if hasattr(os, "sched_getaffinity"):
        return ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return "auto"


#: What vLLM on CPU needs, offline; the caller's values win.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": _all_cpus(),
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: The cache salt of the comparison request.  vLLM's prefix cache and the store
#: both key on it, so the identical prompt misses both and is prefilled in full;
#: the salt changes no computed value.
RECOMPUTE_SALT = "sparkcache-demo-recompute"

#: vLLM's counter of prompt tokens its KV connector supplied (here: from disk).
_DISK_HITS = "vllm:external_prefix_cache_hits"
#: How long engine 1 waits for its snapshots to be published before it exits.
_PUBLISH_WAIT_S = 120.0


def connector_config(store: str | Path) -> dict[str, Any]:
    """``kv_transfer_config`` for the sparkcache connector on the store ``store``."""
    return {
        "kv_connector": "SparkCacheConnector",
        "kv_connector_module_path": "sparkcache.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"folder": str(store)},
    }


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's counters by name, summed over their labels."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0.0) + value
    return out


def _record(llm: Any, out: Any, before: dict[str, float], wall: float) -> dict[str, Any]:
    completion = out.outputs[0]
    disk = _counters(llm).get(_DISK_HITS, 0.0) - before.get(_DISK_HITS, 0.0)
    # vLLM's own TTFT: from the request's arrival to its first token (restore included).
    ttft = getattr(out.metrics, "first_token_latency", 0.0) or wall
    return {
        "prompt_token_ids": list(out.prompt_token_ids),
        "prompt_tokens": len(out.prompt_token_ids),
        "cached": int(out.num_cached_tokens or 0),
        "from_disk": int(disk),
        "ttft_s": float(ttft),
        "answer": completion.text,
        "answer_tokens": list(completion.token_ids),
    }


def _chat(llm: Any, messages: list[dict[str, str]], params: Any) -> dict[str, Any]:
    before = _counters(llm)
    t = time.perf_counter()
    (out,) = llm.chat(messages, params, use_tqdm=False)
    return _record(llm, out, before, time.perf_counter() - t)


def _recompute(llm: Any, token_ids: list[int], params: Any) -> dict[str, Any]:
    before = _counters(llm)
    t = time.perf_counter()
    prompt = {"prompt_token_ids": token_ids, "cache_salt": RECOMPUTE_SALT}
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return _record(llm, out, before, time.perf_counter() - t)


def _wait_published(store: Path, n_tokens: int) -> list[dict[str, Any]]:
    """Wait until a ready snapshot holds ``n_tokens`` tokens; returns the ready snapshots.

    The connector publishes after a request finishes, off the forward path; the
    process must not exit before the bytes are durable.
    """
    deadline = time.monotonic() + _PUBLISH_WAIT_S
    with SnapshotStore(store) as snaps:
        while True:
            ready = [s for s in snaps.snapshots() if s.state == "ready"]
            if any(s.n_tokens >= n_tokens for s in ready) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    return [{"id": s.id, "n_tokens": s.n_tokens, "parent": s.parent_id, "nbytes": s.nbytes}
            for s in sorted(ready, key=lambda s: s.id)]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, ask ``spec["questions"]`` turn by turn, report what happened."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    vllm: Any = importlib.import_module("vllm")
    t = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model"], tokenizer=spec["model"], dtype="float32",
        block_size=spec["block_size"], max_model_len=spec["max_model_len"],
        enforce_eager=True, enable_prefix_caching=True, max_num_seqs=4, seed=0,
        disable_log_stats=False,  # request metrics (TTFT) and the cache counters
        kv_transfer_config=connector_config(spec["store"]),
    )
    result: dict[str, Any] = {"pid": os.getpid(), "start_s": time.perf_counter() - t,
                              "vllm": getattr(vllm, "__version__", "?")}
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
        # One short request first: the first forward pass of a process is slower (lazy
        # kernel and allocator set-up), and no measured request should pay for it.
        # Shorter than SPARK_KV_CACHE_MIN_TOKENS: it is not stored.
        llm.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)
        messages = list(spec["history"])
        turns = []
        for question in spec["questions"]:
            messages.append({"role": "user", "content": question})
            turn = _chat(llm, messages, params)
            messages.append({"role": "assistant", "content": turn["answer"]})
            turns.append(turn)
        result["turns"], result["messages"] = turns, messages
        if spec.get("recompute"):
            result["recompute"] = _recompute(llm, turns[-1]["prompt_token_ids"], params)
        last = turns[-1]
        covered = last["prompt_tokens"] // spec["block_size"] * spec["block_size"]
        result["snapshots"] = _wait_published(Path(spec["store"]), covered)
    finally:
        # Shut the engine down explicitly: it flushes the connector's queued saves, and
        # an engine core left running keeps this process from exiting.
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown(timeout=60)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m sparkcache.demo.engine SPEC.json (run by sparkcache.demo)",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    result = run(spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
