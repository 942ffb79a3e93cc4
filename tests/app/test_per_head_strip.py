"""Expected Attention keeps its tokens per KV head: the window's token strip draws a token some heads dropped in
its own colour, names it when hovered, and lists it in the strip's legend."""

from __future__ import annotations

import numpy as np

from app.panels.strip import TOKEN_COLOURS, _rgb
from app_helpers import close_window, open_window, wait_reply
from engine import snapshot as S
from engine.config import CacheConfig, SamplingConfig


def test_the_strip_shows_tokens_kept_by_some_heads(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(max_new_tokens=80, ignore_eos=True))
    try:
        with qtbot.waitSignal(w.engine.worker.applied, timeout=30_000):
            w.apply_cache_config(CacheConfig(mode="paged", page_size=8, policy="expected",
                                             policy_params={"budget": 48, "recent": 8, "queries": 16}))
        w.send("Once upon a time")
        gen, _ = wait_reply(qtbot, w)
        qtbot.waitUntil(lambda: w.page_map.snapshot is not None and w.page_map.snapshot.generation_id == gen
                        and w.page_map.snapshot.phase != "prefill", timeout=10_000)
        qtbot.wait(300)  # the reply's last frame
        snap = w.page_map.snapshot
        partial = np.nonzero(snap.token_state == S.TOKEN_PARTIAL)[0]
        assert len(partial) and snap.evicted_total > 0
        assert w.page_map.describe_token(int(partial[0])).endswith("kept by some heads")
        image = w.page_map.strip.image  # [rows, T, 4]
        assert np.any(np.all(image[..., :3] == _rgb(TOKEN_COLOURS[S.TOKEN_PARTIAL]).astype(np.uint8), axis=-1))
        assert "kept by some heads" in w.page_map.strip_legend.text()
        caption = w.occupancy.caption.text()
        assert f"{len(partial)} kept by some heads only" in caption and f"{snap.evicted_total} evicted" in caption
    finally:
        close_window(w)
