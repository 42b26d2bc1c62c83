"""A second process holding an index's write lock, for the tests of what
waits for a writer and what does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: Holds ``BEGIN IMMEDIATE`` on the index at argv[1] until a line arrives on stdin.
HOLDER = """
import sys, apsw
conn = apsw.Connection(sys.argv[1])
conn.execute("BEGIN IMMEDIATE")
sys.stdout.write("locked\\n"); sys.stdout.flush()
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


def hold_write_lock(path: Path) -> subprocess.Popen[str]:
    """A process that holds ``path``'s write lock once this returns."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def release(proc: subprocess.Popen[str]) -> None:
    """Let ``proc`` roll back and exit (status 0)."""
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
