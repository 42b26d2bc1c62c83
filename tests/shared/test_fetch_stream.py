"""The streamed fetch (moto's S3 server and file:// tiers): a link's layers are
written into the local segment's temp file while they download (one GET read
in pieces), each piece verified first; a piece that fails, at any position, leaves nothing (no temp
file, no pending snapshot); a real process killed at any instant of a fetch
leaves the old state or the new one.

Verification chunks and pieces are made small here (``CHUNK_BYTES`` 256,
``STREAM_BYTES`` 512) so that each layer of the tiny test model is several
pieces, as an 8B model's are at the real sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache import segment as seg
from sparkcache.backends.keys import is_temp_key
from sparkcache.shared import fetch as fetch_mod
from sparkcache.shared.layout import manifest_key, parse_manifest

from ..store.helpers import identity
from .conftest import Tier
from .test_fetch import _child_manifest, pages_equal, prompt, uploaded
from .test_upload import publish_chain

HostFactory = Callable[..., SnapshotStore]
IDENT = identity()
SMALL_CHUNK, SMALL_STREAM = 256, 512


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(seg, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(fetch_mod, "STREAM_BYTES", SMALL_STREAM)
    monkeypatch.setattr(fetch_mod, "STREAM_AHEAD", 2)
    yield


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and is_temp_key(p.name)]


def segment_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.safetensors") if p.is_file()]


def watch_pieces(store: SnapshotStore, folder: Path) -> list[int]:
    """Before each block of ``store``'s tier streams arrives, the bytes then in
    the local temp files: the real backend's reads, observed."""
    assert store.shared is not None
    backend = store.shared.backend
    real = backend.read_stream
    seen: list[int] = []

    def read_stream(key: str, start: int, end: int, piece: int) -> Iterator[bytes | bytearray]:
        for block in real(key, start, end, piece):
            seen.append(sum(p.stat().st_size for p in temp_files(folder)))
            yield block

    backend.read_stream = read_stream  # type: ignore[method-assign,assignment]
    return seen


def test_a_link_is_written_while_it_downloads(tier: Tier, host: HostFactory,
                                              tmp_path: Path) -> None:
    """Layers come in many pieces, and the local temp file grows between them:
    the download and the local write overlap (a fetch that downloaded whole
    first would find no temp file during the download)."""
    a = uploaded(host, tier)
    b = host("b", tier)
    seen = watch_pieces(b, tmp_path / "b")
    result = b.fetch(IDENT, prompt(64))
    assert (result.outcome, result.n_tokens, len(result.fetched)) == ("fetched", 64, 2)
    layer_bytes = 32 // IDENT.block_size * IDENT.page_nbytes  # each link: 32 tokens
    pieces = -(-layer_bytes * IDENT.num_layers // SMALL_STREAM)
    assert pieces >= 4 and len(seen) == 2 * pieces  # 2 links
    assert max(seen) > 0 and len(set(seen)) > 2  # written piece by piece
    assert pages_equal(a, b, prompt(64), 64)
    assert temp_files(tmp_path / "b") == []


@pytest.mark.parametrize("where", ["first", "last", "tokens"])
def test_a_piece_that_fails_leaves_nothing(tier: Tier, host: HostFactory, tmp_path: Path,
                                           where: str) -> None:
    """One byte flipped in the child's first layer piece, its last one (after
    every other piece was written to the temp file) or its token ids: the link
    is refused (a counted verified miss), its temp file removed, no row of it
    left; the root, intact, is fetched."""
    a = uploaded(host, tier)
    shared, manifest = _child_manifest(a)
    key = manifest.segments[0].key  # type: ignore[attr-defined]
    with shared.backend.open(key) as blob:
        data = bytearray(blob.buffer)
    header = seg.parse_header(memoryview(bytes(data)), manifest.segments[0].digest)  # type: ignore[attr-defined]
    offset, total = header.tensors[{"first": "layer.0", "last": f"layer.{IDENT.num_layers - 1}",
                                    "tokens": "tokens"}[where]]
    data[offset if where == "first" else offset + total - 1] ^= 0x01
    shared.put(key, [bytes(data)])
    b = host("b", tier)
    seen = watch_pieces(b, tmp_path / "b")
    result = b.fetch(IDENT, prompt(64))
    assert result.outcome == "refused" and "digest" in str(result.reason), result
    assert len(result.fetched) == 1 and b.stats()["fetch_refused"] == 1
    if where == "last":  # the bad piece came after the others were written locally
        assert max(seen) > 0
    match = b.lookup(IDENT, prompt(64))
    assert match is not None and match.n_tokens == 32
    assert pages_equal(a, b, prompt(64), 32)
    assert [s.n_tokens for s in b.snapshots()] == [32]
    assert temp_files(tmp_path / "b") == [] and len(segment_files(tmp_path / "b")) == 1
    assert b.check().clean


def test_a_rank_that_fails_takes_the_others_with_it(tier: Tier, host: HostFactory,
                                                    tmp_path: Path) -> None:
    """Two ranks: rank 0's segment is published (pending) before rank 1's last
    piece fails; the pending snapshot and rank 0's file go too."""
    ident = identity(world=2)
    a = host("a", tier)
    publish_chain(a, world=2)
    assert a.upload().error is None
    shared = a.shared
    assert shared is not None
    model, key = ident.digest(), a.snapshot(2).snap_key
    raw = shared.get(manifest_key(model, key))
    assert raw is not None
    g = parse_manifest(raw, model, key).segments[1]
    with shared.backend.open(g.key) as blob:
        data = bytearray(blob.buffer)
    header = seg.parse_header(memoryview(bytes(data)), g.digest)
    offset, total = header.tensors[f"layer.{ident.num_layers - 1}"]
    data[offset + total - 1] ^= 0x01
    shared.put(g.key, [bytes(data)])
    b = host("b", tier)
    result = b.fetch(ident, prompt(64))
    assert result.outcome == "refused" and len(result.fetched) == 1, result
    assert [(s.n_tokens, s.state) for s in b.snapshots()] == [(32, "ready")]
    assert temp_files(tmp_path / "b") == [] and len(segment_files(tmp_path / "b")) == 2
    assert b.check().clean


KILLED = """
import json, os, signal, sys
args = json.loads(sys.argv[1])
from sparkcache import SnapshotStore, segment
from sparkcache.backends import FsspecBackend
from sparkcache.shared import fetch
from tests.store.helpers import identity
from tests.shared.test_fetch import prompt
segment.CHUNK_BYTES, fetch.STREAM_BYTES, fetch.STREAM_AHEAD = 256, 512, 2
calls = [0]
def tick():
    calls[0] += 1
    if calls[0] == args["at"]:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-fetch
real_range, real_stream = FsspecBackend.read_range, FsspecBackend.read_stream
def read_range(self, key, start, end):
    tick()
    return real_range(self, key, start, end)
def read_stream(self, key, start, end, piece):
    for block in real_stream(self, key, start, end, piece):
        tick()  # in the download thread
        yield block
FsspecBackend.read_range, FsspecBackend.read_stream = read_range, read_stream
if args["at"] == 0:  # once the child's segment file is renamed into place
    from sparkcache.backends.local import LocalBackend
    real_put = LocalBackend.put
    def put(self, key, chunks, **kw):
        n = real_put(self, key, chunks, **kw)
        if calls[0] > 2 + 8:  # the child link's (after the root's reads)
            os.kill(os.getpid(), signal.SIGKILL)
        return n
    LocalBackend.put = put
store = SnapshotStore(args["folder"], shared=args["url"], shared_options=args["options"],
                      alias_stride=16)
store.fetch(identity(), prompt(64))
sys.exit(3)  # not killed: the test's kill point was never reached
"""


@pytest.mark.parametrize("at", [1, 3, 7, 12, 15, 0])
def test_a_fetch_killed_at_any_instant_is_old_or_new(tier: Tier, host: HostFactory,
                                                     tmp_path: Path, at: int) -> None:
    """A real process SIGKILLed at its ``at``-th read (a ranged GET of a header
    or token ids, a piece of layers: the root's header, its layers, the child's
    token ids, its layers) or once the child's segment is
    renamed into place before its index row is ready (0): the store then offers
    the old state or the new one, whole and verified; ``check --fix`` reclaims
    what the dead fetch left, and a fetch then completes."""
    a = uploaded(host, tier)
    folder = tmp_path / "b"
    args = {"folder": str(folder), "url": tier.url, "options": tier.options, "at": at}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", KILLED, json.dumps(args)], timeout=120,
                          capture_output=True, text=True, check=False, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == -9, done.stderr
    b = host("b", tier)
    match = b.lookup(IDENT, prompt(64))
    if match is not None:  # the old state (nothing) or a whole, verified link
        assert match.n_tokens in (32, 64)
        assert pages_equal(a, b, prompt(64), match.n_tokens)
    b.check(fix=True)
    assert temp_files(folder) == []
    assert b.check().clean
    result = b.fetch(IDENT, prompt(64))
    assert result.hit and result.n_tokens == 64, result
    assert pages_equal(a, b, prompt(64), 64)
    assert temp_files(folder) == []
    assert len(segment_files(folder)) == 2
