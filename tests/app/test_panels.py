"""Panels fed synthetic snapshots: bar heights, page-map image values and timing curves are exact."""

from __future__ import annotations

import numpy as np
import pytest
from app_helpers import make_info, make_snapshot

from app.panels import MemoryPanel, ModelCardPanel, OccupancyPanel, PageMapPanel, TimingPanel
from app.panels.occupancy import occupancy_stack
from app.panels.page_map import PAD, STATE_COLOURS, TURN_COLOURS, _rgb, page_colours, page_grid, upscale
from engine.snapshot import TOKEN_EVICTED, TOKEN_PINNED, TOKEN_QUANTIZED, TokenEvent


def test_occupancy_bars_stack_by_state(qtbot):
    tokens = np.zeros(12, dtype=np.int8)
    tokens[[0, 1]] = TOKEN_PINNED
    tokens[2:6] = TOKEN_QUANTIZED
    tokens[6:8] = TOKEN_EVICTED
    snap = make_snapshot(tokens_per_layer=np.array([10, 9, 7]), token_state=tokens, seq_len=12, capacity_tokens=16)
    panel = OccupancyPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(snap)
    h = panel.bar_heights()
    np.testing.assert_array_equal(h["pinned"], [2, 2, 2])
    np.testing.assert_array_equal(h["quantized"], [4, 4, 4])
    np.testing.assert_array_equal(h["full"], [4, 3, 1])
    assert "evicted" not in h  # held tokens only: the bars never rise above the capacity line
    y0 = panel.bar_bottoms()
    np.testing.assert_array_equal(y0["full"], [0, 0, 0])
    np.testing.assert_array_equal(y0["quantized"], [4, 3, 1])
    np.testing.assert_array_equal(y0["pinned"], [8, 7, 5])
    assert panel.capacity.value() == 16 and panel.capacity.isVisible()
    assert panel.updates == 1


def test_occupancy_off_mode_holds_nothing():
    stack = occupancy_stack(make_snapshot(mode="off", tokens_per_layer=np.array([0, 0, 0]), num_pages=0))
    assert sum(int(v.sum()) for v in stack.values()) == 0


def test_page_map_grid_and_colours(qtbot):
    snap = make_snapshot()
    grid = page_grid(snap, cols=4)
    np.testing.assert_array_equal(grid, [[1, 1, 2, 0], [3, 4, 6, 0]])
    rgba = page_colours(snap, cols=4)
    assert rgba.shape == (2, 4, 4) and rgba.dtype == np.uint8
    full = lambda hex_: np.round(_rgb(hex_)).astype(np.uint8)  # noqa: E731
    half = lambda hex_, f: np.round(_rgb(hex_) * (0.45 + 0.55 * f)).astype(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(rgba[0, 0, :3], full(TURN_COLOURS[0]))  # active, turn 0, full page
    np.testing.assert_array_equal(rgba[0, 1, :3], half(TURN_COLOURS[1], 0.5))  # active, turn 1, half full
    np.testing.assert_array_equal(rgba[0, 2, :3], full(STATE_COLOURS[2]))  # shared
    np.testing.assert_array_equal(rgba[0, 3, :3], full(STATE_COLOURS[0]))  # free (not dimmed)
    np.testing.assert_array_equal(rgba[1, 0, :3], full(STATE_COLOURS[3]))  # pinned
    np.testing.assert_array_equal(rgba[1, 1, :3], full(STATE_COLOURS[4]))  # quantized
    np.testing.assert_array_equal(rgba[1, 2, :3], full(STATE_COLOURS[6]))  # just evicted
    assert (rgba[..., 3] == 255).all()

    panel = PageMapPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(snap)
    assert panel.cols == 16
    np.testing.assert_array_equal(panel.grid[0, :8], snap.page_state)
    assert (panel.grid[0, 8:] == -1).all()
    np.testing.assert_array_equal(panel.colours[0, 8], PAD)
    drawn = panel.image.image
    np.testing.assert_array_equal(drawn, upscale(panel.colours, panel.px))
    assert "page 1 · active · 2/4 tokens (50% full) · ref count 1 · owner turn 2" == panel.describe_page(1)
    assert panel.page_at(1 * panel.px + 1, 1) == 1
    assert panel.page_at(9 * panel.px + 1, 1) == -1  # past the last page
    assert "free" in panel.describe_page(3) and "owner —" in panel.describe_page(3)


def test_page_map_shows_prefix_cache_pages_as_cached_not_used(qtbot):
    from engine.snapshot import PAGE_CACHED

    snap = make_snapshot(page_state=np.array([1, 1, 2, 0, 3, 4, PAGE_CACHED, PAGE_CACHED], dtype=np.int8),
                         page_fill=np.array([4, 2, 4, 0, 4, 4, 4, 4], dtype=np.int32))
    rgba = page_colours(snap, cols=4)
    np.testing.assert_array_equal(rgba[1, 2, :3], np.round(_rgb(STATE_COLOURS[PAGE_CACHED])).astype(np.uint8))
    assert snap.pages_used == 5
    panel = PageMapPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(snap)
    cap = panel.caption.text()
    assert "<b>5</b>/8 pages used" in cap and "2 pages cached" in cap
    assert "page 6 · cached · 4/4 tokens" in panel.describe_page(6)


def test_page_map_token_strip(qtbot):
    tokens = np.array([1, 0, 0, 2, 3, 4], dtype=np.int8)
    panel = PageMapPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(make_snapshot(token_state=tokens))
    strip = panel.strip.image
    assert strip.shape == (1, 6, 4)
    np.testing.assert_array_equal(strip[0, 3, :3], np.round(_rgb("#ff4b4b")).astype(np.uint8))


def _event(i: int, ms: float, phase: str = "decode", gen: int = 1, n: int = 1) -> TokenEvent:
    return TokenEvent(gen, i, 5, "x", phase, ms, n)


def test_timing_curves_and_previous_overlay(qtbot):
    panel = TimingPanel()
    qtbot.addWidget(panel)
    panel.begin_reply(1, "cache off")
    panel.add_token(_event(0, 50.0, "prefill", n=20))
    for i, ms in enumerate([10.0, 20.0, 30.0, 40.0], start=1):
        panel.add_token(_event(i, ms))
    panel.add_token(_event(9, 999.0, gen=7))  # another reply's token is ignored
    panel.refresh()
    c = panel.curves()
    np.testing.assert_array_equal(c["latency"][0], [1, 2, 3, 4])
    np.testing.assert_array_equal(c["latency"][1], [10, 20, 30, 40])
    np.testing.assert_allclose(c["tps"][1], [100.0, 2000 / 30, 3000 / 60, 4000 / 100])
    assert len(c["prev_latency"][1]) == 0
    np.testing.assert_array_equal(panel.prefill_bars.opts["height"], [0, 50.0])

    panel.begin_reply(2, "cache paged")
    panel.add_token(_event(0, 30.0, "prefill", gen=2))
    for i in range(1, 4):
        panel.add_token(_event(i, 5.0, gen=2))
    panel.refresh()
    c = panel.curves()
    np.testing.assert_array_equal(c["latency"][1], [5, 5, 5])
    np.testing.assert_array_equal(c["prev_latency"][1], [10, 20, 30, 40])  # previous reply overlaid
    np.testing.assert_array_equal(panel.prefill_bars.opts["height"], [50.0, 30.0])
    assert "cache off" in panel.caption.text()


def test_rolling_tps_window():
    from app.panels.token_series import TokenSeries

    s = TokenSeries(capacity=2)  # grows past its capacity
    for i in range(40):
        s.add(_event(i + 1, 10.0))
    assert s.n == 40
    np.testing.assert_allclose(s.rolling_tps(window=16), np.full(40, 100.0))


def test_memory_series(qtbot):
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    for i, kv in enumerate([0, 1 << 20, 2 << 20]):
        panel.show_snapshot(make_snapshot(kv_bytes=kv, weights_bytes=8 << 20), now=100.0 + i)
    s = panel.series()
    np.testing.assert_array_equal(s["t"], [0, 1, 2])
    np.testing.assert_array_equal(s["kv_mib"], [0, 1, 2])
    np.testing.assert_array_equal(s["weights_mib"], [8, 8, 8])
    assert (panel.split.weights, panel.split.kv) == (8 << 20, 2 << 20)


def test_memory_axis_labels_both_end_decades(qtbot):
    """A model of ~1 MiB and a cache of ~0.3 MiB: the log axis spans 0.1 to 10 MiB and says all three (at the plot's
    very edges "0.1" and "10" were dropped, the axis said only "1")."""
    from PySide6.QtGui import QImage, QPainter

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.resize(600, 500)
    panel.show()
    for t, kv in ((0.0, 280 << 10), (0.5, 300 << 10)):
        snap = make_snapshot(weights_bytes=1015 << 10, kv_bytes=kv, bytes_per_layer=np.array([kv // 3] * 3))
        panel.show_snapshot(snap, now=100 + t)
    qtbot.wait(20)
    image = QImage(600, 500, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    specs = panel.plot.getAxis("left").generateDrawSpecs(painter)
    painter.end()
    assert [text for *_, text in specs[2]] == ["0.1", "1", "10"]


@pytest.mark.parametrize("kv_heads,kind", [(8, "MHA"), (2, "GQA"), (1, "MQA")])
def test_model_card(qtbot, kv_heads, kind):
    per_token = 2 * 4 * kv_heads * 16 * 4
    info = make_info(num_kv_heads=kv_heads, kv_bytes_per_token=per_token)
    panel = ModelCardPanel()
    qtbot.addWidget(panel)
    panel.show_model(info)
    mha, mqa = 2 * 4 * 8 * 16 * 4, 2 * 4 * 1 * 16 * 4
    np.testing.assert_allclose(panel.bar_heights(), np.array([mha, per_token, mqa]) * 1024 / 2**20)
    assert f"<b>{kind}</b>" in panel.table.text()
    assert "CPU threads" not in panel.table.text()  # no reason given: no row
    panel.show_model(make_info(threads=1, threads_reason="1 (a model under 50M parameters: threads only add overhead)"))
    assert "CPU threads" in panel.table.text() and "under 50M" in panel.table.text()
    bf16_cpu = "AVX512 vector units · native bf16 (AMX, AVX512-BF16)"
    panel.show_model(make_info(cpu_features=bf16_cpu))
    assert bf16_cpu + ": weights “bfloat16” (File ▸ Models) halve the bytes" in panel.table.text()
    panel.show_model(make_info(cpu_features=bf16_cpu, dtype="bfloat16", kv_dtype="bfloat16"))
    assert bf16_cpu in panel.table.text() and "halve" not in panel.table.text()  # already bf16: no hint


def test_panels_export_png(qtbot, tmp_path):
    panel = OccupancyPanel()
    qtbot.addWidget(panel)
    panel.resize(400, 200)
    panel.show_snapshot(make_snapshot())
    path = tmp_path / "occ.png"
    assert panel.export_png(str(path)) and path.stat().st_size > 1000


def test_page_map_hover_shows_the_page(qtbot):
    from PySide6.QtCore import QPointF

    panel = PageMapPanel()
    qtbot.addWidget(panel)
    panel.resize(420, 260)
    panel.show()
    panel.show_snapshot(make_snapshot())
    qtbot.wait(50)
    inside = panel.image.mapToScene(QPointF(panel.px * 2 + 1, 1))  # page 2 (shared)
    panel._on_mouse((inside,))
    assert panel.hover.text() == panel.describe_page(2) and "shared" in panel.hover.text()
    assert "ref count 2" in panel.hover.text()


def test_state_layers_stand_as_a_constant_bar_and_pools_are_labelled(qtbot):
    snap = make_snapshot(tokens_per_layer=np.array([10, 0, 10]), bytes_per_layer=np.array([640, 320, 640]),
                         layer_kinds=("full", "state", "sliding"), page_groups=(("full", 5), ("sliding 8", 3)))
    panel = OccupancyPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(snap)
    h = panel.bar_heights()
    np.testing.assert_array_equal(h["state"], [0, 5, 0])  # 320 B of state = 5 tokens' worth at 64 B/token
    np.testing.assert_array_equal(h["full"], [10, 0, 0])
    np.testing.assert_array_equal(h["window"], [0, 0, 10])  # a sliding layer in its own colour, in the legend
    assert "fixed state" in panel.caption.text() and "sliding layers keep only their window" in panel.caption.text()
    pages = PageMapPanel()
    qtbot.addWidget(pages)
    pages.show_snapshot(snap)
    assert "full: pages 0–4" in pages.caption.text() and "sliding 8: pages 5–7" in pages.caption.text()


def test_page_map_dots_the_pages_a_batched_step_wrote(qtbot):
    snap = make_snapshot(written_pages=(1, 4), batch_size=3)
    panel = PageMapPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(snap)
    px, drawn = panel.px, panel.image.image
    base = upscale(panel.colours, px)
    changed = np.argwhere((drawn[..., :3] != base[..., :3]).any(axis=-1))  # [pixels, (y, x)]
    cells = {(int(y) // px) * panel.cols + int(x) // px for y, x in changed}
    assert cells == {1, 4} and (drawn[changed[:, 0], changed[:, 1], :3] == 255).all()
    assert "2 written this step (3 chats decoded together)" in panel.caption.text()


def test_page_map_draws_other_chats_pages_in_one_muted_colour(qtbot):
    from app.panels.page_map import OTHER_COLOUR

    mine = np.array([True, False, True, False, True, True, False, False])  # page 1: active, another chat's
    snap = make_snapshot(page_mine=mine)
    rgba = page_colours(snap, cols=4)
    half = np.round(_rgb(OTHER_COLOUR) * (0.45 + 0.55 * 0.5)).astype(np.uint8)  # page 1 is half full
    np.testing.assert_array_equal(rgba[0, 1, :3], half)
    np.testing.assert_array_equal(rgba[0, 0, :3], np.round(_rgb(TURN_COLOURS[0])).astype(np.uint8))  # this chat's
    panel = PageMapPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(snap)
    assert panel.describe_page(1).startswith("page 1 · another chat's ·")


def test_turn_colours_are_blues_unlike_cached_quantized_and_other_chats():
    """#19 item 13: turn 2's teal looked like 'cached'. Every turn is a blue, far from the other states."""
    import colorsys

    from engine import snapshot as S

    others = [STATE_COLOURS[S.PAGE_CACHED], STATE_COLOURS[S.PAGE_QUANTIZED], STATE_COLOURS[S.PAGE_SHARED]]
    for colour in TURN_COLOURS:
        r, g, b = _rgb(colour) / 255
        hue = colorsys.rgb_to_hsv(r, g, b)[0] * 360
        assert 205 <= hue <= 230, (colour, hue)
        for other in others:
            assert np.abs(_rgb(colour) - _rgb(other)).sum() > 100, (colour, other)
    for a, b in zip(TURN_COLOURS, TURN_COLOURS[1:] + TURN_COLOURS[:1]):  # one turn to the next is told apart
        assert np.abs(_rgb(a) - _rgb(b)).sum() > 90, (a, b)


def test_the_timing_caption_says_an_eviction_policy_s_cost_only_when_it_is_a_figure(qtbot):
    """StreamingLLM's bookkeeping read 'eviction scoring 0.00 ms a token, 0 ms in the prefill' (at 1280×720 a sixth
    caption line that cut the charts' axis labels); H2O's scoring is still said."""
    panel = TimingPanel()
    qtbot.addWidget(panel)
    panel.begin_reply(1, "cache paged")
    panel.add_token(_event(0, 50.0, "prefill", n=20))
    for i in range(1, 41):
        panel.add_token(_event(i, 10.0))
    panel.show_caption(make_snapshot(generation_id=1, ttft_ms=50.0, prefill_ms=50.0, policy_prefill_ms=0.02,
                                     policy_decode_ms=0.05))
    assert "eviction scoring" not in panel.caption.text() and "TTFT 50 ms" in panel.caption.text()
    panel.show_caption(make_snapshot(generation_id=1, ttft_ms=50.0, prefill_ms=50.0, policy_prefill_ms=26.0,
                                     policy_decode_ms=31.2))
    assert "eviction scoring 0.78 ms a token, 26 ms in the prefill" in panel.caption.text()


def _lines(html: str, width: int) -> list[str]:
    """The lines Qt's rich-text layout breaks ``html`` into at ``width`` pixels, no-break spaces as spaces."""
    from PySide6.QtGui import QTextDocument

    doc = QTextDocument()
    doc.setHtml(html)
    doc.setTextWidth(width)
    doc.documentLayout()  # laid out at that width (the blocks have no lines before)
    out, block = [], doc.begin()
    while block.isValid():
        lay = block.layout()
        for i in range(lay.lineCount()):
            line = lay.lineAt(i)
            out.append(block.text()[line.textStart():line.textStart() + line.textLength()].replace("\xa0", " ").strip())
        block = block.next()
    return out


def test_narrow_captions_keep_numbers_with_units_and_chips_whole(qtbot):
    from app.panels.base import Caption, legend_html

    text = ("weights <b>1015.8 KiB</b> · KV <b>400.6 KiB</b> (28.3%) · 855 B per token · 1 CPU thread · "
            "<b>4</b>/32 pages used · page size 16")
    caption = Caption(text)
    qtbot.addWidget(caption)
    assert caption.text() == text  # what was set; only the painting glues
    for width in range(100, 300, 7):  # wider than "1015.8 KiB": narrower, Qt breaks inside it anyway
        lines = _lines(caption._probe.text(), width)
        assert lines and "".join(lines).replace(" ", "") == ("weights1015.8KiB·KV400.6KiB(28.3%)·855Bpertoken·"
                                                             "1CPUthread·4/32pagesused·pagesize16")
        assert not any(line.endswith(("1015.8", "400.6", "855", "1", "1 CPU")) for line in lines), (width, lines)
        assert not any(line.startswith(("KiB", "B per", "CPU", "thread", "16", "size")) for line in lines), (width, lines)
        assert not any(line.endswith(("page", "page size")) for line in lines), (width, lines)
    chips = [("#fff", "active (by turn)"), ("#000", "other chats"), ("#f00", "verified (frame)"),
             ("#0f0", "kept by some heads")]
    lines = _lines(legend_html(chips, prefix="pages:"), 150)
    assert len(lines) > 2
    for _, chip in chips:  # each chip on one line of its own or shared, never broken
        assert any(chip in line for line in lines), (chip, lines)
