"""The model card and the memory panel name the weights' format as loaded ("Q4_K_M, 4.81 bits per weight, mapped from
the file"), from ``ModelInfo`` — one set of words (``app.shell.format``) for the loaded model and the Models dialog's
verdict before it loads."""

from __future__ import annotations

from app_helpers import make_info

from app.panels import MemoryPanel, ModelCardPanel
from app.shell.format import info_weights_words, weights_words


def test_the_format_as_loaded_in_words():
    assert weights_words("Q4_K_M", "mapped", "Q4_K_M", 4.81) == "Q4_K_M, 4.81 bits per weight, mapped from the file"
    assert weights_words("F32", "converted", "BF16", 32.0) == "F32, 32.00 bits per weight, converted from BF16"
    assert weights_words("NF4", "quantized", "BF16", 4.72) == "NF4, 4.72 bits per weight, quantized from BF16 as loaded"
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
