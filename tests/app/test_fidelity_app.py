"""Fidelity on the user's chat, in the real window (offscreen, stories260K): Memory's "Check fidelity" says what the
setting costs on the last turn and tints the worst tokens in their bubbles; a lossless setting says KL 0 and 100%;
Compare's Fidelity tab plots bytes per token against top-1 agreement for every precision × policy."""

from __future__ import annotations

import pytest
from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication
from table_checks import all_drawn, shoot

from engine.config import CacheConfig, SamplingConfig


@pytest.fixture
def chatted(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True))
    for text in ("Tell me a story about Lily and her red ball.", "What happened next?"):
        w.send(text)
        wait_reply(qtbot, w)
    yield w
    close_window(w)


def _apply(qtbot, w, cfg: CacheConfig) -> None:
    w.apply_cache_config(cfg)
    qtbot.waitUntil(lambda: w.cache.applied == cfg, timeout=10_000)


def _check(qtbot, w) -> dict:
    qtbot.mouseClick(w.memory.fidelity_button, Qt.MouseButton.LeftButton)
    assert w.fidelity.running and w.memory.fidelity_button.text() == "Stop check"
    qtbot.waitUntil(lambda: not w.fidelity.running, timeout=60_000)
    return w.fidelity.report


def test_check_fidelity_names_the_cost_and_tints_the_worst_tokens(qtbot, chatted):
    from app.chat.message_view import FIDELITY_TINT

    w = chatted
    _apply(qtbot, w, CacheConfig(k_dtype="int4", v_dtype="int4"))
    report = _check(qtbot, w)
    s = report["setting"]
    assert s["label"] == "int4 (your setting)" and not s["error"] and s["mean_kl"] > 0
    text = w.memory.fidelity_label.text()
    assert text.startswith(f"Fidelity of int4 (your setting) on the last turn ({s['tokens']:,} tokens): "
                           f"KL {s['mean_kl']:.4f} nats/token · top-1 {100 * s['top1_agreement']:.1f}% · "
                           f"perplexity ×{s['perplexity_ratio']:.3f}")
    assert w.memory.fidelity_button.text() == "Check fidelity"
    # the last turn: the second question and its reply; the worst tokens are tinted where they are
    marked = [b for b in w.chat.bubbles if b.fidelity_spans]
    assert marked and all(b.position >= w.chat.bubbles[2].position for b in marked)
    worst = report["worst"]
    assert len(worst) == 10 and worst[0]["kl"] == max(s["kl"])
    placed = sum(len(b.fidelity_spans) for b in marked)
    from app.compare.fidelity import WORTH_A_TINT

    worth = [x for x in worst if x["chars"] and (not x["agree"] or x["kl"] >= WORTH_A_TINT)]
    assert placed == len(worth)  # a token that lost nothing (KL 0.000, the same top token) is not tinted
    top = max(marked, key=lambda b: max(x["kl"] for x in worst if x["chars"] in b.fidelity_spans))
    assert FIDELITY_TINT in top.body.text() and top.fidelity_label.isVisible()
    assert f"worst tokens here (tinted); the worst: {worst[0]['text'].strip()!r}, KL {worst[0]['kl']:.3f}" in \
        top.fidelity_label.text()
    for x in worth:  # each tinted run is the token's own text in the bubble
        if x["chars"]:
            b = next(b for b in marked if x["chars"] in b.fidelity_spans)
            assert b.text[x["chars"][0]:x["chars"][1]].strip() == x["text"].strip()

    _apply(qtbot, w, CacheConfig())  # lossless: the reference's logits bit for bit
    report = _check(qtbot, w)
    assert report["setting"]["mean_kl"] == 0.0 and report["setting"]["top1_agreement"] == 1.0
    assert "KL 0.0000 nats/token · top-1 100.0% · perplexity ×1.000" in w.memory.fidelity_label.text()


def test_compare_plots_every_precision_and_policy_on_this_chat(qtbot, chatted, monkeypatch):
    from engine import config

    monkeypatch.setattr(config, "KV_DTYPES", ("auto", "int4"))  # two precisions × every policy: seconds, not minutes
    w = chatted
    _apply(qtbot, w, CacheConfig(k_dtype="int4", v_dtype="int4"))
    dlg = w.open_compare()
    qtbot.addWidget(dlg)
    tab = dlg.fidelity
    dlg.tabs.setCurrentWidget(tab)
    qtbot.mouseClick(tab.run_button, Qt.MouseButton.LeftButton)
    assert not tab.run_button.isEnabled() and tab.stop_button.isEnabled()
    qtbot.waitUntil(lambda: not w.fidelity.running, timeout=120_000)
    from engine.policies import registry

    rows = [r for r in w.fidelity.rows if r["label"] != "reference"]
    assert len(rows) == 1 + 2 * (1 + len(registry)) - 1  # your setting, then the grid without its twin
    points = tab.plot.points()
    assert sorted(p[2] for p in points) == sorted(r["label"] for r in rows)
    by = {r["label"]: r for r in rows}
    for x, y, label in points:
        assert x == pytest.approx(by[label]["bytes_per_token"])
        assert y == pytest.approx(100 * by[label]["top1_agreement"])
    assert "int4 · expected" in " ".join(by) and by["full precision"]["top1_agreement"] == 1.0
    front = tab.plot.front_labels()
    assert front[-1] == "full precision"  # the most bytes, exact: the front ends there
    assert all(by[a]["bytes_per_token"] < by[b]["bytes_per_token"] and by[a]["top1_agreement"] < by[b]["top1_agreement"]
               for a, b in zip(front, front[1:]))
    mine = tab.plot.mine.getData()
    assert (float(mine[0][0]), float(mine[1][0])) == pytest.approx(
        (by["int4 (your setting)"]["bytes_per_token"], 100 * by["int4 (your setting)"]["top1_agreement"]))
    assert tab.table.rowCount() == len(rows) and tab.status.text().startswith(f"Done: {len(rows)} settings")
    # the replies' comparison ends, never sitting at "Running…": it ran its settings, or (where engine.tools.compare
    # is first imported under the two precisions patched in: its int8 row is then refused) it says why
    qtbot.waitUntil(lambda: dlg.status.text().startswith(("Done: ", "Could not compare: ")), timeout=120_000)
    assert dlg.status.text().startswith(("Done: 6 settings", "Could not compare: v_dtype: 'int8' is not one of")), \
        dlg.status.text()
    dlg.tabs.setCurrentWidget(tab)
    for width, height in ((900, 520), (700, 480)):  # the default size, and narrower: no column clips
        dlg.resize(width, height)
        QApplication.processEvents()
        all_drawn(tab.table)
        shoot(dlg, f"compare-fidelity-{width}.png")
    dlg.close()

