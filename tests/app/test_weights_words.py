"""The model card and the memory panel name the weights' format as loaded ("Q4_K_M, 4.81 bits per weight, mapped from
the file"), from ``ModelInfo`` — one set of words (``app.ground.format``) for the loaded model and the Models dialog's
verdict before it loads."""

from __future__ import annotations

from app_helpers import make_info

from app.panels import MemoryPanel, ModelCardPanel
from app.ground.format import info_weights_words, weights_words


def test_the_format_as_loaded_in_words():
    assert weights_words("Q4_K_M", "mapped", "Q4_K_M", 4.81) == "Q4_K_M, 4.81 bits per weight, mapped from the file"
    assert weights_words("F32", "converted", "BF16", 32.0) == "F32, 32.00 bits per weight, converted from BF16"
    assert weights_words("NF4", "quantized", "BF16", 4.72) == "NF4, 4.72 bits per weight, quantized from BF16 as loaded"
    assert weights_words("Q8_0", "copied", "BF16", 8.5) == \
        "Q8_0, 8.50 bits per weight, mapped from its copy quantized from BF16 at a first load"
    assert info_weights_words(make_info()) == "float32 · none"  # a model the loader said nothing more of: the demo


def test_card_and_memory_panel_say_it(qtbot):
    info = make_info(weights_format="Q4_K_M", weights_stored="Q4_K_M", weights_held="mapped", weights_bits=4.81)
    card = ModelCardPanel()
    qtbot.addWidget(card)
    card.show_model(info)
    assert "Q4_K_M, 4.81 bits per weight, mapped from the file" in card.table.text()
    memory = MemoryPanel()
    qtbot.addWidget(memory)
    memory.set_model(info)
    memory.clear()
    assert "(Q4_K_M, 4.81 bits per weight, mapped from the file) · KV <b>0 B</b>" in memory.caption.text()


def test_one_number_for_the_weights_in_the_models_dialog_the_card_and_the_memory_panel(qtbot, data_dir, stories_path):
    """The weights of the built-in model: the Models dialog's verdict before a load, the model card and the memory
    panel after it say one number (the dialog said 1020.5 KiB, the file's size, and the panel 1015.8 KiB); the list
    names a size on disk as such."""
    import re

    from app_helpers import close_window, open_window, wait_reply

    from app.models.dialog import ModelsDialog
    from app.ground.format import human_bytes

    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        held = human_bytes(w.info.weights_bytes)
        assert held == "1015.8 KiB"  # 260,032 float32 weights
        qtbot.waitUntil(lambda: f"weights <b>{held}</b>" in w.memory.caption.text(), timeout=10_000)
        assert f"{held} · " in w.model_card.table.text()
        dlg = ModelsDialog(w.settings, environment={"cuda": False}, current=w.info, parent=w)
        qtbot.addWidget(dlg)
        dlg.show()
        qtbot.waitUntil(lambda: "Weights <b>" in dlg.estimate_label.text(), timeout=30_000)
        said = re.findall(r"[\d.,]+ [KMG]?i?B", re.sub("<[^>]+>", "", dlg.estimate_label.text()))
        assert said[0] == held, dlg.estimate_label.text()
        qtbot.waitUntil(lambda: dlg.scan_label.text().startswith(("Found", "No models")), timeout=60_000)
        found = [dlg.list.item(i).text() for i in range(dlg.list.count())]
        assert not any(re.search(r"· [\d.]+ [KMG]i?B ·", t) for t in found), found  # a size in a list names what
        dlg.close()
    finally:
        close_window(w)
