"""bench/gpu_check.py runs in CI on CPU tensors (small sizes): every layout's bytes
equal, the table printed, exit status 0; a wrong byte makes it exit 1."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="needs torch (bash scripts/install-vllm.sh)")

BENCH = Path(__file__).resolve().parents[2] / "bench"
SMALL = ["--device", "cpu", "--mib", "4", "--reps", "1", "--blocks", "12"]


@pytest.fixture()
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("gpu_check", None)
    return importlib.import_module("gpu_check")


def test_gpu_check_passes_on_cpu_tensors(gpu_check: Any, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "table.md"
    assert gpu_check.main([*SMALL, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for layout in gpu_check.LAYOUTS:
        assert f"gqa {layout}" in text
    assert "restore from disk, page cache cold" in text and "MISS" not in text
    assert out.read_text().strip() == text.strip()


def test_gpu_check_fails_on_a_wrong_byte(gpu_check: Any, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Every upload flips one byte of what it copies: the check must notice."""
    from sparkcache.cuda import pages

    real = pages.KVPages._upload

    def flipped(self: Any, layer: int, idx: np.ndarray, host: Any) -> None:
        host = host.clone()
        host.view(-1)[0] ^= 1
        real(self, layer, idx, host)

    monkeypatch.setattr(pages.KVPages, "_upload", flipped)
    assert gpu_check.main(SMALL) == 1
    assert "DIFFERENT" in capsys.readouterr().out
