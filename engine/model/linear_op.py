"""The compiled step's C++ operators from Python: CPU kernels of ``kvscope::blocked_linear`` (the native blocked
product), ``kvscope::paged_decode`` / ``paged_decode_batch`` (one token's attention read in place from its pages),
``kvscope::write_slot`` (its new K/V written after the step) and ``kvscope::gguf_linear`` (a GGUF weight's product,
from the table ``engine.quant.gguf_op`` fills), in ``engine/native/csrc/torch_ops.cpp`` and ``gguf_ops.cpp``.

A compiled step's package calls the operators through torch's dispatcher (``engine.model.linear_kernel`` and
``engine.kv.store.paged_decode`` define them, with Python kernels): ~17 us a call of a Python kernel, ~2 us of the C++
one (~2 ms of a SmolLM2-shape step's 121 linears). Loaded, the library takes the operators' CPU dispatch and calls the
same C functions as the Python kernels, whose addresses it is handed (``kvs_ops_bind``): the results the same.

Built by the engine's one build path (``engine.native.build``) against the running torch: the prebuilt library for
this torch where an installer or the wheel ships one, else compiled here once (~10-30 s; off the engine thread: the
compiled step's watcher, or ``attach_soon``) and cached. Without it (no C++ compiler and nothing prebuilt, no torch
headers, a failed build) the Python kernels answer.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from engine.kv.quantized import native
from engine.kv.store import paged_decode  # noqa: F401 - defines kvscope::paged_decode, whose CPU kernel is here
from engine.model import linear_kernel
from engine.model.notes import LoadNote
from engine.native import build
from engine.native.libraries import TORCH_OPS
from engine.quant import gguf_op

log = logging.getLogger(__name__)


def _open(path: str) -> ctypes.CDLL:
    torch.ops.load_library(path)  # its static initializers register the operators' CPU kernels
    return ctypes.CDLL(path)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kvs_ops_bind.restype = None
    lib.kvs_ops_bind.argtypes = [p, p, p, p]  # kvs_blocked_mm kvs_blocked_mm_h kvs_plain_decode kvs_tq_decode_heads
    fn = lib.kvs_tq_decode_parallel
    fn.restype = i
    fn.argtypes = [i, i, p, i64, i64, p, p, p, i64, i64]  # hk rep q n nt keys values out width dv
    if hasattr(lib, "kvs_ops_bind_xh"):  # float32 rows x bfloat16 weights (a library prebuilt before: none)
        lib.kvs_ops_bind_xh.restype = None
        lib.kvs_ops_bind_xh.argtypes = [p]  # kvs_blocked_mm_xh
        fn = lib.kvs_blocked_xh_parallel
        fn.restype = i
        fn.argtypes = [i, i, i64, p, p, p, p, p, i64]  # rows n_in nb xf xb wb bias y ldy
    lib.kvs_gguf_bind.restype = None
    lib.kvs_gguf_bind.argtypes = [p, p]  # kq_linear, the shapes-only count
    lib.kvs_gguf_clear.restype = None
    lib.kvs_gguf_clear.argtypes = []
    lib.kvs_gguf_size.restype = i64
    lib.kvs_gguf_size.argtypes = []
    lib.kvs_gguf_bind_rows.restype = None
    lib.kvs_gguf_bind_rows.argtypes = [p, p]  # kq_get_rows, kq_row_bytes_of
    return lib


OPS = build.Native(TORCH_OPS, _declare, _open)
_lock = threading.Lock()
_state = {"tried": False, "loaded": False, "why": ""}


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def attach() -> bool:
    """Load (building once where needed) the C++ operators and hand them the C kernels; False, said once in the log
    and in ``why()``, where it cannot be (the Python kernels answer then). May block for a build: call it off the
    engine thread."""
    with _lock:
        if _state["tried"]:
            return _state["loaded"]
        _state["tried"] = True
        lib, attn = linear_kernel.LINEAR.library(), native.library()  # the products; the decode attention
        ops = OPS.library() if lib is not None and attn is not None else None
        if ops is None:
            _state["why"] = linear_kernel.LINEAR.why() or native.why() or OPS.why() or ""
            log.info("the compiled step's operators call their Python kernels (%s)", _state["why"])
            return False
        ops.kvs_ops_bind(_address(lib.kvs_blocked_mm), _address(lib.kvs_blocked_mm_h),
                         _address(attn.kvs_plain_decode), _address(attn.kvs_tq_decode_heads))
        native.PARALLEL_TQ = ops.kvs_tq_decode_parallel  # the quantized pages' attention: heads shared too
        if linear_kernel.takes_float() and hasattr(ops, "kvs_ops_bind_xh"):  # (both built with it)
            ops.kvs_ops_bind_xh(_address(lib.kvs_blocked_mm_xh))
            linear_kernel.PARALLEL_XH = ops.kvs_blocked_xh_parallel  # float32 rows x bfloat16: blocks shared
        gguf_op.use(ops, linear_kernel.PARALLEL_XH is not None)  # the GGUF products' table (kq_linear bound at its first entry: the GGUF kernels loaded)
        linear_kernel.PARALLEL = True
        _state["loaded"] = True
        return True


def attach_soon() -> None:
    """``attach`` on a thread of its own (a model on several threads: its blocked linears' products are shared
    among them once the kernel loads; until then they run as on one thread or through MKL)."""
    if not _state["tried"]:
        threading.Thread(target=attach, name="kvscope-linear-op", daemon=True).start()


def loaded() -> bool:
    """Has ``attach`` loaded the C++ kernels (the operators' CPU dispatch is theirs)?"""
    return _state["loaded"]


def why() -> str:
    """Why ``attach()`` found no C++ kernel ('' when it did, or before it was asked)."""
    return _state["why"]


def say_missing(progress) -> None:
    """Say as a note of a load's ``progress`` (the command line prints it, the app shows it) which native kernels a
    CPU model cannot have here and what each costs, the first time they are found missing in this process: the
    attention's and the linears' libraries are asked for (built here the first time: a few seconds), the C++
    operators only where no build can give them (``build.probe``: nothing prebuilt for this torch and no working C++
    compiler), so a load never waits for their build."""
    linear_kernel.LINEAR.library()
    native.library()
    if build.probe(TORCH_OPS) is not None:
        OPS.library()  # fails at once: nothing prebuilt for this torch and nothing to build with
    note = build.missing_note()
    if note:
        progress(LoadNote(note), 0.98)
