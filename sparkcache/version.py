"""The package version, in a module of its own so that any layer may name it."""

from __future__ import annotations

__all__ = ["VERSION"]

VERSION = "0.1.0"
