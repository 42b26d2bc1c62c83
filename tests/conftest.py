"""Fixtures and settings shared by every test."""

from __future__ import annotations

import signal

from .filled import filled

__all__ = ["filled"]

# A test runner started as a background job of a non-interactive shell (a CI
# script's `cmd &`) inherits SIGINT ignored, and every process it starts would
# too: Python raises no KeyboardInterrupt then, and a test that stops a child
# with SIGINT (Ctrl-C) would wait for nothing.  The tests run as from a
# terminal, whatever started them: SIGINT at Python's default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
