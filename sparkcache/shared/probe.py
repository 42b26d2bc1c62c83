"""Probing the shared tier: which prefix of a prompt it holds, and its manifests.

The probe half of docs/shared.md's read side (:mod:`sparkcache.shared.fetch`
downloads what this finds).  :func:`probe` asks the tier which prefix of
a prompt it holds, in a bounded number of small requests and never a listing:

1. a HEAD of the alias at the first stride boundary: a snapshot holding the
   prompt's first ``p`` tokens marked every stride boundary up to ``p``, so
   the matched ones are a prefix of them, and when the first is not marked
   the tier holds nothing of the prompt past it (one HEAD: the common miss);
2. a HEAD of the alias at the prompt's last whole block (a snapshot of this
   very prompt, answered before on another host, marked it: its save's
   breakpoint at the prompt's end);
3. otherwise a binary search over the other stride boundaries, one HEAD of a
   alias each, then a HEAD of the aliases at the request's own breakpoints
   above the best stride (at most :data:`MAX_BREAKPOINT_PROBES`).

:func:`resolve` then GETs the best alias, the manifest it names and its
parents' manifests (root first), parsing each strictly; an alias whose
manifest is missing (an upload that died before its manifest, a snapshot the
tier's sweep deleted meanwhile) or that does not agree is skipped for the next
shorter stride (at most :data:`MAX_FALLBACKS`).

A model whose layers keep a window (sliding-window attention: the identity's
``ends_only``) is asked differently: its snapshots store each window only
at their end and have no parent, so only a snapshot that ends inside the
prompt, at a block boundary, restores it.  :func:`probe_ends` lists the
prompt's last whole block and its breakpoints, longest first, and
:func:`resolve_end` asks for the manifest of the snapshot ending exactly
there (its key is the prompt's prefix hash there): one HEAD each while there
is none.  Between the last whole block and the breakpoints,
:func:`marked_end` reads the prompt's best stride alias: when the snapshot
it names ends inside the prompt (a new turn of a stored conversation), that
end is asked for too.  A miss costs two HEADs (the last block's manifest, the
first stride's alias) plus one per breakpoint probed.  A manifest with a
parent, or of another length, is refused.

Every request here is a HEAD or a small GET, counted by :class:`CountedTier`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from sparkcache.errors import InvalidArgument
from sparkcache.shared.layout import Manifest, alias_key, manifest_key, parse_alias, parse_manifest
from sparkcache.shared.tier import SharedTier

__all__ = [
    "MAX_BREAKPOINT_PROBES",
    "MAX_CHAIN_LINKS",
    "MAX_FALLBACKS",
    "CountedTier",
    "RemotePrefix",
    "marked_end",
    "probe",
    "probe_ends",
    "resolve",
    "resolve_end",
]

#: Breakpoints of a request probed above its best stride, at most.
MAX_BREAKPOINT_PROBES = 4
#: Shorter strides tried when the best alias dangles or disagrees.
MAX_FALLBACKS = 2
#: Manifests followed from a snapshot to its root, at most (a tier's chains are
#: its hosts' chains, which compaction bounds far below this).
MAX_CHAIN_LINKS = 64


@dataclass(frozen=True)
class RemotePrefix:
    """An alias found for the prompt: the tier holds its first ``n_tokens``
    tokens (prefix hash ``prefix``) in snapshot ``snap_key``'s chain."""

    n_tokens: int
    prefix: str
    snap_key: str = ""


class CountedTier:
    """The tier's HEAD and GET, counted."""

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier
        self.requests = 0
        self._lock = threading.Lock()

    def has(self, key: str) -> bool:
        with self._lock:
            self.requests += 1
        return self.tier.exists(key)

    def get(self, key: str) -> bytes | None:
        raw = self.tier.get(key)
        with self._lock:  # a HEAD (its size), and the GET when there is an object
            self.requests += 1 if raw is None else 2
        return raw


def probe(tier: SharedTier | CountedTier, model: str, hashes: Sequence[bytes], block_size: int,
          breakpoints: Sequence[int] = (), *, whole: bool = True) -> list[RemotePrefix]:
    """The aliases the tier has for the prompt whose block hashes are ``hashes``,
    best (longest) first, then up to :data:`MAX_FALLBACKS` shorter strides to
    try when the best does not resolve; empty when it holds no prefix.
    ``breakpoints`` are the request's (token counts).  Requests: one HEAD
    when the tier holds nothing of the prompt, two for a prompt it holds
    whole, at most ``2 + log2(len(hashes) * block_size / stride)``, and at
    most :data:`MAX_BREAKPOINT_PROBES` more.  ``whole=False``: the alias of
    the prompt's last block is not asked for (strides and breakpoints only)."""
    heads = tier if isinstance(tier, CountedTier) else CountedTier(tier)
    n_blocks = len(hashes)
    if n_blocks == 0:
        return []

    def marked(i: int) -> bool:
        return heads.has(alias_key(model, hashes[i].hex()))

    def at(i: int) -> RemotePrefix:
        return RemotePrefix((i + 1) * block_size, hashes[i].hex())

    stride = max(1, heads.tier.alias_stride // block_size)
    strides = list(range(stride - 1, n_blocks, stride))
    last = n_blocks - 1
    # Matched strides are a prefix of them: when the first is not marked, none
    # is, and neither is the prompt's end (a snapshot holding it holds the first
    # stride): a prompt the tier holds nothing of costs one HEAD.
    first = bool(strides) and marked(strides[0])
    best: RemotePrefix | None
    if whole and (first or not strides) and (last + 1) % stride and marked(last):
        best, matched = at(last), len(strides)  # the whole prompt: strides are fallbacks
    else:
        lo, hi = (1, len(strides)) if first else (0, 0)
        while lo < hi:  # bisect the rest
            mid = (lo + hi) // 2
            if marked(strides[mid]):
                lo = mid + 1
            else:
                hi = mid
        matched = lo
        top = strides[matched - 1] if matched else -1
        # (none above an unmarked first stride can be marked)
        end = n_blocks if first or not strides else strides[0]
        marks = sorted({b // block_size - 1 for b in breakpoints
                        if top < b // block_size - 1 < end}, reverse=True)
        best = next((at(i) for i in marks[:MAX_BREAKPOINT_PROBES] if marked(i)), None)
        if best is None and matched:
            best, matched = at(top), matched - 1
    if best is None:
        return []
    # Fallbacks: the strides below the best, unprobed (a dangling alias is rare).
    below = [at(strides[k]) for k in range(matched - 1, -1, -1)
             if (strides[k] + 1) * block_size < best.n_tokens]
    return [best, *below[:MAX_FALLBACKS]]


def probe_ends(hashes: Sequence[bytes], block_size: int, breakpoints: Sequence[int] = (),
               ) -> list[RemotePrefix]:
    """For a model whose layers keep a window: where a snapshot of the tier
    could restore the prompt whose block hashes are ``hashes``, longest first:
    the prompt's last whole block, then its breakpoints (rounded down to a
    block, at most :data:`MAX_BREAKPOINT_PROBES`).  A windowed snapshot stores
    its window only at its end, so it restores only a prompt that it ends
    inside, exactly at a block boundary, and its key is the prompt's prefix
    hash there: :func:`resolve_end` asks for that manifest (one HEAD when
    there is none).  No request is made here."""
    n_blocks = len(hashes)
    if n_blocks == 0:
        return []
    ends = sorted({b // block_size for b in breakpoints if 0 < b // block_size < n_blocks},
                  reverse=True)
    return [RemotePrefix(n * block_size, hashes[n - 1].hex(), hashes[n - 1].hex())
            for n in [n_blocks, *ends[:MAX_BREAKPOINT_PROBES]]]


def marked_end(tier: SharedTier | CountedTier, model: str, hashes: Sequence[bytes],
               block_size: int) -> RemotePrefix | None:
    """For a model whose layers keep a window: the end of the snapshot that the
    prompt's best stride alias names (:func:`probe`, then a GET of that
    alias), when the prompt holds that snapshot whole - its key is the
    prompt's prefix hash at its end - for :func:`resolve_end`; None when the
    tier marks no stride of the prompt or its snapshot goes elsewhere (a
    alias names the first snapshot uploaded through it).  Raises
    InvalidArgument for an alias that is not what it claims to be."""
    gets = tier if isinstance(tier, CountedTier) else CountedTier(tier)
    # (An alias at the prompt's last block names a snapshot going on past it.)
    found = probe(gets, model, hashes, block_size, whole=False)
    if not found:
        return None
    raw = gets.get(alias_key(model, found[0].prefix))
    if raw is None:
        return None
    alias = parse_alias(raw, found[0].prefix)
    n = alias.snapshot_tokens // block_size
    if alias.snapshot_tokens % block_size or not 0 < n <= len(hashes) or \
            hashes[n - 1].hex() != alias.snapshot:
        return None
    return RemotePrefix(n * block_size, alias.snapshot, alias.snapshot)


def resolve_end(tier: SharedTier | CountedTier, model: str, found: RemotePrefix,
                ) -> tuple[RemotePrefix, list[Manifest]] | None:
    """The manifest of the snapshot that ends at ``found`` (from
    :func:`probe_ends`): one HEAD when the tier has none (None), else a HEAD
    and a GET.  Raises InvalidArgument when it is there but is not a whole
    snapshot of ``found.n_tokens`` tokens: a windowed snapshot never has a
    parent (its full-attention layers are stored whole)."""
    gets = tier if isinstance(tier, CountedTier) else CountedTier(tier)
    raw = gets.get(manifest_key(model, found.snap_key))
    if raw is None:
        return None
    m = parse_manifest(raw, model, found.snap_key)
    if m.parent is not None or m.start_token != 0:
        raise InvalidArgument(f"manifest {m.snap_key} has a parent: a model whose layers "
                              "keep a window is restored from whole snapshots only")
    if m.n_tokens != found.n_tokens:
        raise InvalidArgument(f"manifest {m.snap_key} says {m.n_tokens} tokens where the "
                              f"prompt has that hash at {found.n_tokens}")
    return found, [m]


def resolve(tier: SharedTier | CountedTier, model: str, found: RemotePrefix,
            ) -> tuple[RemotePrefix, list[Manifest]] | None:
    """The alias ``found`` and its snapshot's chain of manifests, root first,
    each parsed strictly and consistent with the next; None when the alias or
    a manifest is missing (a dangling alias: an upload that died before its
    manifest, or a deletion).  Raises InvalidArgument when an object is there
    but is not what it claims to be."""
    gets = tier if isinstance(tier, CountedTier) else CountedTier(tier)
    raw = gets.get(alias_key(model, found.prefix))
    if raw is None:
        return None
    alias = parse_alias(raw, found.prefix)
    if alias.n_tokens != found.n_tokens:
        raise InvalidArgument(f"alias {found.prefix} says {alias.n_tokens} tokens where the "
                              f"prompt has that hash at {found.n_tokens}")
    chain: list[Manifest] = []
    key: str | None = alias.snapshot
    while key is not None:
        if len(chain) >= MAX_CHAIN_LINKS:
            raise InvalidArgument(f"snapshot {alias.snapshot}'s chain in the tier is longer "
                                  f"than {MAX_CHAIN_LINKS} links")
        raw = gets.get(manifest_key(model, key))
        if raw is None:
            return None
        m = parse_manifest(raw, model, key)
        if chain:
            child = chain[-1]
            if (m.n_tokens != child.start_token or m.scope != child.scope
                    or m.world_size != child.world_size):
                raise InvalidArgument(f"manifest {key} is not the parent manifest "
                                      f"{child.snap_key} names")
        elif m.n_tokens != alias.snapshot_tokens or m.n_tokens < alias.n_tokens:
            raise InvalidArgument(f"alias {found.prefix} names {alias.snapshot_tokens} "
                                  f"tokens of snapshot {key}, whose manifest has {m.n_tokens}")
        chain.append(m)
        key = m.parent
    chain.reverse()
    return RemotePrefix(alias.n_tokens, alias.prefix, alias.snapshot), chain
