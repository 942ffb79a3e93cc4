"""A first launch with nothing chosen: the shipped stories260K opens and writes real English; the random-weight
demo stays one click away."""

from __future__ import annotations

import re

from app_helpers import GREEDY, close_window, open_window, wait_reply

from engine.model.builtin import BUILTIN_LABEL, DEMO_LABEL


def test_first_launch_opens_the_built_in_model_and_it_writes_real_text(qtbot, data_dir):
    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.settings.store import Settings

    settings = Settings.from_data_dir(data_dir)  # a fresh data folder: no model was ever chosen
    assert settings.get("model/last") == "stories260K"
    w = MainWindow(settings, HistoryStore.in_data_dir(data_dir), model=None)
    qtbot.addWidget(w)
    w.sampling_override = GREEDY
    w.show()
    with qtbot.waitSignal(w.model_loaded, timeout=120_000) as blocker:
        w.start()
    try:
        info = blocker.args[0]
        assert (info.name, info.source, info.is_demo) == ("stories260K", "stories260K", False)
        assert "stories260K" in w.status.model.text()
        assert "stories260K, the built-in model" in w.chat.empty_hint.text()
        assert settings.get("model/recent") == []  # the built-in model has its own menu line, not a recent one
        w.send("Once upon a time")
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        reply = w.history.messages(w.chat_id)[-1].content
        words = reply.split()
        # real words, not the demo's character noise: letters (I'm, didn't) and punctuation, and English's commonest
        assert len(words) >= 10 and all(re.fullmatch(r"\"?[A-Za-z]+('[a-z]+)?[.,!?\"]*", word) for word in words), reply
        assert {"the", "to", "a", "was"} & set(words), reply
    finally:
        close_window(w)


def test_the_recent_menu_offers_both_built_in_models(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, "demo")
    try:
        assert w.info.is_demo and w.info.name == DEMO_LABEL
        recent = w.menu_actions["recent"]
        w.models.fill_recent_menu(recent)
        assert [a.text() for a in recent.actions()][:2] == [BUILTIN_LABEL, DEMO_LABEL]
        with qtbot.waitSignal(w.model_loaded, timeout=120_000) as blocker:
            recent.actions()[0].trigger()
        assert blocker.args[0].name == "stories260K" and not blocker.args[0].is_demo
        assert w.settings.get("model/last") == "stories260K"  # by name, not this installation's folder
    finally:
        close_window(w)
