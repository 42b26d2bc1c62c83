"""The demos: a vLLM chat that survives an engine restart, and the store alone.

``python -m sparkcache.demo`` runs them (:mod:`sparkcache.demo.__main__`);
``bash scripts/demo.sh`` installs vLLM first.  The modules:

* :mod:`~sparkcache.demo.chat`: the main demo, two engine processes on one store;
* :mod:`~sparkcache.demo.engine`: one such engine (``python -m sparkcache.demo.engine``);
* :mod:`~sparkcache.demo.model`: the random-weight Llama and tokenizer they serve;
* :mod:`~sparkcache.demo.store_only`: the store alone, without vLLM (``--store-only``).

Nothing here is imported by the rest of sparkcache, and importing any of it
needs neither torch nor vLLM (they are imported when a demo runs).
"""
