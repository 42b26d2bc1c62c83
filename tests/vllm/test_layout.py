"""sparkcache.connector.layout against vLLM itself (no engine): the page shape of a vLLM spec.

The settings and the package's lazy import are tested in tests/connector."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tiny_model import MISSING, SKIP_REASON

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)]


def test_identity_from_a_vllm_spec() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from sparkcache.connector.layout import page_shape_of

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    # The CPU backend's page: [kv_heads, block_size, 2 * head_size] (K and V interleaved).
    assert page_shape_of(spec) == (2, 32, 64)


def _config(*groups: tuple[list[str], object]) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in groups])


def _engine(layer_types: list[str] | None = None) -> object:
    """The parts of a VllmConfig that model_identity reads (a local model named
    by its revision; vLLM's own config objects need a model folder)."""
    from types import SimpleNamespace

    import torch

    hf = SimpleNamespace(num_hidden_layers=4, layer_types=layer_types)
    return SimpleNamespace(
        model_config=SimpleNamespace(model="tiny", revision="r1", hf_config=hf, hf_text_config=hf,
                                     dtype=torch.float32, quantization=None, hf_overrides={}),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )


LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _specs(window: int) -> tuple[object, object]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32,
                                dtype=torch.float32, sliding_window=window)
    return full, sliding


def test_the_group_structure_is_part_of_the_identity() -> None:
    """Windows, kinds and the layer -> group map each name another model; one
    full-attention group adds nothing (those identities are what they were)."""
    from sparkcache.connector.layout import kv_groups, model_identity

    full, sliding = _specs(64)
    _, wider = _specs(128)
    even, odd = [LAYERS[0], LAYERS[2]], [LAYERS[1], LAYERS[3]]
    hybrid = model_identity(_engine(), _config((even, sliding), (odd, full)))
    assert hybrid.window_blocks == (2, 0, 2, 0)
    assert [g.kind for g in kv_groups(_config((even, sliding), (odd, full)))] == \
        ["sliding", "full"]
    others = [
        model_identity(_engine(), _config((even, wider), (odd, full))),  # another window
        model_identity(_engine(), _config((odd, sliding), (even, full))),  # another layer map
        model_identity(_engine(), _config((LAYERS, sliding))),  # every layer sliding
        model_identity(_engine(), _config((LAYERS, full))),  # one full group
    ]
    assert len({hybrid.digest(), *(o.digest() for o in others)}) == 5
    assert others[1].window_blocks == (0, 2, 0, 2)
    assert others[2].window_blocks == (2, 2, 2, 2)
    single = others[3]
    assert single.window_blocks == () and "groups" not in dict(single.extra)


def test_the_cpu_page_format_is_part_of_the_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """On vLLM's CPU platform the identity names the kernel family vLLM picks
    (it decides how a page is laid out inside): bf16 on a CPU with AMX is
    "amx", fp32 anywhere "vec"; another family is another model (a clean miss
    between CPUs that lay pages out otherwise), and a worker whose layers run
    another family than the identity says is refused."""
    import torch
    from vllm.v1.attention.backends import cpu_attn

    from sparkcache.connector.layout import CPU_ATTN_KEY, check_isa, model_identity
    from sparkcache.errors import InvalidArgument

    full, _ = _specs(64)
    fp32 = model_identity(_engine(), _config((LAYERS, full)))
    assert dict(fp32.extra)[CPU_ATTN_KEY] == "vec"
    engine = _engine()
    engine.model_config.dtype = torch.bfloat16  # type: ignore[attr-defined]
    bf16_spec = type(full)(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    bf16 = model_identity(engine, _config((LAYERS, bf16_spec)))
    amx = torch.cpu._is_amx_tile_supported()
    assert dict(bf16.extra)[CPU_ATTN_KEY] == ("amx" if amx else "vec")
    # The same engine where vLLM picks another family (a CPU without AMX, or
    # with): another identity.
    other = "vec" if amx else "amx"
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: other)
    moved = model_identity(engine, _config((LAYERS, bf16_spec)))
    assert dict(moved.extra)[CPU_ATTN_KEY] == other and moved.digest() != bf16.digest()
    # Each worker checks its layers' family (vLLM sets layer.isa) against it.
    layers = [type("Layer", (), {"isa": dict(bf16.extra)[CPU_ATTN_KEY]})() for _ in LAYERS]
    check_isa(bf16, layers)
    with pytest.raises(InvalidArgument, match="CPU kernels"):
        check_isa(moved, layers)


def test_a_mamba_group_is_refused_naming_the_layer_types() -> None:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from sparkcache.connector.layout import model_identity
    from sparkcache.errors import InvalidArgument

    full, _ = _specs(64)
    mamba = MambaSpec(block_size=32, shapes=((3, 288), (8, 32, 16)),
                      dtypes=(torch.float32, torch.float32))
    config = _config(([LAYERS[0]], mamba), (LAYERS[1:], full))
    with pytest.raises(InvalidArgument) as caught:
        model_identity(_engine(["mamba", "attention", "attention", "attention"]), config)
    text = str(caught.value)
    assert "MambaSpec (1 layer: model.layers.0.self_attn.attn)" in text, text
    assert "FullAttentionSpec (3 layers" in text and "['attention', 'mamba']" in text, text
    assert "full attention (FullAttentionSpec) and sliding-window attention" in text, text


def _hub_cache(root: Path, repo: str, ref: str, commit: str, config: str) -> None:
    """A Hugging Face cache holding ``repo`` at ``ref`` = ``commit``, laid out as
    huggingface_hub's downloads lay it out (what vLLM leaves behind)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "config.json").write_text(config)


def test_a_hub_model_is_named_by_the_commit_it_loaded(tmp_path: Path) -> None:
    """A hub model without a revision is named by the commit ``main`` resolved to
    in the local cache, so an update of the repository is a clean miss; one
    that is nowhere to be found keeps an empty revision and says so."""
    from types import SimpleNamespace

    from sparkcache.connector.layout import hub_revision, model_identity

    full, _ = _specs(64)
    config = _config((LAYERS, full))
    first, second = "a" * 40, "b" * 40
    _hub_cache(tmp_path, "org/tiny", "main", first, '{"model_type": "llama"}')

    def ident(revision: str | None, model: str = "org/tiny") -> object:
        engine = _engine()
        engine.model_config.model, engine.model_config.revision = model, revision  # type: ignore[attr-defined]
        engine.load_config = SimpleNamespace(download_dir=str(tmp_path))  # type: ignore[attr-defined]
        return model_identity(engine, config)

    assert hub_revision("org/tiny", None, str(tmp_path)) == first
    before = ident(None)
    assert before.revision == f"commit:{first}"  # type: ignore[attr-defined]
    assert ident("main") == before  # the same ref, the same commit
    _hub_cache(tmp_path, "org/tiny", "main", second, '{"model_type": "llama"}')
    after = ident(None)  # the same name and config, new weights
    assert after.revision == f"commit:{second}"  # type: ignore[attr-defined]
    assert after.digest() != before.digest()  # type: ignore[attr-defined]
    assert ident(first).revision == f"commit:{first}"  # type: ignore[attr-defined]

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.sparkcache")
    log.addHandler(handler)
    try:
        unknown = ident(None, model="org/elsewhere")
    finally:
        log.removeHandler(handler)
    assert unknown.revision == ""  # type: ignore[attr-defined]
    assert any("cannot tell which revision of org/elsewhere" in r.getMessage()
               for r in records)
    assert ident("v1.0", model="org/elsewhere").revision == "v1.0"  # type: ignore[attr-defined]
