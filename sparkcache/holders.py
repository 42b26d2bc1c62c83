"""Who holds a lease: host, pid and process start time, and whether it still lives.

A lease outlives the process that took it only until it expires; ``check`` and
publishers also drop leases whose holder is a dead process on this host, so a
SIGKILLed worker blocks nothing.  The start time guards against pid reuse.
"""

from __future__ import annotations

import os
import socket

__all__ = ["holder_alive", "pid_alive", "process_alive", "start_time", "this_holder"]


def _stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks since boot) from /proc, or ('', '') where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return "", ""
    # The command name (field 2) may hold spaces and parentheses: split after it.
    fields = stat.rsplit(")", 1)[-1].split()
    return (fields[0], fields[19]) if len(fields) > 19 else ("", "")


def start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), or "" where unknown.

    With the pid it names one process: a pid reused by a later process has
    another start time."""
    return _stat(pid)[1]


def this_holder(tag: str = "") -> str:
    """``host/pid/start[/tag]`` naming this process."""
    pid = os.getpid()
    base = f"{socket.gethostname()}/{pid}/{start_time(pid)}"
    return f"{base}/{tag}" if tag else base


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host runs (a zombie does not: it never acts again)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _stat(pid)[0] not in ("Z", "X")


def process_alive(pid: int, started: str | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` (a :func:`start_time`;
    None or "" when not recorded) still runs on this host: a dead pid, or one
    reused by another process, is not."""
    if not pid_alive(pid):  # dead, or killed and not yet reaped
        return False
    now = start_time(pid)
    return not (started and now and started != now)


def holder_alive(holder: str) -> bool | None:
    """True/False for a holder on this host; None when it lives elsewhere (unknown)."""
    parts = holder.split("/")
    if len(parts) < 3 or parts[0] != socket.gethostname():
        return None
    try:
        pid = int(parts[1])
    except ValueError:
        return None
    return process_alive(pid, parts[2])
