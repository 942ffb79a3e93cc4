"""The fused decode attention's native kernels from Python: the library built from ``engine/native/csrc/kv_tq.c``
(quantized pages) and ``kv_plain.c`` (float32 / bfloat16 pages) by the engine's one build path
(``engine.native.build``: a user's own build, else the prebuilt level for this CPU, else compiled here at first use
and cached), its functions declared for ctypes (``library()``). Missing (no compiler and nothing prebuilt, a failed
build, ``KVSCOPE_NATIVE=off``): ``library()`` is None, said once, and every caller keeps its torch path (the same
results up to summation order).
"""

from __future__ import annotations

import ctypes

from engine.native.build import Native
from engine.native.libraries import ATTEND


class Role(ctypes.Structure):
    """``kvs_role`` of the kernel source: one role's pages of one layer."""

    _fields_ = [("codes", ctypes.c_void_p), ("head_stride", ctypes.c_int64), ("row_bytes", ctypes.c_int),
                ("bits", ctypes.c_int), ("dim", ctypes.c_int), ("width", ctypes.c_int), ("norms", ctypes.c_void_p),
                ("levels", ctypes.c_void_p), ("table", ctypes.c_void_p), ("tail", ctypes.c_void_p),
                ("signs", ctypes.c_void_p), ("sign_head_stride", ctypes.c_int64), ("sign_row_bytes", ctypes.c_int),
                ("sign_norms", ctypes.c_void_p), ("sign_levels", ctypes.c_void_p), ("sign_table", ctypes.c_void_p),
                ("mode", ctypes.c_int), ("page_size", ctypes.c_int), ("group", ctypes.c_int),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64, role = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(Role)
    fn = lib.kvs_tq_decode
    fn.restype = i
    fn.argtypes = [i, i, p, i64, i64, role, role, p, p]  # hk rep q n nt keys values scratch out
    fn = lib.kvs_plain_decode
    fn.restype = i
    # h0 h1 rep n dk dv bf16 kp k_head vp v_head slots q nk nv scale out
    fn.argtypes = [i, i, i, i64, i, i, i, p, i64, p, i64, p, p, p, p, ctypes.c_float, p]
    fn = lib.kvs_prefill_attend
    fn.restype = i
    # h0 h1 rep nq n d dv q q_sh q_sr k k_sh k_sr v v_sh v_sr scale causal out o_sr
    fn.argtypes = [i, i, i, i, i64, i, i, p, i64, i64, p, i64, i64, p, i64, i64, ctypes.c_float, i64, p, i64]
    lib.kvs_prefill_width.restype = i
    lib.kvs_prefill_width.argtypes = []
    return lib


# kvs_tq_decode with the KV heads shared among torch's threads, set once ``engine.model.linear_op`` has loaded its
# C++ library (ctypes function: hk rep q n nt keys values out width dv); None until then
PARALLEL_TQ = None
TQ = Native(ATTEND, _declare)  # the fused decode attention over quantized pages, then plain ones


def library() -> ctypes.CDLL | None:
    """The fused attention's kernels (``Native.library``)."""
    return TQ.library()


def why() -> str | None:
    return TQ.why()
