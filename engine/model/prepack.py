"""Linear weights pre-packed for the CPU kernel that reads them fastest, and sibling projections merged.

Why: a decode step is bound by reading the weights once (SmolLM2-135M in float32: 425 MB a token). MKL's
matrix-vector product on plain row-major weights streams them at ~15 GB/s on one core here (bf16 ~11), where
the core streams 34 GB/s; oneDNN on weights reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what vLLM's CPU backend uses) reads them
faster, and several rows at once (a batched decode, a verification) at little more than one row's cost.
Siblings fed the same input (q/k/v, gate/up) become one matrix: one call, one pass over the input.

What changes in the model: each chosen ``nn.Linear`` is replaced by ``PackedLinear`` (a merged group's first
member holds the group's weight, the others ``MergedPart``, taking their columns of the group's output). The
weight's storage is replaced, never duplicated: the packed tensor is the module's ``weight`` parameter, the
plain one is freed (RSS measured the same). Only on CPU, float32 / bfloat16 weights of at least ``MIN_ELEMENTS``
(smaller ones run faster unpacked: the call costs more than the bytes), plain ``nn.Linear`` (bitsandbytes and
other subclasses untouched), never a weight tied to the embedding (the embedding reads its rows).

Exactness: oneDNN sums in another order than MKL: float32 outputs differ in the last bits (measured within
3e-5 on SmolLM2's projections); greedy ids stay HF's (tested on stories260K against an unpacked HF model).

``KVSCOPE_PREPACK`` (``auto`` default, ``off``, ``on``: every eligible linear whatever its size, for tests).
The compiled step's child builds the same structure with plain weights (``restructure(..., packed=False)``):
``_linear_pointwise`` takes either, so the package's graph calls oneDNN and the parent hands it the packed ones.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch
from torch import nn

MODES = ("auto", "on", "off")
DTYPES = (torch.float32, torch.bfloat16)
MIN_ELEMENTS = 1 << 16  # below this (stories260K's 64x64) a oneDNN call costs more than MKL's: measured 3-6x


def env_mode() -> str:
    mode = os.environ.get("KVSCOPE_PREPACK", "auto").strip().lower()
    if mode in MODES:
        return mode
    logging.getLogger("kvscope").warning("KVSCOPE_PREPACK=%r is not one of %s: auto is used", mode, ", ".join(MODES))
    return "auto"


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # [..., out]


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` by oneDNN over ``weight`` [out, in], packed (or plain, in the compiled step's child);
    a merged group's owner when ``splits`` has several widths (``part``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, splits: tuple[int, ...]) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.splits = splits
        self.offsets = tuple(sum(splits[:i]) for i in range(len(splits) + 1))
        self._held = threading.local()  # the group's last input and output while members still take their part

    def extra_repr(self) -> str:
        kind = "packed" if self.weight.is_mkldnn else "plain"
        return f"in={self.in_features}, out={self.splits}, {kind}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(0, x)

    def part(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``j``'s columns of the group's output for ``x``: computed once for all members fed the same
        tensor (the first asks, the others take their slice); a member asking again, or with another input,
        computes afresh (exact either way)."""
        if len(self.splits) == 1:
            return _linear(x, self.weight, self.bias)
        held = getattr(self._held, "v", None)
        if held is None or held[0] is not x or j in held[2]:
            held = (x, _linear(x, self.weight, self.bias), set())  # [..., sum(splits)]
            self._held.v = held
        held[2].add(j)
        if len(held[2]) == len(self.splits):
            self._held.v = None  # all taken: hold nothing between forwards
        return held[1][..., self.offsets[j]:self.offsets[j + 1]]  # [..., splits[j]] (a view)


class MergedPart(nn.Module):
    """A merged group's other member (k_proj of q/k/v): its columns of the owner's output. The owner is
    referenced, not registered, so the group's weight appears once among the model's parameters."""

    def __init__(self, owner: PackedLinear, j: int) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.j = j
        self.in_features, self.out_features = owner.in_features, owner.splits[j]

    def extra_repr(self) -> str:
        return f"part {self.j} of a merged linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.part(self.j, x)


@dataclass(frozen=True)
class Plan:
    """Which linears to pack: groups of sibling module names (one name: packed alone), in module order."""

    groups: tuple[tuple[str, ...], ...]

    def to_json(self) -> list[list[str]]:
        return [list(g) for g in self.groups]

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
    groups = []
    for names in by_key.values():
        groups.append(tuple(names))
    order = {n: i for i, n in enumerate(mods)}
    return Plan(tuple(sorted(groups, key=lambda g: order[g[0]])))


def restructure(model, p: Plan, packed: bool = True) -> None:
    """Replace the plan's linears in ``model`` (one group at a time: the plain weights are freed as it goes, so
    memory never holds two copies of more than one group). ``packed`` False keeps plain weights (the compiled
    step's child: same structure and parameter names, its own throwaway weights)."""
    for names in p.groups:
        mods = [model.get_submodule(n) for n in names]
        with torch.no_grad():
            w = mods[0].weight.detach() if len(mods) == 1 else torch.cat([m.weight.detach() for m in mods])
            b = None
            if mods[0].bias is not None:
                b = mods[0].bias.detach() if len(mods) == 1 else torch.cat([m.bias.detach() for m in mods])
        splits = tuple(m.out_features for m in mods)
        for m in mods:  # drop the plain weights before packing: the merged copy is then the only one
            m.weight = None
        if packed:
            w = torch.ops.mkldnn._reorder_linear_weight(w, None)  # [out, in] in oneDNN's blocked layout
        owner = PackedLinear(w, b, splits)
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
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type == "cpu" and not t.is_mkldnn:
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
    n = sum(len(g) for g in p.groups)
    merged = f", {p.merged} merged groups (q/k/v, gate/up)" if p.merged else ""
    return f"packed for oneDNN: {n} linear{'s' if n != 1 else ''}{merged}"
