"""docs/grafana/sparkcache.json as the tests read it: the metric names its PromQL names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "sparkcache.json"
#: Where a Grafana dashboard holds PromQL: panels' targets, template variables.
QUERY_KEYS = ("expr", "query", "definition")


def load() -> Any:
    return json.loads(DASHBOARD.read_text())


def metric_names(dashboard: Any) -> set[str]:
    """Every ``vllm:*`` metric name the dashboard's PromQL names."""
    found: set[str] = set()
    if isinstance(dashboard, dict):
        for key, value in dashboard.items():
            if key in QUERY_KEYS and isinstance(value, str):
                found |= set(re.findall(r"\bvllm:[A-Za-z0-9_:]+", value))
            else:
                found |= metric_names(value)
    elif isinstance(dashboard, list):
        for value in dashboard:
            found |= metric_names(value)
    return found
