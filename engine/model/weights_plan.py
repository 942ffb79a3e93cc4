"""How a model's weights will be held once loaded, read from its files' headers before anything is loaded: the
format, the bits per weight, whether they are mapped from the file, read as stored, converted, quantized or
dequantized, and their bytes in memory. ``engine.model.fit`` builds its verdict on this; ``ModelInfo`` names the
format as loaded (``held_format``) from the same rules.

The rules are the loaders' own:

- a Hugging Face folder is read tensor by tensor (``engine.model.weights_read``); its weights are held in the
  compute dtype (``hf_load.choose_dtype``: float32 on a CPU unless ``--dtype`` says otherwise); a llama-family
  folder's bf16 weights with ``--dtype bfloat16`` on a CPU are the files' pages (``engine.model.folder_keep``);
- ``--quantize int8`` (bitsandbytes' LLM.int8): every linear's weight in int8 plus one float32 scale per output
  row; ``nf4``: two weights a byte plus a float32 scale per 64 weights (bitsandbytes' default block, no double
  quantization) and a 16-entry codebook per layer. Embeddings, the output head, norms and biases stay in the
  compute dtype (bitsandbytes converts ``nn.Linear`` layers only and leaves the output embedding alone);
- a GGUF file's weights are held as the GGUF loader will hold them (``engine.quant.gguf_keep.plan``): of a kept type
  (``engine.quant.formats``) as stored, memory-mapped from the file (the embedding too), the rest in the compute
  dtype; an architecture or machine the block kernels do not serve (``gguf_keep.refusal``) has every weight
  dequantized to the compute dtype as it is read.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# a name part that marks an embedding or the output head ("model.embed_tokens.weight", GGUF's "output.weight";
# not "blk.0.attn_output.weight")
_EMBEDDING_PARTS = ("wte", "wpe", "lm_head", "shared", "output", "token_embd")
_ELEM = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2, "F64": 8}
NF4_BLOCK = 64  # weights per float32 scale (bitsandbytes' default)
NF4_CODEBOOK = 16 * 4  # the 16 float32 levels, one copy per quantized layer


class Held(enum.StrEnum):
    """How the weights sit in memory once loaded."""

    MAPPED = "mapped"  # as the file stores them, memory-mapped: the file's pages are the weights
    REPACKED = "repacked"  # the file's blocks rearranged for this CPU's vectors as they are read (GGUF, AVX-512)
    READ = "read"  # as the file stores them, read into memory
    CONVERTED = "converted"  # to another float type as they are read (bfloat16 -> float32)
    QUANTIZED = "quantized"  # quantized as they are read (--quantize int8 / nf4)
    COPIED = "copied"  # mapped from the quantized copy a first load kept (engine.model.quant_copies)
    DEQUANTIZED = "dequantized"  # GGUF blocks dequantized to floats as they are read


@dataclass(frozen=True)
class Tensor:
    """One weight as a file declares it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' ("BF16") or GGML's ("Q4_K") spelling
    nbytes: int  # in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def is_linear(self) -> bool:
        """A 2-D weight of a layer that bitsandbytes converts (not an embedding or the output head)."""
        parts = self.name.lower().split(".")
        return (len(self.shape) == 2 and parts[-1] == "weight"
                and not any("embed" in p or p in _EMBEDDING_PARTS for p in parts))


@dataclass(frozen=True)
class WeightsPlan:
    """The weights as they will be held: ``format`` ("BF16", "F32", "Q4_K_M", "int8", "NF4"), converted from
    ``stored`` where they differ, ``bits_per_weight`` as held, how (``held``), the parameters and the bytes in
    memory (``bytes``) beside the bytes on disk (``file_bytes``); ``largest`` is the largest tensor's element
    count (a load's transient memory scales with it)."""

    format: str
    stored: str
    held: Held
    params: int
    bytes: int
    file_bytes: int
    largest: int
    quantization: str = "none"
    looked_up: int = 0  # held once a chat runs, beyond ``bytes``: a tied GGUF table's pages its lookups map

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.bytes / self.params if self.params else 0.0


def compute_dtype_name(spec_dtype: str, config_dtype: str, device: str) -> str:
    """The dtype a load computes in: the one asked for, else float32 on a CPU (half-precision matmuls are slow or
    inexact on most CPUs), else the checkpoint's half type, else float16."""
    if spec_dtype != "auto":
        return spec_dtype
    if device == "cpu":
        return "float32"
    return config_dtype if config_dtype in ("float16", "bfloat16") else "float16"


def stored_format(tensors: Iterable[Tensor]) -> str:
    """The type holding the most bytes among the 2-D+ weights (all tensors when none is)."""
    by_bytes: dict[str, int] = {}
    ts = list(tensors)
    for t in (x for x in ts if len(x.shape) >= 2) or ts:
        by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.nbytes
    if not by_bytes:
        for t in ts:
            by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.nbytes
    return max(by_bytes, key=by_bytes.__getitem__) if by_bytes else "F32"


def _torch_name(dtype: str) -> str:
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype.upper())


def quantized_bytes(t: Tensor, quantization: str) -> int:
    """Bytes of a linear's weight as it is held quantized: Q8_0 blocks (``q8_0``: 34 bytes a block of 32), or as
    bitsandbytes holds it (int8: a float32 scale per output row; NF4: a float32 scale per 64 and a codebook)."""
    rows = t.shape[0]
    if quantization == "q8_0":
        return t.numel // 32 * 34
    if quantization == "int8":
        return t.numel + 4 * rows  # int8 weights + a float32 scale per output row
    return (t.numel + 1) // 2 + 4 * math.ceil(t.numel / NF4_BLOCK) + NF4_CODEBOOK


def int8_blocks(device: str) -> bool:
    """Does ``--quantize int8`` hold Q8_0 blocks on ``device`` (``engine.model.q8_load``)?"""
    from engine.model import q8_load

    return q8_load.available(device)


def plan_tensors(tensors: list[Tensor], compute_dtype: str, quantization: str, file_bytes: int,
                 weights_type: str = "", dequantized: bool = False, blocks: bool = False) -> WeightsPlan:
    """The plan for ``tensors`` held with ``compute_dtype`` activations: quantized (``blocks``: int8 as Q8_0
    blocks, the linears whose rows are whole blocks; else by bitsandbytes), else in the compute dtype
    (``dequantized``: from a GGUF's blocks)."""
    elem = _ELEM[compute_dtype]
    stored = weights_type or stored_format(tensors)
    total = params = 0
    kinds: set[Held] = set()
    q8 = quantization == "int8" and blocks
    for t in tensors:
        params += t.numel
        if quantization != "none" and t.is_linear and (not q8 or t.shape[-1] % 32 == 0):
            total += quantized_bytes(t, "q8_0" if q8 else quantization)
            kinds.add(Held.QUANTIZED)
        else:
            total += t.numel * elem
            kinds.add(Held.DEQUANTIZED if dequantized else Held.READ if _ELEM.get(t.dtype) == elem
                      else Held.CONVERTED)
    largest = max((t.numel for t in tensors), default=0)
    if quantization != "none":
        held, fmt = Held.QUANTIZED, "Q8_0" if q8 else "int8" if quantization == "int8" else "NF4"
    else:
        held = next((h for h in (Held.DEQUANTIZED, Held.CONVERTED) if h in kinds), Held.READ)
        fmt = stored if held == Held.READ else _torch_name(compute_dtype)
    return WeightsPlan(fmt, stored, held, params, total, file_bytes, largest, quantization)


def plan_gguf(info, device: str, compute_dtype: str, quantization: str) -> WeightsPlan:
    """A GGUF file's plan: kept as blocks where the GGUF loader keeps them (``engine.quant.gguf_keep``), else
    dequantized to the compute dtype (and re-quantized by bitsandbytes with ``quantization``)."""
    tensors = gguf_tensors(info)
    keep = quantization == "none" and not _gguf_refusal(info.architecture, device)
    if not keep:
        return plan_tensors(tensors, compute_dtype, quantization, info.size_bytes, info.weights_type, True)
    import torch

    from engine.model.packed_linear import gguf_float_layout
    from engine.quant import gguf_keep

    layout = gguf_float_layout(torch.float32 if _ELEM[compute_dtype] == 4 else torch.bfloat16, device)
    p = gguf_keep.plan(info, device, _ELEM[compute_dtype], layout)
    params = sum(t.numel for t in tensors)
    held = Held.DEQUANTIZED if p.lost and not (p.mapped or p.packed) else Held.REPACKED if p.packed else Held.MAPPED
    copied = max((t.numel for t in tensors if t.dtype in p.lost or len(t.shape) < 2), default=0)
    return WeightsPlan(info.weights_type, info.weights_type, held, params, p.mapped + p.copied, info.size_bytes,
                       copied, quantization, p.looked_up)


def _gguf_refusal(architecture: str, device: str) -> str:
    """Why the GGUF loader dequantizes this file's weights ("" where it keeps them as blocks)."""
    try:
        from engine.quant import gguf_keep
    except ImportError:  # an engine without the block kernels' package
        return "no GGUF block kernels"
    return gguf_keep.refusal(architecture, device)


def folder_tensors(folder: Path) -> tuple[list[Tensor], int]:
    """The tensors a folder's safetensors files declare (headers only) and those files' bytes."""
    from engine.model.model_files import read_header, weight_files

    out: list[Tensor] = []
    size = 0
    for path in weight_files(folder):
        header, _ = read_header(path)
        size += path.stat().st_size
        for name, meta in header.items():
            start, end = meta["data_offsets"]
            out.append(Tensor(name, tuple(int(d) for d in meta["shape"]), str(meta["dtype"]), int(end - start)))
    return out, size


def gguf_tensors(info) -> list[Tensor]:
    """A GGUF file's tensors (``gguf_file.GgufInfo``), shapes as torch orders them (slowest first)."""
    return [Tensor(t.name, tuple(reversed(t.shape)), t.type_name, t.nbytes) for t in info.tensors]


def as_loaded(plan: WeightsPlan, weights_dtype: str) -> tuple[str, Held]:
    """(format, how held) of weights loaded by ``plan``, read off what the loader made: ``weights_dtype`` is the
    float dtype every weight ended in ("float32"), or "" where some are kept in blocks (integer tensors). A file
    the plan would map but the loader dequantized says so."""
    if plan.held not in (Held.MAPPED, Held.REPACKED) or not weights_dtype:
        return plan.format, plan.held
    name = _torch_name(weights_dtype)
    if name == plan.stored:
        return plan.format, Held.READ
    return name, Held.DEQUANTIZED if plan.stored not in ("F32", "F16", "BF16") else Held.CONVERTED
