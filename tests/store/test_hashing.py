"""Identity digests and prefix hashes are deterministic across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache import InvalidArgument, ModelIdentity, RequestScope
from sparkcache.hashing import prefix_hashes, prefix_seed

SCRIPT = """
import json, sys
from sparkcache import ModelIdentity, RequestScope
from sparkcache.hashing import prefix_hashes, prefix_seed
ident = ModelIdentity(model="m", revision="abc", num_layers=2, num_kv_heads=2, head_size=8,
                      dtype="bfloat16", kv_cache_dtype="fp8", block_size=16,
                      page_shape=(2, 32, 8), tp_size=2)
seed = prefix_seed(ident, RequestScope(cache_salt="s", lora="l"))
hs = prefix_hashes(seed, list(range(1000)), 16)
print(json.dumps({"digest": ident.digest(), "seed": seed.hex(), "hashes": [h.hex() for h in hs]}))
"""


def _run(hashseed: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_two_fresh_processes_agree() -> None:
    a, b = _run("1"), _run("2")
    assert a == b
    assert len(a["hashes"]) == 1000 // 16  # type: ignore[arg-type]


def _ident(**kw: object) -> ModelIdentity:
    base: dict[str, object] = dict(model="m", revision="r", num_layers=2, num_kv_heads=2,
                                   head_size=8, dtype="float16", kv_cache_dtype="float16",
                                   block_size=16, page_shape=(2, 32, 8))
    base.update(kw)
    return ModelIdentity(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value", [
    ("model", "other"), ("revision", "r2"), ("num_layers", 3), ("kv_cache_dtype", "bf16"),
    ("block_size", 32), ("tp_size", 2), ("attention_layout", "nhd"), ("page_shape", (2, 32, 16)),
])
def test_every_field_changes_the_digest(field: str, value: object) -> None:
    assert _ident().digest() != _ident(**{field: value}).digest()


def test_scope_changes_seed_but_rank_is_not_part_of_it() -> None:
    ident = _ident()
    assert prefix_seed(ident) != prefix_seed(ident, RequestScope(cache_salt="x"))
    assert prefix_seed(ident) != prefix_seed(ident, RequestScope(lora="a"))
    assert prefix_seed(ident) == prefix_seed(ident, RequestScope())


def test_dtype_spellings_normalize() -> None:
    assert _ident(kv_cache_dtype="torch.bfloat16").kv_cache_dtype == "BF16"
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        _ident(kv_cache_dtype="float13")


def test_identity_roundtrips_through_dict() -> None:
    ident = _ident(extra=(("quant", "awq"),))
    assert ModelIdentity.from_dict(json.loads(ident.canonical())) == ident


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 17))
def test_hashes_are_chained_prefixes(tokens: list[int], bs: int) -> None:
    seed = b"\x01" * 16
    full = prefix_hashes(seed, tokens, bs)
    assert len(full) == len(tokens) // bs
    for k in range(len(full)):
        assert prefix_hashes(seed, tokens[: (k + 1) * bs], bs)[-1] == full[k]


def test_bad_tokens_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        prefix_hashes(b"\0" * 16, [-1, 2], 1)
    with pytest.raises(InvalidArgument):
        prefix_hashes(b"\0" * 16, np.array([1.5]), 1)
    with pytest.raises(InvalidArgument):
        prefix_hashes(b"\0" * 16, [[1, 2]], 1)
