"""``--quantize int8`` on a CPU: every linear's weight quantized to Q8_0 blocks (llama.cpp's 8-bit format: 32 int8
weights and a float16 scale a block, 8.5 bits per weight) the moment transformers has read it, and multiplied by the
GGUF block kernels (``engine.quant``: a ``BlockLinear``), the full-precision copy let go at once.

Why not bitsandbytes' int8 on a CPU: its product reads the weights at a quarter of the block kernels' speed for one
row (8192x2048 from the Llama-3.2-1B shape, one thread, shared AMD EPYC, 2026-12-06: 3.18 ms against 0.79; 16 rows
10.6 against 8.1; 128 rows 32 against 39, where its ``_int_mm`` wins), and a scale per row errs more than one per
32 weights (relative error of the product 0.0117 against 0.0076). The stored bytes stay 8-bit integers: 6% more of
them for the scales. bitsandbytes keeps int8 on CUDA, and on a CPU without the block kernels
(``engine.quant.kernel.library()`` None) or with ``KVSCOPE_INT8=bitsandbytes``.

The quantizer is ggml's ``quantize_row_q8_0_ref`` in C (engine/quant/csrc/kq_quantize.c, built with the block
kernels; bit for bit the ``gguf`` package's Q8_0): the scale d = max|x| / 127 of each block of 32,
q = round-half-away(x / d), d stored as float16. It reads the weight in the folder's own dtype (bfloat16 as read: no
float32 copy in flight).
"""

from __future__ import annotations

import os

import torch
from torch import nn

Q8_0 = 8  # ggml's type id
BLOCK = 32
ENV = "KVSCOPE_INT8"


def available(device: str) -> bool:
    """Does ``--quantize int8`` hold Q8_0 blocks here (a CPU with the GGUF block kernels, not turned off)?"""
    if device != "cpu" or os.environ.get(ENV, "").strip().lower() in ("bitsandbytes", "bnb"):
        return False
    try:
        from engine.quant import kernel
    except ImportError:
        return False
    return kernel.library() is not None


def quantize(w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """w [rows, n] (n a multiple of 32; float32 or bfloat16 as read, other floats converted) -> Q8_0 rows
    [rows, n / 32 * 34] uint8, as ggml stores them: each block's float16 scale (2 bytes) then its 32 int8 weights.
    The block kernels' library quantizes (``kq_quantize_q8_0``, C: engine/quant/csrc/kq_quantize.c)."""
    import ctypes

    from engine.quant import kernel

    lib = kernel.library()
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.to(torch.float32)
    if w.stride(1) != 1:
        w = w.contiguous()
    rows, n = w.shape
    out = torch.empty(rows, n // BLOCK * (BLOCK + 2), dtype=torch.uint8)  # [rows, row_bytes]
    fn = lib.kq_quantize_q8_0
    if fn.argtypes is None:  # declared once, here: the library is the block kernels' (engine.quant.kernel)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int]  # x bf16 rows n stride out threads
    if fn(w.data_ptr(), int(w.dtype == torch.bfloat16), rows, n, w.stride(0), out.data_ptr(),
          threads or torch.get_num_threads()) != 0:
        raise ValueError(f"Q8_0: rows of {n} weights are no whole blocks of {BLOCK}")
    return out


def _skip(model) -> set[str]:
    """Names of the linears that stay in floats: the output head (tied to the embedding or not; bitsandbytes leaves
    it alone too)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n for n, m in model.named_modules() if m is out}


def config():
    """transformers' quantization config that has a load quantize every linear to Q8_0 as it reads it
    (``Q8Quantizer``); registered with transformers the first time."""
    _register()
    return _CLASSES["config"]()


_CLASSES: dict = {}


def _register() -> None:
    """Register ``Q8Config`` / ``Q8Quantizer`` with transformers' public registry (once per process)."""
    if _CLASSES:
        return
    from transformers.quantizers import register_quantization_config, register_quantizer

    config_cls = register_quantization_config("kvscope_q8_0")(_config_class())
    quantizer_cls = register_quantizer("kvscope_q8_0")(_quantizer_class())
    _CLASSES.update(config=config_cls, quantizer=quantizer_cls)


def _config_class():
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class Q8Config(QuantizationConfigMixin):
        def __init__(self, **_kw) -> None:
            self.quant_method = "kvscope_q8_0"

    return Q8Config


def _quantize_op(base):
    class Q8Quantize(base):
        """One linear's float weight -> its Q8_0 blocks (transformers sets them into the ``BlockLinear``)."""

        def __init__(self, hf_quantizer) -> None:
            self.hf_quantizer = hf_quantizer

        def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):
            out = {}
            for name, value in input_dict.items():
                value = value[0] if isinstance(value, list) else value
                out[name] = quantize(value.detach())  # [out, in / 32 * 34] uint8; the float copy freed with it
            return out

    return Q8Quantize


def _quantizer_class():
    from transformers.core_model_loading import ConversionOps
    from transformers.quantizers import HfQuantizer
    from transformers.quantizers.quantizers_utils import get_module_from_name

    from engine.quant.modules import BlockLinear

    op = _quantize_op(ConversionOps)

    class Q8Quantizer(HfQuantizer):
        requires_calibration = False

        def validate_environment(self, *args, **kwargs) -> None:
            pass

        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            module, name = get_module_from_name(model, param_name)
            return isinstance(module, BlockLinear) and name == "weight"

        def _process_model_before_weight_loading(self, model, **kwargs) -> None:
            _to_blocks(model)

        def _process_model_after_weight_loading(self, model, **kwargs):
            return model

        def get_quantize_ops(self):
            return op(self)

        def is_serializable(self) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    return Q8Quantizer


def _to_blocks(model) -> None:
    """Every eligible ``nn.Linear`` (on the meta device still) becomes a ``BlockLinear`` whose weight is the meta
    tensor of its blocks, [out, in / 32 * 34] uint8: transformers then sets each quantized weight into it."""
    from engine.quant.modules import BlockLinear

    skip = _skip(model)
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or mod.in_features % BLOCK or name in skip:
            continue
        w = torch.empty(mod.out_features, mod.in_features // BLOCK * (BLOCK + 2), dtype=torch.uint8, device="meta")
        bias = torch.empty(mod.out_features, dtype=torch.float32, device="meta") if mod.bias is not None else None
        new = BlockLinear(w, Q8_0, mod.in_features, bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
