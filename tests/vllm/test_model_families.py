"""Spark's model families on real vLLM: Llama, Mistral, Qwen2, Qwen3 and Granite.

Each family is a tiny random-weight model of its transformers architecture
(:func:`random_models.build_model`), with its own head layout (:data:`FAMILIES`:
head sizes 32 and 64, MQA, GQA and MHA, Qwen3's head size that is not
hidden / heads, Qwen2's QKV bias, Granite's multipliers).  Per family, three
engines on one store, one after the other:

1. *publish*: answers :data:`PROMPT` (1050 tokens, prefilled in chunks of 128)
   from scratch, with logprobs - the reference - and saves it when it finishes;
2. *restore*: a new engine answers :data:`PROMPT` again.  It must restore all
   but the last prompt token and answer with the reference's greedy tokens and
   logprobs within LOGPROB_TOL;
3. *fault*: a new engine with ``SPARKCACHE_TEST_FAULT=flip-restored`` (restored
   pages scrambled after verification) restores the same and must answer
   differently: the comparison would catch a wrong restore of this family's KV.

Then the Llama model's config.json gets another ``rope_theta`` in place -
same folder, same weight files, same explicit ``revision`` - and a fourth
engine must miss cleanly (restore nothing) and answer differently.

Engine starts are what these tests cost: a vLLM engine of the default
multiprocess kind spawns two processes that import torch and vLLM (about 20 s
each on the 2-core test machine).  So all sixteen engines run in one script
process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (:data:`IN_PROCESS`): each is
still a new engine core, worker, zeroed KV cache and connector (scheduler and
worker side) on the store, created and torn down in turn, in about 3 s.  The
other tests in tests/vllm run vLLM's default multiprocess engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import CHUNK
from random_models import build_model
from tiny_model import (
    BLOCK_SIZE,
    COMPUTED,
    MISSING,
    NEEDS_VLLM,
    run_engine_script,
    same_answer,
    token_prompt,
)

from sparkcache.connector.layout import config_fingerprint, weights_fingerprint

pytestmark = NEEDS_VLLM

#: The families and their tiny models: ``build_model`` arguments (2 layers each).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"hidden": 256, "heads": 4, "kv_heads": 2},  # head size 64, GQA
    # Mistral's default sliding window (4096) would make a second KV cache group.
    "mistral": {"hidden": 128, "heads": 4, "kv_heads": 1, "sliding_window": None},  # 32, MQA
    "qwen2": {"hidden": 256, "heads": 4, "kv_heads": 4},  # head size 64, MHA, QKV bias
    "qwen3": {"hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 64},  # q/k norms
    "granite": {"hidden": 256, "heads": 8, "kv_heads": 2, "embedding_multiplier": 2.0,
                "residual_multiplier": 0.5, "attention_multiplier": 0.05},  # head size 32
}
#: (KV heads, head size) each family's identity must record.
HEAD_LAYOUT = {"llama": (2, 64), "mistral": (1, 32), "qwen2": (4, 64), "qwen3": (2, 64),
               "granite": (2, 32)}
#: 1050 tokens: the snapshot (prompt + 15 computed answer tokens, whole blocks)
#: ends at 1056, past the prompt's last whole block (1024), so a restore takes
#: that block too and leaves vLLM only the last prompt token to compute.
PROMPT = token_prompt(1050, seed=60)
#: The Llama engines name their weights explicitly (the connector's ``revision``):
#: the rope check must not rest on the folder's fingerprint.
LLAMA_REVISION = "tiny-llama-r1"
#: config.json's rope_theta for the rope check (transformers' default is 10000).
OTHER_ROPE_THETA = 500000.0
#: The engines run in the script's process (see the module docstring).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: Every engine here: chunked prefill, a KV cache of 95 usable blocks (>= 2048 tokens).
ENGINE = {**CHUNK, "num_gpu_blocks_override": 96, "distributed_executor_backend": "uni"}

SCRIPT = """
import json, time, traceback
from pathlib import Path
from tiny_model import answer, connector_config, in_process_engine, settle
from tiny_model import ready_snapshots as ready
from sparkcache import SnapshotStore
from sparkcache.catalog import model_identity
from sparkcache.connector.worker import FAULT_ENV

def engine(model, folder, extra, fault=""):
    # The worker reads FAULT_ENV when it registers its KV cache.
    return in_process_engine(model, start_env={FAULT_ENV: fault} if fault else None,
                             kv_transfer_config=connector_config(folder, **extra),
                             **args["engine"])

def gen(llm, store, prompt):
    return answer(llm, store, prompt, args["max_tokens"])

def identities(store):
    out = {}
    for s in ready(store):
        ident = model_identity(store._core, s.model_id)
        out[str(s.model_id)] = {"num_kv_heads": ident.num_kv_heads,
                                "head_size": ident.head_size,
                                "page_shape": list(ident.page_shape),
                                "revision": ident.revision}
    return out

def family(spec):
    model, folder, extra, prompt, rec = (spec["model"], spec["folder"], spec["extra"],
                                         args["prompt"], {})
    store = SnapshotStore(folder)
    with engine(model, folder, extra) as llm:
        rec["publish"] = gen(llm, store, prompt)
        settle(llm, store, 1)
    rec["published"] = [[s.id, s.n_tokens, s.model_id] for s in ready(store)]
    with engine(model, folder, extra) as llm:
        rec["restore"] = gen(llm, store, prompt)
        settle(llm, store, 1)
    with engine(model, folder, extra, fault="flip-restored") as llm:
        rec["fault"] = gen(llm, store, prompt)
        settle(llm, store, 1)
    rec["identities"] = identities(store)
    return rec

def rope(spec):
    # The same folder with another rope_theta in config.json; put back after.
    config = Path(spec["model"]) / "config.json"
    original = config.read_bytes()
    cfg = json.loads(original)
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = spec["rope_theta"]
    else:
        cfg["rope_theta"] = spec["rope_theta"]
    config.write_text(json.dumps(cfg, indent=2))
    store = SnapshotStore(spec["folder"])
    before = len(ready(store))
    try:
        with engine(spec["model"], spec["folder"], spec["extra"]) as llm:
            rec = {"answer": gen(llm, store, args["prompt"])}
            settle(llm, store, before + 1)
    finally:
        config.write_bytes(original)
    rec["snapshots"] = [[s.id, s.n_tokens, s.model_id] for s in ready(store)]
    return rec

results = {}
for spec in args["families"]:
    t0 = time.monotonic()
    try:
        results[spec["name"]] = family(spec)
    except Exception:
        results[spec["name"]] = {"error": traceback.format_exc()}
    results[spec["name"]]["seconds"] = time.monotonic() - t0
if args.get("rope"):
    try:
        results["rope"] = rope(args["rope"])
    except Exception:
        results["rope"] = {"error": traceback.format_exc()}
report(results)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if MISSING:
        pytest.skip(f"needs {', '.join(MISSING)}")
    root = tmp_path_factory.mktemp("families")
    return {name: build_model(root / name, arch=name, **cfg) for name, cfg in FAMILIES.items()}


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("families-run")
    specs = [
        {"name": name, "model": str(model), "folder": str(tmp / f"store-{name}"),
         "extra": {"revision": LLAMA_REVISION} if name == "llama" else {}}
        for name, model in models.items()
    ]
    rope = {**specs[0], "rope_theta": OTHER_ROPE_THETA}
    assert rope["name"] == "llama"
    return run_engine_script(SCRIPT, args={
        "tmp": str(tmp), "families": specs, "rope": rope, "prompt": PROMPT,
        "max_tokens": 16, "engine": ENGINE,
    }, timeout=900, env=IN_PROCESS)


def _external(rec: dict[str, Any]) -> float:
    return float(rec["metrics"].get("vllm:external_prefix_cache_hits", 0))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_restores_its_own_answer_and_a_scrambled_restore_is_caught(
    runs: dict[str, Any], name: str
) -> None:
    rec = runs[name]
    assert "error" not in rec, rec.get("error", "") + runs["_log"]
    ref, out, bad = rec["publish"], rec["restore"], rec["fault"]
    # The reference: computed from scratch, published on finish.
    assert ref["cached"] == 0 and _external(ref) == 0
    assert len(set(ref["tokens"])) > 1, "a degenerate model: the same token throughout"
    ((_, n_tokens, model_id),) = rec["published"]
    assert n_tokens == (len(PROMPT) + 15) // BLOCK_SIZE * BLOCK_SIZE == 1056
    # The head layout this family was built with is what the identity records.
    ident = rec["identities"][str(model_id)]
    assert (ident["num_kv_heads"], ident["head_size"]) == HEAD_LAYOUT[name], ident
    # A new engine restores all but the last prompt tokens (>= 90%) ...
    assert out["cached"] == len(PROMPT) - COMPUTED >= 0.9 * len(PROMPT), runs["_log"]
    assert _external(out) == out["cached"]
    assert out["metrics"]["vllm:sparkcache_hit_tokens"] == out["cached"]
    assert out["stats"]["hits"] == 1, out["stats"]
    heads, tokens, width = ident["page_shape"]  # fp32: 4 bytes each
    blocks = -(-out["cached"] // BLOCK_SIZE)
    assert out["metrics"]["vllm:sparkcache_loaded_bytes"] == blocks * 2 * heads * tokens * width * 4
    assert out["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    assert not any(k.startswith("quarantined") for k in out["stats"])
    # ... and answers as the engine that computed it.
    assert same_answer(out, ref) == ""
    # The negative control: restored from disk again, scrambled, caught.
    assert bad["cached"] == out["cached"]
    assert _external(bad) == bad["cached"]
    assert bad["stats"]["hits"] == 1
    assert same_answer(bad, ref) != ""


def test_another_rope_theta_in_config_json_never_restores(runs: dict[str, Any]) -> None:
    """Same folder, same weight files, same explicit revision; only config.json's
    rope_theta differs (K is rotated otherwise): a clean miss, not a restore."""
    rope, llama = runs["rope"], runs["llama"]
    assert "error" not in rope, rope.get("error", "") + runs["_log"]
    assert "error" not in llama, llama.get("error", "")
    out = rope["answer"]
    assert out["cached"] == 0, runs["_log"]
    assert _external(out) == 0
    assert "hits" not in out["stats"], out["stats"]
    # It is another model for the store: its snapshot lands under a new model row.
    ((_, _, llama_model),) = llama["published"]
    new = [s for s in rope["snapshots"] if s[2] != llama_model]
    assert [s[1] for s in new] == [1056], rope["snapshots"]
    # And the KV it computes differs: a restore of the first model's would be wrong.
    assert same_answer(out, llama["publish"]) != ""


def test_identity_names_config_json_with_or_without_a_revision(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """No engine: a local folder's config.json is named by the weights
    fingerprint (used without a revision) and by the config fingerprint (always
    part of the identity); a hub model's config by its revision alone."""
    folder = tmp_path / "m"
    shutil.copytree(models["llama"], folder)
    model_config = SimpleNamespace(model=str(folder), hf_config_path=None)
    weights, config = weights_fingerprint(folder), config_fingerprint(model_config)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {}),
                              "rope_theta": OTHER_ROPE_THETA}
    path.write_text(json.dumps(cfg))
    assert weights_fingerprint(folder) != weights
    assert config_fingerprint(model_config) not in ("", config)
    # A config read from elsewhere (vLLM's hf_config_path) counts as well.
    moved = SimpleNamespace(model=str(folder), hf_config_path=str(models["qwen3"]))
    assert config_fingerprint(moved) not in ("", config_fingerprint(model_config))
    assert config_fingerprint(SimpleNamespace(model="org/model", hf_config_path=None)) == ""
