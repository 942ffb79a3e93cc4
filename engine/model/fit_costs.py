"""What a model costs beyond its weights and its KV cache, as ``engine.model.fit`` estimates it: the libraries a load
imports, what a first reply adds, a GGUF's tokenizer, a prompt token's activations and a load's bytes in flight —
each measured (``tests/engine/measure_fit.py``), with the config readers they need.
"""

from __future__ import annotations

from engine.model.weights_plan import Held

MiB = 1 << 20
# what a load imports beyond an idle engine (transformers' model and tokenizer code; bitsandbytes): measured
# +133 MB (none) and +170 MB (int8 / nf4) over the idle process on the 1B shape
LIBRARIES = {"none": 135 * MiB, "int8": 170 * MiB, "nf4": 170 * MiB}
# what a first reply adds beyond its activations and cache: the compiled decode step's code (4-11 MB), the
# sessions' modules (2 MB), a first chat's state (0-8 MB); measured on the 1B shape and 4-layer models. (Was 70 MB,
# fitted on the 1B when the activations' measured 1.6x was not counted: a 4-layer model's running estimate 13% high.)
RUNTIME = 16 * MiB
# a GGUF's tokenizer, built from its vocabulary's arrays (transformers' converter, then tokenizers' BPE), per merge
# (per token where a SentencePiece vocabulary has none): (held once loaded, more in flight while it is built).
# Measured on 4-layer models with real vocabularies, 2026-12-07: GPT-2's 50,000 merges, Qwen2's 151,387, Llama-3's
# 280,147 held +8 / +33 / +64 MiB after the load and +13 / +18 / +34 more at its peak; Phi-3's 32,064 SentencePiece
# tokens +17 and +8. (A folder's tokenizer.json is read by tokenizers itself: within the libraries' measure.)
TOKENIZER_BYTES = {"merge": (235, 130), "token": (556, 260)}
VOCAB_KEY = "kvscope_vocabulary"  # a GGUF's config (``weights_for``): {"tokens": n, "merges": m} of its header
# a prompt token's activations against the estimate's float formula: bitsandbytes' int8 product casts, quantizes
# and widens its inputs (x4.2 measured at 512-token chunks), NF4 dequantizes (x1.6); float and block products
# x1.6 (the MLP's gate, up and their product live at once, the blocks' 8-bit rows, the allocator's free lists:
# 1B shape, +48 / +74 MB for 133 / 256+ prompt tokens against a formula of 28 / 44)
ACTIVATION_FACTOR = {"none": 1.6, "int8": 4.2, "nf4": 1.6}  # (int8 as Q8_0 blocks: "none"; plan.format says)
# bytes in flight while loading, per element of the largest tensor: a tensor read (2 B/weight for bf16) and
# converted by four reader threads (float32: +130 MB for 16.8M-weight tensors), or quantized (int8 +185 MB:
# the float copy, its absolute values and rounding; nf4 +224 MB), or the packed copy of a merged gate/up (+65 MB)
# (a GGUF kept as blocks: its largest tensor copied out of the file, a norm or a type with no block kernel)
LOAD_BYTES_PER_ELEMENT = {Held.CONVERTED: 8, Held.READ: 4, Held.QUANTIZED: 14, Held.MAPPED: 4, Held.REPACKED: 4,
                          Held.COPIED: 4}


def text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def positive_int(c: dict, *names: str) -> int:
    """The first of ``names`` in ``c`` that is a positive int; 0 where none is."""
    for n in names:
        v = c.get(n)
        if type(v) is int and v > 0:
            return v
    return 0


def activation_bytes(config: dict, elem_bytes: int, quantization: str = "none") -> int:
    """A prompt token's activations in a prefill forward (hidden states, the MLP's products) in the compute dtype
    (times ``ACTIVATION_FACTOR``: what the products hold beyond it, measured). Not the logits: a prefill keeps the last token's only
    (``logits_to_keep=1``), and counting a vocabulary's row per prompt token put a Llama-3 vocabulary's 192-token
    chat at +98 MiB (0.84 of the estimate measured)."""
    c = text_config(config)
    hidden = positive_int(c, "hidden_size", "n_embd")
    inter = positive_int(c, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    per = (6 * hidden + 4 * inter) * elem_bytes
    return int(per * ACTIVATION_FACTOR.get(quantization, 1.0))


def tokenizer_bytes(config: dict) -> tuple[int, int]:
    """(held, in flight while built) by the tokenizer a GGUF's vocabulary makes (``TOKENIZER_BYTES``); (0, 0)
    for a folder's."""
    vocab = config.get(VOCAB_KEY) or {}
    merges, tokens = int(vocab.get("merges", 0) or 0), int(vocab.get("tokens", 0) or 0)
    per, n = (TOKENIZER_BYTES["merge"], merges) if merges else (TOKENIZER_BYTES["token"], tokens)
    return per[0] * n, per[1] * n
