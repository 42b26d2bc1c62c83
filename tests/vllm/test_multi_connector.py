"""sparkcache inside vLLM's own ``MultiConnector``, and an in-process engine's shutdown.

* damaged: one sparkcache child over a store whose snapshot has a flipped
  payload byte, the top-level ``kv_load_failure_policy`` left unset (vLLM's
  default ``fail``): the restore fails verification and the request is
  recomputed (the scheduler reads the top-level policy, which sparkcache sets
  on its parent too), never finished with ``finish_reason="error"``;
* two children: two sparkcache connectors (two stores) in one
  ``MultiConnector``: both save, and each reports its facts under its own
  ``kv_transfer_params`` key (``sparkcache``, then ``sparkcache.1``) instead of
  vLLM's "Key clash" error;
* shutdown: an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shut
  down right after ``generate()`` still writes the last request's snapshot
  (its save was planned, but no step carried it to the worker); vLLM's
  prefix-cache reset fails until steps released the held blocks, as
  docs/connector.md says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import CHUNK
from tiny_model import (
    BLOCK_SIZE,
    LONG_PROMPT,
    MAX_TOKENS,
    NEEDS_VLLM,
    OTHER_PROMPT,
    SHARED_PREFIX_PROMPT,
    damaged_copy,
    run_engine_script,
)

pytestmark = NEEDS_VLLM

#: One engine with a MultiConnector of one sparkcache child per folder; each
#: prompt answered in turn, then every store waited for (``ready`` snapshots).
MULTI = """
import time
from vllm import SamplingParams
from tiny_model import connector_config
from sparkcache import SnapshotStore

def child(folder):
    config = connector_config(folder)
    del config["kv_load_failure_policy"]  # the child's own is not what vLLM reads
    return config

ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
       "kv_connector_extra_config": {"connectors": [child(f) for f in args["folders"]]}}
llm = make_llm(args["model"], kv_transfer_config=ktc, **args["engine"])
stores = [SnapshotStore(f) for f in args["folders"]]
sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
results = {}
for name, prompt in args["prompts"]:
    (o,) = llm.generate([{"prompt_token_ids": prompt}], sp)
    c = o.outputs[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
            sum(s.state == "ready" for s in st.snapshots()) < args["ready"] for st in stores):
        time.sleep(0.1)
    results[name] = {
        "tokens": list(c.token_ids), "finish_reason": c.finish_reason,
        "params": sorted(o.kv_transfer_params or {}),
        "snapshots": [[[s.state, s.reason, s.n_tokens] for s in st.snapshots()]
                      for st in stores]}
report(results)
"""

#: An in-process engine: an answer, vLLM's prefix-cache reset at once, then
#: steps until it succeeds; another answer, the engine shut down at once; then
#: what the store holds.
SHUTDOWN = """
import time
from vllm import SamplingParams
from tiny_model import connector_config
from sparkcache import SnapshotStore

llm = make_llm(args["model"], kv_transfer_config=connector_config(args["folder"]),
               **args["engine"])
sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
(o,) = llm.generate([{"prompt_token_ids": args["prompt"]}], sp)
rec = {"tokens": list(o.outputs[0].token_ids), "reset": llm.reset_prefix_cache(), "steps": 0}
while not llm.reset_prefix_cache() and rec["steps"] < 100:
    llm.llm_engine.step()
    rec["steps"] += 1
    time.sleep(0.05)
(o,) = llm.generate([{"prompt_token_ids": args["other"]}], sp)
rec["other"] = list(o.outputs[0].token_ids)
llm.llm_engine.engine_core.shutdown()
with SnapshotStore(args["folder"]) as store:
    rec["snapshots"] = [[s.state, s.n_tokens] for s in store.snapshots()]
report(rec)
"""


def _multi(model: Path, tmp: Path, folders: list[Path], prompts: list[tuple[str, list[int]]],
           ready: int) -> dict[str, Any]:
    return run_engine_script(MULTI, args={
        "model": str(model), "tmp": str(tmp), "folders": [str(f) for f in folders],
        "prompts": prompts, "ready": ready, "engine": CHUNK, "max_tokens": MAX_TOKENS})


def test_inside_multi_connector_a_damaged_snapshot_is_recomputed(
    tiny_model_dir: Path, baseline: dict[str, Any], published: dict[str, Any], tmp_path: Path,
) -> None:
    folder = damaged_copy(published["folder"], tmp_path / "store")
    run = _multi(tiny_model_dir, tmp_path, [folder], [("shared", SHARED_PREFIX_PROMPT)], 1)
    shared = run["shared"]
    assert shared["finish_reason"] == "length", run["_log"]
    assert shared["tokens"] == baseline["shared"][0]["tokens"]
    assert [s[:2] for s in shared["snapshots"][0]] == [["quarantined", "digest"],
                                                     ["ready", None]]  # recomputed, stored
    assert shared["params"] == ["sparkcache"]
    assert "sets kv_load_failure_policy=recompute" in run["_log"]


def test_two_sparkcache_children_report_under_their_own_keys(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path: Path,
) -> None:
    folders = [tmp_path / "a", tmp_path / "b"]
    run = _multi(tiny_model_dir, tmp_path, folders, [("long", LONG_PROMPT)], 1)
    long = run["long"]
    assert long["finish_reason"] == "length", run["_log"]
    assert long["tokens"] == baseline["long"][0]["tokens"]
    assert long["params"] == ["sparkcache", "sparkcache.1"]
    for snaps in long["snapshots"]:  # both children saved it
        assert [s[0] for s in snaps] == ["ready"], long["snapshots"]


def test_an_in_process_engine_writes_its_last_save_at_shutdown(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path: Path,
) -> None:
    rec = run_engine_script(SHUTDOWN, args={
        "model": str(tiny_model_dir), "tmp": str(tmp_path), "folder": str(tmp_path / "s"),
        "prompt": LONG_PROMPT, "other": OTHER_PROMPT, "max_tokens": MAX_TOKENS,
        "engine": {**CHUNK, "distributed_executor_backend": "uni"},
    }, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert rec["tokens"] == baseline["long"][0]["tokens"]
    assert rec["other"] == baseline["other"][0]["tokens"]
    # No step ran after the request finished: its blocks were still held for
    # the save, so vLLM could not reset its prefix cache until steps carried
    # the save and reported it copied (docs/connector.md, "Shutdown").
    assert rec["reset"] is False and 1 <= rec["steps"] < 100, rec
    # The second answer's save was carried by no step: written at shutdown.
    assert rec["snapshots"] == [
        ["ready", (len(p) + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE]
        for p in (LONG_PROMPT, OTHER_PROMPT)], rec["_log"]
    assert "save(s) planned after the last step, run at shutdown" in rec["_log"]
