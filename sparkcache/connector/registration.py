"""A worker's KV cache as sparkcache moves it: vLLM's registered tensors grouped
by KV cache group, checked against the identity, and vLLM's attention layers
of them (whose kernel family the identity names)."""

from __future__ import annotations

from typing import Any

from sparkcache.connector.kvlayers import LayerGroups
from sparkcache.connector.layout import KVGroup, check_tensors, layer_order
from sparkcache.cuda import KVPages
from sparkcache.errors import InvalidArgument
from sparkcache.identity import ModelIdentity

__all__ = ["attention_layers", "layer_groups"]


def attention_layers(vllm_config: Any, kv_caches: dict[str, Any]) -> list[Any]:
    """vLLM's attention layers of these KV caches (its forward context)."""
    context = vllm_config.compilation_config.static_forward_context
    layers = [context[name] for name in kv_caches if name in context]
    if len(layers) != len(kv_caches):
        raise InvalidArgument(f"vLLM's forward context holds {len(layers)} of the "
                              f"{len(kv_caches)} layers with a KV cache")
    return layers


def _group_caches(kv_caches: dict[str, Any], kv_groups: list[KVGroup]) -> list[dict[str, Any]]:
    """Each KV cache group's layers and their caches.  A plain model's one
    group is every layer vLLM registered (one sharing another layer's cache
    is stored once, under the first name)."""
    if len(kv_groups) == 1:
        return [dict(kv_caches)]
    missing = [n for g in kv_groups for n in g.layers if n not in kv_caches]
    if missing:
        raise InvalidArgument(f"vLLM registered no KV cache for layers {missing[:4]}")
    return [{n: kv_caches[n] for n in g.layers} for g in kv_groups]


def layer_groups(kv_caches: dict[str, Any], kv_groups: list[KVGroup], identity: ModelIdentity,
                 *, staging_mb: int, use_numpy: bool,
                 ) -> tuple[list[KVPages], LayerGroups, dict[str, int]]:
    """Each KV cache group's layers as their own :class:`KVPages` (each group
    has its own block table; the groups share ``staging_mb``), checked against
    the identity; and each vLLM layer name's index among the identity's layers
    (a layer sharing another layer's cache: that layer's)."""
    caches = _group_caches(kv_caches, kv_groups)
    group_pages = [KVPages(c, use_numpy=use_numpy, staging_bytes=(staging_mb << 20) // len(caches))
                   for c in caches]
    check_tensors(identity, [t for p in group_pages for t in p.tensors])
    names = layer_order(n for p in group_pages for n in p.names)
    where = [next((g, p.names.index(n)) for g, p in enumerate(group_pages) if n in p.names)
             for n in names]
    index = {name: i for i, name in enumerate(names)}
    for cache, pages in zip(caches, group_pages, strict=True):
        stored = {int(t.data_ptr()): index[n] for n, t in zip(pages.names, pages.tensors,
                                                               strict=True)}
        for name, tensor in cache.items():
            if name not in index and int(tensor.data_ptr()) in stored:
                index[name] = stored[int(tensor.data_ptr())]
    return group_pages, LayerGroups(group_pages, where), index
