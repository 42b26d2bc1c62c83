"""This source tree's entry points as the processes a test starts find them.

``pip install -e .`` writes a distribution's entry points into its installed
metadata (``sparkcache-*.dist-info/entry_points.txt``), read by
``importlib.metadata``, which is how vLLM finds its plugins.  When the
installed ``sparkcache`` is this tree's (CI: ``scripts/env.sh``), that
metadata is used as it is, and must hold what ``pyproject.toml`` declares.
When it is another tree's (this tree's code is run through ``PYTHONPATH``),
:func:`entry_points_path` writes a ``dist-info`` of this tree's declarations
into a folder that, first on ``PYTHONPATH``, shadows the installed one.
Either way an entry point missing from ``pyproject.toml`` is missing in the
processes too.
"""

from __future__ import annotations

import importlib.metadata
import json
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared(group: str) -> dict[str, str]:
    """The entry points of ``group`` that this tree's ``pyproject.toml`` declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project.get("entry-points", {}).get(group, {}))


def _installed_here() -> importlib.metadata.Distribution | None:
    """The installed ``sparkcache`` distribution when it was installed from this tree."""
    try:
        dist = importlib.metadata.distribution("sparkcache")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    return dist if url.removeprefix("file://") == str(ROOT) else None


def entry_points_path(tmp: Path, group: str) -> Path | None:
    """A folder to put first on ``PYTHONPATH`` so that ``group``'s entry points
    are this tree's; None when the installed metadata already is (its entry
    points are then checked against ``pyproject.toml``)."""
    wanted = declared(group)
    dist = _installed_here()
    if dist is not None:
        have = {e.name: e.value for e in dist.entry_points if e.group == group}
        assert have == wanted, (
            f"the installed sparkcache's {group} entry points are {have}, pyproject.toml "
            f"declares {wanted}: run `pip install -e . --no-deps` again")
        return None
    info = tmp / "sparkcache-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sparkcache\nVersion: 0.1.0\n")
    lines = [f"[{group}]", *(f"{name} = {value}" for name, value in wanted.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return tmp


def pythonpath(tmp: Path, group: str, *more: str) -> str:
    """A ``PYTHONPATH`` with this tree's ``group`` entry points, this tree and ``more``."""
    first = entry_points_path(tmp, group)
    return ":".join(str(p) for p in (first, ROOT, *more) if p)
