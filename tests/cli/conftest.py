"""The fixtures of the ``sparkcache`` command's tests (tests/cli/helpers.py)."""

from __future__ import annotations

from .helpers import folder, run

__all__ = ["folder", "run"]
