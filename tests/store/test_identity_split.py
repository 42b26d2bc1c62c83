"""ModelIdentity split in two: what the KV is (kv_digest) and how it is sharded."""

from __future__ import annotations

import dataclasses

import pytest

from sparkcache.errors import InvalidArgument
from sparkcache.identity import MLA_KEY, ModelIdentity
from sparkcache.sharding import Sharding, plan_reads


def ident(tp: int, heads: int, **kw: object) -> ModelIdentity:
    args: dict[str, object] = {
        "model": "m", "revision": "r", "num_layers": 2, "num_kv_heads": heads, "head_size": 32,
        "dtype": "float32", "kv_cache_dtype": "float32", "block_size": 32,
        "page_shape": (heads, 32, 64), "attention_layout": "vllm/NHD", "tp_size": tp,
        "extra": (("cpu_attn", "vec"),), **kw}
    return ModelIdentity(**args)  # type: ignore[arg-type]


def test_tp_sizes_of_one_model_share_the_kv_digest_not_the_digest() -> None:
    one, two, four = ident(1, 4), ident(2, 2), ident(4, 1)
    assert len({one.digest(), two.digest(), four.digest()}) == 3  # a folder each, as before
    assert one.kv_digest(4) == two.kv_digest(4) == four.kv_digest(4)
    assert one.kv_digest(4) is not None and len(one.kv_digest(4) or "") == 32
    # Replicated heads: tp=4 over 2 KV heads holds one head a rank.
    assert ident(4, 1).kv_digest(2) == ident(1, 2).kv_digest(2) != one.kv_digest(4)
    assert two.sharding(4) == Sharding(4, 2)
    assert plan_reads(two.sharding(4), one.sharding(4), 0)[1].src_rank == 1


@pytest.mark.parametrize("change", [
    {"revision": "r2"}, {"dtype": "bfloat16"}, {"kv_cache_dtype": "bfloat16"},
    {"block_size": 64}, {"head_size": 16}, {"num_layers": 3},
    {"attention_layout": "vllm/HND"}, {"extra": (("cpu_attn", "amx"),)},
])
def test_anything_that_changes_a_heads_bytes_changes_the_kv_digest(
        change: dict[str, object]) -> None:
    base = ident(2, 2)
    assert dataclasses.replace(base, **change).kv_digest(4) != base.kv_digest(4)  # type: ignore[arg-type]


def test_the_digest_did_not_change() -> None:
    """The digest names stores written before the split: it must stay what it was."""
    assert ident(2, 2).digest() == "1f4d5ea9181bedec9834aec4b4ef0492"  # computed before it


def test_pages_without_heads_outermost_serve_only_their_own_sharding() -> None:
    flat = dataclasses.replace(ident(2, 2), page_shape=(32, 2, 64))
    assert flat.kv_digest(4) is None


def test_a_rank_whose_heads_are_not_a_split_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="not a tp=2 split"):
        ident(2, 3).sharding(4)
    with pytest.raises(InvalidArgument):
        ident(2, 2).kv_digest(6)
    mla = ident(2, 2, extra=((MLA_KEY, "1"),))
    assert mla.sharding(4).mla


def test_a_models_shardings_share_one_budget_digest() -> None:
    """Spark's per-model limits count every TP size of a model together, and
    nothing of another model (ModelIdentity.budget_digest)."""
    from tests.store.test_reshard import ident

    assert ident(1).budget_digest() == ident(2).budget_digest() == ident(4).budget_digest()
    assert ident(1).digest() != ident(2).digest()
    assert ident(1, model="other").budget_digest() != ident(1).budget_digest()
    assert ident(2, dtype="bfloat16").budget_digest() != ident(2).budget_digest()
    # Pages whose outer dimension is not the rank's heads serve only their own
    # sharding: their budget is their own.
    flat = ident(2, page_shape=(32, 2, 8))
    assert flat.budget_digest() == flat.digest()
