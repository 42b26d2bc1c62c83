#!/usr/bin/env bash
# Installs what the tests need into .venv, then runs lint, types and every test.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
.venv/bin/ruff check sparkcache tests bench migrations
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
