"""KV caches in bfloat16, float16 and fp8 (e4m3, e5m2) on real vLLM: saved and restored
bit-exactly, and never offered to an engine of another KV dtype.

One script process runs every engine in turn on one store, over the tests'
tiny Llama (head size 32, 2 KV heads), in-process like test_model_families.py
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``; each engine a new engine core, worker,
zeroed KV cache and connector):

* an fp32 engine publishes :data:`PROMPT`;
* per KV dtype (:data:`DTYPES`), a *plain* engine (no connector) answers
  :data:`PROMPT`: what vLLM alone answers, and the check that vLLM itself is
  deterministic here (two fresh engines, one answer);
* a *publish* engine answers :data:`PROMPT` from
  scratch: it must miss, though the store holds the prompt in every dtype
  before it (fp8 comes after bf16: the same model dtype, another KV dtype;
  fp8_e5m2 after fp8: the same element size).
  Its snapshot's pages are read from the store (verified) as the reference;
* a new *restore* engine of that dtype answers :data:`PROMPT`: restored (all
  but the last :data:`COMPUTED` prompt tokens), with the publishing engine's
  greedy tokens.  Then
  the reference snapshot is deleted from the index and the engine answers
  :data:`PROMPT` + its answer + :data:`MORE`: vLLM's own prefix cache serves the
  blocks the restore wrote, the rest is computed, and the connector publishes
  the whole request anew - its first blocks are the bytes the restore put in
  the engine's KV cache, read back through the connector's save path.  They
  must equal the reference byte for byte.

A page's internal layout depends on the CPU (vLLM's AMX kernels pack K in
16-token groups and V in token pairs; its vector kernels store K transposed,
V by token: docs/connector-notes.md), so the tests assume none: which bytes of
a page belong to which token slot is read from vLLM's own KV writer
(:data:`PROBE`), and the identity names the kernel family.

If vLLM refuses a dtype on this machine (fp16 on a CPU platform without it; an
fp8 KV cache needs x86 with AVX-512 or AMX on CPU), its tests skip with
vLLM's message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CHUNK
from tiny_model import BLOCK_SIZE, COMPUTED, NEEDS_VLLM, run_engine_script, token_prompt

pytestmark = NEEDS_VLLM

#: The KV dtypes under test: engine arguments, and the identity they must give
#: (kv_cache_dtype as sparkcache names it, vLLM's cache_dtype).
DTYPES: dict[str, dict[str, Any]] = {
    "bf16": {"engine": {"dtype": "bfloat16"}, "kv": "BF16", "cache_dtype": "auto"},
    "fp16": {"engine": {"dtype": "float16"}, "kv": "F16", "cache_dtype": "auto"},
    "fp8": {"engine": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}, "kv": "U8",
            "cache_dtype": "fp8"},
    # The same bytes per element as e4m3 (both uint8 to vLLM): only vLLM's
    # cache_dtype in the identity keeps the two apart.
    "fp8_e5m2": {"engine": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"}, "kv": "U8",
                 "cache_dtype": "fp8_e5m2"},
}
PROMPT = token_prompt(500, seed=70)
#: Appended to PROMPT + its answer: a request whose snapshot holds the restored blocks.
MORE = token_prompt(40, seed=71)
#: The reference snapshot: PROMPT + 15 computed answer tokens, whole blocks.
STORED = (len(PROMPT) + 15) // BLOCK_SIZE * BLOCK_SIZE  # 512
#: Restored: all but the last COMPUTED prompt tokens (the stored block holding
#: the prompt's end too).
RESTORED = len(PROMPT) - COMPUTED
#: Greedy tokens must be equal to the publishing engine's.  Logprobs of a
#: restored answer agree with those of plain vLLM computing the same last
#: COMPUTED prompt tokens in a step of their own to this; with the publishing
#: engine's (which computed them in a chunk of 116) to this plus how far
#: vLLM's own two answers are apart (in 16-bit dtypes a chunk's shape moves
#: the last digits).
LOGPROB_TOL_16 = 0.05
ENGINE = {**CHUNK, "num_gpu_blocks_override": 96, "distributed_executor_backend": "uni"}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

SCRIPT = """
import os, traceback
import numpy as np
from tiny_model import answer, connector_config, in_process_engine, ready_snapshots
from tiny_model import settle as settle_store
from sparkcache import SnapshotStore
from sparkcache.catalog import model_identity

folder = args["folder"]
store = SnapshotStore(folder)

def engine(**kwargs):
    return in_process_engine(args["model"], kv_transfer_config=connector_config(folder),
                             **args["engine"], **kwargs)

def gen(llm, prompt):
    return answer(llm, store, prompt, args["max_tokens"])

def ready():
    return ready_snapshots(store)

def settle(llm, n):
    settle_store(llm, store, n)

def pages(snap, tokens, name):
    # The snapshot's first STORED tokens, verified, as [layer, block, bytes].
    ident = model_identity(store._core, snap.model_id)
    match = store.lookup(ident, tokens)
    assert match is not None and match.snapshot_id == snap.id, (match, snap)
    layers = store.read(match, 0, n_tokens=args["stored"])
    np.save(os.path.join(args["tmp"], name), np.stack(layers))
    extra = dict(ident.extra)
    return {"dtype": ident.dtype, "kv_cache_dtype": ident.kv_cache_dtype,
            "cache_dtype": extra["cache_dtype"], "page_shape": list(ident.page_shape),
            "page_nbytes": ident.page_nbytes, "model_id": snap.model_id,
            "cpu_attn": extra.get("cpu_attn"), "vllm_isa": vllm_isa(ident)}

def vllm_isa(ident):
    # The kernel family vLLM's CPU backend picks for this configuration.
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[ident.dtype]
    return _get_attn_isa(dtype, ident.block_size, ident.head_size,
                         dict(ident.extra)["cache_dtype"])

def slot_owner(info):
    # Which token slot each byte of a page belongs to, read from vLLM's own
    # KV writer (the engine's kernel family and KV dtype): every slot written
    # with 4/3, then one slot with 10/3 (every byte of the two differs, in each
    # of these dtypes); the bytes that changed are that slot's.  Asserts that
    # each byte belongs to exactly one slot.
    import torch
    from vllm import _custom_ops as ops
    torch.cpu._is_amx_tile_supported()  # (lets this process use AMX tiles)
    heads, bs, width = info["page_shape"]
    model_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[
        info["dtype"]]
    kvd = info["cache_dtype"]
    cache_dtype = torch.uint8 if kvd.startswith("fp8") else model_dtype
    def page(other=None):
        cache = torch.zeros(1, heads, bs, width, dtype=cache_dtype)
        kc, vc = cache.view(1, heads, 2 * bs, width // 2).chunk(2, dim=2)
        for slot in range(bs):
            kv = torch.full((1, heads, width // 2), 10 / 3 if slot == other else 4 / 3,
                            dtype=model_dtype)
            ops.cpu_attn_reshape_and_cache(kv, kv, kc, vc, torch.tensor([slot]),
                                           info["cpu_attn"], 1.0, 1.0, kvd)
        return cache.view(torch.uint8).numpy().reshape(-1).copy()
    base = page()
    owner = np.full(base.size, -1)
    for slot in range(bs):
        changed = page(slot) != base
        assert (owner[changed] == -1).all(), f"slot {slot} shares bytes with another slot"
        owner[changed] = slot
    assert (owner >= 0).all(), f"{(owner < 0).sum()} bytes of the page belong to no slot"
    return owner

prompt = args["prompt"]
results = {}
with engine(dtype="float32") as llm:
    results["fp32"] = gen(llm, prompt)
    settle(llm, 1)
for name, spec in args["dtypes"].items():
    rec = results[name] = {"before": [[s.id, s.n_tokens, s.model_id] for s in ready()]}
    try:
        with in_process_engine(args["model"], **args["engine"], **spec["engine"]) as llm:
            rec["plain"] = gen(llm, prompt)  # vLLM alone, no connector
        split = {**args["engine"], **spec["engine"],
                 "max_num_batched_tokens": len(prompt) - args["computed"]}
        with in_process_engine(args["model"], **split) as llm:
            rec["plain_split"] = gen(llm, prompt)  # ... computing the last tokens apart
        with engine(**spec["engine"]) as llm:
            rec["publish"] = gen(llm, prompt)
            settle(llm, len(rec["before"]) + 1)
    except Exception:
        rec["refused"] = traceback.format_exc()
        continue
    try:
        ref = ready()[-1]
        rec["reference"] = [ref.id, ref.n_tokens, ref.parent_id]
        rec["identity"] = pages(ref, prompt + rec["publish"]["tokens"], name + "-published.npy")
        np.save(os.path.join(args["tmp"], name + "-owner.npy"), slot_owner(rec["identity"]))
        with engine(**spec["engine"]) as llm:
            rec["restore"] = gen(llm, prompt)
            settle(llm, len(ready()))
            rec["deleted"] = store.delete(ref.id, force=True)
            longer = prompt + rec["restore"]["tokens"] + args["more"]
            rec["republish"] = gen(llm, longer)
            settle(llm, len(rec["before"]) + 1)
        new = ready()[-1]
        rec["republished"] = [new.id, new.n_tokens, new.parent_id]
        pages(new, longer, name + "-restored.npy")
    except Exception:
        rec["error"] = traceback.format_exc()
# A bf16 engine whose vLLM picks another CPU kernel family (as on a CPU of the
# other kind: "vec" where this one has AMX, else "vec16", both of which run on
# any x86), over a store holding bf16 snapshots of its prompt: a clean miss.
bf16 = results.get("bf16", {})
if "identity" in bf16 and "error" not in bf16:
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    mine = bf16["identity"]["cpu_attn"]
    other = results["other_family"] = {"family": "vec" if mine == "amx" else "vec16",
                                       "models": sorted({s.model_id for s in ready()})}
    chooser = cpu_attn._get_attn_isa
    cpu_attn._get_attn_isa = lambda *a, **k: other["family"]
    try:
        with engine(**args["dtypes"]["bf16"]["engine"]) as llm:
            other["out"] = gen(llm, prompt)
            settle(llm, len(ready()) + 1)
        snap = ready()[-1]
        other["model_id"] = snap.model_id
        other["cpu_attn"] = dict(model_identity(store._core, snap.model_id).extra)["cpu_attn"]
    except Exception:
        other["error"] = traceback.format_exc()
    finally:
        cpu_attn._get_attn_isa = chooser
report(results)
"""


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("kv-dtypes")
    result = run_engine_script(SCRIPT, args={
        "tmp": str(tmp), "model": str(tiny_model_dir), "folder": str(tmp / "store"),
        "prompt": PROMPT, "more": MORE, "stored": STORED, "max_tokens": 16,
        "computed": COMPUTED,
        "engine": ENGINE, "dtypes": {name: {"engine": d["engine"]} for name, d in DTYPES.items()},
    }, timeout=600, env=IN_PROCESS)
    result["tmp"] = tmp
    return result


def _run(runs: dict[str, Any], name: str) -> dict[str, Any]:
    rec: dict[str, Any] = runs[name]
    if "refused" in rec:
        # vLLM's own reason, from the engine's exception or its log.
        lines = [ln for ln in (rec["refused"] + runs["_log"]).splitlines()
                 if "Error" in ln or "not support" in ln or "requires" in ln]
        pytest.skip(f"vLLM refuses {name} here: " + " | ".join(lines[-3:]))
    assert "error" not in rec, rec["error"] + runs["_log"]
    return rec


def _worst(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest logprob difference of two answers."""
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def _external(out: dict[str, Any]) -> float:
    return float(out["metrics"].get("vllm:external_prefix_cache_hits", 0))


@pytest.mark.parametrize("name", list(DTYPES))
def test_kv_pages_restore_bit_exactly(runs: dict[str, Any], name: str) -> None:
    rec = _run(runs, name)
    ref, out, again = rec["publish"], rec["restore"], rec["republish"]
    ident = rec["identity"]
    assert (ident["kv_cache_dtype"], ident["cache_dtype"]) == \
        (DTYPES[name]["kv"], DTYPES[name]["cache_dtype"]), ident
    # The identity names the page format vLLM's CPU backend writes here.
    assert ident["cpu_attn"] == ident["vllm_isa"], ident
    assert len(set(ref["tokens"])) > 1 and all(np.isfinite(ref["logprobs"]))
    # vLLM itself: two fresh engines (one without the connector) answer alike,
    # else no restore can be judged by its answer on this machine.
    if rec["plain"]["tokens"] != ref["tokens"]:
        pytest.fail(f"vLLM is not deterministic here ({name} KV cache): two fresh engines "
                    f"answered {rec['plain']['tokens']} and {ref['tokens']}")
    assert rec["reference"][1:] == [STORED, None]
    # A new engine restores all but the last prompt token, from disk ...
    assert out["cached"] == RESTORED and _external(out) == RESTORED, runs["_log"]
    assert out["stats"].get("hits") == 1
    blocks = -(-RESTORED // BLOCK_SIZE)
    assert out["metrics"]["vllm:sparkcache_loaded_bytes"] == blocks * 2 * ident["page_nbytes"]
    assert out["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    # ... and answers with the publishing engine's greedy tokens, its logprobs
    # as vLLM's own when it computes the same last tokens apart.
    assert out["tokens"] == ref["tokens"]
    split = rec["plain_split"]
    vllm_apart = _worst(split, ref)
    assert _worst(out, split) <= LOGPROB_TOL_16, (out["logprobs"], split["logprobs"])
    assert _worst(out, ref) <= LOGPROB_TOL_16 + vllm_apart, (out["logprobs"], ref["logprobs"])
    # The longer request: the restored blocks from vLLM's prefix cache, nothing
    # from disk (the reference is deleted), all of it published anew.
    assert rec["deleted"] == [rec["reference"][0]]
    assert again["cached"] >= STORED and _external(again) == 0
    assert rec["republished"][1] > STORED and rec["republished"][2] is None
    published = np.load(runs["tmp"] / f"{name}-published.npy")
    restored = np.load(runs["tmp"] / f"{name}-restored.npy")
    layers, blocks = 2, STORED // BLOCK_SIZE
    assert published.shape == restored.shape == (layers, blocks, ident["page_nbytes"])
    assert published.any()
    # Whole blocks below the prompt's last token: exactly what the restore wrote.
    whole = RESTORED // BLOCK_SIZE
    assert np.array_equal(published[:, :whole], restored[:, :whole])
    # The block holding the prompt's end: the bytes of its restored token slots
    # too, wherever the page's layout puts them (read from vLLM's writer);
    # vLLM computed the slots from RESTORED on.
    owner = np.load(runs["tmp"] / f"{name}-owner.npy")
    tail = RESTORED - whole * BLOCK_SIZE
    mine = owner < tail
    assert mine.sum() == tail * ident["page_nbytes"] // BLOCK_SIZE  # each slot its share
    assert np.array_equal(published[:, whole][:, mine], restored[:, whole][:, mine])


@pytest.mark.parametrize("name", list(DTYPES))
def test_a_snapshot_in_one_kv_dtype_is_never_offered_to_another(
    runs: dict[str, Any], name: str
) -> None:
    """The publish engine of each dtype finds the prompt stored in every dtype
    before it (fp32 first; fp8 after bf16, its model dtype) and restores none."""
    rec = _run(runs, name)
    assert runs["fp32"]["cached"] == 0
    others = {m for _, _, m in rec["before"]}
    earlier = [d for d in list(DTYPES)[:list(DTYPES).index(name)] if "refused" not in runs[d]]
    assert len(others) == 1 + len(earlier), rec["before"]  # fp32 and each earlier dtype
    assert rec["identity"]["model_id"] not in others
    out = rec["publish"]
    assert out["cached"] == 0 and _external(out) == 0, runs["_log"]
    assert "hits" not in out["stats"], out["stats"]
    assert out["metrics"].get("vllm:sparkcache_lookups", 0) >= 1


def test_a_snapshot_of_another_cpu_kernel_family_is_never_offered(runs: dict[str, Any]) -> None:
    """A bf16 engine whose vLLM lays pages out with another kernel family (as
    one on the other kind of CPU would) finds the bf16 snapshots of its prompt
    under another identity: nothing restored, its own snapshot published."""
    if "other_family" not in runs:
        _run(runs, "bf16")  # skips with vLLM's reason when it refuses bf16
    rec = runs["other_family"]
    assert "error" not in rec, rec.get("error", "") + runs["_log"]
    assert rec["cpu_attn"] == rec["family"] != runs["bf16"]["identity"]["cpu_attn"]
    assert rec["model_id"] not in rec["models"]
    out = rec["out"]
    assert out["cached"] == 0 and _external(out) == 0, runs["_log"]
    assert "hits" not in out["stats"], out["stats"]
