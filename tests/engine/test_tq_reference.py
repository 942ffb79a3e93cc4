"""Ours against the ``turboquant`` package (0.2.0) at the same bits, on the same model and text (#33 item 4).

Opt-in (``KVSCOPE_REFERENCE=1``): the package runs in a venv of its own (``turboquant_env``, made once and cached) and
each of its rows feeds 511 tokens one at a time through HF's model twice (~4 minutes a row on this shared machine), so
the default suite skips it; ``tests/engine/measure_turboquant.py`` prints the whole table.

What differs: the package keeps the last ``residual_len`` tokens exact (128 by default) and quantizes each older
token alone; ours keeps the page being filled exact (0 to 15 tokens at pages of 16) and quantizes a page when its
last token is written. On stories260K (head_dim 8) how many recent tokens stay exact weighs more than anything else
(the package at 4 bits: ×1.000 with 128, ×1.014 with 16, ×1.66 with 1), so the test runs the package's quantizer
under our page policy (``turboquant_ref.py`` with RESIDUAL -16): same window, same bits, its codebook (equal-mass
cells) and one Haar rotation for every layer and head against ours. Margins (perplexity within, top-1 agreement
within), measured 2026-12-03: 4 bits 10% / 5 points (ours ×1.108 86.1%, its ×1.127 88.2%); 3 bits 40% / 10 points
(ours ×2.55 60.0%, its ×1.92 67.3%: our codebook has the lower round-trip error on these keys, yet its wider outer
cells lose fewer tokens at 3 bits; a Haar rotation per head instead of Walsh–Hadamard gave ours ×2.23 61.2%).
"""

from __future__ import annotations

import os

import pytest

import turboquant_env as env

MARGINS = {4: (0.10, 0.05), 3: (0.40, 0.10)}  # bits: (perplexity, top-1 agreement)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("KVSCOPE_REFERENCE") != "1",
    reason="set KVSCOPE_REFERENCE=1: the turboquant package in a venv of its own, ~10 minutes")]


def test_ours_is_within_the_stated_margin_of_the_turboquant_package(stories):
    try:
        py = env.ensure_venv(lambda _m: None)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"the turboquant venv could not be made (offline?): {e}")
    ids = env.token_ids()
    theirs = {r["bits"]: r for r in env.reference_rows(py, ids, bits=(4, 3), residuals=(-16,))}
    ours = {int(r["k_dtype"][2]): r for r in env.our_rows(stories, ids, kinds=("tq4", "tq3"))}
    for bits, (ppl, top1) in MARGINS.items():
        o, t = ours[bits], theirs[bits]
        assert o["perplexity"] <= (1 + ppl) * t["perplexity"], (bits, o, t)
        assert o["top1_agreement"] >= t["top1_agreement"] - top1, (bits, o, t)
