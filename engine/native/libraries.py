"""The native libraries: which sources each is compiled from, with which flags, and in words the fast path it is and
what runs without it (said once to the user when it is missing: ``engine.native.build.missing_note``). Built and
loaded by ``engine.native.build``; their Python faces declare their functions (``engine.kv.quantized.native``,
``engine.model.linear_kernel``, ``engine.model.linear_op``, ``engine.quant.kernel``)."""

from __future__ import annotations

from pathlib import Path

from engine.native.build import Library

HERE = Path(__file__).parent
CSRC = HERE / "csrc"
PREBUILT = HERE / "prebuilt"
QUANT = HERE.parent / "quant"  # the GGUF block kernels' sources live beside their Python face
C_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno")

ATTEND = Library(
    "attend", CSRC, ("kv_tq.c", "kv_plain.c", "kv_prefill.c"), C_FLAGS, PREBUILT, "KVSCOPE_ATTEND_LIB",
    what="the fused decode attention",
    cost="each decode step gathers the cached K/V into new tensors for torch's attention (quantized pages "
         "dequantized whole), and a few new tokens over many cached ones run torch's attention (~1.5x slower)")
LINEAR = Library(
    "linear", CSRC, ("blocked_linear.c", "argmax.c"), C_FLAGS, PREBUILT, "KVSCOPE_LINEAR_LIB",
    what="the blocked linears' product",
    cost="float32 and bfloat16 linears go through torch's per-block product (bfloat16 at ~5 GB/s), and a greedy "
         "token is picked by torch's argmax (~0.1 ms a token for a 128K vocabulary)")
KQ = Library(
    "kq", QUANT / "csrc", ("*.c",), (*C_FLAGS, "-std=gnu11"), QUANT / "prebuilt", "KVSCOPE_QUANT_LIB",
    what="the GGUF block kernels", cost="quantized GGUF weights are dequantized on load (up to 7x the file's size in memory)",
    openmp=True)
TORCH_OPS = Library(
    "torch_ops", CSRC, ("torch_ops.cpp", "gguf_ops.cpp"), ("-O2", "-shared", "-fPIC", "-std=c++20", "-w", "-fopenmp"),
    PREBUILT, "KVSCOPE_TORCH_OPS_LIB",
    what="the compiled step's C++ operators",
    cost="a compiled step calls Python kernels (~17 us a call where these take ~2) and a product on several threads "
         "is not shared among them",
    cxx=True, torch=True)
ALL = (ATTEND, LINEAR, KQ, TORCH_OPS)
