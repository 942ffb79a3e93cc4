"""Settings belong to a chat (#49 item 1): each chat keeps its cache settings in its history row and gets them back
when opened (after a restart too), a new chat starts from the user's defaults, a lossy setting is never applied as a
side effect of another change and asks first with what it was measured to cost here, and a switch that would read
many tokens again says how many before. The real window on stories260K, the real history file."""

from __future__ import annotations

import json

from app_helpers import close_window, open_window, use_lossy, wait_reply

from app.controls import cache_controller
from app.controls.cache_controls import CacheControls
from app.controls.lossy import Measured, added, lossy_parts
from engine.config import CacheConfig, ModelSpec, SamplingConfig

SHORT = SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _choose(qtbot, w, **values) -> None:
    """Pick values in the controls as the user does (combos by data, the page size by value)."""
    c = w.controls
    for name, value in values.items():
        if name == "page_size":
            c.page_size.setValue(value)
        else:
            box = getattr(c, name)
            box.setCurrentIndex(box.findData(value))


def _row(w, chat_id) -> dict:
    return json.loads(w.history.chat(chat_id).settings)["cache"]


def test_each_chat_keeps_its_own_settings_and_a_new_chat_starts_from_the_defaults(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        first = w.chat_id
        defaults = w.cache.defaults
        _choose(qtbot, w, page_size=32)
        qtbot.waitUntil(lambda: w.cache.applied.page_size == 32, timeout=10_000)
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        assert _row(w, first)["page_size"] == 32
        w.new_chat()  # the defaults, not what was last chosen for the other chat
        second = w.chat_id
        qtbot.waitUntil(lambda: w.cache.applied == defaults, timeout=10_000)
        assert w.controls.config() == defaults and _row(w, second)["page_size"] == defaults.page_size
        _choose(qtbot, w, mode="contiguous")
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.send("A dog")
        wait_reply(qtbot, w)
        w.open_chat(first)  # its own settings come back into force, and say so
        qtbot.waitUntil(lambda: w.cache.applied == defaults.replace(page_size=32), timeout=10_000)
        assert w.controls.config().page_size == 32 and w.controls.page_size.value() == 32
        qtbot.waitUntil(lambda: "32-token pages" in w.status.cache.text(), timeout=10_000)
        w.open_chat(second)
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.controls.default_button.click()  # these become what new chats start with
        assert w.cache.defaults.mode == "contiguous"
    finally:
        close_window(w)
    w.close()
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)  # a restart: each chat as it was
    try:
        assert w.chat_id == second
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.open_chat(first)
        qtbot.waitUntil(lambda: (w.cache.applied.mode, w.cache.applied.page_size) == ("paged", 32), timeout=10_000)
        w.new_chat()
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)  # the defaults made above
    finally:
        close_window(w)


def test_a_lossy_setting_never_comes_back_by_itself(qtbot):
    """tq2 keys, then Contiguous (no pages: full precision), then Paged again: the keys stay at full precision
    (they came back as 2-bit before, and Regenerate then wrote gibberish); 8-bit, near-exact, still comes back."""
    c = CacheControls(CacheConfig(k_dtype="tq2", v_dtype="int8"))
    qtbot.addWidget(c)
    sent: list[CacheConfig] = []
    c.changed.connect(sent.append)
    c.mode.setCurrentIndex(c.mode.findData("contiguous"))
    assert (sent[-1].k_dtype, sent[-1].v_dtype) == ("auto", "auto")
    c.mode.setCurrentIndex(c.mode.findData("paged"))
    assert (sent[-1].k_dtype, sent[-1].v_dtype) == ("auto", "int8")
    c.policy.setCurrentIndex(c.policy.findData("h2o"))
    c.mode.setCurrentIndex(c.mode.findData("off"))
    c.mode.setCurrentIndex(c.mode.findData("paged"))
    assert sent[-1].policy == "none"  # an eviction policy comes back only when chosen again
    assert lossy_parts(CacheConfig(k_dtype="int8")) == [] and added(CacheConfig(), CacheConfig(v_dtype="tq3")) == [
        "values 3-bit rotated (tq3)"]
    assert added(CacheConfig(k_dtype="tq2"), CacheConfig(k_dtype="tq4")) == []  # more bits: nothing to ask


def test_a_lossy_choice_says_its_measured_cost_first_and_is_marked_on_the_chat(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        Measured(w.settings).record(w.info.source, [{"k_dtype": "tq2", "v_dtype": "auto", "policy": "none",
                                                     "params": {}, "tokens": 64, "top1_agreement": 0.203,
                                                     "mean_kl": 1.3125}])
        _choose(qtbot, w, k_dtype="tq2")
        strip = w.controls.asking_strip
        qtbot.waitUntil(lambda: strip.isVisibleTo(w.controls), timeout=5_000)
        assert "top-1 agreement 20.3%, KL 1.312 nats a token (64 tokens)" in strip.text.text()
        assert w.cache.applied.k_dtype == "auto"  # nothing applied yet
        strip.no.click()  # Cancel: the controls show the setting in force again
        assert w.controls.config().k_dtype == "auto" and not w.chat.lossy_chip.isVisible()
        _choose(qtbot, w, k_dtype="tq2")
        use_lossy(qtbot, w)
        qtbot.waitUntil(lambda: w.cache.applied.k_dtype == "tq2", timeout=10_000)
        assert w.chat.lossy_chip.isVisibleTo(w) and "keys 2-bit rotated (tq2)" in w.chat.lossy_chip.toolTip()
        assert w.controls.lossy_line.isVisibleTo(w)
        w.new_chat()  # another chat: its own (lossless) settings, no mark
        qtbot.waitUntil(lambda: w.cache.applied.k_dtype == "auto", timeout=10_000)
        assert not w.chat.lossy_chip.isVisibleTo(w)
    finally:
        close_window(w)


def test_a_switch_that_reads_many_tokens_again_says_how_many_first(qtbot, data_dir, stories_path, monkeypatch):
    """StreamingLLM → H2O: what StreamingLLM evicted comes back from the text. The switch says how many tokens it
    reads again before anything changes (here for any time: stories260K reads them in milliseconds)."""
    monkeypatch.setattr(cache_controller, "ASK_REREAD_MS", 0.0)
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.apply_cache_config(CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 64}))
        qtbot.waitUntil(lambda: w.cache.applied.policy == "streaming", timeout=10_000)
        w.send("the little dog ran to the park and played with a red ball in the sun. " * 4)
        wait_reply(qtbot, w)
        snap = w.scheduler.latest
        fed = snap.seq_len - 1  # the last token sampled is not fed yet
        held = int(max(snap.tokens_per_layer))
        _choose(qtbot, w, policy="h2o")
        use_lossy(qtbot, w)  # an eviction policy: lossy, asked first
        strip = w.controls.asking_strip
        qtbot.waitUntil(lambda: "reads" in strip.text.text() and strip.isVisibleTo(w.controls), timeout=10_000)
        said = strip.text.text()
        assert "with its next message" in said and w.cache.applied.policy == "streaming"
        n = int(said.split("reads ")[1].split(" tokens")[0].replace(",", ""))
        assert held < fed and n == fed - 4  # all but the sinks, which were never evicted
        strip.yes.click()
        qtbot.waitUntil(lambda: w.cache.applied.policy == "h2o", timeout=10_000)
    finally:
        close_window(w)


def test_a_model_keeps_its_own_defaults_for_new_chats_after_a_chat_s_own(qtbot, data_dir, stories_path):
    """"Make default for this model": the loaded model's new chats start with its own settings, another model's with
    the user's defaults; a chat opened keeps its own (restored first, whatever the model's defaults say since), after
    a reload too; "Make default for new chats" forgets the model's own."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        defaults = w.cache.defaults
        first = w.chat_id
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        w.new_chat()
        _choose(qtbot, w, mode="contiguous")
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.controls.model_default_button.click()
        assert "New chats of stories260K start with" in w.controls.notes.text()
        assert w.cache.defaults == defaults and w.settings.get("cache/mode") == defaults.mode  # the user's: unchanged
        w.new_chat()  # this model's own
        third = w.chat_id
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        assert _row(w, third)["mode"] == "contiguous" and w.controls.config().mode == "contiguous"
        w.open_chat(first)  # its own first
        qtbot.waitUntil(lambda: w.cache.applied == defaults, timeout=10_000)
        with qtbot.waitSignal(w.model_loaded, timeout=60_000):  # another model: the user's defaults
            w.load_model(ModelSpec(source="demo"))
        w.new_chat()
        qtbot.waitUntil(lambda: w.cache.applied == defaults, timeout=10_000)
        assert _row(w, w.chat_id)["mode"] == defaults.mode
        with qtbot.waitSignal(w.model_loaded, timeout=60_000):  # back: its own again, kept in the settings
            w.load_model(ModelSpec(source=str(stories_path)))
        w.new_chat()
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.controls.default_button.click()  # the button pressed last wins: the model's own are forgotten
        assert "its own defaults for this model are forgotten" in w.controls.notes.text()
        assert w.settings.get("model/defaults") == {} and w.cache.defaults.mode == "contiguous"
    finally:
        close_window(w)


def test_a_model_s_own_defaults_stay_in_its_settings_file(tmp_path):
    """A store's declared default is never edited through what ``get`` hands out: a model's own defaults saved in
    one settings file are not the next file's (every later window's new chats started contiguous)."""
    from app.settings.model_defaults import ModelDefaults
    from app.settings.store import Settings

    ModelDefaults(Settings.from_file(tmp_path / "a.ini")).save("stories260K", '{"cache": {"mode": "contiguous"}}')
    fresh = Settings.from_file(tmp_path / "b.ini")
    assert fresh.get("model/defaults") == {} and ModelDefaults(fresh).get("stories260K") == {}
