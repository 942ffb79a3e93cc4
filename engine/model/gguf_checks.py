"""A GGUF file's model, described by its header, checked against the tensors the same header lists — before
transformers builds a layer or a tokenizer from it.

transformers trusts the header's numbers: ``llama.block_count`` 10^6 in a 1 MB file built 10^6 layers (5.5 GB,
150 s, ``std::bad_alloc``), a vocabulary of 10^6 tokens over 512 embedding rows ran 50 s and 3.1 GB into its
tokenizer, ``head_count_kv`` 0 divided by zero, a string where a number belongs stopped the Models dialog's whole
scan. Here every value transformers reads is type-checked and every size is compared with the tensors present
(``token_embd.weight`` is ``[hidden, vocab]`` in GGUF's fastest-first order), in microseconds, each refusal one
line naming the file, the key and the value (``ModelFormatError``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from engine.errors import ModelFormatError
from engine.model.gguf_file import GgufInfo, TensorEntry

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# keys whose values are counts or lengths (whole numbers, or per-layer lists of them) and those that are real
# numbers, by the end of their name: every key transformers maps (integrations/ggml.py) ends in one of these
_WHOLE = ("_count", "count_kv", "_length", "vocab_size", "sliding_window", "dimension_count", "inner_size",
          "state_size", "time_step_rank", "conv_kernel", "l_cache", "_token_id", "buckets_count")
_REAL = ("epsilon", "freq_base", "factor", "softcapping", "scale", "logit_scale")
_MIN_VOCAB_SHARE = 2  # a tokenizer must name at least 1/2 of the embedding rows (real ones: 99-100 %)
_FIX = "re-download it or convert it again with llama.cpp"


# general.architecture values that name no text-generation model
NOT_GENERATIVE = {"t5": "an encoder-decoder model", "umt5": "an encoder-decoder model",
                  "t5encoder": "an encoder", "general": "", "tokenizer": ""}


def check_named(info: GgufInfo) -> None:
    """Refuse a file that names no architecture, or one that is not a text-generation model (transformers' own
    list of the ones it reads is ``engine.model.gguf_load.check_architecture``'s, which imports it)."""
    name, arch = Path(info.path).name, info.architecture
    if not arch:
        raise ModelFormatError(f"{name} names no architecture (general.architecture is missing): not a model file")
    if NOT_GENERATIVE.get(arch):
        from engine.errors import UnsupportedModelError

        raise UnsupportedModelError(f"{name} holds {NOT_GENERATIVE[arch]} ({arch}), not a text-generation model")


def _fail(info: GgufInfo, what: str) -> ModelFormatError:
    return ModelFormatError(f"{Path(info.path).name}: {what} ({_FIX})")


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, dict):
        return f"an array of {value.get('count', 0):,} {str(value.get('type', '')).lower()}s"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def _is_whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_types(info: GgufInfo) -> None:
    """Every ``{architecture}.*`` count / length a whole number (or a per-layer list of them) and every epsilon,
    frequency base or factor a finite number above 0."""
    prefix = f"{info.architecture}."
    for key, value in info.metadata.items():
        if not key.startswith(prefix) and not key.startswith("tokenizer.ggml.") or key.endswith("token_type"):
            continue
        if key.endswith(_WHOLE):
            items = value if isinstance(value, list) else [value]
            if not items or not all(_is_whole(v) for v in items):
                raise _fail(info, f"{key} is {_kind(value)}, not a whole number")
            if min(items) < 0:
                raise _fail(info, f"{key} is {min(items)}: it cannot be negative")
        elif key.endswith(_REAL) and key.startswith(prefix):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _fail(info, f"{key} is {_kind(value)}, not a number")
            if not math.isfinite(value) or value <= 0:
                raise _fail(info, f"{key} is {value}: it must be a finite number above 0")


def _layers(info: GgufInfo) -> int:
    """How many layers the tensors hold: the highest ``blk.N.`` + 1."""
    top = -1
    for t in info.tensors:
        m = _BLOCK.match(t.name)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def _tensor(info: GgufInfo, name: str) -> TensorEntry | None:
    return next((t for t in info.tensors if t.name == name), None)


def _per_layer(info: GgufInfo, key: str, layers: int, minimum: int) -> list[int]:
    """``{arch}.key`` as one value per layer (a list must have one per layer); [] when absent."""
    value = info.get(key)
    if value is None:
        return []
    if isinstance(value, list):
        if len(value) != layers:
            raise _fail(info, f"{info.architecture}.{key} lists {len(value)} values for {layers} layers")
        values = value
    else:
        values = [value] * layers
    if max(values, default=0) < minimum:
        raise _fail(info, f"{info.architecture}.{key} is {max(values, default=0)}: it must be at least {minimum}")
    return values


def check_layers(info: GgufInfo) -> int:
    """``block_count`` against the layers the tensors hold; the layer count."""
    arch, held = info.architecture, _layers(info)
    count = info.get("block_count")
    if count is None:
        raise _fail(info, f"{arch}.block_count is missing")
    if count != held:
        raise _fail(info, f"{arch}.block_count is {count:,} but the file holds the tensors of {held:,} layers")
    return held


def check_heads(info: GgufInfo, layers: int, hidden: int) -> None:
    """Head counts at least 1 where a layer has attention, query heads a whole multiple of key/value heads, and
    the q / k projections as wide as the heads times their size."""
    arch = info.architecture
    heads = _per_layer(info, "attention.head_count", layers, 1)
    kv = _per_layer(info, "attention.head_count_kv", layers, 0) or heads
    for i, (h, k) in enumerate(zip(heads, kv)):
        if h and not k:
            raise _fail(info, f"{arch}.attention.head_count_kv is 0 for layer {i}, which has {h} query heads")
        if h and h % k:
            raise _fail(info, f"{arch}.attention.head_count {h} is not a multiple of head_count_kv {k} "
                              f"(layer {i})")
    if not heads:
        return
    head_dim = info.get("attention.key_length") or (hidden // heads[0] if heads[0] else 0)
    for role, n in (("attn_q", heads[0]), ("attn_k", kv[0])):
        t = _tensor(info, f"blk.0.{role}.weight")
        if t is not None and len(t.shape) == 2 and n and t.shape[1] != n * head_dim:
            raise _fail(info, f"{arch}.attention.head_count{'_kv' if role == 'attn_k' else ''} is {n:,} heads of "
                              f"{head_dim} but blk.0.{role}.weight has {t.shape[1]:,} rows")


def check_vocabulary(info: GgufInfo) -> tuple[int, int]:
    """The embedding's rows against ``vocab_size``, the output head and the tokenizer's token list (a token
    without a row crashes the model; rows without tokens write nothing); (rows, hidden)."""
    arch = info.architecture
    embd = _tensor(info, "token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise _fail(info, "it has no token_embd.weight (the token embedding)")
    hidden, rows = embd.shape
    width = info.get("embedding_length")
    if width is not None and width != hidden:
        raise _fail(info, f"{arch}.embedding_length is {width:,} but token_embd.weight rows are {hidden:,} wide")
    vocab = info.get("vocab_size")
    if vocab is not None and vocab != rows:
        raise _fail(info, f"{arch}.vocab_size is {vocab:,} but token_embd.weight has {rows:,} rows")
    out = _tensor(info, "output.weight")
    if out is not None and tuple(out.shape) != (hidden, rows):
        raise _fail(info, f"output.weight is {list(out.shape)} but token_embd.weight is {[hidden, rows]}")
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    n = tokens.get("count", 0) if isinstance(tokens, dict) else len(tokens) if isinstance(tokens, list) else None
    if n is None:
        raise _fail(info, "it has no tokenizer (tokenizer.ggml.tokens is missing)")
    if n > rows:
        raise _fail(info, f"its tokenizer has {n:,} tokens but token_embd.weight has {rows:,} rows")
    if n * _MIN_VOCAB_SHARE < rows:
        raise _fail(info, f"its tokenizer has {n:,} tokens for {rows:,} embedding rows: most of what the model "
                          "writes would have no text")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        v = info.metadata.get(key)
        m = v.get("count") if isinstance(v, dict) else len(v) if isinstance(v, list) else None
        if m is not None and m != n:
            raise _fail(info, f"{key} has {m:,} entries for {n:,} tokens")
    merges = info.metadata.get("tokenizer.ggml.merges")
    m = merges.get("count", 0) if isinstance(merges, dict) else len(merges) if isinstance(merges, list) else 0
    if m > 4 * n + 1000:
        raise _fail(info, f"tokenizer.ggml.merges has {m:,} entries for {n:,} tokens")
    for key in ("bos", "eos", "unknown", "padding"):
        tid = info.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if _is_whole(tid) and tid >= n:
            raise _fail(info, f"tokenizer.ggml.{key}_token_id is {tid:,}, past its {n:,} tokens")
    return rows, hidden


def check_feed_forward(info: GgufInfo, layers: int) -> None:
    ffn = _per_layer(info, "feed_forward_length", layers, 0)
    up = _tensor(info, "blk.0.ffn_up.weight")
    if ffn and up is not None and len(up.shape) == 2 and up.shape[1] != ffn[0]:
        raise _fail(info, f"{info.architecture}.feed_forward_length is {ffn[0]:,} but blk.0.ffn_up.weight has "
                          f"{up.shape[1]:,} rows")


def check_model(info: GgufInfo) -> None:
    """Everything transformers would build from ``info``'s header, against the tensors it lists
    (``ModelFormatError`` naming the key and value). The architecture is checked before (``check_architecture``)."""
    if not info.tensors:
        raise _fail(info, "it holds no tensors: it is not a model (or only a vocabulary)")
    check_types(info)
    context = info.get("context_length")
    if context is not None and context < 1:
        raise _fail(info, f"{info.architecture}.context_length is {context}: it must be at least 1")
    layers = check_layers(info)
    _, hidden = check_vocabulary(info)
    check_heads(info, layers, hidden)
    check_feed_forward(info, layers)
