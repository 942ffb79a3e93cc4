"""Human-readable numbers for labels and tooltips."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    n = float(n)
    if abs(n) >= 1e9:
        return f"{n / 1e9:.1f}B"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.1f}M"
    if abs(n) >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def count(n: int, word: str = "token", plural: str = "") -> str:
    """1 -> '1 token', 1234 -> '1,234 tokens' (``plural`` when it is not ``word`` + 's')."""
    n = int(n)
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


# -- a model's weights and memory (the engine's types: ``engine.model.fit`` / ``weights_plan``, ``ModelInfo``) ------
HELD_WORDS = {"mapped": "mapped from the file", "repacked": "repacked from the file",
              "read": "read as stored", "converted": "converted from {stored}",
              "quantized": "quantized from {stored} as loaded", "dequantized": "dequantized from {stored}",
              "copied": "mapped from its copy quantized from {stored} at a first load"}


def weights_words(fmt: str, held: str, stored: str, bits: float) -> str:
    """'Q4_K_M, 4.85 bits per weight, mapped from the file' / 'F32, 32.00 bits per weight, converted from BF16'."""
    how = HELD_WORDS.get(held, held).format(stored=stored)
    return ", ".join(p for p in (fmt, f"{bits:.2f} bits per weight" if bits else "", how) if p)


def info_weights_words(info) -> str:
    """The loaded model's weights as held (``ModelInfo``); its dtype where the loader said nothing more (demo)."""
    if not getattr(info, "weights_format", ""):
        return f"{info.dtype} · {info.quantization}"
    return weights_words(info.weights_format, info.weights_held, info.weights_stored, info.weights_bits)


def kv_kind_words(fit, kind: str) -> str:
    return fit.compute_dtype if kind == "auto" else kind


def fit_html(fit, context: int) -> str:
    """The models dialog's verdict: the weights as held, the KV cache at ``context`` tokens and a token's bytes at
    every precision, the longest context that fits in the free memory, and whether it fits."""
    w = fit.weights
    ctx = min(context, fit.context) if fit.context else context
    kv = fit.kv_bytes("auto", ctx)
    lines = [f"Weights <b>{human_bytes(w.bytes)}</b> ({weights_words(w.format, str(w.held), w.stored, w.bits_per_weight)})"
             f" + KV cache <b>{human_bytes(kv)}</b> at {ctx:,} tokens ({human_bytes(fit.cost('auto').bytes_per_token)}"
             f"/token) + runtime {human_bytes(fit.total_at(ctx) - w.bytes - kv)} = <b>{human_bytes(fit.total_at(ctx))}</b>",
             "KV cache per token: " + ", ".join(f"{kv_kind_words(fit, k.kind)} {human_bytes(k.bytes_per_token)}"
                                               for k in fit.kv)]
    if fit.context and context > fit.context:
        lines.append(f"The model's context is {fit.context:,} tokens; the estimate uses that.")
    where = f"{human_bytes(fit.available)} of {fit.available_from}"
    if not fit.fits:
        lines.append(f"<span style='color:#ff8080'>Will not fit in {where}: try 8-bit/4-bit weights, a shorter "
                     "context, or another device.</span>")
    elif all(k.longest_context >= fit.context for k in fit.kv) and fit.context:
        lines.append(f"<span style='color:#43c59e'>Fits in {where}: its whole context ({fit.context:,} tokens) at "
                     "every precision.</span>")
    else:
        longest = ", ".join(f"{kv_kind_words(fit, k.kind)} {k.longest_context:,}" for k in fit.kv)
        lines.append(f"<span style='color:#43c59e'>Fits in {where}</span>; longest context: {longest} tokens.")
    return "<br>".join(lines)


def wont_fit_words(fit) -> str:
    """The banner's one line for a model that will not fit, with the numbers."""
    where = f"{human_bytes(fit.available)} of {fit.available_from}"
    if fit.load_bytes > fit.available:
        return (f"{fit.name} will not fit: loading needs {human_bytes(fit.load_bytes)} and {where} is available "
                "(try 8-bit/4-bit weights or another device)")
    best = max(fit.kv, key=lambda k: k.longest_context)
    return (f"{fit.name} will not fit: beside its weights, {where} holds {best.longest_context:,} tokens of KV cache "
            f"at most ({kv_kind_words(fit, best.kind)}), fewer than {fit.min_context:,}")


def copies_words(state, enabled: bool) -> str:
    """Settings ▸ Quantized copies' "On disk" line from ``app.link.copies.CopiesState`` (None: not counted yet):
    '1.2 GiB in 3 copies · budget 16.0 GiB', '0 B · budget 16.0 GiB', '1.2 GiB in 3 copies · off: loads neither
    keep nor use copies'; ``enabled``: the setting's checkbox (the environment KV Scope started in can turn copies
    off)."""
    if state is None:
        return "counting…"
    held = human_bytes(state.nbytes)
    if state.count:
        held += f" in {count(state.count, 'copy', 'copies')}"
    elif state.nbytes:
        held += " in a copy being written"
    if state.on:
        return f"{held} · budget {human_bytes(state.budget)}"
    if enabled:
        return f"{held} · off (KVSCOPE_QUANTIZED_CACHE=off when KV Scope started)"
    return f"{held} · off: loads neither keep nor use copies"
