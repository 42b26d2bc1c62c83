"""``python -m sparkcache``: the same as the ``sparkcache`` command."""

from __future__ import annotations

import sys

from sparkcache.cli import main

sys.exit(main())
