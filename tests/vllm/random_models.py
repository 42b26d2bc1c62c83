"""Tiny random-weight models of any transformers architecture that vLLM can serve offline.

No model can be downloaded where the tests run, so they build one:
:func:`build_model` writes a tokenizer and a model of the architecture
transformers names ``arch`` (its ``model_type``: ``"llama"``, ``"qwen3"``,
``"mistral"``, ``"granite"``...), of the given sizes, into a folder.  The
defaults are the tests' model: a Llama of 2 layers, hidden 128, 4 attention
heads over 2 KV heads (head size 32, which vLLM's CPU attention supports).
The weights are drawn with ``initializer_range=0.5`` so that greedy outputs
depend visibly on the prompt (with the usual 0.02 every prompt decodes to the
same token).  Everything is seeded: building twice gives the same files.

The tests prompt with token ids, so the tokenizer is trained on nothing: a
byte-level BPE without merges (every byte one token), a chat template, and
byte pairs that fill the vocabulary up to :data:`VOCAB_SIZE`; encoding never
produces them, but any id a random model generates decodes to text.

torch, transformers and tokenizers are imported through importlib when a
model is built: importing this module (and skipping without them) needs none.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 2048
SEED = 1234
SPECIAL_TOKENS = ["<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

#: The tests' model (see the module docstring).
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 256
MAX_MODEL_LEN = 2048

#: A sliding-window model (``build_model(folder, "gemma3_text", **GEMMA3)``):
#: Gemma-3's text architecture, 4 layers alternating a :data:`WINDOW`-token
#: sliding window (layers 0 and 2) and full attention (1 and 3), head size 32.
#: vLLM's hybrid KV cache manager gives it two KV cache groups.
WINDOW = 64
GEMMA3: dict[str, Any] = {
    "hidden": 128, "heads": 4, "kv_heads": 2, "layers": 4, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}


def build_tokenizer(folder: Path, max_model_len: int = MAX_MODEL_LEN) -> Any:
    """Save the byte-level tokenizer (with the chat template) in ``folder``; returns it."""
    tk: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")

    alphabet = sorted(tk.pre_tokenizers.ByteLevel.alphabet())
    pairs = [a + b for a in alphabet for b in alphabet]
    vocab = (SPECIAL_TOKENS + alphabet + pairs)[:VOCAB_SIZE]
    tok = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids 0-4, matched whole in text
    begin, end = SPECIAL_TOKENS[:2]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=begin, eos_token=end, pad_token=end,
        model_max_length=max_model_len,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_model(
    folder: Path, arch: str = "llama", *, hidden: int = HIDDEN, layers: int = LAYERS,
    heads: int = HEADS, kv_heads: int = KV_HEADS, intermediate: int = INTERMEDIATE,
    max_model_len: int = MAX_MODEL_LEN, **config: Any,
) -> Path:
    """Write the tokenizer and a random model of transformers' ``arch`` into ``folder``.

    ``hidden // heads`` is the head size: vLLM's CPU attention supports 32, 64,
    80, 96, 112, 128 and 256.  ``config`` adds or overrides the architecture's
    own settings (e.g. ``sliding_window``).  Returns ``folder``.
    """
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder, max_model_len)
    settings = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_model_len,
        "initializer_range": 0.5,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "dtype": "float32",
        **config,
    }
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(arch, **settings))
    model.to(torch.float32).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder


if __name__ == "__main__":  # by hand: python tests/vllm/random_models.py DIR [ARCH]
    print(build_model(Path(sys.argv[1]), *sys.argv[2:3]))
