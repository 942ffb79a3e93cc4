"""The module a model holds a GGUF embedding table in, as the file stores it: ``BlockEmbedding`` (an
``nn.Embedding``), its rows looked up and dequantized, nothing else; in a compiled step through the operator
``kvscope::gguf_rows``. The linears' module, ``BlockLinear``, is ``engine.quant.modules``', which imports this one:
both are imported from there.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant import formats, gguf_op, kernel


def gguf_rows(w: torch.Tensor, ggml_type: int, dim: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the GGUF table w [rows, row_bytes] dequantized: [*ids.shape, dim] float32 — the Python kernel
    of the operator a compiled step calls, which binds the lookup to the C++ operators' kernel where they are loaded
    (``gguf_op.bind_rows``: it answers from then on)."""
    if w.device.type == "cpu":
        gguf_op.bind_rows(kernel.library())
    return kernel.get_rows(w, ggml_type, dim, ids)


# Defined as ``gguf_linear`` is (engine.quant.modules): custom_op's schema, without its Python layer; the C++
# operators' library takes the CPU dispatch of ``gguf_rows`` where loaded, and calls ``gguf_rows_py`` (this kernel)
# for what it does not take.
_LIB = torch.library.Library("kvscope", "FRAGMENT")
for _name in ("gguf_rows", "gguf_rows_py"):
    _LIB.define(f"{_name}(Tensor w, SymInt ggml_type, SymInt dim, Tensor ids) -> Tensor")
    _LIB.impl(_name, gguf_rows, "CompositeExplicitAutograd")

    @torch.library.register_fake(f"kvscope::{_name}", lib=_LIB)
    def _(w, ggml_type, dim, ids):
        return ids.new_empty((*ids.shape, dim), dtype=torch.float32)  # [*ids, dim]


class BlockEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: the rows looked up are dequantized (to ``dtype``), nothing else.
    ``scale`` multiplies them (Gemma 3's scaled embedding)."""

    maps_file = True

    def __init__(self, weight: torch.Tensor, ggml_type: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 padding_idx: int | None = None, scale: float | None = None) -> None:
        super().__init__()
        if weight.device.type == "cpu":
            kernel.check_rows(weight, ggml_type, embedding_dim)
        self.ggml_type, self.embedding_dim = int(ggml_type), int(embedding_dim)
        self.num_embeddings = int(weight.shape[0])
        self.padding_idx, self.scale, self.dtype = padding_idx, scale, dtype
        self.weight = nn.Parameter(weight, requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {formats.name(self.ggml_type)} blocks"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type == "cuda":
            from transformers.integrations.gguf import kernels as hf

            flat = ids.reshape(-1)
            out = hf.dequantize_blocks(self.weight, self.ggml_type, flat.numel(), self.embedding_dim, self.dtype,
                                       indices=flat).reshape(*ids.shape, self.embedding_dim)
        elif torch.compiler.is_compiling() or torch.compiler.is_exporting():
            out = torch.ops.kvscope.gguf_rows(self.weight, self.ggml_type, self.embedding_dim, ids)  # [*ids, dim]
        else:
            out = kernel.get_rows(self.weight, self.ggml_type, self.embedding_dim, ids.cpu())  # [*ids, dim]
        if self.scale is not None:
            out = out * self.scale
        return out.to(self.dtype)
