"""GGUF files with weights in any block type, written in the test with the ``gguf`` package's writer.

Weights of a type ``gguf.quants`` can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) are the model's own,
quantized; k-quant weights (Q4_K, Q5_K, Q6_K: the package has no quantizer for them) are random valid blocks,
their scales set so the values have about the model's spread. Random block bytes are valid blocks: every bit
pattern decodes, and the reference for a file is the model the ``gguf`` package dequantizes from it
(transformers' ``from_pretrained(dir, gguf_file=...)``), never the model it was written from.

``types(hf_name, shape)`` picks each 2-D weight's type (None: F32); norms stay F32. The rest is ``gguf_make``'s
(names, llama's q/k permutation, Gemma's 1 + w norms, hyperparameters, stories260K's vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from gguf_make import CHAT_TEMPLATE, _hyperparameters, _vocab, close, gguf_tensors

ALL = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
# d = std / a, dmin = b * d; where the half-precision d (and dmin) sit in a block
K_SCALES = {"Q4_K": (150.0, 7.5), "Q5_K": (300.0, 15.5), "Q6_K": (600.0, 0.0), "Q3_K": (60.0, 0.0),
            "Q2_K": (20.0, 1.5)}
D_AT = {"Q4_K": 0, "Q5_K": 0, "Q6_K": 208, "Q3_K": 108, "Q2_K": 80}


def random_k_blocks(data: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks (Q2_K .. Q6_K) for data's shape [rows, n] (n a multiple of 256), uint8 [rows, bytes]."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, n = data.shape
    raw = rng.integers(0, 256, size=(rows, n // block, size), dtype=np.uint8)
    a, b = K_SCALES[qtype]
    d = np.full(raw.shape[:2], max(float(data.std()), 1e-3) / a, dtype=np.float16)
    at = D_AT[qtype]
    raw[:, :, at:at + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    if b:
        dmin = (d.astype(np.float32) * b).astype(np.float16)
        raw[:, :, at + 2:at + 4] = dmin.view(np.uint8).reshape(*d.shape, 2)
    return raw.reshape(rows, -1)


def encode(data: np.ndarray, qtype: str, rng: np.random.Generator):
    """(array, raw_dtype) for the writer: data [rows, n] float32 as ``qtype``."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return np.ascontiguousarray(data, dtype=np.float32), None
    if qtype in K_SCALES:
        return random_k_blocks(data, qtype, rng), kind
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), kind), kind


def write_blocks(model, arch: str, tokenizer_model: Path, path: Path,
                 types: Callable[[str, tuple[int, ...]], str | None], seed: int = 0, file_type: int | None = None,
                 chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Write ``model`` (a float32 transformers causal LM of type ``arch``) to ``path`` with each 2-D weight in
    ``types(hf_name, shape)`` (None: F32). Returns ``path``."""
    import gguf

    rng = np.random.default_rng(seed)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _hyperparameters(writer, arch, cfg, int(cfg.max_position_embeddings))
    if file_type is not None:
        writer.add_file_type(file_type)
    pieces, scores, token_types = _vocab(tokenizer_model)
    bos, eos, unk = 1, 2, 0
    if arch == "gemma2":  # Gemma's special pieces where its vocabulary has them (as gguf_make writes them)
        pieces[:5] = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        token_types[:5] = [3, 3, 3, 2, 3]
        bos, eos, unk = 2, 1, 3
        writer.add_pad_token_id(0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(unk)
    writer.add_add_bos_token(True)
    if chat_template:
        writer.add_chat_template(chat_template)
    for name, hf_name, data in gguf_tensors(model, arch):
        qtype = types(hf_name, data.shape) if data.ndim == 2 else None
        array, raw = encode(data, qtype or "F32", rng)
        writer.add_tensor(name, array, raw_dtype=raw) if raw is not None else writer.add_tensor(name, array)
    close(writer)
    return path


def cycle(kinds: tuple[str, ...]) -> Callable[[str, tuple[int, ...]], str]:
    """A ``types`` that gives the 2-D weights ``kinds`` in turn (each weight its own, in state-dict order)."""
    seen: dict[str, str] = {}

    def pick(hf_name: str, shape: tuple[int, ...]) -> str:
        if hf_name not in seen:
            seen[hf_name] = kinds[len(seen) % len(kinds)]
        return seen[hf_name]
    return pick
