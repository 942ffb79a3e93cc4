"""Issue #19 item 12 on the real window (stories260K): notes in the controls' words, about the chat on screen;
StreamingLLM's note names its sinks; why 4-bit holds as many bytes per token as 8-bit here."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply

from engine.config import CacheConfig, SamplingConfig

ENGINE_WORDS = ("K:", "V:", "paged/", "h2o(", "streaming(", "budget=")


def apply(qtbot, w, cfg: CacheConfig) -> list[str]:
    with qtbot.waitSignal(w.cache.changed, timeout=30_000) as changed:
        w.apply_cache_config(cfg)
    return changed.args[1]


def test_notes_use_the_controls_words_and_speak_of_the_chat_on_screen(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        notes = apply(qtbot, w, CacheConfig(page_size=4, k_dtype="int8"))
        said = w.controls.notes.text()
        assert notes and "8-bit" in said and "full precision" in said
        assert not any(word in said for word in ENGINE_WORDS), said

        w.new_chat()  # an empty chat: the worker's cache is the other chat's
        assert w.controls.notes.text() == ""  # the last change's notes were about the other chat
        qtbot.waitUntil(lambda: w.cache.applied == w.cache.defaults, timeout=60_000)  # its own settings, back quietly
        assert w.controls.notes.text() == ""
        notes = apply(qtbot, w, CacheConfig(page_size=4, k_dtype="int8", policy="h2o",
                                            policy_params={"budget": 20, "recent": 4}))
        said = w.controls.notes.text()
        assert len(notes) == 1 and notes[0].endswith(": this chat uses it from its next message"), notes
        assert "evicted" not in said and "chat " not in said.replace("this chat", "")
        assert "heavy hitters" in said and not any(word in said for word in ENGINE_WORDS), said
        assert "evicted" not in w.statusBar().currentMessage()
    finally:
        close_window(w)


def test_int4_says_why_it_holds_as_many_bytes_as_int8(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        apply(qtbot, w, CacheConfig(page_size=4, k_dtype="int4", v_dtype="int4"))
        c = w.controls  # applied from elsewhere, the controls show it (they read 16 tokens, full precision)
        assert (c.page_size.value(), c.k_dtype.currentData(), c.v_dtype.currentData()) == (4, "int4", "int4")
        said = w.controls.notes.text()
        assert "4-bit holds 20 bytes per token per head here, as many as 8-bit (20)" in said
        assert "head dim 8 with 4-token pages" in said and "pages of 8 or more tokens make 4-bit the smaller" in said
        apply(qtbot, w, CacheConfig(page_size=16, k_dtype="int4", v_dtype="int4"))
        assert "as many as 8-bit" not in w.controls.notes.text()  # at 16-token pages 4-bit is the smaller
    finally:
        close_window(w)


def test_streaming_llm_names_its_sinks_not_the_prompt(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True))
    try:
        apply(qtbot, w, CacheConfig(page_size=4, policy="streaming", policy_params={"sinks": 4, "window": 16}))
        w.send("Once upon a time there was a little dog who liked to run and play in the big green park")
        wait_reply(qtbot, w)
        notes = w.chat.bubbles[-1].notes_label.text()
        assert "keeps the first 4 tokens (attention sinks) and the most recent ones, 20 in all" in notes, notes
        assert "protected prompt" not in notes and "raise the budget" not in notes
        assert not any(word in notes for word in ENGINE_WORDS), notes
    finally:
        close_window(w)


def test_a_reprefill_in_words_live_and_as_saved():
    """What the bubble and the footer say of tokens read again after a change (``engine.core.records.Reprefill``, or
    the dict a saved reply holds), in the controls' words, shown from half a second on."""
    from dataclasses import asdict

    from app.ground import note_words as nw
    from engine.core.records import Reprefill

    streaming = CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 64})
    r = Reprefill(tokens=916, start=4, done=312, ms=400.0, estimate_ms=1200.0, old=streaming,
                  new=streaming.replace(policy="h2o", policy_params={}))
    assert nw.reprefill_progress(r) == ("Re-prefilling 916 tokens after switching to Heavy hitters (H2O): 312 of 916 "
                                        "(34%), about 0.8 s left · Stop (Esc) cancels")
    assert nw.reprefill_shown(r) and not nw.reprefill_shown(Reprefill(tokens=9, start=0, estimate_ms=20.0))
    assert nw.reprefill_shown(Reprefill(tokens=9, start=0, estimate_ms=20.0, ms=600.0))  # it turned out slower
    saved = [asdict(Reprefill(tokens=916, start=4, done=916, ms=1234.0, old=streaming, new=streaming.replace(
        policy="none", policy_params={}))), asdict(Reprefill(tokens=1, start=0, done=1, ms=3.0,
                                                             old=CacheConfig(mode="off"), new=CacheConfig()))]
    assert nw.reprefill_footer(saved) == (
        "re-prefilled 916 tokens in 1.2 s after Keep everything was chosen (the evicted tokens come back); "
        "re-prefilled 1 token in 3 ms after the cache was turned on, not in TTFT")
    cut = Reprefill(tokens=916, start=4, done=120, ms=150.0, old=CacheConfig(), new=CacheConfig(k_dtype="int8"))
    assert nw.reprefill_footer([cut]) == ("re-prefilled 120 of 916 tokens in 0.1 s after switching to paged cache, "
                                          "16-token pages, keys 8-bit, not in TTFT")


def test_a_policy_turned_on_says_so_before_its_settings():
    """'Heavy hitters (H2O) on: tokens kept per layer 256, …' — it read '… (H2O) (tokens kept per layer 256, …) on',
    the "on" left at the end of a line after two brackets."""
    from app.ground.note_words import plain_note
    from engine.core.vocab import Note, NoteKind

    note = Note("h2o on", NoteKind.POLICY_ON, policy="h2o", params={"budget": 256, "recent": 64})
    assert plain_note(note) == "Heavy hitters (H2O) on: tokens kept per layer 256, recent tokens always kept 64"
    assert plain_note(Note("s on", NoteKind.POLICY_ON, policy="streaming", params={})) == \
        "Attention sinks + recent window (StreamingLLM) on"
