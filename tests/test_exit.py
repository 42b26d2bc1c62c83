"""A process that imports sparkcache and then runs vLLM exits on its own.

vLLM starts its engine as a non-daemon child process and shuts it down from a
``weakref.finalize``.  Python runs exit hooks last-registered-first, and
``multiprocessing``'s hook joins non-daemon children; sqlalchemy (which the
index schema imports) registers weakref's hook at import.  If that happened
before ``multiprocessing.util`` was imported, the join ran first and the
process never exited (found with real vLLM: every engine script hung after
its last line).  This reproduces vLLM's pattern without vLLM.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
for name in sys.argv[1:]:
    __import__(name)
import multiprocessing as mp
import time
import weakref


class Engine:
    def __init__(self):
        self.proc = mp.get_context("fork").Process(target=time.sleep, args=(120,))
        self.proc.start()
        weakref.finalize(self, self.proc.terminate)


if __name__ == "__main__":
    engine = Engine()
"""


@pytest.mark.parametrize("modules", [["sparkcache"], ["sparkcache.index.schema"],
                                     ["sparkcache.connector"], ["sparkcache.store"]])
def test_importing_sparkcache_first_does_not_hang_exit(modules: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *modules], timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_pattern_does_hang_when_the_order_is_wrong() -> None:
    """The negative control: sqlalchemy's hook first, multiprocessing's second."""
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", SCRIPT, "sqlalchemy", "multiprocessing.util"],
                       timeout=5, capture_output=True)
