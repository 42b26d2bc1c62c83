"""The store-only demo: publish a conversation, restart, restore it verified, survive damage.

Run with ``python -m sparkcache.demo --store-only`` (or ``python -m
sparkcache.demo.store_only``); needs neither vLLM nor torch.  Each phase runs in a
fresh process, as a restarted server would: nothing is shared but the folder.
The "KV cache" is synthetic (a deterministic function of the token prefix, like
a real one), so every restored byte can be checked.  The main demo
(:mod:`sparkcache.demo.chat`) does the same through vLLM with a real model.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from sparkcache import CorruptSnapshot, ModelIdentity, SnapshotStore, admin

BLOCK = 32
LAYERS = 12
SYSTEM_TOKENS = 2048  # a long shared system prompt
TURN_TOKENS = 512


def demo_identity() -> ModelIdentity:
    return ModelIdentity(
        model="demo/llama-like-1b", revision="synthetic-weights-v1", num_layers=LAYERS,
        num_kv_heads=8, head_size=64, dtype="float16", kv_cache_dtype="float16",
        block_size=BLOCK, page_shape=(8, 2 * BLOCK, 64), attention_layout="cpu-paged",
    )


def conversation(turns: int) -> np.ndarray:
    rng = np.random.default_rng(42)
    return rng.integers(0, 32_000, SYSTEM_TOKENS + turns * TURN_TOKENS).astype(np.uint32)


def kv_pages(ident: ModelIdentity, toks: np.ndarray, start: int = 0) -> list[np.ndarray]:
    """Deterministic rows: block b of layer l depends on tokens[: (b+1)*BLOCK]."""
    n_blocks = len(toks) // BLOCK
    prefix = np.cumsum(toks[: n_blocks * BLOCK].astype(np.int64) * 7919) % (2**31)
    layers = []
    for layer in range(LAYERS):
        rows = np.empty((n_blocks - start // BLOCK, ident.page_nbytes), np.uint8)
        for b in range(start // BLOCK, n_blocks):
            rng = np.random.default_rng([int(prefix[(b + 1) * BLOCK - 1]), layer])
            rows[b - start // BLOCK] = rng.integers(0, 256, ident.page_nbytes, np.uint8)
        layers.append(rows)
    return layers


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def phase_publish(root: Path) -> None:
    ident = demo_identity()
    with SnapshotStore(root) as store:
        turn1 = conversation(1)
        t = time.perf_counter()
        a = store.publish(ident, 0, turn1, kv_pages(ident, turn1))
        print(f"[publish] turn 1: {a.n_tokens} tokens -> snapshot {a.snapshot_id}, "
              f"{mb(a.bytes_written)} written durably in {time.perf_counter() - t:.2f} s")
        turn2 = conversation(2)
        t = time.perf_counter()
        b = store.publish(ident, 0, turn2, kv_pages(ident, turn2, start=len(turn1)),
                          parent=a.snapshot_id)
        print(f"[publish] turn 2: {b.n_tokens} tokens -> snapshot {b.snapshot_id} extends "
              f"{a.snapshot_id}; copy-on-write wrote only the tail: {mb(b.bytes_written)} "
              f"in {time.perf_counter() - t:.2f} s")
    print(f"[publish] process {os.getpid()} exits; the store lives on in {root}")


def phase_restore(root: Path) -> None:
    ident = demo_identity()
    with SnapshotStore(root) as store:
        prompt = conversation(3)  # turn 3: everything so far plus a new message
        t = time.perf_counter()
        match = store.lookup(ident, prompt)
        looked = time.perf_counter() - t
        assert match is not None, "the stored conversation should be found"
        pages = store.read(match, 0)
        took = time.perf_counter() - t
        original = kv_pages(ident, prompt[: match.n_tokens])
        ok = all(np.array_equal(p, w) for p, w in zip(pages, original, strict=True))
        print(f"[restart] new process {os.getpid()}: prompt of {len(prompt)} tokens, "
              f"longest stored prefix {match.n_tokens} tokens (snapshot {match.snapshot_id})")
        print(f"[restart] lookup {looked * 1e3:.2f} ms; verified restore of "
              f"{mb(sum(p.nbytes for p in pages))} in {took * 1e3:.1f} ms; "
              f"bytes equal to the original KV: {ok}")
        print(f"[restart] {len(prompt) - match.n_tokens} tokens left to prefill instead of "
              f"{len(prompt)}")


def phase_damage(root: Path) -> None:
    ident = demo_identity()
    with SnapshotStore(root) as store:
        newest = max(store.snapshots(), key=lambda s: s.id)
        (segment,) = admin.show(store, newest.id).segments
        path = root / segment.object_key
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        print(f"[damage] flipped one byte in the middle of snapshot {newest.id}'s file")
        prompt = conversation(3)
        match = store.lookup(ident, prompt)
        assert match is not None
        try:
            store.read(match, 0)
            print("[damage] ERROR: the damaged file was accepted")
            sys.exit(1)
        except CorruptSnapshot as exc:
            print(f"[damage] restore refused ({exc.reason}): snapshot {match.snapshot_id} "
                  "quarantined, the request would recompute")
        match = store.lookup(ident, prompt)
        assert match is not None
        store.read(match, 0)
        print(f"[damage] next lookup falls back to snapshot {match.snapshot_id}: "
              f"{match.n_tokens} verified tokens restored")
        stats = store.stats()
        print("[stats] " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))


PHASES = {"publish": phase_publish, "restore": phase_restore, "damage": phase_damage}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparkcache.demo --store-only",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, help="store folder (default: a fresh temp folder)")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        PHASES[args.phase](args.root)
        return 0
    with tempfile.TemporaryDirectory(prefix="sparkcache-demo-") as tmp:
        root = args.root or Path(tmp) / "store"
        for phase in ("publish", "restore", "damage"):
            subprocess.run([sys.executable, "-m", "sparkcache.demo.store_only", "--phase", phase,
                            "--root", str(root)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
