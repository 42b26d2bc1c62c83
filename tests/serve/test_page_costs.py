"""The page shows the cost model's measured rates of each model and the host's."""

from __future__ import annotations

from pathlib import Path

from sparkcache import SnapshotStore
from sparkcache.measures import CostRow
from sparkcache.serve import page

from ..store.helpers import identity, pages_for, tokens


def test_the_page_lists_the_measured_rates(tmp_path: Path) -> None:
    ident = identity()
    with SnapshotStore(tmp_path) as store:
        toks = tokens(32, seed=1)
        store.publish(ident, 0, toks, pages_for(ident, toks))
        assert "measured rates" not in page.render(store, csrf="x")  # nothing measured yet
        store.record_costs([CostRow(ident.digest(), "prefill", 11, 1 / 5000, 0.0, 4, 1.0),
                            CostRow("", "tier s3://b/<kv> -", 0, 1e-7, 0.5, 2, 1.0)])
        text = page.render(store, csrf="x")
    section = text.split("measured rates</h3>")[1].split("</table>")[0]
    assert "5,000 tokens/s" in section and "&lt;=2048" in section
    assert "10.0 MB/s" in section and "0.5000" in section
    assert "s3://b/&lt;kv&gt;" in section  # escaped
