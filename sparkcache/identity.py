"""What makes two KV caches interchangeable.

An identity has three parts (see docs/architecture.md):

* :class:`ModelIdentity` - the model part: weights, KV layout, topology and the
  storage schema.  It names one model folder on disk and one row in the index,
  and is the unit of retention.  Split in two by :meth:`ModelIdentity.kv_digest`
  (what the KV *is*: model, weights, dtype, one head's page, the KV heads in
  all) and :meth:`ModelIdentity.sharding` (how it is *sharded*: TP/PP/DCP
  sizes, which heads a rank holds); its :meth:`~ModelIdentity.digest` names
  both, as it always did, so stores written before the split read the same.
* the *rank* - which segment of a snapshot a worker owns.  It is passed next to
  the identity, never folded into the prefix hashes, so that every rank computes
  the same hashes.
* :class:`RequestScope` - cache salt, LoRA and multimodal hashes.  It partitions
  prefixes inside one model without new folders (it seeds the prefix hashes).

Digests are xxh3_128 over canonical JSON, so they are equal across processes,
machines and Python versions (no ``hash()``, no PYTHONHASHSEED).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from sparkcache.errors import InvalidArgument
from sparkcache.sharding import Sharding

__all__ = [
    "MLA_KEY",
    "STORAGE_SCHEMA_VERSION",
    "WINDOW_BLOCKS_KEY",
    "ModelIdentity",
    "RequestScope",
    "canonical_json",
    "normalize_dtype",
]

#: Bumped whenever the bytes a segment holds change meaning.  Part of every
#: identity, so entries written by another version miss cleanly.
STORAGE_SCHEMA_VERSION = 1

#: The ``extra`` key naming, per layer (in layer order), how many blocks ending
#: at a segment's end that layer stores: ``"2,0,2,0"`` (0: every block).  Set
#: for models with sliding-window layers, which need only their window.
WINDOW_BLOCKS_KEY = "window_blocks"

# Storage dtype names are the safetensors ones; engine spellings map onto them.
_DTYPE_ALIASES: dict[str, str] = {
    "float64": "F64", "double": "F64", "fp64": "F64", "f64": "F64",
    "float32": "F32", "float": "F32", "fp32": "F32", "f32": "F32",
    "float16": "F16", "half": "F16", "fp16": "F16", "f16": "F16",
    "bfloat16": "BF16", "bf16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "fp8_e4m3": "F8_E4M3", "fp8": "F8_E4M3", "f8_e4m3": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "fp8_e5m2": "F8_E5M2", "f8_e5m2": "F8_E5M2",
    "int64": "I64", "i64": "I64", "int32": "I32", "i32": "I32",
    "int16": "I16", "i16": "I16", "int8": "I8", "i8": "I8",
    "uint8": "U8", "u8": "U8", "bool": "BOOL",
}

#: The ``extra`` key set (to anything) when the KV is MLA's one latent per
#: token, replicated on every rank rather than split by heads.
MLA_KEY = "mla"

#: Bytes per element of every storage dtype.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}


def normalize_dtype(name: str) -> str:
    """Map an engine dtype spelling (``torch.bfloat16``, ``fp8``, ``F16``) to a storage name."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"dtype must be a non-empty string, got {name!r}")
    key = name.strip()
    if key.upper() in DTYPE_SIZES:
        return key.upper()
    key = key.lower().removeprefix("torch.").removeprefix("numpy.")
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    raise InvalidArgument(
        f"unknown dtype {name!r}; use one of {sorted(DTYPE_SIZES)} or an engine spelling "
        "such as 'float16', 'bfloat16', 'fp8_e4m3'"
    )


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the same text on every machine."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelIdentity:
    """The model part of a KV-cache identity.

    Anything that changes the bytes of a KV row must be a field here; two
    identities with any field different never share a snapshot.

    ``page_shape`` is the shape of one block of one layer as this rank's engine
    lays it out (e.g. ``(kv_heads, 2 * block_size, head_size)`` on vLLM's CPU
    backend); ``attention_layout`` is a free-form tag naming that layout.  The
    store never interprets pages: it checks that their byte size is
    ``prod(page_shape) * itemsize(kv_cache_dtype)``.
    """

    model: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_cache_dtype: str
    block_size: int
    page_shape: tuple[int, ...]
    attention_layout: str = "paged"
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    schema_version: int = STORAGE_SCHEMA_VERSION
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model or len(self.model) > 4096:
            raise InvalidArgument("model must be a non-empty string of at most 4096 characters")
        if "\x00" in self.model:
            raise InvalidArgument("model name must not contain NUL characters")
        if not isinstance(self.revision, str):
            raise InvalidArgument("revision must be a string (a commit, tag or weights digest)")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size",
                     "tp_size", "pp_size", "dcp_size", "schema_version"):
            _check_positive(name, getattr(self, name))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "kv_cache_dtype", normalize_dtype(self.kv_cache_dtype))
        shape = tuple(self.page_shape)
        if not shape:
            raise InvalidArgument("page_shape must have at least one dimension")
        for dim in shape:
            _check_positive("page_shape dimension", dim)
        object.__setattr__(self, "page_shape", shape)
        try:
            extra = tuple(sorted((str(k), str(v)) for k, v in self.extra))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"extra must be (name, value) pairs, got {self.extra!r}") from exc
        object.__setattr__(self, "extra", extra)
        windows = self.window_blocks
        if windows and len(windows) != self.num_layers:
            raise InvalidArgument(f"extra {WINDOW_BLOCKS_KEY} names {len(windows)} layers; "
                                  f"the identity has num_layers={self.num_layers}")

    @functools.cached_property
    def window_blocks(self) -> tuple[int, ...]:
        """Per layer, the blocks a segment keeps below its end (0: all of them);
        ``()`` when every layer keeps every block (``extra[WINDOW_BLOCKS_KEY]``)."""
        text = dict(self.extra).get(WINDOW_BLOCKS_KEY)
        if not text:
            return ()
        try:
            windows = tuple(int(v) for v in text.split(","))
        except ValueError as exc:
            raise InvalidArgument(f"extra {WINDOW_BLOCKS_KEY} must be comma-separated "
                                  f"block counts, got {text!r}") from exc
        if any(w < 0 for w in windows):
            raise InvalidArgument(f"extra {WINDOW_BLOCKS_KEY} has a negative count: {text!r}")
        return windows

    @property
    def ends_only(self) -> bool:
        """Some layer keeps only a window: a snapshot restores only at its end,
        where its window is stored (lookups and fetches ask for ends only)."""
        return any(self.window_blocks)

    def first_stored_block(self, layer: int, start_block: int, end_block: int) -> int:
        """The first block that ``layer`` stores of a segment holding blocks
        ``[start_block, end_block)``: ``start_block`` unless the layer keeps only
        a window of blocks ending at ``end_block``."""
        windows = self.window_blocks
        keep = windows[layer] if windows else 0
        return start_block if keep == 0 else max(start_block, end_block - keep)

    @property
    def world_size(self) -> int:
        """How many ranks hold a segment of every snapshot."""
        return self.tp_size * self.pp_size * self.dcp_size

    @property
    def page_nbytes(self) -> int:
        """Bytes of one block of one layer."""
        n = DTYPE_SIZES[self.kv_cache_dtype]
        for dim in self.page_shape:
            n *= dim
        return n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["page_shape"] = list(self.page_shape)
        d["extra"] = [list(kv) for kv in self.extra]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelIdentity:
        try:
            args = dict(d)
            args["page_shape"] = tuple(args["page_shape"])
            args["extra"] = tuple(tuple(kv) for kv in args.get("extra", ()))
            return cls(**args)
        except InvalidArgument:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"not a model identity: {exc!r}") from exc

    def canonical(self) -> str:
        return canonical_json(self.to_dict())

    def digest(self) -> str:
        """32 hex characters naming this model part everywhere (folder, index row)."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        # Computed once: every restore checks each segment's identity against it.
        return xxhash.xxh3_128_hexdigest(b"sparkcache-model\x00" + self.canonical().encode())

    def sharding(self, total_kv_heads: int) -> Sharding:
        """How this identity's KV is split over its ranks, given the model's KV
        heads in all (``num_kv_heads`` is one rank's: a rank's page holds its
        heads, ``page_shape[0]``).  InvalidArgument when the rank's heads are not
        the ones a contiguous split of ``total_kv_heads`` over ``tp_size`` gives."""
        sharding = Sharding(total_kv_heads, self.tp_size, self.pp_size, self.dcp_size,
                            mla=MLA_KEY in dict(self.extra))
        if not sharding.splits or sharding.local_heads != self.num_kv_heads:
            raise InvalidArgument(
                f"{self.num_kv_heads} KV heads per rank are not a tp={self.tp_size} split "
                f"of {total_kv_heads} KV heads")
        return sharding

    def kv_digest(self, total_kv_heads: int) -> str | None:
        """32 hex characters naming what the KV *is*, whatever its sharding: two
        identities with the same kv digest hold the same heads' bytes in the
        same page layout, split differently (:mod:`sparkcache.sharding`).  None
        when the pages do not have the rank's heads as their outer dimension
        (``page_shape[0] == num_kv_heads``): such a snapshot serves only its
        own sharding."""
        if self.page_shape[0] != self.num_kv_heads:
            return None
        self.sharding(total_kv_heads)
        return self._unsharded_digest(b"sparkcache-kv\x00", num_kv_heads=total_kv_heads)

    def budget_digest(self) -> str:
        """32 hex characters naming what Spark's per-model limits count together
        (docs/retention.md): every sharding of this model's KV, whatever its TP
        size; :meth:`digest` itself when the pages do not have the rank's heads
        as their outer dimension (a snapshot that serves only its own sharding)."""
        if self.page_shape[0] != self.num_kv_heads:
            return self.digest()
        return self._unsharded_digest(b"sparkcache-budget\x00")

    def _unsharded_digest(self, tag: bytes, **fields: int) -> str:
        """The digest of this identity without how it is sharded (TP, PP and DCP
        sizes, the rank's head count; one head's page), plus ``fields``."""
        part = self.to_dict()
        for name in ("tp_size", "pp_size", "dcp_size", "num_kv_heads"):
            del part[name]
        part["page_shape"][0] = 1  # one head's page
        part.update(fields)
        return xxhash.xxh3_128_hexdigest(tag + canonical_json(part).encode())

    def check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise InvalidArgument(
                f"rank must be an integer in [0, {self.world_size}) for this topology "
                f"(tp={self.tp_size}, pp={self.pp_size}, dcp={self.dcp_size}), got {rank!r}"
            )
        return rank


@dataclass(frozen=True)
class RequestScope:
    """Per-request partition of the prefix space: cache salt, LoRA, multimodal
    inputs, tenant (docs/serve.md, "Tenants")."""

    cache_salt: str | None = None
    lora: str | None = None
    mm_hashes: tuple[str, ...] = ()
    #: The tenant whose request it is; recorded on the snapshots it publishes
    #: (``snapshots.tenant``) for the tenant's limits and clear.
    tenant: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mm_hashes", tuple(str(h) for h in self.mm_hashes))

    def canonical(self) -> str:
        doc: dict[str, Any] = {"cache_salt": self.cache_salt, "lora": self.lora,
                               "mm": list(self.mm_hashes)}
        if self.tenant is not None:  # absent otherwise: scopes without one hash as before
            doc["tenant"] = self.tenant
        return canonical_json(doc)

    @property
    def is_default(self) -> bool:
        return (self.cache_salt is None and self.lora is None and not self.mm_hashes
                and self.tenant is None)

    @classmethod
    def from_dict(cls, doc: Any) -> RequestScope:
        """The scope whose :meth:`canonical` JSON parses to ``doc``: every field
        present (``tenant`` only when there is one), of its type, nothing else;
        else InvalidArgument."""
        if not (isinstance(doc, dict) and set(doc) - {"tenant"} == {"cache_salt", "lora", "mm"}):
            raise InvalidArgument(f"not a request scope: {doc!r}")
        salt, lora, mm, tenant = doc["cache_salt"], doc["lora"], doc["mm"], doc.get("tenant")
        if not (all(v is None or isinstance(v, str) for v in (salt, lora))
                and isinstance(mm, list) and all(isinstance(h, str) for h in mm)
                and (tenant is None or isinstance(tenant, str))
                and not ("tenant" in doc and tenant is None)):
            raise InvalidArgument(f"not a request scope: {doc!r}")
        return cls(cache_salt=salt, lora=lora, mm_hashes=tuple(mm), tenant=tenant)

    @classmethod
    def from_canonical(cls, text: str) -> RequestScope:
        """The scope :meth:`canonical` wrote as ``text`` (InvalidArgument if it is not one)."""
        try:
            doc = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"not a request scope: {text!r}") from exc
        return cls.from_dict(doc)
