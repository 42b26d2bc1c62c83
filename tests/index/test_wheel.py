"""The migrations work from an installed wheel, away from the source tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, json, sys
import sparkcache._migrations
from sparkcache.index import Database, current_revision, head_revision
db = Database(sys.argv[1])
print(json.dumps({
    "migrations": sparkcache._migrations.__file__,
    "top_level_migrations": importlib.util.find_spec("migrations") is not None,
    "applied": db.migrated,
    "revision": current_revision(db.connection),
    "head": head_revision(),
}))
"""


def run(*args: str | Path, cwd: Path) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def build_wheel(tmp_path: Path) -> Path:
    """Build from a clean copy: no stale build/ folder, nothing written to the tree."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("sparkcache", "migrations"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src, cwd=tmp_path)
    (wheel,) = dist.glob("sparkcache-*.whl")
    return wheel


def expected_files() -> set[str]:
    """Every module on disk, at the path it must have inside the wheel."""
    files = {
        f"sparkcache/{p.relative_to(ROOT / 'sparkcache').as_posix()}"
        for p in (ROOT / "sparkcache").rglob("*.py")
    }
    files |= {
        f"sparkcache/_migrations/{p.relative_to(ROOT / 'migrations').as_posix()}"
        for p in (ROOT / "migrations").rglob("*")
        if p.suffix in {".py", ".mako"}
    }
    return {f for f in files if "__pycache__" not in f} | {"sparkcache/py.typed"}


@pytest.mark.slow
def test_installed_wheel_creates_an_index_at_head(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = expected_files() - names
    assert not missing, f"add these packages to [tool.setuptools] packages: {sorted(missing)}"
    assert not [n for n in names if n.startswith("migrations/")]

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", wheel, cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "store").mkdir()
    out = run(python, "-c", CHECK, tmp_path / "store" / "index.sqlite", cwd=elsewhere)
    result = json.loads(out)
    assert result["migrations"].startswith(str(venv))
    assert not result["top_level_migrations"]
    assert result["applied"] == [
        "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
    assert result["revision"] == result["head"] == "0012"
