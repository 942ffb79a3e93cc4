"""What a loaded model's weights hold: their bytes as stored (bitsandbytes' scales with them) and their format as
loaded, for ``ModelInfo`` (the model card, the memory panel, the fit verdict's check against a real load)."""

from __future__ import annotations

import dataclasses

import torch

from engine.snapshot import ModelInfo


def weights_bytes(model) -> int:
    """Bytes of the parameters as stored (int8 / packed 4-bit for bitsandbytes layers; tied weights once), with
    what a quantized weight keeps beside it: bitsandbytes' int8 row scales (``SCB``) and 4-bit block scales and
    codebook (``quant_state``: 58 MB of NF4 scales on the 1B shape, left out before)."""
    seen: set[tuple] = set()
    total = 0

    def key(t) -> tuple:  # one storage's bytes once, whichever tensor objects view them (a GGUF's tied head)
        if t.layout != torch.strided:  # oneDNN's packed weights (torch._mkldnn) have no storage to point at
            return (id(t),)
        return (t.data_ptr(), t.numel(), t.dtype) if t.data_ptr() else (id(t),)

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and key(t) not in seen:
            seen.add(key(t))
            total += t.numel() * t.element_size()

    # a GGUF linear repacked for the integer road holds its packed copy (or will, at its first product); the file's
    # pages it was read from are let go (a tied embedding's too: its looked-up rows are read from the file again)
    repacked = [m for m in model.modules() if getattr(m, "held_bytes", None) is not None and m.held_bytes()]
    seen.update(key(m.weight) for m in repacked)
    total += sum(m.held_bytes() for m in repacked)
    for mod in model.modules():
        add(getattr(getattr(mod, "state", None), "SCB", None))  # Linear8bitLt keeps its scales there once run
        for p in mod.parameters(recurse=False):
            add(p)
            add(getattr(p, "SCB", None))
            qs = getattr(p, "quant_state", None)
            while qs is not None:
                add(getattr(qs, "absmax", None))
                add(getattr(qs, "code", None))
                qs = getattr(qs, "state2", None)
    return total


def held_info(info: ModelInfo, plan, model) -> ModelInfo:
    """``info`` with the weights' format as loaded (``engine.model.weights_plan``: "Q4_K_M, mapped from the file",
    "F32 converted from BF16") and their bits per weight as held."""
    from engine.model.weights_plan import Held, as_loaded

    dtypes = {p.dtype for p in model.parameters()}
    floats = all(d.is_floating_point for d in dtypes)
    big = max(model.parameters(), key=lambda p: p.numel(), default=None)
    fmt, held = as_loaded(plan, str(big.dtype).replace("torch.", "") if floats and big is not None else "")
    copied = getattr(model, "kvscope_copied", None)  # a --quantize folder load: its kept copy mapped, or not
    if copied is not None and held in (Held.QUANTIZED, Held.COPIED):
        held = Held.COPIED if copied else Held.QUANTIZED
    params = plan.params or sum(p.numel() for p in model.parameters())
    return dataclasses.replace(info, weights_format=fmt, weights_stored=plan.stored, weights_held=str(held),
                               weights_bits=round(8 * info.weights_bytes / max(1, params), 2))
