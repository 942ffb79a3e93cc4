"""A GGUF file's model with its weights kept as the file stores them: the file memory-mapped once, each linear's
and the embedding's tensor a view of the mapping (``BlockLinear`` / ``BlockEmbedding``), nothing dequantized but
the 1-D tensors (norms, biases) and weights of a type the kernels do not multiply.

Why not transformers' own ``GgufConfig(dequantize=False)``: in 5.24 it keeps blocks only for the architectures of
its new GGUF path (qwen3.5, lfm2) and only where the ``kernels`` package fetches ggml's GPU kernels from the hub;
and its lazy tensors copy every tensor out of the mapping (``np.copy`` in ``LazyGgufTensor``), so a load's peak is
the file in anonymous memory plus the mapping's pages. Here the modules take transformers' layout
(``[out_features, bytes_per_row]`` uint8, as its ``GgufLinear``) and its name mapping and tensor processors
(``get_gguf_hf_weights_map``, ``TENSOR_PROCESSORS``: llama.cpp's names, Gemma's norms stored as 1 + w), so the
model is the one transformers builds from the same file; llama's query / key rows, stored in llama.cpp's rotary
order, stay in it and the product writes each output where the model wants it (``out_map``).

Peak memory: the model is built with its parameters on the meta device (``accelerate.init_empty_weights``,
buffers real), so nothing is allocated for a weight that stays in the file; the mapping's pages count in the
process's RSS as the products first read them (as llama.cpp's mmap does). On AVX-512 VNNI and AVX2 the integer
road's linears are repacked (``BlockLinear.defer_pack``: sixteen rows a group, llama.cpp's repacked buffers for wide
vectors), the file's pages let go as each ~16 MiB is packed (``kernel.pack``'s ``mapped``, then ``Table.release``):
the weights are held once, never the file beside its copy. The repacking was most of a load's time (1B shape, one
thread: Q4_K_M ~0.45 of ~0.6 s; llama.cpp's 0.55-0.85 s), so a thread starts it as the load ends
(``modules.pack_soon``) and the first product waits for what is left.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from engine.quant import formats, kernel
from engine.quant.gguf_table import Table
from engine.quant.mapped import Mapping
from engine.quant.modules import BlockEmbedding, BlockLinear

_SIMPLE = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor")
# ggml types transformers' GPU path can multiply or dequantize (its GGML_BLOCK): others are dequantized on CUDA
_CUDA_TYPES = frozenset((2, 3, 8, 12, 13, 14))


def refusal(architecture: str, device: str) -> str:
    """Why this file's weights cannot stay as blocks here ('' when they can)."""
    if architecture not in formats.ARCHITECTURES:
        return f"{architecture} GGUF weights are dequantized on load (blocks are kept for {', '.join(sorted(formats.ARCHITECTURES))})"
    if device == "cpu" and kernel.library() is None:
        return f"no GGUF block kernels on this machine ({kernel.why()})"
    if device not in ("cpu", "cuda"):
        return f"GGUF blocks are multiplied on the CPU and CUDA, not {device}"
    return ""


@contextmanager
def _cached_name_map():
    """transformers builds gguf's tensor-name map again for every submodule (~85 ms each, hundreds of them): one
    map per load (it is read-only)."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@contextmanager
def empty():
    """A model built with its parameters on the meta device (buffers real) and none of them initialised: transformers
    draws every meta weight's random values anyway (``init_weights``: 0.08-0.1 s of a 1B-shape load)."""
    import accelerate
    from transformers.initialization import no_init_weights

    with accelerate.init_empty_weights(include_buffers=False), no_init_weights():
        yield


def _row_order(processor, gguf_name: str, rows: int) -> torch.Tensor | None:
    """Where each stored row goes in the model's weight (llama's query / key rows), or None: the same order."""
    if type(processor).__name__ != "LlamaTensorProcessor" or not (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        return None
    index = np.arange(rows, dtype=np.float64)[:, None]
    moved = processor.process(weights=index, name=gguf_name).weights[:, 0].astype(np.int64)  # model row i <- moved[i]
    out = np.empty(rows, dtype=np.int32)
    out[moved] = np.arange(rows, dtype=np.int32)  # stored row moved[i] is the model's output i
    return None if np.array_equal(out, np.arange(rows)) else torch.from_numpy(out)


def _keep(ggml_type: int, shape: tuple[int, ...], device: str) -> bool:
    return formats.is_kept(ggml_type, shape) and (device == "cpu" or ggml_type in _CUDA_TYPES)


def build(path: Path, architecture: str, config, cls, dtype: torch.dtype, device: str, attn: str,
          progress: Callable[[str, float], None] | None = None, check: Callable[[], None] = lambda: None,
          layout=None, ends: dict[int, int] | None = None):
    """The model of the GGUF file at ``path`` (``architecture`` its ``general.architecture``, ``config`` read from
    it, ``cls`` its causal-LM class) with the weights of kept types as blocks mapped from the file and everything
    else in ``dtype``, on ``device``. Raises ValueError naming what does not fit (a tensor the model does not have,
    a parameter the file lacks). ``layout``: the float layout BF16 linears take (the model room's
    ``engine.model.packed_linear.gguf_float_layout``; None: the rows' product)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    table = Table(path, ends)  # (``ends``: the header's string arrays, as ``load``'s caller walked them)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    if type(processor).__name__ not in _SIMPLE:
        raise ValueError(f"{architecture}: its GGUF tensors are reshaped on load, so they cannot stay as blocks")
    with empty():
        model = cls._from_config(config, dtype=dtype, attn_implementation=attn)
    with _cached_name_map():
        names = get_gguf_hf_weights_map(model, processor)
    total, group = max(len(table.entries), 1), []  # the linears packed together at the first product
    for i, (gname, (t, shape, _, _)) in enumerate(table.entries.items()):
        check()
        if progress and i % max(1, total // 50) == 0:
            progress(f"mapping {path.name}: tensor {i + 1} of {total}", 0.15 + 0.4 * i / total)
        hf = names.get(gname)
        if hf is None:
            continue  # llama.cpp's extras the model has no place for (rope_freqs): transformers skips them too
        _place(model, table, processor, gname, hf, t, shape, dtype, device, group, layout)
    tie_head(model, table, group, layout)
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{path.name} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])})")
    model.eval()
    model.kvscope_pack_group = group  # packed on a thread once the load has probed the model (``pack_soon``)
    packed = {id(m) for m in group}
    in_place = [g for g, m in kept_linears(model, table) if id(m) not in packed]
    model.kvscope_map_pages = functools.partial(table.map_pages, in_place)  # then their pages mapped
    return model


def kept_linears(model, table: Mapping) -> list[tuple[str, BlockLinear]]:
    """(file tensor name, module) of each linear multiplied from the file's mapping."""
    found = [(table.name_at(m.weight.data_ptr()), m) for m in model.modules()
             if isinstance(m, BlockLinear) and m.weight.device.type == "cpu"]
    return [(g, m) for g, m in found if g is not None]


def keep_module(model, owner_name: str, blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype, device: str,
                group: list, release: Callable[[], None], order: torch.Tensor | None = None, layout=None) -> bool:
    """Replace the model's ``nn.Linear`` or ``nn.Embedding`` at ``owner_name`` by its block module over ``blocks``
    (the weight as the file stores it, ``[rows, row_bytes]``): a linear's packing deferred to the first product
    (``defer_pack``, then ``release``: the file's pages let go; ``layout``: a float layout the loader hands the
    module, ``BlockLinear.layout``), an embedding's rows looked up in the file. False (nothing done) for any other
    module."""
    owner = model.get_submodule(owner_name)
    n_in = owner.weight.shape[1]
    if type(owner) is nn.Linear:
        new = BlockLinear(blocks.to(device), ggml_type, n_in, owner.bias, order)
        if layout is not None and device == "cpu" and layout.takes(ggml_type, new.out_features, dtype):
            new.layout = layout
        model.set_submodule(owner_name, new)
        if device == "cpu":  # the products will read the packed copy: the file's pages are let go then
            new.defer_pack(release, group, mapped=True)
        return True
    if isinstance(owner, nn.Embedding):
        scale = None if getattr(owner, "embed_scale", None) is None else float(owner.embed_scale)
        model.set_submodule(owner_name, BlockEmbedding(blocks.to(device), ggml_type, n_in, dtype, owner.padding_idx,
                                                       scale))
        return True
    return False


def _place(model, table: Table, processor, gname: str, hf: str, t: int, shape: tuple[int, ...],
           dtype: torch.dtype, device: str, group: list, layout=None) -> None:
    """Put the file's tensor ``gname`` where the model's ``hf`` is: a kept weight replaces its module (``layout``:
    the float layout a BF16 linear takes, ``build``'s), anything else is dequantized (and processed as
    transformers would) into the parameter."""
    owner_name, leaf = hf.rsplit(".", 1)
    owner = model.get_submodule(owner_name)
    current = getattr(owner, leaf)
    if (leaf == "weight" and _keep(t, shape, device) and tuple(current.shape) == shape
            and keep_module(model, owner_name, table.blocks(gname), t, dtype, device, group,
                            functools.partial(table.release, gname), _row_order(processor, gname, shape[0]),
                            layout)):
        return
    data = processor.process(weights=table.floats(gname), name=gname).weights
    value = torch.from_numpy(np.ascontiguousarray(data)).to(dtype).reshape(current.shape).to(device)
    setattr(owner, leaf, nn.Parameter(value, requires_grad=False) if isinstance(current, nn.Parameter) else value)


def tie_head(model, table: Mapping, group: list, layout=None) -> None:
    """An output head the file has no tensor for reads the embedding (tied): the same blocks, no copy (a packed
    copy for the integer road's product, as llama.cpp's repacked output head, or ``layout``'s where it takes them;
    the lookups read the file's rows)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or not weight.is_meta:
        return
    if isinstance(embed, BlockEmbedding):
        name = next(n for n, m in model.named_modules() if m is head)
        new = BlockLinear(embed.weight.data, embed.ggml_type, embed.embedding_dim,
                          head.bias if head.bias is not None and not head.bias.is_meta else None)
        if layout is not None and layout.takes(new.ggml_type, new.out_features, embed.dtype):
            new.layout = layout
        model.set_submodule(name, new)
        gname = table.name_at(embed.weight.data_ptr())
        if new.weight.device.type == "cpu" and gname is not None:
            new.defer_pack(functools.partial(table.release, gname), group, mapped=True)
    else:
        head.weight = embed.weight


def tensor_types(info) -> list[tuple[int, tuple[int, ...]]]:
    """(ggml type, torch-order shape) of every tensor of a ``GgufInfo`` (its header, read before)."""
    import gguf

    return [(gguf.GGMLQuantizationType[t.type_name].value, tuple(reversed(t.shape))) for t in info.tensors]


@dataclass(frozen=True)
class Plan:
    """What loading a file with its blocks kept holds: bytes mapped from the file (or copied to the GPU) and
    copied into the process, the file's bits per weight, the types dequantized for want of a kernel, the road."""

    mapped: int
    copied: int
    bits: float
    lost: tuple[str, ...]
    device: str
    road: str  # "int8 activations, AVX-512 + VNNI"
    packed: bool = False  # the integer road's linears repacked sixteen rows a group (the file's pages let go)
    blocked: bool = False  # every linear BF16, blocked for the native product (a float layout: the pages let go)
    looked_up: int = 0  # a tied table's file pages its lookups map again while a chat runs (``_tied_pages``)

    @property
    def where(self) -> str:
        if self.device != "cpu":
            return f"copied to {self.device} layer by layer"
        return "repacked from the file" if self.packed else "blocked from the file" if self.blocked else \
            "mapped from the file"


def _linears(info) -> list[int]:
    """Indices of ``info``'s 2-D tensors multiplied as linears (not the token embedding, whose rows are looked up in
    the file, unless it is also the output head)."""
    names, tied = [t.name for t in info.tensors], _tied_table(info)
    return [i for i, (_, s) in enumerate(tensor_types(info))
            if len(s) == 2 and (names[i] != "token_embd.weight" or i == tied)]


def _tied_table(info) -> int | None:
    """The index of ``info``'s token embedding where it is also the output head (no ``output.weight``), else None."""
    names = [t.name for t in info.tensors]
    return names.index("token_embd.weight") if "token_embd.weight" in names and "output.weight" not in names else None


def _packed(info, device: str) -> list[int]:
    """Indices of ``info``'s linears the loader holds repacked (a packed type's)."""
    if device != "cpu" or kernel.default_road() != "int8" or not kernel.packs():
        return []
    types = tensor_types(info)
    return [i for i in _linears(info) if formats.packed_bytes(*types[i]) and kernel.packs(types[i][0])]


def _blocked(info, compute_bytes: int, layout) -> list[int]:
    """Indices of ``info``'s BF16 linears the loader holds blocked (``layout``, ``build``'s: float32 compute on the
    CPU)."""
    if compute_bytes != 4 or layout is None:
        return []
    types = tensor_types(info)
    return [i for i in _linears(info) if types[i][0] == 30 and types[i][1][0] % 16 == 0]


def _tied_pages(info, types, copies: set[int]) -> int:
    """The file's bytes of a tied embedding whose head is held as a copy (repacked or blocked): the copy's product
    lets the file's pages go, but the lookups map them again as a chat goes, and this kernel maps a whole large folio
    per row (1.5-2 MiB a looked-up row here: a Llama-3-vocabulary 1B's Q6_K table +95 MiB after 192 lookups, all
    its 205 MiB after 640; its BF16 file's 501 MiB table 233 MiB after 640), so the table is held twice once a chat
    runs: counted in full there (not in the load's peak, nor after it)."""
    i = _tied_table(info)
    return formats.file_bytes(*types[i]) if i is not None and i in copies and types[i][0] >= 0 else 0


def plan(info, device: str, compute_bytes: int, layout=None) -> Plan:
    """The ``Plan`` of a ``GgufInfo`` loaded kept on ``device`` in a compute dtype of ``compute_bytes`` (``layout``:
    the float layout its BF16 linears take, as ``build``'s)."""
    types = [(t if len(s) != 2 or _keep(t, s, device) else -1, s) for t, s in tensor_types(info)]
    packed = _packed(info, device)
    mapped, copied = formats.model_bytes([(t if t >= 0 else 99, s) for t, s in types], compute_bytes, packed=packed)
    blocked = _blocked(info, compute_bytes, layout)
    moved = sum(formats.file_bytes(*types[i]) for i in blocked)  # a blocked copy where the file's pages were
    mapped, copied = mapped - moved, copied + moved
    lost = tuple(sorted({formats.name(t) for t, s in tensor_types(info) if len(s) == 2 and not _keep(t, s, device)}))
    road = (f"{kernel.default_road()} activations, {kernel.isa()}" if device == "cpu"
            else "ggml's kernels or cuBLAS on dequantized chunks")
    every = bool(blocked) and set(blocked) == {i for i in _linears(info) if types[i][0] >= 0}  # none left mapped
    return Plan(mapped, copied, formats.bits_per_weight(tensor_types(info)), lost, device, road, bool(packed), every,
                _tied_pages(info, types, set(packed) | set(blocked)) if device == "cpu" else 0)


def load(path: Path, info, config, dtype: torch.dtype, device: str, progress=None, check=lambda: None, layout=None,
         ends: dict[int, int] | None = None):
    """``build`` from the loader: the causal-LM class of ``config``, sdpa attention where the class has it (else
    eager: Gemma 2's softcapping). ``ends``: ``Table``'s, from the header's walk of this version of the file.
    ValueError / RuntimeError name what does not fit."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return with_attention(lambda attn: build(path, info.architecture, config, cls, dtype, device, attn, progress,
                                             check, layout, ends))


def with_attention(build_as: Callable[[str], nn.Module | None]):
    """``build_as("sdpa")``, else ``build_as("eager")`` where the class has no sdpa (Gemma 2's softcapping), its
    ``block_plan`` kept on it (None: ``build_as`` gave none)."""
    try:
        model = build_as("sdpa")
    except ValueError as e:
        if "sdpa" not in str(e).lower() and "scaled_dot_product" not in str(e).lower():
            raise
        model = build_as("eager")
    if model is not None:
        model.kvscope_block_plan = block_plan(model)
    return model


def block_plan(model) -> list[dict]:
    """The model's block modules, by name (what a compiled step's child builds the same structure from: the
    package's graph calls the block operators and the parent hands it its own mapped weights)."""
    plan = []
    for name, m in model.named_modules():
        if isinstance(m, BlockLinear):
            plan.append({"name": name, "kind": "linear", "type": m.ggml_type, "in": m.in_features,
                         "shape": list(m.weight.shape), "bias": m.bias is not None, "map": m.out_map is not None,
                         "road": m.road})
        elif isinstance(m, BlockEmbedding):
            plan.append({"name": name, "kind": "embedding", "type": m.ggml_type, "in": m.embedding_dim,
                         "shape": list(m.weight.shape), "scale": m.scale, "padding": m.padding_idx,
                         **({"dtype": str(m.dtype).removeprefix("torch.")} if m.dtype != torch.float32 else {})})
    return plan


def restructure(model, plan: list[dict]) -> None:
    """Replace ``plan``'s modules in a model built from the same config with block modules of throwaway weights
    (zeros; an identity row order): the same parameter and buffer names and shapes as the parent's."""
    for p in plan:
        w = torch.zeros(p["shape"], dtype=torch.uint8)
        if p["kind"] == "linear":
            bias = torch.zeros(p["shape"][0]) if p["bias"] else None
            order = torch.arange(p["shape"][0], dtype=torch.int32) if p["map"] else None
            model.set_submodule(p["name"], BlockLinear(w, p["type"], p["in"], bias, order, p["road"]))
        else:
            rows = getattr(torch, p.get("dtype", "float32"))  # a bf16 folder's embedding gives bf16 rows
            model.set_submodule(p["name"], BlockEmbedding(w, p["type"], p["in"], rows, p["padding"], p["scale"]))


def skeleton(cls, config, dtype: torch.dtype, plan: list[dict], attn: str = "sdpa"):
    """The model of ``config`` with ``plan``'s block modules and throwaway zeros elsewhere, never allocating the
    dense weights the blocks replace (a compiled step's child: an 8B file's dense float32 model would be 32 GB)."""
    with empty():
        model = cls._from_config(config, dtype=dtype, attn_implementation=attn)
    restructure(model, plan)
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype),
                                                                  requires_grad=False))
    return model.eval()
