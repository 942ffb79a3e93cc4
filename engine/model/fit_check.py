"""The memory verdict before a load (``check``: ``engine.model.fit``'s estimate, the refusal of a model that will not
fit, the note said before the weights are read) and the command line's words for it. (The app words the same types
in ``app.ground.format``.)"""

from __future__ import annotations

from pathlib import Path

from engine.model.fit import Fit, KVCost, WontFitError, estimate_path
from engine.model.notes import LoadNote
from engine.model.weights_plan import Held, WeightsPlan


def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def held_words(w: WeightsPlan) -> str:
    """'Q4_K_M, 4.85 bits per weight, mapped from the file' / 'F32 (converted from BF16), 32.0 bits per weight'."""
    how = {Held.MAPPED: "mapped from the file", Held.READ: "read as stored",
           Held.REPACKED: "repacked from the file",
           Held.CONVERTED: f"converted from {w.stored} as read",
           Held.QUANTIZED: f"quantized from {w.stored} as read" + (" (bitsandbytes)" if w.format == "int8" else ""),
           Held.COPIED: f"mapped from its copy quantized from {w.stored} at a first load",
           Held.DEQUANTIZED: f"dequantized from {w.stored} as read"}[w.held]
    return f"{w.format}, {w.bits_per_weight:.2f} bits per weight, {how}"


def describe(fit: Fit) -> str:
    """One line: the weights as held, what a token costs for each K/V precision and the longest context."""
    kv = ", ".join(f"{_kind(fit, k)} {human_bytes(k.bytes_per_token)}" for k in fit.kv)
    where = f"{human_bytes(fit.available)} of {fit.available_from}"
    if all(k.longest_context >= fit.context for k in fit.kv) and fit.context:
        room = f"its whole context ({fit.context:,} tokens) fits at every precision in {where}"
    else:
        room = f"longest context in {where}: " + ", ".join(f"{_kind(fit, k)} {k.longest_context:,}" for k in fit.kv)
    looked = fit.weights.looked_up
    pages = f" and {human_bytes(looked)} of the file's embedding its lookups map as a chat goes" if looked else ""
    return (f"{fit.name}: weights {human_bytes(fit.weights.bytes)} ({held_words(fit.weights)}){pages}, "
            f"{human_bytes(fit.resident_bytes)} with the runtime; KV cache per token: {kv}; {room}")


def _kind(fit: Fit, k: KVCost) -> str:
    return fit.compute_dtype if k.kind == "auto" else k.kind


def refusal(fit: Fit, alternatives: list[tuple[str, Fit]] = ()) -> str:
    """Why ``fit`` does not fit, with the numbers, and the settings that would."""
    if fit.load_bytes > fit.available:
        why = (f"loading needs {human_bytes(fit.load_bytes)} (weights {human_bytes(fit.weights.bytes)} as "
               f"{fit.weights.format}, {human_bytes(fit.libraries + fit.tokenizer + fit.loading)} for the "
               f"libraries, the tokenizer and the tensor being read)")
    else:
        best = max(fit.kv, key=lambda k: k.longest_context)
        why = (f"after its weights ({human_bytes(fit.resident_bytes)} with the runtime) the KV cache has room for "
               f"{best.longest_context:,} tokens at most ({_kind(fit, best)}), fewer than {fit.min_context:,}")
    others = [f"{flag} needs {human_bytes(f.load_bytes)}" for flag, f in alternatives if f.fits]
    tip = f"; {'; '.join(others)}" if others else ""
    return (f"{fit.name} will not fit: {why}, and {human_bytes(fit.available)} of {fit.available_from} "
            f"is available{tip}")


class FitNote(LoadNote):
    """The verdict said before the weights load (``describe``'s words; ``fit`` for whoever words it otherwise)."""

    fit: Fit


def check(path: Path, spec, device: str, progress=None, name: str = "", say: bool = True) -> Fit | None:
    """Before a load reads a weight: ``WontFitError`` with the numbers (and the settings that would fit) when the
    model will not fit; else the verdict, said through ``progress`` as a ``FitNote`` (unless ``say`` is False). None
    when the files cannot be read here (the loader's own checks then say why, in their words)."""
    try:
        f = estimate_path(path, spec, device, name=name)
    except Exception:  # noqa: BLE001 - unreadable files are the loader's checks' to name
        return None
    if not f.fits:
        raise WontFitError(refusal(f, alternatives(path, spec, device, f)), f)
    if progress is not None and say:
        progress(note(f), 0.12)
    return f


def note(f: Fit) -> FitNote:
    """The verdict as the note said before the weights load (``describe``'s words, ``fit`` the type)."""
    n = FitNote(describe(f))
    n.fit = f
    return n


def alternatives(path: Path, spec, device: str, fit: Fit) -> list[tuple[str, Fit]]:
    """The smaller ways to hold these weights (``--dtype bfloat16`` where float32 was chosen, ``--quantize``),
    each with its verdict in the same memory."""
    import dataclasses

    out = []
    for flag, change in (("--dtype bfloat16", {"dtype": "bfloat16"}), ("--quantize int8", {"quantization": "int8"}),
                         ("--quantize nf4", {"quantization": "nf4"})):
        alt = dataclasses.replace(spec, **change)
        if alt == spec:
            continue
        try:
            g = estimate_path(path, alt, device, fit.available, fit.available_from, fit.name)
        except Exception:  # noqa: BLE001
            continue
        if g.weights.bytes < fit.weights.bytes:
            out.append((flag, g))
    return out
