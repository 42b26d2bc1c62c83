"""The connector uploads to a shared tier (issue 15, first half): the scheduler
process runs the uploader, and its shutdown waits for the queue, so the
snapshot of an answer given just before a clean exit is in the tier; with
``shared_sweep`` it also runs the tier's sweeper; a tier that cannot be used
stops the engine at start with a clear error.

The tier is a ``file://`` folder here (tests/shared runs the S3 ones against
moto's server).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import LONG_PROMPT, NEEDS_VLLM, run_scenario, same_answer

from sparkcache import SnapshotStore
from sparkcache.shared import SharedTier, parse_manifest
from sparkcache.shared.layout import manifest_key, model_key
from sparkcache.shared.lease import LEASE_KEY

pytestmark = NEEDS_VLLM


def test_an_answer_reaches_the_tier_by_a_clean_exit(
    tiny_model_dir: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    folder = tmp_path / "store"
    result = run_scenario(tiny_model_dir, tmp_path, [
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "ready": 1},
    ], folder=folder, engine=CHUNK,
        extra={"shared": f"file://{tier}", "upload_wait_seconds": 60, "shared_sweep": True})
    (out,) = result["long"]["outs"]
    assert same_answer(out, baseline["long"][0]) == ""
    with SnapshotStore(folder) as store:
        snaps = [s for s in store.snapshots() if s.state == "ready"]
        assert snaps and all(s.uploaded_at is not None for s in snaps), result["_log"]
        with store._core.read() as conn:
            model = store._core.model(conn, snaps[0].model_id)
    assert model is not None
    shared = SharedTier(f"file://{tier}", alias_stride=256)
    try:
        assert shared.exists(model_key(model.digest))
        for snap in snaps:
            raw = shared.get(manifest_key(model.digest, snap.snap_key))
            assert raw is not None
            manifest = parse_manifest(raw, model.digest, snap.snap_key)
            assert manifest.n_tokens == snap.n_tokens
            assert all(shared.size(g.key) == g.nbytes for g in manifest.segments)
        # The scheduler process ran the tier's sweeper (shared_sweep): its first
        # pass, at start, finished and recorded so; the default age kept everything.
        lease = json.loads(shared.get(LEASE_KEY) or b"{}")
        assert lease["finished_at"] is not None and lease["expires_at"] == 0, lease
        assert f"/{os.getpid()}/" not in lease["holder"]
    finally:
        shared.close()


def test_a_tier_that_cannot_be_used_stops_the_engine_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "not-mounted"
    with pytest.raises(AssertionError, match="create it first"):
        run_scenario(tiny_model_dir, tmp_path, [{"op": "reset"}], folder=tmp_path / "store",
                     engine=CHUNK, extra={"shared": f"file://{missing}"})
    assert not missing.exists()
