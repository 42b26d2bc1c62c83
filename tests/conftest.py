"""Fixtures shared by the top-level tests."""

from __future__ import annotations

from .filled import filled

__all__ = ["filled"]
