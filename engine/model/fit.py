"""Will it fit? The memory a model will take, said before it loads: its weights as they will be held
(``engine.model.weights_plan``), the KV cache's bytes per token for each K/V precision (``engine.kv.paged.sizes``,
the formulas the cache itself uses), and the longest context that fits in the free RAM (CPU) or GPU memory.

The loader refuses a model that does not fit (``WontFitError``, with the numbers) before reading a weight: a load
the system would kill never starts (``engine.model.fit_check``). ``Fit`` is the type; the command line's words are
``fit_check``'s, the app's its own (``app.ground.format``).

What the process will hold, beyond what it holds now (measured on the Llama-3.2-1B shape, AMD EPYC, 2026-12-06,
``tests/engine/measure_fit.py``):

    loading   libraries + weights + in flight      in flight = the largest tensor's elements x LOAD_BYTES_PER_ELEMENT
    running   libraries + weights + activations + KV   activations = a prefill chunk's, for min(chunk, context)

``KVSCOPE_AVAILABLE_MEMORY`` (bytes, or with a unit: ``1.5GiB``, ``800MB``) stands in for the free memory: a small
machine simulated, for tests and for the user who wants the engine to keep within a budget.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError
from engine.kv.paged import sizes
# the measured costs beyond the weights and the cache (the libraries, a first reply, the tokenizer, the activations,
# a load's bytes in flight) and the config readers they need: ``engine.model.fit_costs`` (public from here too)
from engine.model.fit_costs import (  # noqa: F401
    ACTIVATION_FACTOR, LIBRARIES, LOAD_BYTES_PER_ELEMENT, RUNTIME, TOKENIZER_BYTES, VOCAB_KEY, MiB, activation_bytes,
    positive_int as _int, text_config, tokenizer_bytes)
from engine.model.weights_plan import Held, WeightsPlan

ENV = "KVSCOPE_AVAILABLE_MEMORY"
KV_KINDS = ("auto", "int8", "int4", "tq4", "tq3", "tq2")  # the K/V precisions a model can be run with
PAGE_SIZE = 16  # the paged cache's default: quantized pages' scales are per page
MIN_CONTEXT = 512  # a model that cannot hold this many tokens (or its whole context, if less) is refused
HEADROOM = 256 << 20  # left free for the system and the app around the model


class WontFitError(EngineError):
    """The model will not fit in the memory there is; ``fit`` says by how much."""

    def __init__(self, message: str, fit: "Fit") -> None:
        super().__init__(message)
        self.fit = fit


@dataclass(frozen=True)
class Attention:
    """What a token costs the KV cache: layers of full attention, sliding-window layers and their window, and the
    K/V heads' widths."""

    full: int
    sliding: int
    window: int
    kv_heads: int
    head_dim: int

    def per_token(self, kind: str, elem_bytes: int) -> float:
        """One token's K and V in one layer as ``kind`` ("auto": the compute dtype's ``elem_bytes``)."""
        if self.kv_heads < 1 or self.head_dim < 1:
            return 0.0
        if kind == "auto":
            return 2.0 * sizes.full_bytes_per_token(self.kv_heads, self.head_dim, elem_bytes)
        return sum(sizes.bytes_per_token(kind, role, self.kv_heads, self.head_dim, PAGE_SIZE) for role in "kv")

    @property
    def held(self) -> int:
        """Tokens a sliding layer holds at most: the window less the query (as HF's cache and ``ModelInfo``)."""
        return max(0, self.window - 1)

    def bytes_at(self, tokens: int, layer_bytes: float) -> float:
        return layer_bytes * (self.full * tokens + self.sliding * min(tokens, self.held))

    def cache_bytes(self, kind: str, elem_bytes: int, tokens: int) -> float:
        """What a chat's cache holds at ``tokens`` tokens as ``kind``: its pages, and for a quantized kind the
        page being filled, kept at full precision until it is whole (``QuantView.tail``)."""
        layer = self.per_token(kind, elem_bytes)
        held = self.bytes_at(tokens, layer)
        if kind != "auto":
            held += self.bytes_at(min(tokens, PAGE_SIZE), self.per_token("auto", elem_bytes) - layer)
        return held

    def working_bytes(self, kind: str, elem_bytes: int, tokens: int) -> float:
        """Beside a quantized cache: one layer's K and V dequantized for attention (``QuantView``'s buffer)."""
        return 0.0 if kind == "auto" or not self.full + self.sliding else \
            tokens * self.per_token("auto", elem_bytes)

    def longest(self, kind: str, elem_bytes: int, budget: float, cap: int, activations=lambda n: 0) -> int:
        """The most tokens (at most ``cap``) whose cache, working buffer and ``activations(tokens)`` fit in
        ``budget`` bytes."""
        def need(n: int) -> float:
            return self.cache_bytes(kind, elem_bytes, n) + self.working_bytes(kind, elem_bytes, n) + activations(n)

        if need(cap) <= budget:
            return cap
        lo, hi = 0, cap  # need(lo) <= budget < need(hi)
        if need(0) > budget:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
        return lo


@dataclass(frozen=True)
class KVCost:
    """One K/V precision: its bytes per token (every layer, K and V) and the longest context that fits."""

    kind: str  # "auto" is the compute dtype (``Fit.compute_dtype``)
    bytes_per_token: float
    longest_context: int


@dataclass(frozen=True)
class Fit:
    """The verdict before a load: the weights as held, the rest of what the process will take, the memory there
    is, and per K/V precision the bytes a token costs and the longest context that fits."""

    name: str
    device: str  # "cpu" | "cuda" | "mps"
    compute_dtype: str  # the activations' and the full-precision cache's dtype
    weights: WeightsPlan
    libraries: int
    runtime: int  # a first reply's modules and compiled step
    loading: int  # in flight while loading, beyond the kept weights
    activations: int  # bytes a prompt token's activations take in a prefill forward
    chunk: int  # tokens a prefill forward feeds at most (``engine.model.chunks``)
    available: int
    available_from: str  # "free RAM", "free GPU memory", or the variable that set it
    context: int  # the model's own context length
    kv: tuple[KVCost, ...]
    attention: Attention
    tokenizer: int = 0  # what the tokenizer built at load holds (a GGUF's, from its vocabulary: ``tokenizer_bytes``)

    @property
    def elem_bytes(self) -> int:
        return 4 if self.compute_dtype == "float32" else 2

    def kv_bytes(self, kind: str, tokens: int) -> float:
        """What a chat's cache holds at ``tokens`` tokens as ``kind`` (``Attention.cache_bytes``)."""
        return self.attention.cache_bytes(kind, self.elem_bytes, tokens)

    @property
    def load_bytes(self) -> int:
        """The peak while loading, beyond what the process holds now."""
        return self.libraries + self.tokenizer + self.weights.bytes + self.loading

    @property
    def resident_bytes(self) -> int:
        """Held once loaded and running, before any KV."""
        return (self.libraries + self.tokenizer + self.runtime + self.weights.bytes + self.weights.looked_up
                + self.compute_at(self.context or self.chunk))

    def total_at(self, tokens: int, kind: str = "auto") -> int:
        """All the process will hold beyond what it holds now, running a chat of ``tokens`` tokens with ``kind``
        K/V: libraries, runtime, weights, a prefill's activations, the cache and its working buffer."""
        return int(self.libraries + self.tokenizer + self.runtime + self.weights.bytes + self.weights.looked_up
                   + self.compute_at(tokens) + self.kv_bytes(kind, tokens)
                   + self.attention.working_bytes(kind, self.elem_bytes, tokens))

    def compute_at(self, tokens: int) -> int:
        """A prefill forward's activations for a prompt of ``tokens`` tokens."""
        return self.activations * min(tokens, self.chunk)

    @property
    def min_context(self) -> int:
        return min(MIN_CONTEXT, self.context) if self.context else MIN_CONTEXT

    @property
    def fits(self) -> bool:
        return self.load_bytes <= self.available and any(k.longest_context >= self.min_context for k in self.kv)

    def cost(self, kind: str) -> KVCost:
        return next(k for k in self.kv if k.kind == kind)


# -- the memory there is ----------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1.5GiB', '800MB', '2g', '123456' -> bytes (ValueError with one line otherwise)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{ENV}={text!r}: expected a size such as 8GiB, 800MB or 123456 (bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory(device: str) -> tuple[int, str]:
    """Bytes free for a model on ``device`` now, less ``HEADROOM``, and where the number came from."""
    if os.environ.get(ENV, "").strip():
        return parse_bytes(os.environ[ENV]), ENV
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return max(0, free - HEADROOM), "free GPU memory"
    import psutil

    return max(0, psutil.virtual_memory().available - HEADROOM), "free RAM"


# -- the model's shape ------------------------------------------------------------------------------------------
def attention_of(config: dict) -> Attention:
    """Layers that cache K/V (full and sliding-window: ``layer_types`` as transformers reads it; recurrent and
    convolution layers hold none) and the K/V heads' widths, from a ``config.json``."""
    c = text_config(config)
    layers = _int(c, "num_hidden_layers", "n_layer")
    q_heads = _int(c, "num_attention_heads", "n_head")
    kv_heads = _int(c, "num_key_value_heads") or q_heads
    hidden = _int(c, "hidden_size", "n_embd")
    head_dim = _int(c, "head_dim") or (hidden // q_heads if q_heads else 0)
    window = _int(c, "sliding_window", "attention_chunk_size")
    types = c.get("layer_types")
    if not isinstance(types, list) or not types:
        return Attention(layers, 0, 0, kv_heads, head_dim)
    attn = [t for t in types if isinstance(t, str) and t.endswith("attention")]
    sliding = sum(1 for t in attn if t in ("sliding_attention", "chunked_attention")) if window else 0
    return Attention(len(attn) - sliding, sliding, window, kv_heads, head_dim)


def _native_quantizer() -> bool:
    """Are the block kernels' quantizers here (``engine.model.q8_load``, ``engine.model.nf4_quant``)?"""
    try:
        from engine.quant import kernel
    except ImportError:
        return False
    return kernel.library() is not None


def _blocks(plan: WeightsPlan, device: str) -> bool:
    """Are ``--quantize int8 / nf4``'s weights the block kernels' (Q8_0 / NF4 blocks quantized in C, no
    bitsandbytes module, its products or its import)?"""
    return device == "cpu" and plan.format in ("Q8_0", "NF4") and plan.quantization in ("int8", "nf4") \
        and _native_quantizer()


def estimate(name: str, config: dict, plan: WeightsPlan, device: str, compute_dtype: str,
             available: int | None = None, available_from: str = "") -> Fit:
    """The verdict for ``plan`` (see ``weights_for``) on ``device``; ``available`` None: measured now."""
    if available is None:
        available, available_from = available_memory(device)
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[compute_dtype]
    gpu = device != "cpu"
    blocks = _blocks(plan, device)
    # the block kernels' int8 / NF4: the engine's own libraries (bitsandbytes never imported: 1B shape, NF4 from
    # the folder's mapping, running 926 MiB where bitsandbytes' ~100 MiB in the estimate said 1,053)
    libraries = 0 if gpu else LIBRARIES["none"] if blocks else LIBRARIES.get(plan.quantization, LIBRARIES["none"])
    factor = LOAD_BYTES_PER_ELEMENT.get(plan.held, 8)
    if plan.format == "Q8_0" or blocks:
        factor = 4  # quantized in C from the file's bytes (a folder's mapping: one tensor's in flight, +13-17 MB)
    tokenizer, building = tokenizer_bytes(config)
    loading = building + (plan.file_bytes if plan.held == Held.DEQUANTIZED  # transformers maps the file while it
                          else plan.largest * factor)  # dequantizes
    from engine.model.chunks import prefill_chunk

    kind = "none" if plan.format == "Q8_0" or blocks else plan.quantization  # the block products: the float formula
    act, chunk = activation_bytes(config, elem, kind), prefill_chunk(plan.params, device)
    c = text_config(config)
    context = _int(c, "max_position_embeddings", "n_positions", "seq_length")
    attn = attention_of(config)
    runtime = RUNTIME
    budget = available - (libraries + tokenizer + runtime + plan.bytes + plan.looked_up)
    cap = context or (1 << 20)
    kv = []
    for kind in KV_KINDS:
        per_token = attn.bytes_at(1, attn.per_token(kind, elem))
        kv.append(KVCost(kind, per_token, attn.longest(kind, elem, budget, cap, lambda n: act * min(n, chunk))))
    return Fit(name, device, compute_dtype, plan, libraries, runtime, int(loading), act, chunk, int(available),
               available_from, context, tuple(kv), attn, tokenizer)


# -- a model's files -> the verdict -----------------------------------------------------------------------------
def compute_dtype(spec, config: dict, device: str) -> str:
    """The dtype the loader computes in (``hf_load.choose_dtype``), by name."""
    from engine.model.weights_plan import compute_dtype_name

    c = text_config(config)
    stored = c.get("dtype") or c.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype") or ""
    return compute_dtype_name(spec.dtype, str(stored).replace("torch.", ""), device)


def weights_for(path: Path, spec, device: str) -> tuple[dict, WeightsPlan, str]:
    """(config, how the weights will be held, compute dtype) of a model folder or GGUF file, from headers only.
    ``EngineError`` (one line) for files that cannot be read."""
    from engine.model import weights_plan as wp
    from engine.model.gguf_file import looks_like_gguf

    if looks_like_gguf(str(path)):
        from engine.model.gguf_checks import check_model
        from engine.model.gguf_file import read_gguf
        from engine.model.gguf_load import check_architecture

        info = read_gguf(path)
        check_architecture(info)  # a bad header gets its own one line, and no estimate
        check_model(info)
        config = info.config()
        config[VOCAB_KEY] = {k: _array_count(info.metadata.get(f"tokenizer.ggml.{k}")) for k in ("tokens", "merges")}
        dtype = compute_dtype(spec, config, device)
        return config, wp.plan_gguf(info, device, dtype, spec.quantization), dtype
    from engine.model.model_files import check_folder

    config = check_folder(path, spec)  # the files and config.json's sizes, each problem in its own one line
    dtype = compute_dtype(spec, config, device)
    tensors, size = wp.folder_tensors(path)
    blocks = spec.quantization == "int8" and wp.int8_blocks(device)
    plan = wp.plan_tensors(tensors, dtype, spec.quantization, size, blocks=blocks)
    if plan.held == Held.READ and _mapped_folder(path, str(config.get("model_type", "")), spec, dtype, device):
        plan = dataclasses.replace(plan, held=Held.MAPPED)  # the same bytes, the files' pages
    elif plan.held == Held.QUANTIZED and _copied(path, str(config.get("model_type", "")), spec, dtype, device):
        plan = dataclasses.replace(plan, held=Held.COPIED)  # the blocks a first load quantized, mapped
    return config, plan, dtype


def _array_count(value) -> int:
    """How many items a header's array holds (a long one is kept as {"count": n, ...}, a short one as a list)."""
    if isinstance(value, dict):
        return int(value.get("count", 0) or 0)
    return len(value) if isinstance(value, list) else 0


def _copied(folder: Path, model_type: str, spec, compute_dtype: str, device: str) -> bool:
    """Will a ``--quantize`` load of the folder map the quantized copy a first load kept
    (``engine.model.quant_copies``)? (A copy found broken then is quantized again: the model card says so.)"""
    try:
        from engine.model import folder_keep, quant_copies
        from engine.model.model_files import weight_files
    except ImportError:
        return False
    if not folder_keep.applies(folder, model_type, spec, compute_dtype, device):
        return False
    path = quant_copies.path_of(weight_files(folder), spec.quantization)
    return path is not None and path.is_file()


def _mapped_folder(folder: Path, model_type: str, spec, compute_dtype: str, device: str) -> bool:
    """Are a folder's bf16 weights multiplied from its files' mappings (``engine.model.folder_keep``)? (torch
    imported only where the load could be: a CPU, bfloat16 or int8)"""
    wanted = spec.quantization == "int8" or (spec.quantization == "none" and compute_dtype == "bfloat16")
    if device != "cpu" or not wanted:
        return False
    try:
        from engine.model import folder_keep
    except ImportError:  # an engine without the block kernels' package
        return False
    return folder_keep.applies(folder, model_type, spec, compute_dtype, device)


def estimate_path(path: Path, spec, device: str, available: int | None = None, available_from: str = "",
                  name: str = "") -> Fit:
    """The verdict for the model at ``path`` (a folder or a GGUF file) loaded as ``spec`` says on ``device``
    (``available`` None: the memory free now)."""
    config, plan, dtype = weights_for(path, spec, device)
    return estimate(name or path.name, config, plan, device, dtype, available,
                    available_from or ("" if available is None else "the memory given"))
