"""The upload lease of an uploader that was SIGKILLed blocks nothing, so
``sparkcache check`` does not call the store damaged for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.cli import main
from sparkcache.shared.uploader import UPLOAD_LEASE, UPLOAD_LEASE_SECONDS

from ..store.helpers import identity, pages_for, tokens

HOLDER = """
import sys, time
from sparkcache import SnapshotStore
with SnapshotStore(sys.argv[1]) as store:
    store.acquire_lease(int(sys.argv[2]), kind=sys.argv[3], ttl=float(sys.argv[4]))
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_uploaders_lease_leaves_check_clean(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "s"
    with SnapshotStore(folder) as store:
        toks = tokens(32)
        sid = store.publish(identity(), 0, toks, pages_for(identity(), toks)).snapshot_id
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), str(sid), UPLOAD_LEASE,
         str(UPLOAD_LEASE_SECONDS)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    capsys.readouterr()
    assert main(["--folder", str(folder), "--json", "check"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["clean"] is True and len(found["expired_leases"]) == 1
    with SnapshotStore(folder) as store:
        assert store.evict(count=1) == [sid]  # it blocks nothing
