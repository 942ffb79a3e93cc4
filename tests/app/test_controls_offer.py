"""#31 item 4: the cache controls offer only what can apply. What cannot is greyed out with the reason first in its
tooltip, in the controls' words; a choice the cache mode or the policy rules out falls back and returns when it can
apply again, so nothing the engine would refuse is ever sent (no red banner after the debounce)."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply

from app.controls.cache_controls import CacheControls
from app.controls.cache_parts import TOOLTIP_ROLE
from app.ground.widgets import DEBOUNCE_MS
from engine.config import CacheConfig, SamplingConfig

ENGINE_WORDS = ("'rolling'", "truncate_middle", "overflow '", "evicts from a cache", "contiguous or paged")
NEEDS_CACHE = 'Needs a cache: choose "Contiguous" or "Paged" under Cache'


def _greyed(box) -> dict[str, str]:
    """The items of ``box`` that cannot be chosen: their names → their tooltips."""
    model = box.model()
    return {box.itemText(i): box.itemData(i, TOOLTIP_ROLE) for i in range(box.count())
            if not model.item(i).isEnabled()}


def test_cache_off_greys_the_overflow_choices_that_drop_and_a_message_is_answered(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    c = w.controls
    try:
        assert c.overflow.currentText() == "Drop the oldest turns"  # the default
        c.mode.setCurrentIndex(c.mode.findData("off"))  # as the user does
        assert c.overflow.currentText() == "Stop the reply"  # at once, before anything reaches the engine
        greyed = _greyed(c.overflow)
        assert set(greyed) == {"Drop the oldest turns", "Drop the middle", "Drop the oldest (rolling window)",
                               "Let the eviction policy decide"}
        assert greyed["Drop the middle"].startswith(NEEDS_CACHE), greyed
        assert greyed["Drop the oldest (rolling window)"].startswith(NEEDS_CACHE), greyed
        assert greyed["Let the eviction policy decide"].startswith("Needs an eviction policy to decide"), greyed
        assert not c.k_dtype.isEnabled() and c.k_dtype.toolTip().startswith(NEEDS_CACHE)
        assert not c.prefix_reuse.isEnabled() and c.prefix_reuse.toolTip().startswith(NEEDS_CACHE)
        qtbot.waitUntil(lambda: w.cache.applied.mode == "off", timeout=10_000)
        qtbot.wait(DEBOUNCE_MS + 300)  # nothing reverts after the debounce, and no red banner
        assert (w.cache.applied.mode, w.cache.applied.overflow) == ("off", "stop") and not w.chat.notice.isVisible()
        assert c.mode.currentData() == "off" and c.overflow.currentText() == "Stop the reply"
        tips = " ".join([c.overflow.toolTip(), c.k_dtype.toolTip(), c.policy.toolTip(), *greyed.values()])
        assert not any(word in tips for word in ENGINE_WORDS), tips

        w.send("Once upon a time")
        gen, reason = wait_reply(qtbot, w)
        assert reason == "max_tokens" and "cache off" in w.chat.bubbles[-1].stats_label.text()

        c.mode.setCurrentIndex(c.mode.findData("paged"))  # the choice the mode ruled out comes back
        assert c.overflow.currentText() == "Drop the oldest turns"
        qtbot.waitUntil(lambda: (w.cache.applied.mode, w.cache.applied.overflow) == ("paged", "turns"),
                        timeout=10_000)
        assert "Let the eviction policy decide" in _greyed(c.overflow) and not w.chat.notice.isVisible()
    finally:
        close_window(w)


def test_precision_needs_pages_and_the_policy_overflow_needs_a_policy(qtbot):
    c = CacheControls(CacheConfig(k_dtype="int8", overflow="rolling"))
    qtbot.addWidget(c)
    sent: list[CacheConfig] = []
    c.changed.connect(sent.append)
    policy_decides = _greyed(c.overflow)["Let the eviction policy decide"]
    assert policy_decides.startswith('Needs an eviction policy to decide: choose one under Eviction')
    c.mode.setCurrentIndex(c.mode.findData("contiguous"))
    assert sent[-1].k_dtype == "auto" and c.k_dtype.currentText() == "Full precision"  # 8-bit is kept per page
    greyed = _greyed(c.k_dtype)
    assert set(greyed) == {"8-bit (int8)", "4-bit (int4, KIVI)", "4-bit rotated (tq4)", "3-bit rotated (tq3)",
                           "2-bit rotated (tq2)", "4-bit rotated + QJL", "3-bit rotated + QJL", "2-bit rotated + QJL"}
    assert all(t.startswith('Kept per page: needs the "Paged" cache') for t in greyed.values())
    assert not c.page_size.isEnabled() and c.page_size.toolTip().startswith('Only the "Paged" cache has pages')
    c.mode.setCurrentIndex(c.mode.findData("paged"))
    assert sent[-1].k_dtype == "int8" and not _greyed(c.k_dtype)  # back with the pages

    c.policy.setCurrentIndex(c.policy.findData("h2o"))
    assert "Let the eviction policy decide" not in _greyed(c.overflow)
    c.overflow.setCurrentIndex(c.overflow.findData("policy"))
    assert sent[-1].overflow == "policy" and sent[-1].policy == "h2o"
    c.policy.setCurrentIndex(c.policy.findData("none"))  # "Keep everything": nothing decides, the reply stops
    assert sent[-1].overflow == "stop" and c.overflow.currentText() == "Stop the reply"
    assert all(cfg == cfg.fitted() for cfg in sent)  # nothing the engine would refuse was sent


def test_a_question_below_a_short_dock_s_fold_is_scrolled_into_view(qtbot):
    """StreamingLLM's two parameters push the strip that asks before a lossy change under a 1280×720 dock's fold (it was
    asked there, unseen): asking scrolls the controls to it."""
    from app.ground.docks import scrolled

    c = CacheControls(CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 256}))
    area = scrolled(c)
    qtbot.addWidget(area)
    area.resize(380, 380)
    area.show()
    qtbot.waitExposed(area)
    assert area.verticalScrollBar().value() == 0
    c.ask("Keys 4-bit (int4, KIVI) loses information: replies may change.", "Use it", lambda: None, lambda: None)

    def in_view() -> bool:
        top = c.asking_strip.mapTo(area.viewport(), c.asking_strip.rect().topLeft()).y()
        return top >= 0 and top + c.asking_strip.height() <= area.viewport().height()

    qtbot.waitUntil(in_view, timeout=2000)
    assert area.verticalScrollBar().value() > 0
