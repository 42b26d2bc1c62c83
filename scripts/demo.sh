#!/usr/bin/env bash
# The main job (until the vLLM connector lands): publish, restart, restore, print.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec .venv/bin/python -m sparkcache.demo "$@"
