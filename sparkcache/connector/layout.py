"""The :class:`~sparkcache.identity.ModelIdentity` of a vLLM engine, from its config.

The scheduler and every worker compute the identity with the same function
from the same inputs (the ``VllmConfig`` and the ``KVCacheConfig`` both roles
receive), so the scheduler can look up what the workers publish without ever
seeing a KV tensor.  Each worker then checks the identity against its real
tensors (:func:`check_tensors`) and turns itself off on a mismatch: a wrong
guess costs misses, never a wrong restore.

Duck-typed over vLLM objects (``Any``) so that neither mypy nor an import of
this module needs vLLM; vLLM is imported lazily through importlib, which also
keeps mypy from following imports into vLLM and torch (slow, and their types
change between versions).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from sparkcache.errors import InvalidArgument
from sparkcache.identity import (
    DTYPE_SIZES,
    WINDOW_BLOCKS_KEY,
    ModelIdentity,
    canonical_json,
    normalize_dtype,
)

__all__ = [
    "CPU_ATTN_KEY", "KVGroup", "check_isa", "check_tensors", "config_fingerprint",
    "cpu_attn_isa", "hub_revision", "kv_groups", "layer_order", "lone_token_differs",
    "model_identity", "rank_of", "total_kv_heads", "weights_fingerprint",
]

logger = logging.getLogger("vllm.sparkcache")

#: A hub commit, as the Hugging Face cache names its snapshot folders.
_COMMIT = re.compile(r"[0-9a-f]{40}")

#: Files whose bytes define the weights of a local model folder.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: Files of a local model folder that say what its weights compute (HF, Mistral format).
_CONFIG_FILES = ("config.json", "params.json")


def hub_revision(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The commit of hub model ``model`` at ``revision`` (a branch, tag or
    commit; None: ``main``) that vLLM loaded, from the local Hugging Face cache
    ("" when it is not there).

    vLLM downloads a model at a ref and records which commit that was
    (``refs/<ref>``); the snapshot folder holding its config.json is named by
    that commit.  Naming the identity by the commit
    makes an update of the repository a clean miss, not KV of the old weights
    restored into the new ones.  Reads files only, never the network.
    """
    try:
        hub = importlib.import_module("huggingface_hub")
        found = hub.try_to_load_from_cache(model, "config.json", cache_dir=cache_dir,
                                           revision=revision)
    except Exception:  # not a repo id, no huggingface_hub: unknown
        return ""
    if isinstance(found, str) and _COMMIT.fullmatch(Path(found).parent.name):
        return Path(found).parent.name
    return ""


def weights_fingerprint(folder: str | os.PathLike[str]) -> str:
    """A cheap digest naming the weights in a local model folder.

    config.json's bytes plus the name, size and mtime of every weight file:
    re-saving different weights under the same path changes it (a clean miss),
    reading gigabytes of weights at start-up does not happen.  Pass
    ``revision`` in the connector settings to name the weights exactly.
    """
    root = Path(folder)
    h = xxhash.xxh3_128(b"sparkcache-weights\x00")
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            st = path.stat()
            h.update(f"{path.relative_to(root)}\x00{st.st_size}\x00{st.st_mtime_ns}\n".encode())
    return "local:" + h.hexdigest()


def config_fingerprint(model_config: Any) -> str:
    """A digest of the config files vLLM reads this model's architecture from.

    The revision names the weights; the config says what they compute - rope
    theta and scaling, norm epsilons, multipliers, the head layout - and the
    same weights under another config write other KV, which no check of the
    stored bytes can notice.  So the identity names the config too, also when
    ``revision`` is given: the files of a local model folder and of vLLM's
    ``hf_config_path``.  ``""`` when neither is a local folder (a hub model's
    config is named by its revision).
    """
    h = xxhash.xxh3_128(b"sparkcache-config\x00")
    found = False
    for source in (getattr(model_config, "hf_config_path", None), model_config.model):
        if not source or not os.path.isdir(str(source)):
            continue
        for name in _CONFIG_FILES:
            path = Path(str(source)) / name
            if path.is_file():
                h.update(f"{name}\x00".encode() + path.read_bytes() + b"\x00")
                found = True
    return "local:" + h.hexdigest() if found else ""


def _dtype_name(dtype: Any) -> str:
    return normalize_dtype(str(dtype))


#: KV cache specs whose blocks vLLM frees or rewrites below a request's end
#: (windows, chunks, rings, recurrent state) and that sparkcache does not
#: store; sliding windows (``SlidingWindowSpec``) are stored per window.
_UNSUPPORTED_SPECS = ("MambaSpec", "ChunkedLocalAttentionSpec", "CircularBufferSpec",
                      "RSWASpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec")
_SUPPORTED = ("full attention (FullAttentionSpec) and sliding-window attention "
              "(SlidingWindowSpec) layers")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups, as sparkcache stores it.

    ``window_blocks``: the blocks a snapshot keeps of each of its layers,
    ending at the snapshot's end (0: every block).  A sliding window of ``W``
    tokens reaches back ``W - 1`` tokens (plus vLLM's ``extra_retained_tokens``)
    from the next token, so a restore at a block boundary needs exactly the
    blocks holding those tokens.
    """

    kind: str  # "full" or "sliding"
    spec: str  # vLLM's spec class name
    window: int  # tokens; 0 for full attention
    block_size: int
    window_blocks: int
    layers: tuple[str, ...]  # vLLM layer names


def layer_order(names: Any) -> list[str]:
    """vLLM's layer names in model order (``model.layers.<i>...``: by ``i``)."""
    def key(name: str) -> tuple[int, str]:
        found = _LAYER_INDEX.findall(f".{name}.")
        return (int(found[-1]) if found else -1, name)
    return sorted(names, key=key)


def _describe(groups: list[Any]) -> str:
    return "; ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} "
                     f"layer{'s' if len(g.layer_names) != 1 else ''}: "
                     f"{', '.join(layer_order(g.layer_names)[:4])}"
                     f"{', ...' if len(g.layer_names) > 4 else ''})" for g in groups)


def kv_groups(kv_cache_config: Any, hf_config: Any = None) -> list[KVGroup]:
    """The engine's KV cache groups; InvalidArgument (the engine does not start)
    for a layout sparkcache cannot store, naming its layer types.

    Every group must be attention KV of one page layout (heads, head size,
    dtype, block size); a group of Mamba or linear-attention state, chunked
    local attention, a ring buffer or cross-attention is refused: a restore
    would need that state at the prefix's end, which this version does not
    store (docs/connector.md, "Model coverage").
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise InvalidArgument("the engine has no KV cache groups; sparkcache has nothing to store")
    types = getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type",
                                                               None)
    what = f" (the model's layer types: {sorted(set(map(str, types)))})" if types else ""
    out: list[KVGroup] = []
    for group in groups:
        spec = group.kv_cache_spec
        name = type(spec).__name__
        missing = [a for a in ("num_kv_heads", "head_size", "block_size", "dtype")
                   if not hasattr(spec, a)]
        if name in _UNSUPPORTED_SPECS or missing:
            raise InvalidArgument(
                f"sparkcache cannot store this model's KV cache: its groups are "
                f"{_describe(groups)}{what}.  It stores {_SUPPORTED}; {name} layers hold "
                "state that a restore would need at the prefix's end, which sparkcache does "
                "not store.  Serve this model without the sparkcache connector.")
        window = int(getattr(spec, "sliding_window", None) or 0)
        sliding = any(c.__name__ == "SlidingWindowSpec" for c in type(spec).__mro__)
        bs = int(spec.block_size)
        keep = 0
        if sliding:
            if window <= 0:
                raise InvalidArgument(f"{name} with sliding_window={window}: not a window")
            extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
            keep = -(-(window - 1 + extra) // bs) or 1
        out.append(KVGroup("sliding" if sliding else "full", name, window if sliding else 0,
                           bs, keep, tuple(layer_order(group.layer_names))))
    if len(out) > 1:
        first = groups[0].kv_cache_spec
        for group in groups[1:]:
            spec = group.kv_cache_spec
            same = all(getattr(spec, a) == getattr(first, a)
                       for a in ("num_kv_heads", "head_size", "block_size", "dtype"))
            if not same or page_shape_of(spec) != page_shape_of(first):
                raise InvalidArgument(
                    f"sparkcache stores KV cache groups of one page layout; this engine's "
                    f"groups differ: {_describe(groups)} ({first} vs {spec})")
    return out


def _attention_spec(kv_cache_config: Any) -> Any:
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec


def page_shape_of(spec: Any) -> tuple[int, ...]:
    """Shape of one manager block of one layer, in elements of the cache dtype."""
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    _blocks, heads, tokens, content_bytes = interface.compute_layer_kv_cache_shape_bytes(spec, 1)
    itemsize = DTYPE_SIZES[_dtype_name(spec.dtype)]
    if content_bytes % itemsize:
        raise InvalidArgument(f"KV page content of {content_bytes} bytes is not a whole number "
                              f"of {spec.dtype} elements")
    return (int(heads), int(tokens), int(content_bytes) // itemsize)


#: The identity's key for the page format of vLLM's CPU attention backend.
CPU_ATTN_KEY = "cpu_attn"


def _on_cpu() -> bool:
    """Whether this process runs vLLM's CPU platform."""
    return bool(importlib.import_module("vllm.platforms").current_platform.is_cpu())


def cpu_attn_isa(vllm_config: Any, spec: Any) -> str | None:
    """The kernel family ("amx", "vec", "vec16", "neon", ...) vLLM's CPU
    attention backend picks for this engine, which decides how a KV page is
    laid out inside (docs/connector-notes.md, "KV pages on CPU"); None off the
    CPU platform.  Asked of vLLM's own chooser with the inputs its attention
    builder gives it, so the scheduler and the workers name the same format;
    each worker then checks it against its layers (:func:`check_isa`)."""
    if not _on_cpu():
        return None
    try:
        cpu_attn = importlib.import_module("vllm.v1.attention.backends.cpu_attn")
        return str(cpu_attn._get_attn_isa(vllm_config.model_config.dtype, int(spec.block_size),
                                          int(spec.head_size),
                                          vllm_config.cache_config.cache_dtype))
    except Exception as exc:  # vLLM refuses the configuration: it will say so itself
        return f"unknown ({type(exc).__name__})"


def check_isa(identity: ModelIdentity, layers: list[Any]) -> None:
    """Raise InvalidArgument unless every attention layer runs the CPU kernel
    family the identity names (vLLM sets ``layer.isa`` when it builds the
    attention backend, before the KV cache is registered)."""
    want = dict(identity.extra).get(CPU_ATTN_KEY)
    if want is None:
        return
    found = sorted({str(getattr(layer, "isa", None)) for layer in layers})
    if found != [want]:
        raise InvalidArgument(
            f"the attention layers run vLLM's CPU kernels {found}, the identity says "
            f"{want!r}: pages of another layout would be stored under its name")


def lone_token_differs() -> bool:
    """Whether this engine computes a prompt's last token alone by another
    kernel path than a prefill (vLLM's CPU backend with split-KV decoding,
    VLLM_CPU_ATTN_SPLIT_KV on: its answer may then differ from the engine's
    that prefilled the snapshot).  The connector's ``compute_tokens`` auto
    leaves two tokens to compute there."""
    if not _on_cpu():
        return False
    envs = importlib.import_module("vllm.envs")
    return bool(getattr(envs, "VLLM_CPU_ATTN_SPLIT_KV", True))


def _engine_revision(vllm_config: Any, model: str) -> str:
    """What names the weights this engine loaded: vLLM's revision of a local
    folder, else the folder's :func:`weights_fingerprint`; for a hub model the
    commit its revision (or ``main``) resolved to in the local cache, else the
    revision as given ("" and a warning when there is none)."""
    given = vllm_config.model_config.revision
    if os.path.isdir(model):
        return str(given) if given is not None else weights_fingerprint(model)
    load = getattr(vllm_config, "load_config", None)
    commit = hub_revision(model, given, getattr(load, "download_dir", None))
    if commit:
        return f"commit:{commit}"
    if given is None:
        logger.warning(
            "sparkcache cannot tell which revision of %s this engine runs (not a folder, "
            "not in the Hugging Face cache): an update of the model under the same name "
            "would not be noticed; pass --revision to vLLM or the connector's revision",
            model)
    return "" if given is None else str(given)


def _group_extra(groups: list[KVGroup], num_layers: int) -> dict[str, str]:
    """The identity's part that names the KV cache groups.

    The group structure is part of the identity: another grouping, window or
    layer map is another model (a clean miss).  A single full-attention group
    adds nothing, so those identities are what they always were."""
    if len(groups) == 1 and groups[0].kind == "full":
        return {}
    names = layer_order(name for g in groups for name in g.layers)
    if len(names) != num_layers:
        raise InvalidArgument(
            f"the KV cache groups hold {len(names)} layers, the model has {num_layers} "
            "(shared KV layers?); sparkcache cannot map them")
    index = {name: i for i, name in enumerate(names)}
    keep = {name: g.window_blocks for g in groups for name in g.layers}
    return {
        "groups": canonical_json([
            {"kind": g.kind, "spec": g.spec, "window": g.window, "block_size": g.block_size,
             "layers": [index[n] for n in g.layers]} for g in groups]),
        WINDOW_BLOCKS_KEY: ",".join(str(keep[n]) for n in names),
    }


def model_identity(
    vllm_config: Any, kv_cache_config: Any, *, revision: str | None = None
) -> ModelIdentity:
    """The model part of the identity of this engine's KV cache."""
    vllm = importlib.import_module("vllm")
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    hf_text = getattr(model_config, "hf_text_config", model_config.hf_config)
    groups = kv_groups(kv_cache_config, hf_text)
    spec = _attention_spec(kv_cache_config)

    model = str(model_config.model)
    if revision is None:  # the connector's own revision names the weights as given
        revision = _engine_revision(vllm_config, model)
    try:
        layout = cache_config.get_resolved_kv_cache_layout().name
    except (AttributeError, ValueError):
        layout = "unresolved"
    extra = {
        "vllm": str(vllm.__version__),
        "cache_dtype": str(cache_config.cache_dtype),
        "quantization": str(model_config.quantization),
        "spec": type(spec).__name__,
        "hf_overrides": canonical_json(getattr(model_config, "hf_overrides", None) or {}),
        "config": config_fingerprint(model_config),
    }
    isa = cpu_attn_isa(vllm_config, spec)
    if isa is not None:  # another kernel family lays pages out otherwise: a clean miss
        extra[CPU_ATTN_KEY] = isa
    num_layers = int(hf_text.num_hidden_layers)
    extra.update(_group_extra(groups, num_layers))
    return ModelIdentity(
        model=model,
        revision=str(revision),
        num_layers=num_layers,
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        dtype=_dtype_name(model_config.dtype),
        kv_cache_dtype=_dtype_name(spec.dtype),
        block_size=int(spec.block_size),
        page_shape=page_shape_of(spec),
        attention_layout=f"vllm/{layout}",
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        dcp_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
        extra=tuple(sorted(extra.items())),
    )


def total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads in all, before the TP split (what a snapshot of
    another TP size is re-sharded by); 0 where its KV is not split by heads
    (MLA: one latent per token) or vLLM cannot say: snapshots of another TP
    size are then not looked for."""
    model_config = vllm_config.model_config
    try:
        if getattr(model_config, "use_mla", False):
            return 0
        return int(model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def rank_of(identity: ModelIdentity, tp_rank: int, pp_rank: int, dcp_rank: int = 0) -> int:
    """This worker's segment index: ``(pp * tp_size + tp) * dcp_size + dcp``."""
    return identity.check_rank(
        (pp_rank * identity.tp_size + tp_rank) * identity.dcp_size + dcp_rank
    )


def check_tensors(identity: ModelIdentity, tensors: list[Any]) -> None:
    """Raise InvalidArgument unless every tensor is ``[num_blocks, *page_shape]``
    of the identity's KV dtype (and, without pipeline parallelism, one per layer)."""
    if identity.pp_size == 1 and len(tensors) != identity.num_layers:
        raise InvalidArgument(f"{len(tensors)} KV cache tensors for a model with "
                              f"{identity.num_layers} layers (shared KV layers?)")
    for t in tensors:
        if tuple(t.shape[1:]) != identity.page_shape:
            raise InvalidArgument(f"KV cache tensor of shape {tuple(t.shape)}; expected pages of "
                                  f"{identity.page_shape} (kernel block splitting?)")
        if _dtype_name(t.dtype) != identity.kv_cache_dtype:
            raise InvalidArgument(f"KV cache tensor of dtype {t.dtype}; the identity says "
                                  f"{identity.kv_cache_dtype}")
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidArgument(f"KV cache on {t.device}: sparkcache moves pages of CPU and "
                                  "CUDA tensors only")
