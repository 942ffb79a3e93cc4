"""Linear weights held in the layout the CPU kernel that reads them fastest wants, and sibling projections merged.

Why: a decode step is bound by reading the weights once (SmolLM2-135M in float32: 425 MB a token). MKL's
matrix-vector product on plain row-major weights streams them at ~10 GB/s on one core here, where a ``sum`` over
the same bytes streams ~20 and llama.cpp's dot products ~15. Two layouts read faster
(``engine.model.packed_linear``): oneDNN's blocked layout (what vLLM's CPU backend uses; the fastest for several
rows at once) and, for a chat's one-row steps, sixteen outputs side by side (``blocked``). Only one copy of a
weight exists, so the layout is chosen per model at load for its workload: a chat (the app, ``generate``,
``bench``) decodes one row at a time -> ``blocked`` for float32, and for bfloat16 where the native product is
built (else ``onednn``); a server (``engine serve``, ``set_workload("server")``) decodes batches -> ``onednn``.
``KVSCOPE_PREPACK_KIND=onednn|blocked`` forces one. Siblings fed the same input (q/k/v, gate/up) become one matrix:
one call, one pass over the input.

What changes in the model: each chosen ``nn.Linear`` is replaced by a ``PackedLinear`` (a merged group's first
member holds the group's weight, the others are ``MergedPart``). The weight's storage is replaced, never
duplicated (RSS measured the same). Only on CPU, float32 / bfloat16 weights of at least ``MIN_ELEMENTS``
(smaller ones run faster as they are: the call costs more than the bytes), plain ``nn.Linear`` that the probe
forward called (bitsandbytes and other subclasses untouched; a linear never called may have its weight read by
the model itself), never a weight tied to the embedding (the embedding reads its rows).

Exactness: the kernels sum in another order than MKL: float32 outputs differ in the last bits; greedy ids stay
HF's (tested on stories260K against an unpacked HF model).

``KVSCOPE_PREPACK`` (``auto`` default, ``off``, ``on``: every eligible linear whatever its size, for tests).
The compiled step's child builds the same structure with throwaway weights (``restructure(..., packed=False)``),
so the package's graph calls the same kernels and the parent hands it its own weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.packed_linear import BLOCK, MergedPart, PackedLinear, block

MODES = ("auto", "on", "off")
KINDS = ("onednn", "blocked")
WORKLOADS = ("chat", "server")
_workload = "chat"
DTYPES = (torch.float32, torch.bfloat16)
MIN_ELEMENTS = 1 << 16  # below this (stories260K's 64x64) a oneDNN call costs more than MKL's: measured 3-6x


def env_mode() -> str:
    mode = os.environ.get("KVSCOPE_PREPACK", "auto").strip().lower()
    if mode in MODES:
        return mode
    logging.getLogger("kvscope").warning("KVSCOPE_PREPACK=%r is not one of %s: auto is used", mode, ", ".join(MODES))
    return "auto"


def set_workload(workload: str) -> None:
    """What the models loaded from now on mostly run: ``chat`` (one row a step) or ``server`` (batches)."""
    global _workload
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {', '.join(WORKLOADS)}")
    _workload = workload


def kind_for(dtype: torch.dtype, out_features: int) -> str:
    """The layout for a weight of ``dtype`` with ``out_features`` rows, for this process's workload ("": none,
    left as loaded: bfloat16 where oneDNN cannot run it and the rows are no multiple of 16)."""
    from engine.model.packed_linear import onednn_takes

    forced = os.environ.get("KVSCOPE_PREPACK_KIND", "").strip().lower()
    kind = forced if forced in KINDS else "blocked" if _workload == "chat" and _blocked_pays(dtype) else "onednn"
    if kind == "onednn" and not onednn_takes(dtype):
        kind = "blocked"  # an AVX2-only CPU: oneDNN has no bfloat16 product there
    if kind == "onednn" or out_features % BLOCK == 0:
        return kind
    return "onednn" if onednn_takes(dtype) else ""


def _blocked_pays(dtype: torch.dtype) -> bool:
    """float32: always (torch's per-block product streams it too); bfloat16: only with the native product, which
    reads it at 18-19 GB/s where oneDNN's one-row product reads 12-14 (torch's per-block product: 5)."""
    from engine.model import linear_kernel

    return dtype == torch.float32 or (dtype == torch.bfloat16 and linear_kernel.LINEAR.library() is not None)


@dataclass(frozen=True)
class Plan:
    """Which linears to pack: groups of sibling module names (one name: packed alone), in module order."""

    groups: tuple[tuple[str, ...], ...]
    kinds: tuple[str, ...] = ()  # each group's layout (``engine.model.packed_linear``); empty: all onednn

    def kind(self, i: int) -> str:
        return self.kinds[i] if self.kinds else "onednn"

    def to_json(self) -> list:
        return [[self.kind(i), list(g)] for i, g in enumerate(self.groups)]

    @classmethod
    def from_json(cls, data: list) -> "Plan":
        return cls(tuple(tuple(g) for _, g in data), tuple(k for k, _ in data))

    @property
    def merged(self) -> int:
        return sum(1 for g in self.groups if len(g) > 1)


class Watch:
    """Forward pre-hooks on a model's linears during the loader's probe forward: which siblings were fed the very
    same tensor at every call (q/k/v, gate/up), so merging them computes what they computed."""

    def __init__(self, model) -> None:
        self.fed: dict[str, list] = {}
        self._hooks = []
        for name, mod in model.named_modules():
            if type(mod) is nn.Linear:
                self._hooks.append(mod.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(_mod, args):
            if args:
                self.fed.setdefault(name, []).append(args[0])
        return hook

    def close(self) -> dict[str, list]:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        fed, self.fed = self.fed, {}
        return fed


def _eligible(model, mode: str) -> dict[str, nn.Linear]:
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    out = {}
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or mod.weight.dtype not in DTYPES or mod.weight.device.type != "cpu":
            continue
        if id(mod.weight) in tied or mod.weight.is_mkldnn:
            continue
        if mode != "on" and mod.weight.numel() < MIN_ELEMENTS:
            continue
        out[name] = mod
    return out


def plan(model, fed: dict[str, list], mode: str) -> Plan:
    """Group the eligible linears the probe called: siblings (one parent) of one dtype, input width and bias
    presence, fed the same tensor objects in the same number of calls, merge; the rest are packed alone."""
    mods = {n: m for n, m in _eligible(model, mode).items() if fed.get(n)}  # never called: the model may read
    by_key: dict[tuple, list[str]] = {}  # its weight itself (Jamba's mamba dt_proj): left as loaded
    for name, mod in mods.items():
        calls = fed[name]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        key = (parent, mod.weight.dtype, mod.in_features, mod.bias is not None, tuple(id(t) for t in calls))
        by_key.setdefault(key, []).append(name)
    order = {n: i for i, n in enumerate(mods)}
    groups = sorted((tuple(names) for names in by_key.values()), key=lambda g: order[g[0]])
    kinds = [kind_for(mods[g[0]].weight.dtype, sum(mods[n].out_features for n in g)) for g in groups]
    kept = [i for i, k in enumerate(kinds) if k]  # no layout for it here: left as loaded
    return Plan(tuple(groups[i] for i in kept), tuple(kinds[i] for i in kept))


def restructure(model, p: Plan, packed: bool = True) -> None:
    """Replace the plan's linears in ``model`` (one group at a time: the plain weights are freed as it goes, so
    memory never holds two copies of more than one group). ``packed`` False keeps plain weights (the compiled
    step's child: same structure and parameter names, its own throwaway weights, blocked where the plan says)."""
    for i, names in enumerate(p.groups):
        mods = [model.get_submodule(n) for n in names]
        kind = p.kind(i)
        with torch.no_grad():
            ws = [m.weight.detach() for m in mods]
            if kind == "blocked" and all(x.shape[0] % BLOCK == 0 and x.stride(1) == 1 for x in ws):
                w = block(ws)  # [out/16, in, 16], the members blocked side by side (no concatenated copy first)
            else:
                w = ws[0] if len(ws) == 1 else torch.cat(ws)
                w = block(w) if kind == "blocked" else w
            del ws
            b = None
            if mods[0].bias is not None:
                b = mods[0].bias.detach() if len(mods) == 1 else torch.cat([m.bias.detach() for m in mods])
        splits = tuple(m.out_features for m in mods)
        for m in mods:  # drop the plain weights before packing: the merged copy is then the only one
            m.weight = None
        n_in = int(w.shape[1])  # [out/16, in, 16] blocked, [out, in] else
        if kind != "blocked" and packed:
            w = torch.ops.mkldnn._reorder_linear_weight(w, None)  # [out, in] in oneDNN's blocked layout
        owner = PackedLinear(w, b, splits, kind, n_in)
        del w
        _put(model, names[0], owner)
        for j, n in enumerate(names[1:], start=1):
            _put(model, n, MergedPart(owner, j))
    if packed:
        _own_the_rest(model)
    model._kvscope_prepack = p


def _own_the_rest(model) -> None:
    """Copy the tensors left as loaded (embedding, norms) into memory of their own: the loader maps the weights
    file, and while any tensor still points into that mapping, the pages the packed linears were read from stay
    resident (RSS: SmolLM2-shape 1,209 MB packed vs 763 MB plain before this; after it, 763 MB)."""
    ours = {id(m.weight) for m in model.modules() if isinstance(m, PackedLinear)}  # new tensors already
    # a GGUF's blocks are the mapping itself, read in place (engine.quant): a copy would double their memory
    ours |= {id(t) for m in model.modules() if getattr(m, "maps_file", False)
             for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type == "cpu" and not t.is_mkldnn and id(t) not in ours:
                t.data = t.data.clone()


def _trim() -> None:
    """Hand the freed plain weights' heap back to the system (glibc keeps it otherwise: 35 MB of SmolLM2's)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _put(model, name: str, mod: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, mod)


def plan_of(model) -> Plan | None:
    """The plan ``restructure`` applied to ``model`` (None: its linears are as loaded)."""
    return getattr(model, "_kvscope_prepack", None)


def apply(model, fed: dict[str, list], device_type: str, quantization: str, mode: str | None = None) -> str:
    """Pack ``model``'s linears after load (``fed``: what ``Watch`` saw in the probe forward). Returns what the
    model card says ("" when nothing was packed, with why where it is a choice)."""
    mode = mode if mode is not None else env_mode()
    if mode == "off":
        return "plain (KVSCOPE_PREPACK=off)"
    if device_type != "cpu" or quantization not in ("none", "", None) or not torch.backends.mkldnn.is_available():
        return ""
    p = plan(model, fed, mode)
    if not p.groups:
        return ""
    restructure(model, p)
    _trim()
    return describe(p)


def describe(p: Plan) -> str:
    """The model card's line: how many linears in which layout, how many merged groups."""
    count = {k: sum(len(g) for i, g in enumerate(p.groups) if p.kind(i) == k) for k in KINDS}
    held = [f"{n} {'blocked' if k == 'blocked' else 'oneDNN-packed'}" for k, n in count.items() if n]
    merged = [f"{p.merged} merged (q/k/v, gate/up)"] if p.merged else []
    return " · ".join(held + merged)
