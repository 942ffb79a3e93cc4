"""#31 item 8: a chat is tied to the model that wrote it. A stories260K chat opened with another model loaded is
marked in the chat list and says so; a message sent there waits until the user chooses to go on with the model
loaded now (the chat is then tied to it) or loads the chat's own model back."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply

from engine.config import ModelSpec, SamplingConfig

DEMO = "demo (random weights)"


def _load(qtbot, w, source: str) -> None:
    with qtbot.waitSignal(w.model_loaded, timeout=120_000):
        w.load_model(ModelSpec(source=source))


def _buttons(w) -> list[str]:
    return [b.text() for b in w.chat.notice.action_buttons]


def test_a_chat_written_by_another_model_says_so_before_it_goes_on(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        chat_id = w.chat_id
        assert w.history.chat(chat_id).model_name == "stories260K"
        assert w.chat_list.item(0).text() == "Once upon a time"  # its own model: no mark

        _load(qtbot, w, "demo")
        qtbot.waitUntil(w.chat.notice.isVisible, timeout=5_000)
        assert w.chat.notice.text == ("This chat was written by stories260K; demo (random weights) is loaded now and "
                                      "would answer a message sent here.")
        assert _buttons(w) == ["Load stories260K", "New chat"]
        assert w.chat_list.item(0).text() == "Once upon a time · stories260K"

        w.chat.input.setPlainText("What did they do next?")
        w.chat.submit()  # held: the user chooses first
        assert len(w.history.messages(chat_id)) == 2 and not w.generation_id
        assert w.chat.notice.text.startswith("Not sent yet: this chat was written by stories260K, and demo (random "
                                             "weights) is loaded now.")
        assert _buttons(w) == [f"Send with {DEMO}", "Load stories260K", "New chat"]
        assert w.chat.input.toPlainText() == "What did they do next?"  # the text is not lost
        w.chat.notice.action_buttons[1].click()  # Load stories260K: back to the chat's own model
        qtbot.waitUntil(lambda: w.info is not None and w.info.name == "stories260K", timeout=120_000)
        assert not w.chat.notice.isVisible() and w.chat_list.item(0).text() == "Once upon a time"

        _load(qtbot, w, "demo")
        w.chat.submit()
        qtbot.waitUntil(lambda: _buttons(w)[:1] == [f"Send with {DEMO}"], timeout=5_000)
        w.chat.notice.action_buttons[0].click()  # go on with the demo: answered, and the chat is the demo's now
        assert wait_reply(qtbot, w)[1] == "max_tokens"
        assert [m.role for m in w.history.messages(chat_id)] == ["user", "assistant", "user", "assistant"]
        assert w.history.chat(chat_id).model_name == DEMO and w.chat_list.item(0).text() == "Once upon a time"
        assert not w.chat.notice.isVisible() and w.chat.input.toPlainText() == ""
    finally:
        close_window(w)
