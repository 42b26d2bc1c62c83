"""Where the store lives: the one resolver of Spark's folder settings.

The connector, retention and the command line all find the store's root the
same way: an explicit folder wins, then ``SPARK_KV_CACHE_FOLDER``, then
``$SPARK_STORAGE/kvcache``, where ``SPARK_STORAGE`` defaults to
``~/.local/share/spark`` (Spark's own default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["FOLDER_VAR", "STORAGE_VAR", "resolve_folder"]

FOLDER_VAR = "SPARK_KV_CACHE_FOLDER"
STORAGE_VAR = "SPARK_STORAGE"
#: SPARK_STORAGE when it is not set, below the home folder.
DEFAULT_STORAGE = (".local", "share", "spark")


def resolve_folder(
    folder: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """The store's root: ``folder``, else $SPARK_KV_CACHE_FOLDER, else
    $SPARK_STORAGE/kvcache (SPARK_STORAGE defaulting to ``~/.local/share/spark``).

    Empty values count as unset; ``~`` is expanded.  Nothing is created.
    """
    env = os.environ if env is None else env
    chosen = os.fspath(folder) if folder else env.get(FOLDER_VAR)
    if chosen:
        return Path(chosen).expanduser()
    storage = env.get(STORAGE_VAR) or str(Path.home().joinpath(*DEFAULT_STORAGE))
    return Path(storage).expanduser() / "kvcache"
