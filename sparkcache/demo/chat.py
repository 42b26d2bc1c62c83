"""The main job: a vLLM conversation that survives an engine restart.

Run with ``bash scripts/demo.sh`` (or ``python -m sparkcache.demo``).  It builds
a random-weight Llama (no download: :mod:`sparkcache.demo.model`), then runs
two vLLM engines with the sparkcache connector, each in a fresh process
(:mod:`sparkcache.demo.engine`), sharing nothing but the store folder:

1. engine 1 answers the first turns of a chat with a long system prompt; the
   connector publishes each finished turn as a snapshot; the process exits;
2. engine 2 — the restart — continues the chat: the next turn's prompt
   restores the earlier turns from disk.  The same engine then answers the
   identical prompt once more under a cache salt, which both vLLM's prefix
   cache and the store key on: a full prefill, the honest "without the
   snapshot".  The two greedy answers must be equal.

It prints prompt tokens, tokens restored from disk and time to first token
(vLLM's own measure: request arrival to first token) with and without the
snapshot, and exits non-zero when nothing was restored or the answers differ.
``--quick`` uses a tiny model (the size of the tests') and a shorter chat (the
test suite runs it).  The command line is :mod:`sparkcache.demo.__main__`.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkcache import admin
from sparkcache.demo.model import DEMO, TINY, WORDS, ModelSize, ensure_model

#: vLLM on CPU wants block sizes that are multiples of 32.
BLOCK_SIZE = 32
#: What the demo needs beyond sparkcache itself (scripts/install-vllm.sh installs them).
NEEDS = ("vllm", "transformers", "tokenizers")
#: Seconds an engine process may take (start, turns, publish, shutdown).
ENGINE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Plan:
    """What one run of the demo does."""

    size: ModelSize
    model_name: str
    system_words: int  # length of the system prompt (about a token a word)
    max_tokens: int  # greedy answer length (at most)


FULL = Plan(DEMO, "model-demo", system_words=2200, max_tokens=32)
QUICK = Plan(TINY, "model-tiny", system_words=400, max_tokens=16)

#: The user's messages: engine 1 answers all but the last, engine 2 the last.
QUESTIONS = (
    "Which window of the reading room opens early, and who holds the key?",
    "Is the blue folder still under the large map of the garden?",
    "Now tell me a short story about the quick fox and the river, from the notes.",
)


def system_prompt(n_words: int) -> str:
    """A long, deterministic system prompt: instructions, then notes to answer from."""
    rng = random.Random(2024)  # noqa: S311 (reproducible text, not a secret)
    sentences = []
    count = 0
    while count < n_words:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        count += len(words)
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
    return ("You are the help desk of the river garden library. Answer from these notes "
            "only, briefly.\n\n" + " ".join(sentences))


def missing_packages() -> list[str]:
    out = []
    for name in NEEDS:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except (ImportError, ValueError):  # a broken install
            out.append(name)
    return out


def _quiet_transformers() -> None:
    """No progress bars or advice from transformers while the model is built."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging_mod: Any = importlib.import_module("transformers.utils.logging")
    logging_mod.disable_progress_bar()


def run_engine(name: str, folder: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Run :mod:`sparkcache.demo.engine` on ``spec`` in a new process; its log goes
    to ``folder/<name>.log``.  Raises RuntimeError (with the log's tail) on failure."""
    spec_file, out_file = folder / f"{name}.spec.json", folder / f"{name}.json"
    log_file = folder / f"{name}.log"
    out_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "out": str(out_file)}))
    with log_file.open("w") as log:
        # A session of its own: on a timeout or Ctrl-C the engine goes with every
        # process vLLM started for it.
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkcache.demo.engine", str(spec_file)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            status = proc.wait(timeout=ENGINE_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if status != 0 or not out_file.exists():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{name} failed (exit status {status}); the end of "
                           f"{log_file}:\n{tail}")
    result: dict[str, Any] = json.loads(out_file.read_text())
    return result


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.0f} kB"


def _turn_line(label: str, turn: dict[str, Any]) -> str:
    cached, disk = turn["cached"], turn["from_disk"]
    return (f"  {label:<7} prompt {turn['prompt_tokens']:>5}  cached {cached:>5} "
            f"(memory {cached - disk:>5}, disk {disk:>5})  TTFT {turn['ttft_s']:5.2f} s")


def _snapshot_line(snaps: list[dict[str, Any]]) -> str:
    parts = []
    for s in snaps:
        parent = f", extends #{s['parent']} (+{_mb(s['nbytes'])})" if s["parent"] else \
            f", {_mb(s['nbytes'])}"
        parts.append(f"#{s['id']} {s['n_tokens']} tokens{parent}")
    return f"  published {len(snaps)} snapshot(s): " + "; ".join(parts)


def _print_stats(store: Path) -> None:
    with admin.open_store(store) as st:
        stats = admin.stats(st)
        n = len(admin.list_snapshots(st))
    print(f"store: {n} snapshots, {stats.publishes} publishes ({_mb(stats.written_bytes)} "
          f"written), hits {stats.hits} ({stats.restored_tokens} tokens, "
          f"{_mb(stats.restored_bytes)} restored), misses {stats.misses}, "
          f"quarantined {len(stats.quarantined)}")
    print(f"  more: sparkcache --folder {store} ls   (or stats, show ID, verify)")


def run_demo(folder: Path, plan: Plan) -> int:
    """The demo in ``folder``; 0 when engine 2 restored from disk and the answers agree."""
    started = time.perf_counter()
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows through a pipe too
    folder.mkdir(parents=True, exist_ok=True)
    model, store = folder / plan.model_name, folder / "store"
    shutil.rmtree(store, ignore_errors=True)  # every run starts from an empty store
    print("sparkcache demo: a chat that survives a vLLM restart")
    print(f"  working folder {folder} (model, store, engine logs)")

    _quiet_transformers()
    t = time.perf_counter()
    built = ensure_model(model, plan.size)
    how = f"built in {time.perf_counter() - t:.1f} s" if built else "reused"
    print(f"  model: random-weight Llama, {plan.size.describe()} ({how})")

    spec = {"model": str(model), "store": str(store), "block_size": BLOCK_SIZE,
            "max_model_len": plan.size.max_model_len, "max_tokens": plan.max_tokens}
    history = [{"role": "system", "content": system_prompt(plan.system_words)}]

    print("[engine 1] starting vLLM with the sparkcache connector in a new process "
          "(about a minute)...")
    one = run_engine("engine1", folder, {**spec, "history": history,
                                         "questions": list(QUESTIONS[:-1])})
    print(f"[engine 1] pid {one['pid']}, vLLM {one['vllm']}, started in {one['start_s']:.0f} s")
    for i, turn in enumerate(one["turns"], 1):
        print(_turn_line(f"turn {i}", turn))
    print(_snapshot_line(one["snapshots"]))
    print("  the process exits: its KV cache is gone")

    print("[engine 2] restart: a new process on the same store (about a minute)...")
    two = run_engine("engine2", folder, {**spec, "history": one["messages"],
                                         "questions": [QUESTIONS[-1]], "recompute": True})
    print(f"[engine 2] pid {two['pid']}, started in {two['start_s']:.0f} s")
    (restored,), again = two["turns"], two["recompute"]
    same = _print_restart(restored, again)
    print()
    _print_stats(store)
    print(f"demo took {time.perf_counter() - started:.0f} s")

    if restored["from_disk"] <= 0:
        print("FAILED: engine 2 restored nothing from the store (see engine2.log)")
        return 1
    if not same:
        print("FAILED: the restored answer differs from the recomputed one")
        return 1
    return 0


def _print_restart(restored: dict[str, Any], again: dict[str, Any]) -> bool:
    """Print engine 2's restored turn beside the same prompt recomputed; whether
    their greedy answers are equal."""
    label = f"turn {len(QUESTIONS)}"
    print(_turn_line(label, restored) + "  <- restored")
    print(_turn_line(label, again) + "  <- same prompt, recomputed")
    print("  (recomputed: the identical tokens under a cache salt, on which vLLM's "
          "prefix cache\n   and the store both key: nothing is reused)")
    same = bool(restored["answer_tokens"] == again["answer_tokens"])
    head = ", ".join(map(str, restored["answer_tokens"][:6]))
    print(f"  greedy answers equal: {'yes' if same else 'NO'} "
          f"({len(restored['answer_tokens'])} tokens each: [{head}, ...])")

    speedup = again["ttft_s"] / restored["ttft_s"] if restored["ttft_s"] else float("inf")
    print()
    print(f"  {'':<20}{'prompt':>8}{'restored':>10}{'TTFT recompute':>16}"
          f"{'TTFT restored':>15}{'speedup':>9}")
    print(f"  {label + ' after restart':<20}{restored['prompt_tokens']:>8}"
          f"{restored['from_disk']:>10}{again['ttft_s']:>14.2f} s{restored['ttft_s']:>13.2f} s"
          f"{speedup:>8.1f}x")
    return same
