"""The message area keeps problems until the user dismisses them (a failed load was said for ~6 s and then
replaced by the next notice): a chat notice shown, cleared or replaced never takes a problem with it, the same
problem twice is one entry, and the pager and × go through them. The real NoticeBar, and the real window at first
launch on a model that cannot load."""

from __future__ import annotations

from app_helpers import close_window, wait_reply

from app.ground.notice import MAX_PROBLEMS, NoticeBar


def test_problems_stay_behind_chat_notices_until_dismissed(qtbot):
    bar = NoticeBar()
    qtbot.addWidget(bar)
    bar.show()
    bar.add_problem("Could not load /models/x: no config.json")
    bar.show_message("This chat was written by stories260K", tone="info")
    assert bar.text == "This chat was written by stories260K" and bar.position.text() == "2 of 2"
    bar.clear()  # another chat opened, or a message sent: the chat notice goes, the problem comes forward
    assert bar.text == "Could not load /models/x: no config.json" and bar.isVisible() and not bar.pager.isVisible()
    bar.show_message("Not sent yet", [("Send anyway", lambda: None)])
    bar.show_message("Saved in /tmp", tone="info")  # a chat notice replaces the chat notice, not the problem
    assert bar.problems == ["Could not load /models/x: no config.json"] and len(bar.entries) == 2
    bar.add_problem("Could not load /models/x: no config.json")
    assert len(bar.entries) == 2 and "(×2)" in bar.label.text() and bar.position.text() == "1 of 2"
    bar.newer.click()
    assert bar.text == "Saved in /tmp" and not bar.newer.isEnabled()
    bar.older.click()
    assert bar.text == "Could not load /models/x: no config.json" and not bar.older.isEnabled()
    bar.add_problem("Cache settings not applied: page size: 999 is outside 1..256")
    assert bar.problems[-1].startswith("Cache settings") and bar.text.startswith("Cache settings")
    bar.close_button.click()  # × dismisses the one in front only
    assert bar.problems == ["Could not load /models/x: no config.json"]
    bar.dismiss_all()
    assert not bar.isVisible() and bar.text == "" and bar.entries == []
    for i in range(MAX_PROBLEMS + 5):
        bar.add_problem(f"failure {i}")
    assert len(bar.problems) == MAX_PROBLEMS and bar.problems[-1] == f"failure {MAX_PROBLEMS + 4}"


def test_an_action_closes_its_own_entry_only(qtbot):
    bar = NoticeBar()
    qtbot.addWidget(bar)
    bar.show()
    clicked = []
    bar.add_problem("The server could not start: port 8000 is taken", [("Choose another port…", lambda: clicked.append(1))])
    bar.show_message("Not sent yet", [("Send anyway", lambda: clicked.append(2))])
    bar.action_buttons[0].click()
    assert clicked == [2] and bar.text.startswith("The server could not start")
    bar.resolve("The server could not start: port 8000 is taken")
    assert not bar.isVisible()


def test_a_model_that_failed_at_launch_stays_said_through_chats_and_replies(qtbot, data_dir, tmp_path):
    from app.history.store import HistoryStore
    from app.settings.store import Settings
    from app.shell.window import MainWindow

    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    w = MainWindow(Settings.from_data_dir(data_dir), HistoryStore.in_data_dir(data_dir), model=str(folder))
    qtbot.addWidget(w)
    w.show()
    try:
        with qtbot.waitSignal(w.model_loaded, timeout=120_000):
            w.start()
        said = w.chat.notice.problems
        assert len(said) == 1 and str(folder) in said[0] and "stories260K" in said[0]
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        w.new_chat()
        qtbot.wait(50)
        assert w.chat.notice.problems == said and w.chat.notice.isVisibleTo(w)  # still there, until dismissed
        w.chat.notice.close_button.click()
        assert not w.chat.notice.isVisibleTo(w)
    finally:
        close_window(w)
