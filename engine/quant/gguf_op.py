"""The table the C++ kernel of ``kvscope::gguf_linear`` answers from (``engine/native/csrc/gguf_ops.cpp``), filled
and emptied from Python.

A compiled decode step calls the operator ~113 times (1B shape). Its Python kernel (``engine.quant.modules``) finds
the weight's packed owner or descriptor and calls ``kq_linear`` through ctypes: ~12 us a call over the product,
~1.4 ms a token. Once the C++ operators are loaded (``engine.model.linear_op.attach`` hands their library here), the
Python kernel ``offer``s each call that was a plain descriptor's product (no packing pending, not inside
``shapes_only``): the C++ kernel then answers the same arguments with the same C function and descriptor, and sends
every other call to the Python kernel (``kvscope::gguf_linear_py``). A float layout's owner whose product is the
float32-rows blocked one (a BF16 GGUF's, ``packed_linear.BF16_BLOCKED_F32``) or the bfloat16 one (a bf16 folder's,
``packed_linear.BF16_BLOCKED``) is offered as its blocked copy (``offer_blocked``): the C++ kernel calls that product
(``kvs_blocked_xh_parallel`` / ``kvs_blocked_h_parallel``) as its Python product does.

An entry holds the storages its descriptor points into, so no address in the table is freed and reused while it is
there. The table is emptied (``forget``) whenever a block linear changes (a weight, bias, row map, road, packed copy
or layout set, moved, packed, deferred) or an owner it served is collected: an entry never answers for a module in
another state than the one it was offered in. A ``forget`` between a call's start and its offer voids the offer
(``generation``).
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref

import torch

# ``engine.quant.modules.shapes_only``'s count: while it is nonzero the C++ kernel sends every call to Python
HELD = ctypes.c_int(0)
# an offer and a forget one at a time (an offer is checked against the generation it saw); reentrant: a collection
# inside an offer runs a collected owner's forget on the same thread
_lock = threading.RLock()
_state = {"ops": None, "bound": False, "generation": 0}

# the C++ kernel's registration (its only kernel is C++'s): ``held``, the storages the descriptor points into
_LIB = torch.library.Library("kvscope", "FRAGMENT")
_LIB.define("gguf_table_put(Tensor w, int ggml_type, int n_in, Tensor? bias, Tensor? out_map, int road, "
            "Tensor[] held, int desc) -> ()")
_LIB.define("gguf_table_put_blocked(Tensor w, int ggml_type, int n_in, Tensor? bias, Tensor? out_map, int road, "
            "Tensor wb, bool rounded, bool half=False) -> ()")


def use(ops: ctypes.CDLL, blocked: bool = False) -> None:
    """The C++ operators' library, loaded and declared (``engine.model.linear_op``): the table is filled from now on;
    ``blocked``: it shares a float32-rows blocked product's blocks among torch's threads (``offer_blocked``)."""
    with _lock:
        _state["blocked"] = blocked
        if _state["ops"] is None:  # emptied while Python runs: an entry left to the library's exit would let its
            atexit.register(forget)  # storages go after Python is gone (a numpy or mapping storage: a crash)
        if _state["ops"] is not ops:
            _state["rows"] = False  # (``bind_rows``: this library's lookup not bound yet)
        _state["ops"] = ops


def generation() -> int:
    """How many times the table was emptied: a call reads it before it looks at a module, ``offer`` after."""
    return _state["generation"]


def on() -> bool:
    """Is there a C++ kernel to offer descriptors to?"""
    return _state["ops"] is not None


def offer(seen: int, x2: torch.Tensor, w: torch.Tensor, ggml_type: int, n_in: int, bias: torch.Tensor | None,
          out_map: torch.Tensor | None, road: int, desc, owner=None) -> None:
    """The descriptor ``desc`` (``(kq_linear, address, kernel.Weight, storages)``, as ``engine.quant.modules`` keeps
    them) answers the calls with these arguments from now on, unless the table was emptied since ``seen``
    (``generation``) or ``shapes_only`` is running. ``owner``: the block linear whose descriptor it is (its
    collection empties the table). Calls the C++ kernel would send back (activations not float32 [m, n_in]) are not
    offered: each would be offered again."""
    ops = _state["ops"]
    if ops is None or HELD.value or x2.dtype != torch.float32 or x2.dim() != 2 or x2.shape[1] != n_in:
        return
    held = [torch.empty(0, dtype=torch.uint8).set_(s) for s in desc[3]]  # the storages, as tensors
    _put(seen, desc[0], owner, torch.ops.kvscope.gguf_table_put, w, ggml_type, n_in, bias, out_map, road, held,
         desc[1])


def offer_blocked(seen: int, x2: torch.Tensor, w: torch.Tensor, ggml_type: int, n_in: int, bias: torch.Tensor | None,
                  out_map: torch.Tensor | None, road: int, owner) -> None:
    """``offer`` for a float layout's owner (``owner.layout``, ``owner.packed``): where its product is the float32-rows
    blocked one (``linear_kernel.float_product`` of its blocked copy, bias and rounding) and the C++ operators have
    it (``use(..., blocked=True)``), or the bfloat16 one (a bf16 folder's linears, no bias: the rows rounded to
    bfloat16, ``linear_kernel.product``, the outputs widened), the C++ kernel answers these arguments with that
    product from now on (the bfloat16 one up to 16 rows: beyond, the layout's product may be oneDNN's)."""
    layout, wb = owner.layout, owner.packed
    compute = getattr(layout, "compute", None)
    half = compute == torch.bfloat16 and bias is None and not layout.rounded
    if (_state["ops"] is None or HELD.value or wb is None or wb.dtype != torch.bfloat16 or not wb.is_contiguous()
            or x2.dim() != 2 or x2.shape[1] != n_in or x2.dtype != torch.float32
            or not (half or (compute == torch.float32 and _state.get("blocked")
                             and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))))):
        return
    from engine.quant import kernel

    _put(seen, kernel.library().kq_linear, owner, torch.ops.kvscope.gguf_table_put_blocked, w, ggml_type, n_in,
         bias, out_map, road, wb, bool(layout.rounded), half)


def _put(seen: int, kq_linear, owner, put, *args) -> None:
    """``put(*args)`` unless the table was emptied since ``seen`` (the C++ kernel bound to ``kq_linear`` and the
    shapes-only count at the first); ``owner``'s collection empties the table."""
    with _lock:
        if seen != _state["generation"] or HELD.value:
            return
        if not _state["bound"]:
            _state["ops"].kvs_gguf_bind(ctypes.cast(kq_linear, ctypes.c_void_p).value, ctypes.addressof(HELD))
            _state["bound"] = True
        put(*args)
        if owner is not None and not owner.__dict__.get("_tabled"):
            owner.__dict__["_tabled"] = True
            weakref.finalize(owner, forget).atexit = False


def bind_rows(kq) -> None:
    """The C++ kernel of ``kvscope::gguf_rows`` looks rows up from now on (``kq``: the GGUF kernels' library, whose
    ``kq_get_rows`` it calls), where the C++ operators are loaded. Once; cheap after."""
    ops = _state["ops"]
    if ops is None or _state.get("rows") or kq is None or not hasattr(ops, "kvs_gguf_bind_rows"):
        return
    with _lock:
        addr = ctypes.cast(kq.kq_get_rows, ctypes.c_void_p).value
        ops.kvs_gguf_bind_rows(addr, ctypes.cast(kq.kq_row_bytes_of, ctypes.c_void_p).value)
        _state["rows"] = True


def forget() -> None:
    """Empty the table (its storages let go): a block linear changed or was collected. Cheap where it is empty."""
    with _lock:
        _state["generation"] += 1
        if _state["ops"] is not None:
            _state["ops"].kvs_gguf_clear()


def size() -> int:
    """Entries in the table (0 without the C++ kernel)."""
    ops = _state["ops"]
    return int(ops.kvs_gguf_size()) if ops is not None else 0
