"""What a GGUF tensor of each ggml type costs once loaded: the facts the loader acts on and the "will it fit"
estimate reads (no torch, no kernels imported: cheap to ask before anything loads).

A GGUF file's linear weights and token embedding of a ``KEPT`` type stay as the file stores them, mapped from
the file (no second copy): ``held_bytes`` is then the tensor's bytes in the file. Every other tensor is held in
the compute dtype: 1-D tensors (norms, biases: a few KiB a layer), and weights of a type the kernels do not
multiply (Q2_K, Q3_K, the IQ types, ...), dequantized on load. ``EMBEDDING_AS_BLOCKS``: the token embedding is
kept as blocks too and its rows dequantized as they are looked up (an untied output head is a kept linear).
Where the block kernels are missing (no compiler and no prebuilt library) nothing is kept: the whole model is
dequantized, as ``held_bytes(..., kept=False)`` counts. On AVX-512 VNNI the integer road's Q4_0, Q8_0, Q4_K and
Q6_K linears are held repacked sixteen rows a group (``packed_bytes``: in memory of their own, the file's pages let
go), an embedding's rows still read from the file; ``--quantize nf4``'s NF4 rows (``NF4``, ours) likewise, in Q4_0's
packed layout.
"""

from __future__ import annotations

from math import prod
from typing import Iterable

# ggml type id -> (name, elements per block, bytes per block); ggml's enum numbers (gguf's GGMLQuantizationType)
TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# ours, no ggml type (ggml's ids run to 39; a GGUF file never holds it): what ``--quantize nf4`` holds on a CPU,
# bitsandbytes' NF4 codes in Q4_0's layout with a half-precision scale and an int8 table (csrc/kq_blocks.h)
NF4 = 100
TYPES[NF4] = ("NF4", 32, 18)
# the types whose weights stay as stored and are multiplied by the block kernels (every type in llama.cpp's
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K_M / Q4_K_S, Q5_K_M / Q5_K_S, Q6_K, F16, BF16 and F32 files, with the 32-block
# types its quantizer falls back to when a row is no multiple of 256: Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K)
KEPT = frozenset((0, 1, 30, 2, 3, 6, 7, 8, 12, 13, 14))
QUANTIZED = KEPT - {0, 1, 30}
EMBEDDING_AS_BLOCKS = True
# the integer road's packed layout on AVX-512 VNNI (engine/quant/csrc/kq_pack.c): per sixteen rows, steps of
# (elements, bytes); Q4_K takes 2.8% more than the file (its 6-bit scales unpacked), Q6_K 1% (scales padded)
PACKED_STEPS = {2: (64, 576), 8: (64, 1088), 12: (256, 2368), 14: (256, 3392), NF4: (64, 576)}
# llama.cpp's architecture names whose GGUF weights load kept as blocks (their tensors map one to one onto the
# model's linears; llama's query / key rows are reordered by the product, not copied). Others are dequantized.
ARCHITECTURES = frozenset(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
                           "stablelm", "starcoder2", "granite", "olmo", "olmo2"))


def name(ggml_type: int) -> str:
    """'Q4_K' for 12; 'type 99' for a number ggml does not define."""
    return TYPES[ggml_type][0] if ggml_type in TYPES else f"type {ggml_type}"


def kept_names() -> str:
    """The kept types in words, for one-line messages ('F32, F16, BF16, Q4_0, ...')."""
    order = (0, 1, 30, 2, 3, 6, 7, 8, 12, 13, 14)
    return ", ".join(name(t) for t in order)


def row_bytes(ggml_type: int, n: int) -> int:
    """Bytes one row of ``n`` elements takes (ValueError: an unknown type or ``n`` no multiple of its block)."""
    if ggml_type not in TYPES:
        raise ValueError(f"unknown ggml type {ggml_type}")
    _, elems, size = TYPES[ggml_type]
    if n < 0 or n % elems:
        raise ValueError(f"{name(ggml_type)} rows hold multiples of {elems} elements, not {n}")
    return n // elems * size


def file_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes the tensor takes in the file (``shape`` in any order: only its last ggml dimension, the row, must be
    whole blocks; torch order puts it last)."""
    if not shape:
        return row_bytes(ggml_type, 1)
    return prod(shape[:-1]) * row_bytes(ggml_type, shape[-1])


def is_kept(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Is a tensor of this type and shape (torch order) held as the file stores it? Weights (2-D) of a kept
    type; 1-D tensors are held in the compute dtype."""
    return ggml_type in KEPT and len(shape) == 2


def held_bytes(ggml_type: int, shape: tuple[int, ...], compute_bytes: int = 4, kept: bool = True) -> int:
    """Bytes the tensor takes in memory once loaded: its file bytes where kept (mapped from the file), else its
    elements in the compute dtype (``compute_bytes``: 4 for float32, the CPU's)."""
    if kept and is_kept(ggml_type, shape):
        return file_bytes(ggml_type, shape)
    return prod(shape) * compute_bytes


def packed_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes a weight (torch order ``[rows, n]``) takes repacked for the integer road (``kq_pack_bytes``); 0 for a
    type without a packed layout."""
    if ggml_type not in PACKED_STEPS or len(shape) != 2:
        return 0
    elems, size = PACKED_STEPS[ggml_type]
    return -(-shape[0] // 16) * -(-shape[1] // elems) * size


def model_bytes(tensors: Iterable[tuple[int, tuple[int, ...]]], compute_bytes: int = 4,
                kept: bool = True, packed: Iterable[int] = ()) -> tuple[int, int]:
    """(bytes mapped from the file, bytes copied into the process) for a model's ``(ggml_type, shape)`` tensors;
    the tensors whose indices are in ``packed`` are held repacked (``packed_bytes``, copied)."""
    mapped = copied = 0
    packed = set(packed)
    for i, (t, shape) in enumerate(tensors):
        if kept and i in packed and packed_bytes(t, shape):
            copied += packed_bytes(t, shape)
        elif kept and is_kept(t, shape):
            mapped += file_bytes(t, shape)
        else:
            copied += prod(shape) * compute_bytes
    return mapped, copied


def bits_per_weight(tensors: Iterable[tuple[int, tuple[int, ...]]]) -> float:
    """The file's average bits per weight over its tensors (the model card's '4.85 bits per weight')."""
    bits = elems = 0
    for t, shape in tensors:
        bits += 8 * file_bytes(t, shape)
        elems += prod(shape) if shape else 1
    return bits / elems if elems else 0.0
