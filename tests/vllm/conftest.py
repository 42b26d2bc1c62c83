"""Fixtures for the vLLM tests: the tiny model, built once per session.

This folder has no ``__init__.py`` on purpose: pytest's default (prepend)
import mode would import a package ``tests/vllm`` as top-level ``vllm`` and
shadow the real one.  Modules here import their helpers as ``tiny_model``.

Every test module here sets ``pytestmark = NEEDS_VLLM``; without vLLM they are
skipped with the reason (how to install it), never failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_model import MAX_TOKENS, MISSING, build_model, run_engine_script


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder vLLM serves: random Llama weights, BPE tokenizer, chat template."""
    if MISSING:
        pytest.skip(f"needs {', '.join(MISSING)}")
    return build_model(tmp_path_factory.mktemp("tiny-llama"))


#: Run inside the engine process (see tiny_model.run_engine_script): one engine,
#: no connector, greedy outputs and prefix-cache counters for every test prompt.
BASELINE = """
from vllm import SamplingParams
from tiny_model import LONG_PROMPT, SHARED_PREFIX_PROMPT, metrics_of

llm = make_llm(args["model"])
sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
texts = llm.generate(args["texts"], sp)
first = llm.generate([{"prompt_token_ids": LONG_PROMPT}], sp)[0]
again = llm.generate([{"prompt_token_ids": LONG_PROMPT}], sp)[0]
shared = llm.generate([{"prompt_token_ids": SHARED_PREFIX_PROMPT}], sp)[0]
chat = llm.chat([{"role": "user", "content": args["texts"][0]}], sp)[0]
report({
    "texts": [list(o.outputs[0].token_ids) for o in texts],
    "long": [list(o.outputs[0].token_ids) for o in (first, again)],
    "long_cached": [first.num_cached_tokens, again.num_cached_tokens],
    "shared": list(shared.outputs[0].token_ids),
    "shared_cached": shared.num_cached_tokens,
    "chat_prompt": list(chat.prompt_token_ids),
    "chat": list(chat.outputs[0].token_ids),
    "metrics": metrics_of(llm),
})
"""


@pytest.fixture(scope="session")
def baseline(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What plain vLLM (no connector) answers; the reference for every connector test."""
    tmp = tmp_path_factory.mktemp("baseline")
    texts = ["the quick brown fox jumps over the lazy dog", "river 42 mountain cloud window"]
    return run_engine_script(BASELINE, args={
        "model": str(tiny_model_dir), "tmp": str(tmp), "texts": texts, "max_tokens": MAX_TOKENS,
    })
