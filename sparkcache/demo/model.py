"""A random-weight Llama and a locally trained tokenizer that vLLM can serve offline.

No model can be downloaded on the machines the demo runs on, so it builds
one: a byte-level BPE tokenizer (2048 tokens, trained on
pseudo-English made of :data:`WORDS`) with a chat template, and a Llama of the
size a :class:`ModelSize` names.  The weights are drawn with
``initializer_range=0.5`` so that greedy outputs depend visibly on the prompt
(with the usual 0.02 every prompt decodes to the same token).  Everything is
seeded: building twice gives the same files.

:data:`TINY` is ``--quick``'s model; :data:`DEMO` is big enough that
prefilling a few thousand tokens takes seconds on a couple of CPU cores, so the
demo's time to first token with and without a restore differ visibly.

torch, transformers and tokenizers are imported inside the functions (through
importlib, which also keeps mypy out of them): ``import sparkcache`` never
needs them.
"""

from __future__ import annotations

import importlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO",
    "SEED",
    "SPECIAL_TOKENS",
    "TINY",
    "VOCAB_SIZE",
    "WORDS",
    "ModelSize",
    "build_model",
    "build_tokenizer",
    "corpus",
    "ensure_model",
]

VOCAB_SIZE = 2048
SEED = 1234

SPECIAL_TOKENS = ["<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORD_TEXT = (
    "the a an cache block token layer head model prompt store snapshot index engine "
    "request restore publish verify page memory disk file folder write read copy "
    "hash prefix chain alias lease evict budget worker scheduler rank vector matrix "
    "river mountain cloud garden window letter number story question answer reason "
    "quick brown fox jumps over lazy dog and or but with from into under above "
    "red green blue yellow black white small large early late fast slow open close"
)
#: The words the tokenizer is trained on (prompts made of them tokenize compactly).
WORDS = _WORD_TEXT.split(" ")

#: Where :func:`ensure_model` records the size a folder was built with.
_STAMP = ".sparkcache-model.json"


@dataclass(frozen=True)
class ModelSize:
    """The shape of a random Llama.  ``head_size`` is ``hidden // heads``; vLLM's
    CPU attention supports 32, 64, 80, 96, 112, 128 and 256."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_model_len: int

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        """Weights in the model (embeddings, layers, norms, untied output head)."""
        kv = 2 * self.hidden * self.kv_heads * self.head_size
        layer = 2 * self.hidden * self.hidden + kv + 3 * self.hidden * self.intermediate
        return 2 * VOCAB_SIZE * self.hidden + self.layers * (layer + 2 * self.hidden) + self.hidden

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads over "
                f"{self.kv_heads} KV heads, {self.parameters / 1e6:.0f}M parameters, float32")


#: ``--quick``'s model (the tests' size): engines start fast, prefill is instant.
TINY = ModelSize(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                 max_model_len=2048)
#: The demo's model: ~40M float32 parameters, a 3000-token prefill takes seconds
#: on two cores.
DEMO = ModelSize(hidden=768, layers=6, heads=12, kv_heads=4, intermediate=2048,
                 max_model_len=4096)


def corpus(n_lines: int = 4000, seed: int = SEED) -> list[str]:
    """Deterministic pseudo-English lines to train the tokenizer on."""
    rng = random.Random(seed)  # noqa: S311 (reproducible text, not a secret)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(folder: Path, max_model_len: int = TINY.max_model_len) -> None:
    """Train the BPE tokenizer on :func:`corpus` and save it (with the chat template)."""
    tk: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    begin, end = SPECIAL_TOKENS[:2]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=begin, eos_token=end, pad_token=end,
        model_max_length=max_model_len,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def build_model(folder: Path, size: ModelSize = TINY) -> Path:
    """Write the tokenizer and a random Llama of ``size`` into ``folder``; returns it."""
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder, size.max_model_len)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_size,
        max_position_embeddings=size.max_model_len,
        initializer_range=0.5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def ensure_model(folder: Path, size: ModelSize) -> bool:
    """Build the model of ``size`` into ``folder`` unless it already holds it.

    Returns True when it built.  A stamp file, written last, records the size:
    a folder from an interrupted build or of another size is rebuilt.  Reusing
    the folder keeps the weight files' mtimes, so the connector's weights
    fingerprint (and with it the snapshots' identity) stays the same.
    """
    stamp = folder / _STAMP
    want = {**asdict(size), "vocab_size": VOCAB_SIZE, "seed": SEED}
    try:
        if json.loads(stamp.read_text()) == want:
            return False
    except (OSError, ValueError):
        pass
    stamp.unlink(missing_ok=True)
    build_model(folder, size)
    stamp.write_text(json.dumps(want, sort_keys=True) + "\n")
    return True
