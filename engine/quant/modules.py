"""The modules a model holds GGUF weights in, as the file stores them: ``BlockLinear`` (an ``nn.Linear``) and
``BlockEmbedding`` (an ``nn.Embedding``, defined with its operator in ``engine.quant.block_embedding``).

The weight is transformers' ``GgufLinear`` layout, ``[out_features, bytes_per_row]`` uint8 (one GGUF row of blocks
per output), usually a view of the memory-mapped file: loading copies nothing, and the pages are read from the
file's page cache as the products first touch them.

On the CPU the product is ``engine.quant.kernel.matmul`` (8-bit activations by default, float ones on the
``float`` road). A compiled step calls it as the operator ``kvscope::gguf_linear``: a C++ kernel answers the calls
its table holds (``engine.quant.gguf_op``), the Python one below the rest. On CUDA the blocks are
multiplied by ggml's published kernels through transformers (``mul_mat_vec``, up to its row limit) where the
``kernels`` package has them, else dequantized a chunk of rows at a time and multiplied by cuBLAS (transformers'
``GgufLinear`` does the same): the weights stay as blocks in the GPU's memory either way.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from engine.quant import formats, gguf_op, kernel
from engine.quant.block_embedding import BlockEmbedding


# a compiled step's calls of the operator: the kernel's descriptor of each weight, made once (by the addresses and
# shapes the package hands it; the storages are kept, so an address is never reused while it is here)
_DESCRIPTORS: dict[tuple, tuple] = {}
# the packed linears by their weight's address: the operator is handed the weight (the package's constant) and
# multiplies the module's packed copy instead (weak: a model let go takes its packed copies with it)
_PACKED: "weakref.WeakValueDictionary[int, BlockLinear]" = weakref.WeakValueDictionary()
_PACKING = threading.Lock()  # one deferred packing at a time (a weight is packed once, whichever thread asks first)
_HELD = gguf_op.HELD  # inside ``shapes_only`` (nonzero): the CPU's block products give zeros


@contextmanager
def shapes_only():
    """While a loader runs its test forward, which asks only what each layer caches: the CPU's block products give
    zeros of their shape, read no weight and pack none (its three tokens read every page of the file and
    multiplied every weight: 0.2-0.4 s of a 1B-shape load, one thread; the pages are read at the first reply
    instead, as a mapped file's are)."""
    _HELD.value += 1
    try:
        yield
    finally:
        _HELD.value -= 1


def gguf_linear(x2: torch.Tensor, w: torch.Tensor, ggml_type: int, n_in: int, bias: torch.Tensor | None,
                out_map: torch.Tensor | None, road: int) -> torch.Tensor:
    """x2 [m, n_in] float32 times the GGUF weight w [n_out, row_bytes] -> [m, n_out] float32: the Python kernel of
    the operator ``kvscope::gguf_linear`` a compiled step calls (``_LIB`` below), and of ``kvscope::gguf_linear_py``,
    which the C++ kernel calls for what its table does not hold. A plain descriptor's product is offered to that
    table (``gguf_op.offer``)."""
    if w.device.type != "cpu":
        return kernel.matmul(x2, w, ggml_type, n_in, bias, out_map, kernel.ROADS[road])
    seen = gguf_op.generation()
    owner = _PACKED.get(w.data_ptr())
    if owner is not None and owner.pending() and not _HELD.value:
        owner.pack_pending()
        seen = gguf_op.generation()  # (the packing emptied the table: what follows is read after it)
    if owner is not None and owner.serves(w, ggml_type, n_in, bias, out_map, kernel.ROADS[road]):
        y = owner.forward(x2)
        d = owner._desc  # None: the float layout's product (offered as its blocked copy where the C++ kernel has it)
        if gguf_op.on() and not owner.pending():
            if d is not None:
                gguf_op.offer(seen, x2, w, ggml_type, n_in, bias, out_map, road, d, owner)
            elif owner.layout is not None:
                gguf_op.offer_blocked(seen, x2, w, ggml_type, n_in, bias, out_map, road, owner)
        return y
    key = (w.data_ptr(), tuple(w.shape), ggml_type, n_in, road, bias.data_ptr() if bias is not None else 0,
           out_map.data_ptr() if out_map is not None else 0)
    d = _DESCRIPTORS.get(key)
    if d is None:
        desc = kernel.weight(w, ggml_type, n_in, bias, out_map, kernel.ROADS[road])
        held = tuple(t.untyped_storage() for t in (w, bias, out_map) if t is not None)
        d = _DESCRIPTORS[key] = (kernel.library().kq_linear, ctypes.addressof(desc), desc, held)
    x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)  # [m, n_out]
    if x2.shape[0] and d[0](d[1], x2.data_ptr(), x2.shape[0], y.data_ptr(), torch.get_num_threads()) != 0:
        raise RuntimeError("the GGUF block product refused its arguments or ran out of memory")
    if gguf_op.on() and (owner is None or not owner.pending()):
        gguf_op.offer(seen, x2, w, ggml_type, n_in, bias, out_map, road, d, owner)
    return y


# Defined without ``torch.library.custom_op``: its Python layer (argument checks, an aliasing check of the result)
# cost ~15 us a call over the product's own ~8 (a 64x256 Q8_0 weight, one row), and a 1B-shape decode step calls it
# 113 times: 1.7 ms a token, ~7% of a two-thread step; registered straight, ~3 us. The schema is custom_op's own,
# so packages built before still call it. The C++ operators' library (``engine.model.linear_op``) takes its CPU
# dispatch where loaded; ``gguf_linear_py`` is this kernel under a name of its own, which the C++ kernel calls.
_LIB = torch.library.Library("kvscope", "FRAGMENT")
for _name in ("gguf_linear", "gguf_linear_py"):
    _LIB.define(f"{_name}(Tensor x2, Tensor w, SymInt ggml_type, SymInt n_in, Tensor? bias, Tensor? out_map, "
                "SymInt road) -> Tensor")
    _LIB.impl(_name, gguf_linear, "CompositeExplicitAutograd")

    @torch.library.register_fake(f"kvscope::{_name}", lib=_LIB)
    def _(x2, w, ggml_type, n_in, bias, out_map, road):
        return x2.new_empty(x2.shape[0], w.shape[0])  # [m, n_out]


def _cuda_product(x2: torch.Tensor, w: torch.Tensor, ggml_type: int, n_in: int, n_out: int) -> torch.Tensor:
    """transformers' GGUF product on a GPU: ggml's kernel where published and the rows are few, else the blocks
    dequantized a chunk at a time by torch and multiplied by cuBLAS (never the whole weight at once)."""
    from transformers.integrations.gguf import kernels as hf

    k = hf.get_gguf_kernel()
    if k and k.supports(ggml_type) and x2.shape[0] <= hf.MAX_GEMV_ROWS:
        return hf.mul_mat_vec(w, x2, ggml_type, n_out).to(x2.dtype)
    rows = max(1, hf.DEQUANT_CHUNK_ELEMS // n_in)
    out = torch.empty(x2.shape[0], n_out, dtype=x2.dtype, device=x2.device)  # [m, n_out]
    for start in range(0, n_out, rows):
        chunk = hf.dequantize_blocks(w[start:start + rows], ggml_type, min(rows, n_out - start), n_in, x2.dtype)
        out[:, start:start + rows] = x2 @ chunk.T
    return out


class BlockLinear(nn.Module):
    """``y = x Wᵀ + b`` with W kept as GGUF blocks of ``ggml_type`` (module doc). ``out_map`` (int32, optional):
    output row o of the stored weight is the model's output ``out_map[o]`` (llama.cpp's query / key row order)."""

    maps_file = True  # its weight is read in place from the file's mapping: never copied by the loader

    def __init__(self, weight: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None,
                 out_map: torch.Tensor | None = None, road: str | None = None) -> None:
        super().__init__()
        if weight.device.type == "cpu":
            kernel.check_rows(weight, ggml_type, in_features)
        self.ggml_type, self.in_features, self.out_features = int(ggml_type), int(in_features), int(weight.shape[0])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias.to(torch.float32), requires_grad=False) if bias is not None else None
        self.register_buffer("out_map", out_map, persistent=False)
        self.road = road or kernel.default_road()
        self.packed = None  # the weight repacked for the integer road (``pack``): not a parameter, never saved
        self.rows_packed = False  # ``hold_packed_only``: the weight is a view of ``packed``, its rows let go
        # a float layout a loader hands in (``engine.model.packed_linear.BF16_BLOCKED``: BF16 rows held sixteen
        # outputs side by side for the native blocked product, 1.25x the rows' product): ``pack`` / ``defer_pack``
        # make it, the CPU product reads it (``layout.pack(rows, out, in)``, ``layout.product(x2, packed, bias)``,
        # ``layout.bytes(out, in)``)
        self.layout = None
        self._desc = None  # the kernel's descriptor (``kernel.weight``), made at the first product
        self._after_pack: Callable[[], None] | None = None  # ``defer_pack``'s: packing waits for the first product

    def __setattr__(self, name: str, value) -> None:
        changes = name in ("weight", "bias", "out_map", "road", "packed", "layout")
        if changes:
            self.__dict__["_desc"] = None  # it points into the tensors being replaced
        if name == "weight":
            self.__dict__["packed"] = None  # a copy of the weight replaced
            self.__dict__["_after_pack"] = None
            self.__dict__["rows_packed"] = False
        super().__setattr__(name, value)
        if changes:
            gguf_op.forget()  # the C++ kernel's table may hold this module's old descriptor

    def _apply(self, fn, recurse: bool = True):
        if self.__dict__.get("rows_packed"):
            probe = self.weight.detach()[:0]
            if fn(probe) is not probe:  # moved or converted: the rows' layout back first (the packed bytes are not it)
                self.weight = nn.Parameter(self.rows(), requires_grad=False)
        self.__dict__["_desc"] = None  # .to(), .float(): new tensors
        before = (self.weight.data_ptr(), self.weight.device)
        out = super()._apply(fn, recurse)
        if (self.weight.data_ptr(), self.weight.device) != before:
            self.__dict__["packed"] = None  # the weight moved: its packed copy is another's
            self.__dict__["_after_pack"] = None
        gguf_op.forget()
        return out

    def pack(self, threads: int | None = None, mapped: bool = False) -> bool:
        """Repack the weight sixteen rows a group for the integer road's product (``kernel.pack``): from now on
        the CPU product reads the packed copy only, so the caller may let the weight's file pages go (they are
        read again from the file if the weight itself is). False where there is none: not the CPU, the float
        road, a type or CPU without a packed product. ``mapped``: the weight is a view of a private file mapping
        (``kernel.pack``: its pages are let go as they are packed)."""
        if self.__dict__.get("rows_packed"):
            return True  # packed already, and the weight is that copy
        layout = self.__dict__.get("layout")
        if layout is not None and self.weight.device.type == "cpu" and not self.weight.is_meta:
            packed = layout.pack(self.weight.detach(), self.out_features, self.in_features)
            if packed is None:
                return False
            self.packed = packed
            _PACKED[self.weight.data_ptr()] = self
            gguf_op.forget()  # (after: a call that found no owner offers nothing from now on)
            return True
        if self.weight.device.type != "cpu" or self.road != "int8" or self.weight.is_meta:
            return False
        packed = kernel.pack(self.weight.detach(), self.ggml_type, self.in_features, threads, mapped)
        if packed is None:
            return False
        self.packed = packed
        _PACKED[self.weight.data_ptr()] = self
        gguf_op.forget()
        return True

    def hold_packed_only(self) -> bool:
        """``pack``, then let the rows' layout go: the packed copy becomes the weight's only bytes, ``weight`` a view
        of them in its shape ([out, row_bytes] uint8, ``rows_packed``; ``rows`` reads the rows back). For weights in
        the process's own memory (quantized at load), held twice otherwise: a GGUF's rows are the file's pages,
        which its packing lets go. Moved or converted (``.to``), the rows are unpacked first. False where ``pack``
        gives no copy (the rows kept)."""
        if self.__dict__.get("rows_packed"):
            return True
        if self.packed is None and not self.pack():  # (packed already: a deferred packing's ``after``)
            return False
        if _PACKED.get(self.weight.data_ptr()) is self:
            del _PACKED[self.weight.data_ptr()]  # the rows' address, freed below: another weight's to take
        rb = formats.row_bytes(self.ggml_type, self.in_features)
        view = self.packed[:self.out_features * rb].view(self.out_features, rb)  # the packed bytes, the rows' shape
        self._parameters["weight"] = nn.Parameter(view, requires_grad=False)  # (not __setattr__: it drops the copy)
        self.__dict__["rows_packed"] = True
        self.__dict__["_desc"] = None
        _PACKED[view.data_ptr()] = self
        gguf_op.forget()
        return True

    def rows(self) -> torch.Tensor:
        """The weight in the file's layout, [out, row_bytes] uint8 (read back from the packed copy where the rows
        were let go: ``hold_packed_only``)."""
        if not self.__dict__.get("rows_packed"):
            return self.weight.detach()
        return kernel.unpack(self.packed, self.ggml_type, self.out_features, self.in_features)

    def defer_pack(self, after: Callable[[], None], group: list | None = None, mapped: bool = False) -> bool:
        """Pack at the first product instead of now (``pack``), then call ``after`` (a loader lets the file's pages
        go): the repacking's time (the 1B shape's Q4_K_M: ~0.45 s of a ~1 s load, one thread) moves from the load
        to the first reply's prefill. ``group`` (a list this appends to): the modules packed together at the first
        product of any of them, before a layer's activations are made (packed one by one within the prefill, the
        weights and the activations shared the heap: +70-130 MB of peak). ``mapped``: the weight is a view of a
        private file mapping, let go chunk by chunk as it is packed (``pack``). False where ``pack`` gives no copy."""
        own = self.__dict__.get("layout") is not None or (self.road == "int8" and kernel.packs(self.ggml_type))
        if self.weight.device.type != "cpu" or self.weight.is_meta or not own:
            return False
        self.__dict__["_desc"] = None  # the next product comes back for the packing
        self.__dict__["_after_pack"] = after
        self.__dict__["_mapped"] = mapped
        self.__dict__["_group"] = group if group is not None else []
        self._group.append(self)
        _PACKED[self.weight.data_ptr()] = self  # a compiled step's operator finds it and packs it first
        gguf_op.forget()  # the C++ kernel's table may hold the weight's rows: the next call comes to Python
        return True

    def pending(self) -> bool:
        """Is its packing waiting for its first product (``defer_pack``)?"""
        return self._after_pack is not None

    def pack_pending(self) -> None:
        """Do the packing ``defer_pack`` put off, for its whole group (once, whichever thread asks first: a product
        asking meanwhile waits for it). Each module stays pending until its packed copy is in place, so a product on
        another thread never keeps a descriptor of the file's layout."""
        with _PACKING:
            for m in self.__dict__.get("_group") or (self,):
                if m._after_pack is None:
                    continue
                packed = m.pack(mapped=m.__dict__.get("_mapped", False))
                after = m._after_pack
                m.__dict__["_after_pack"], m.__dict__["_group"] = None, None
                if packed:
                    after()

    def held_bytes(self) -> int:
        """Bytes its packed copy takes or will take (0: the weight as the file stores it)."""
        if self.packed is not None:
            return self.packed.numel() * self.packed.element_size()
        if self.pending() and self.__dict__.get("layout") is not None:
            return self.layout.bytes(self.out_features, self.in_features)
        return formats.packed_bytes(self.ggml_type, (self.out_features, self.in_features)) if self.pending() else 0

    def serves(self, w: torch.Tensor, ggml_type: int, n_in: int, bias: torch.Tensor | None,
               out_map: torch.Tensor | None, road: str) -> bool:
        """Is the operator's call (a compiled step's: its constants are this module's tensors) this module's
        product, so it can take the packed copy?"""
        def same(a, b):
            return (a is None and b is None) or (a is not None and b is not None and a.data_ptr() == b.data_ptr())
        return (self.packed is not None and self.weight.data_ptr() == w.data_ptr() and ggml_type == self.ggml_type
                and n_in == self.in_features and road == self.road and same(bias, self.bias)
                and same(out_map, self.out_map))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {formats.name(self.ggml_type)} blocks, "
                f"{self.road} activations" + (", rows reordered" if self.out_map is not None else "")
                + (", packed sixteen rows a group" if self.packed is not None else "")
                + (" (its only copy)" if self.rows_packed else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this ~110 times (1B shape): every microsecond here is 0.1 ms a token, so the common
        # case (float32, contiguous, CPU, eager) goes straight to the library with the descriptor made once
        d = self._desc
        if d is None and self.packed is not None and self.layout is not None and self.out_map is None and \
                not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            y = self.layout.product(x.reshape(-1, self.in_features), self.packed, self.bias)  # [m, out]
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if d is None or torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return self._general(x)
        if x.dtype is not torch.float32 or not x.is_contiguous():
            return self.forward(x.to(torch.float32).contiguous()).to(x.dtype)
        y = torch.empty(x.shape[:-1] + (self.out_features,), dtype=torch.float32)  # [..., out]
        m = x.numel() // self.in_features
        if m and d[0](d[1], x.data_ptr(), m, y.data_ptr(), torch.get_num_threads()) != 0:
            raise RuntimeError("the GGUF block product refused its arguments or ran out of memory")
        return y

    def _general(self, x: torch.Tensor) -> torch.Tensor:
        """The first call (makes the descriptor), a trace (the operator), a GPU (ggml's kernels or cuBLAS)."""
        x2 = x.reshape(-1, self.in_features)  # [m, in]
        if self.weight.device.type == "cuda":
            y = _cuda_product(x2, self.weight, self.ggml_type, self.in_features, self.out_features)
            if self.out_map is not None:
                y = torch.empty_like(y).index_copy_(1, self.out_map.long(), y)
            y = y + self.bias.to(y.dtype) if self.bias is not None else y
        elif torch.compiler.is_compiling() or torch.compiler.is_exporting():
            y = torch.ops.kvscope.gguf_linear(x2.to(torch.float32), self.weight, self.ggml_type, self.in_features,
                                              self.bias, self.out_map, kernel.ROADS.index(self.road))
        elif self.weight.device.type == "cpu":
            bias = self.bias.detach() if self.bias is not None else None
            if _HELD.value:  # a loader's test run for the shapes (``shapes_only``): no descriptor kept, nothing read
                return x.new_zeros(*x.shape[:-1], self.out_features)  # [..., out]
            if self.pending():
                self.pack_pending()
            if self.packed is not None and self.__dict__.get("layout") is not None:
                y = self.layout.product(x2, self.packed, bias)  # [m, out]
                if self.out_map is not None:
                    y = torch.empty_like(y).index_copy_(1, self.out_map.long(), y)
                return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            desc = kernel.weight(self.weight.detach(), self.ggml_type, self.in_features, bias, self.out_map, self.road,
                                 self.packed)
            # (the library's function, the descriptor's address, the descriptor and the storages it points into:
            # kept alive with it, so a tensor whose .data someone replaces never leaves it pointing at freed memory)
            held = tuple(t.untyped_storage() for t in (self.weight, bias, self.out_map, self.packed) if t is not None)
            self.__dict__["_desc"] = (kernel.library().kq_linear, ctypes.addressof(desc), desc, held)
            return self.forward(x)
        else:
            raise RuntimeError(f"GGUF blocks are multiplied on the CPU and CUDA, not {self.weight.device.type}")
        y = y.reshape(*x.shape[:-1], self.out_features)  # [..., out]
        return y if y.dtype == x.dtype else y.to(x.dtype)


def pack_soon(group: list, then: Callable[[], None] | None = None) -> threading.Thread | None:
    """Start packing ``group`` (``BlockLinear.defer_pack``'s), then ``then`` (the loader maps the pages of the
    weights multiplied in place), on a thread of its own: a load returns without waiting for it, and the first
    reply's product waits only for the packing left (nothing, when the user took a second to type). None when
    there is nothing to do."""
    if not group and then is None:
        return None

    def run() -> None:
        if group:
            group[0].pack_pending()
        if then is not None:
            then()
    t = threading.Thread(target=run, name="kvscope-gguf-pack", daemon=True)
    t.start()
    if not _PACKERS_WAITED:
        _PACKERS_WAITED.append(atexit.register(_finish_packing))  # once a process
    _PACKERS.add(t)
    return t


_PACKERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_PACKERS_WAITED: list = []


def _finish_packing() -> None:
    """At exit, let a packing still running end first (a command that exits right after a load: torch's threads
    torn down under the packing thread's ops ended the process with "terminate called without an active
    exception"); ~1 s at most for a 1B model."""
    for t in list(_PACKERS):
        t.join(timeout=60)


def parameter_count(model: nn.Module) -> int:
    """The weights ``model`` computes with, whatever holds them: a block linear's or embedding's parameter is the
    file's bytes (a Q4_K row of 2,048 weights is 1,152 bytes), bitsandbytes' 4-bit parameter its packed bytes, so
    ``numel`` would size a prefill chunk (``engine.model.chunks``) or a thread count by the format, not the model
    (1B-shape Q8_0: 512-token chunks where the estimate before the load said 256, +80 MB of peak)."""
    logical: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, BlockLinear):
            logical[id(m.weight)] = m.in_features * m.out_features
        elif isinstance(m, BlockEmbedding):
            logical[id(m.weight)] = m.num_embeddings * m.embedding_dim
    total = 0
    for p in model.parameters():
        shape = getattr(getattr(p, "quant_state", None), "shape", None)  # bitsandbytes' Params4bit
        total += logical.get(id(p), int(torch.Size(shape).numel()) if shape is not None else p.numel())
    return total
