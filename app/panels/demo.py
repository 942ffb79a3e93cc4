"""Run the live panels on synthetic snapshots: ``python -m app.panels.demo [--frames N]``.

A fake paged cache grows token by token over a few turns, quantizes old pages and evicts past a budget,
so every panel can be looked at (and smoke-tested headless) without a model.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from engine.snapshot import (
    PAGE_ACTIVE,
    PAGE_EVICTED,
    PAGE_FREE,
    PAGE_QUANTIZED,
    PAGE_SHARED,
    TOKEN_EVICTED,
    TOKEN_QUANTIZED,
    TOKEN_SINK,
    CacheSnapshot,
    TokenEvent,
)

LAYERS, PAGE, POOL, BUDGET = 6, 8, 96, 320


def synthetic(step: int) -> tuple[CacheSnapshot, TokenEvent]:
    """The cache after ``step`` tokens: 4 sink tokens, a sliding budget, old pages quantized."""
    seq = 40 + step
    held = min(seq, BUDGET)
    evicted = seq - held
    tokens = np.zeros(seq, dtype=np.int8)
    tokens[:4] = TOKEN_SINK
    tokens[4 : 4 + evicted] = TOKEN_EVICTED
    tokens[4 + evicted : max(4 + evicted, seq - 64)] = TOKEN_QUANTIZED
    n_pages = -(-held // PAGE)
    state = np.full(POOL, PAGE_FREE, dtype=np.int8)
    state[:n_pages] = PAGE_ACTIVE
    state[: min(2, n_pages)] = PAGE_SHARED
    state[2 : max(2, n_pages - 8)] = PAGE_QUANTIZED
    if evicted and step % 8 == 0:
        state[n_pages] = PAGE_EVICTED
    owner = np.where(state != PAGE_FREE, np.arange(POOL) // 12, -1).astype(np.int32)
    fill = np.where(state != PAGE_FREE, PAGE, 0).astype(np.int32)
    if n_pages:
        fill[n_pages - 1] = held - (n_pages - 1) * PAGE
    ref = np.where(state == PAGE_SHARED, 2, np.where(state != PAGE_FREE, 1, 0)).astype(np.int32)
    per_layer = np.full(LAYERS, held) - np.arange(LAYERS) * (evicted > 0)
    snap = CacheSnapshot(
        generation_id=1, step=step, mode="paged", policy="streaming", page_size=PAGE, num_pages=POOL,
        pages_used_per_layer=np.full(LAYERS, n_pages), tokens_per_layer=per_layer,
        bytes_per_layer=per_layer * 512, capacity_tokens=POOL * PAGE, page_state=state, page_owner=owner,
        page_fill=fill, page_refcount=ref, token_state=tokens, weights_bytes=64 << 20,
        kv_bytes=int(per_layer.sum()) * 512, device_bytes=0, reused_tokens=32, recomputed_tokens=8,
        first_divergence=32, seq_len=seq, context_length=2048, evicted_total=evicted,
    )
    event = TokenEvent(1, step, 7, "x", "prefill" if step == 0 else "decode", 80.0 if step == 0 else 8 + (step % 7),
                       40 if step == 0 else 1)
    return snap, event


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--frames", type=int, default=0, help="quit after N frames (0: run until closed)")
    ns = args.parse_args(argv)
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QGridLayout, QWidget

    import app  # noqa: F401 - PySide6 fix
    from app.panels import MemoryPanel, OccupancyPanel, PageMapPanel, TimingPanel
    from app.ground.theme import apply_theme

    qa = QApplication.instance() or QApplication(sys.argv[:1])
    apply_theme(qa)
    window = QWidget()
    window.setWindowTitle("KV Scope panels (synthetic data)")
    grid = QGridLayout(window)
    panels = [OccupancyPanel(), PageMapPanel(), TimingPanel(), MemoryPanel()]
    for i, p in enumerate(panels):
        grid.addWidget(p, i // 2, i % 2)
    panels[2].begin_reply(1, "synthetic")
    window.resize(1100, 700)
    window.show()
    frame = [0]

    def tick() -> None:
        snap, event = synthetic(frame[0])
        panels[2].add_token(event)
        for p in panels:
            p.show_snapshot(snap)
        frame[0] += 1
        if ns.frames and frame[0] >= ns.frames:
            qa.quit()

    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(33)
    qa.exec()
    ok = all(p.updates > 0 for p in panels)
    print(f"{frame[0]} frames, panels updated: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
