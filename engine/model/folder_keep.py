"""A Hugging Face folder's bf16 weights multiplied from the files' mappings, as a BF16 GGUF's are
(``engine.quant.gguf_keep``): on a CPU, ``--dtype bfloat16``, a llama-family model (``MODEL_TYPES``) of safetensors
files. A safetensors BF16 tensor is byte for byte a GGUF BF16 one (ggml type 30, row-major), so each file is mapped
once and each linear's weight is a ``BlockLinear`` view of the mapping (the rows in the file's order: no
permutation), the embedding a ``BlockEmbedding`` whose looked-up rows are widened, a tied head the embedding's
blocks; norms are copied into the compute dtype. Nothing is read at load but the headers and the norms: the pages
are mapped on a thread once the load returns (``modules.pack_soon``), as a BF16 GGUF's.

Why: read tensor by tensor (``engine.model.weights_read``) and blocked for the native product (``kvs_block16``),
the Llama-3.2-1B shape's folder loaded in 4.4-4.8 s (2.7 s of reading, 1.3 s of blocking) where llama.cpp maps
the same weights as a BF16 GGUF in 0.1-0.6 s. Once loaded, the pack thread blocks each linear for the native
blocked product (``packed_linear.BF16_BLOCKED``: the rows' own product read them at 18 GB/s, the blocked one 23),
each weight's file pages let go as it is blocked: bfloat16 activations, sums in float32, rounded to bfloat16 as
torch's bfloat16 linear rounds them.

``--quantize int8`` / ``nf4`` take the same road: each linear's Q8_0 blocks (``engine.model.q8_load``) or NF4
blocks (bitsandbytes' codes and scales, ``_nf4_rows``) are quantized by C straight from the mapping, the tensor's
file pages let go at once; what they hold is the folder path's bit for bit, without transformers' reading (nor
bitsandbytes' import). The blocks are written to a quantized copy as they are made (``engine.model.quant_copies``),
and the next load of the same files maps that copy instead of quantizing again (``_Copies``).

Anything else keeps the folder path: float32 (the default), a GPU, other architectures, linears
with biases, weights stored in other types than BF16 (norms may be F16 / F32), remote code, files whose names do not map one to one
onto the model's parameters (transformers' renaming then applies). ``KVSCOPE_MAP_FOLDERS=off`` turns it off.
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine.quant import gguf_keep, kernel
from engine.quant.mapped import Mapping
from engine.model.packed_linear import BF16_BLOCKED
from engine.quant.modules import BlockLinear

DTYPES = {"BF16": 30, "F16": 1, "F32": 0}  # safetensors' dtype -> the ggml type of the same bytes
_TORCH = {30: torch.bfloat16, 1: torch.float16, 0: torch.float32}
# transformers' model types whose safetensors names are the model's parameters and whose linears are plain
# ``nn.Linear`` without biases (checked against HF's greedy tokens in tests/engine/test_folder_keep.py)
MODEL_TYPES = frozenset(("llama", "mistral", "qwen3", "granite", "olmo2"))
ENV = "KVSCOPE_MAP_FOLDERS"


class SafetensorsTable(Mapping):
    """A .safetensors file mapped once; ``entries`` as ``Mapping``'s, each declared span checked against the
    mapping itself (the file is checked whole by ``model_files.check_safetensors`` first)."""

    def __init__(self, path: Path) -> None:
        from engine.model.model_files import check_safetensors

        tensors = check_safetensors(path)  # every entry well formed, the tensors tiling the data: one line each
        super().__init__(path)
        if self.size < 8:
            raise ValueError(f"{path.name} is cut short ({self.size} bytes)")
        (n,) = struct.unpack_from("<Q", self.map, 0)
        for name, meta in tensors.items():
            t, shape = DTYPES.get(meta["dtype"]), tuple(int(d) for d in meta["shape"])
            start, end = (int(x) for x in meta["data_offsets"])
            if t is None:
                raise ValueError(f"{path.name}: tensor {name!r} is {meta['dtype']}, not one of "
                                 f"{', '.join(DTYPES)}")
            if not self.inside(8 + n + start, end - start) or end - start != _numel(shape) * _TORCH[t].itemsize:
                raise ValueError(f"{path.name}: tensor {name!r} lies past the end of the file or does not hold "
                                 "its shape")
            self.entries[name] = (t, shape, 8 + n + start, end - start)

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in ``dtype``, copied out of the mapping."""
        t, shape, start, nbytes = self.entries[name]
        raw = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        return raw.view(_TORCH[t]).reshape(shape).to(dtype, copy=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Files:
    """A folder's tables as one (``gguf_keep.tie_head`` / ``kept_linears`` ask ``name_at``)."""

    def __init__(self, tables: list[SafetensorsTable]) -> None:
        self.tables = tables
        self.owner = {name: t for t in tables for name in t.entries}

    def name_at(self, address: int) -> str | None:
        return next((n for n in (t.name_at(address) for t in self.tables) if n is not None), None)

    def release(self, name: str) -> None:
        self.owner[name].release(name)

    def map_pages(self, names: list[str]) -> None:
        for t in self.tables:
            t.map_pages([n for n in names if n in t.entries])


def applies(folder: Path, model_type: str, spec, dtype_name: str, device: str) -> bool:
    """Are this folder's weights loaded from its files' mappings (module doc)? Headers only (no weight read)."""
    from engine.model.model_files import read_header, weight_files

    from engine.model import q8_load

    from engine.model import nf4_quant

    wanted = ((spec.quantization == "none" and dtype_name == "bfloat16")
              or (spec.quantization == "int8" and q8_load.available(device))
              or (spec.quantization == "nf4" and nf4_quant.available(device)))
    if (os.environ.get(ENV, "").strip().lower() in ("off", "0", "no") or device != "cpu" or not wanted
            or spec.trust_remote_code or model_type not in MODEL_TYPES or kernel.library() is None):
        return False
    files = weight_files(folder)
    if not files:
        return False
    for path in files:
        header, _ = read_header(path)
        if any(not isinstance(m, dict) or m.get("dtype") not in DTYPES or name.endswith(".bias")
               or (len(m.get("shape") or ()) >= 2 and m["dtype"] != "BF16") for name, m in header.items()):
            return False  # a bias, another type, a float32 / float16 weight (converted as read: the folder path)
    return True


def load(folder: Path, config, dtype: torch.dtype, progress: Callable[[str, float], None] | None = None,
         check: Callable[[], None] = lambda: None, quantize: str = ""):
    """``build`` with sdpa attention where the class has it (else eager), under the heap's loading rules
    (``heap.while_loading``: int8's rows, freed once repacked, go back to the system)."""
    from engine.model import heap

    with heap.while_loading():
        return gguf_keep.with_attention(lambda attn: build(folder, config, dtype, attn, progress, check, quantize))


def build(folder: Path, config, dtype: torch.dtype, attn: str, progress: Callable[[str, float], None] | None = None,
          check: Callable[[], None] = lambda: None, quantize: str = ""):
    """The model of ``folder`` with its BF16 linears and embedding as blocks mapped from the files, everything else
    copied in ``dtype``; None where the files' names are not the model's parameters one to one (the caller reads
    the folder as before). ValueError names a file that does not hold what its header says. ``quantize``
    ("int8" / "nf4", ``--quantize``): each linear but the output head quantized to Q8_0 / NF4 blocks from the
    mapping instead (C, the linears' threads), every tensor's file pages let go once it is consumed, the
    rest copied in ``dtype`` as the folder path holds it."""
    from engine.model.model_files import weight_files
    from engine.model.weights_read import causal_lm_class, generation_config

    files = Files([SafetensorsTable(p) for p in weight_files(folder)])
    with gguf_keep.empty():
        model = causal_lm_class(config)._from_config(config, dtype=dtype, attn_implementation=attn)
    params = dict(model.named_parameters())
    head = next((f"{n}.weight" for n, m in model.named_modules() if m is model.get_output_embeddings()), "")
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        params.pop(head, None)  # the embedding's blocks (``tie_head``); a file's own copy: transformers' reading
    if set(files.owner) != set(params) or any(tuple(p.shape) != files.owner[n].entries[n][1]
                                              for n, p in params.items()):
        return None
    group: list = []  # BF16 blocked (bfloat16 compute) and Q8_0 repacked after the load; else pages mapped then
    copies = _Copies(weight_files(folder), quantize, _plan(model, files, head, quantize)) if quantize else None
    try:
        _each(folder, model, files, head, group, dtype, copies, progress, check)
    except BaseException:
        if copies is not None and copies.writer is not None:
            copies.writer.abort()
        raise
    gguf_keep.tie_head(model, files, group)
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{folder.name} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])})")
    model.eval()
    model.generation_config = generation_config(folder)
    model.kvscope_pack_group = group
    packed = {id(m) for m in group}
    in_place = [g for g, m in gguf_keep.kept_linears(model, files) if id(m) not in packed]
    if copies is not None:  # the copy's blocks where no packed copy replaces them (a build without packing)
        copies.map_later([g for g, m in gguf_keep.kept_linears(model, copies.copy) if id(m) not in packed]
                         if copies.copy is not None else [])
        model.kvscope_blocks = copies.words()
        model.kvscope_copied = copies.copy is not None  # (the model card's "mapped from its copy")
    if in_place:  # (int8 holds none: the mappings go with this function)
        model.kvscope_map_pages = functools.partial(files.map_pages, in_place)
    elif copies is not None and copies.in_place:
        model.kvscope_map_pages = functools.partial(copies.copy.map_pages, copies.in_place)
    if not quantize:
        blocked = any(isinstance(m, BlockLinear) and m.layout is not None for m in model.modules())
        where = "blocked from the files' mappings" if blocked else "mapped from the files"  # (blocked after the load)
        model.kvscope_blocks = f"BF16 safetensors, {where} ({kernel.isa()})"  # (the bits: the weights row's)
    return model


def _each(folder: Path, model, files: Files, head: str, group: list, dtype: torch.dtype, copies: "_Copies | None",
          progress: Callable[[str, float], None] | None, check: Callable[[], None]) -> None:
    """Every tensor of the files into the model: ``_quantized`` (``copies`` given) or ``_place``."""
    total = max(len(files.owner), 1)
    verb = "mapping" if copies is None or copies.copy is not None else "quantizing"
    for i, (name, table) in enumerate(files.owner.items()):
        check()
        if progress and i % max(1, total // 50) == 0:
            progress(f"{verb} {folder.name}: tensor {i + 1} of {total}", 0.15 + 0.4 * i / total)
        if copies is not None:
            _quantized(model, table, name, copies, group, dtype)
        else:
            _place(model, table, name, dtype, group)
    if copies is not None:
        copies.finish()


def _plan(model, files: Files, head: str, kind: str) -> dict[str, tuple[int, int, int]]:
    """The linears ``--quantize`` quantizes (all but the output head, rows of whole blocks): name -> (the kernels'
    block type, rows, inputs)."""
    from engine.model import q8_load
    from engine.quant import formats

    t_new = q8_load.Q8_0 if kind == "int8" else formats.NF4
    plan = {}
    for name, table in files.owner.items():
        owner_name, _, leaf = name.rpartition(".")
        _, shape, _, _ = table.entries[name]
        if leaf == "weight" and name != head and len(shape) == 2 and shape[1] % q8_load.BLOCK == 0 \
                and type(model.get_submodule(owner_name)) is nn.Linear:
            plan[name] = (t_new, shape[0], shape[1])
    return plan


class _Copies:
    """A ``--quantize`` load's quantized copy (``engine.model.quant_copies``): the copy mapped where one is kept
    (``copy``), else the writer of the one this load makes (``writer``, None where copies are off or out of room)."""

    def __init__(self, paths: list[Path], kind: str, plan: dict[str, tuple[int, int, int]]) -> None:
        from engine.model import quant_copies

        self.kind, self.plan, self.in_place = kind, plan, []
        self.copy, key = quant_copies.find(paths, kind, plan)
        self.writer = quant_copies.open_writer(kind, key, plan) if self.copy is None else None
        self.path = self.copy.path if self.copy is not None else self.writer.path if self.writer else None

    def finish(self) -> None:
        if self.writer is not None and self.writer.finish() is None:
            self.path = None  # (a disk error dropped it: said in the log)

    def map_later(self, names: list[str]) -> None:
        self.in_place = names

    def words(self) -> str:
        """The model card's line: where the blocks came from."""
        from engine.quant import formats

        fmt = formats.name(next(iter(self.plan.values()))[0]) if self.plan else self.kind
        if self.copy is not None:
            return f"{fmt} blocks mapped from {self.path} ({kernel.isa()})"
        kept = f"kept in {self.path} for the next load" if self.path else "no copy kept"
        return f"{fmt} blocks quantized from the folder at load, {kept} ({kernel.isa()})"


def _quantized(model, table: SafetensorsTable, name: str, copies: _Copies, group: list, dtype: torch.dtype) -> None:
    """A planned linear's weight (``_plan``) as Q8_0 (int8) or NF4 blocks in a ``BlockLinear``: mapped from the
    kept copy (packed from its pages after the load, as a GGUF's), else quantized from the mapping in C (its
    repacking for the integer road deferred, the rows then let go: ``hold_packed_only``) and written to the copy
    being made; any other tensor copied into its parameter. Then the tensor's file pages let go."""
    from engine.model import q8_load

    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if name in copies.plan and copies.copy is not None:
        gguf_keep.keep_module(model, owner_name, copies.copy.blocks(name), copies.plan[name][0], dtype, "cpu", group,
                              functools.partial(copies.copy.release, name))
        return  # (the folder's pages of it never read)
    if name in copies.plan:
        t, shape, _, _ = table.entries[name]
        w = table.blocks(name).view(torch.bfloat16) if t == 30 else table.tensor(name, torch.float32)  # [out, in]
        rows, t_new = (q8_load.quantize(w), q8_load.Q8_0) if copies.kind == "int8" else _nf4_rows(w)
        if copies.writer is not None:
            copies.writer.put(name, rows)
        new = BlockLinear(rows, t_new, shape[1], owner.bias)
        model.set_submodule(owner_name, new)
        new.defer_pack(new.hold_packed_only, group)  # repacked on the pack thread after the load, the rows let go
    else:
        setattr(owner, leaf, nn.Parameter(table.tensor(name, getattr(owner, leaf).dtype), requires_grad=False))
    table.release(name)


def _place(model, table: SafetensorsTable, name: str, dtype: torch.dtype, group: list) -> None:
    """A BF16 weight of a linear or the embedding becomes its block module over the mapping; any other tensor is
    copied into its parameter in the parameter's dtype."""
    t, shape, _, _ = table.entries[name]
    owner_name, _, leaf = name.rpartition(".")
    current = getattr(model.get_submodule(owner_name), leaf)
    if (leaf == "weight" and t == 30 and len(shape) == 2
            and gguf_keep.keep_module(model, owner_name, table.blocks(name), t, dtype, "cpu", group,
                                      functools.partial(table.release, name), layout=BF16_BLOCKED)):
        return
    value = table.tensor(name, current.dtype)
    setattr(model.get_submodule(owner_name), leaf, nn.Parameter(value, requires_grad=False))


def _nf4_rows(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """w [out, in] as the kernels' NF4 rows: bitsandbytes' codes and scales (blocks of 64, ``nf4_quant``'s C
    quantizer, bit for bit its own) rearranged into 32-blocks (``kq_nf4_blocks``), as a bitsandbytes load's
    ``Linear4bit`` becomes (``nf4_quant.to_blocks``) without the module, its float32 weight or its buffers."""
    from engine.model import nf4_quant
    from engine.quant import formats

    n_out, n_in = w.shape
    codes, absmax = nf4_quant.quantize_4bit(w, BNB_BLOCK, "nf4", torch.uint8)  # [out * in / 2, 1], [blocks]
    rows = torch.empty(n_out, n_in // 32 * 18, dtype=torch.uint8)  # [out, row_bytes]
    if nf4_quant._library().kq_nf4_blocks(codes.data_ptr(), absmax.data_ptr(), BNB_BLOCK, n_out, n_in,
                                          rows.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"NF4 blocks of a {n_out}x{n_in} weight: the kernels refused them")
    return rows, formats.NF4


BNB_BLOCK = 64  # bitsandbytes' 4-bit block (its BitsAndBytesConfig default, what the folder path stores)
