"""What a user sees of a table: every cell's text drawn whole (Compare's columns ran off the dialog's edge)."""

from __future__ import annotations

import os
from pathlib import Path

# screenshots to look at by hand, saved only where KVSCOPE_SHOTS names a folder; the asserts stand alone
SHOTS = Path(os.environ["KVSCOPE_SHOTS"]) if os.environ.get("KVSCOPE_SHOTS") else None


def all_drawn(table) -> None:
    """The columns fit the view (nothing scrolls sideways or runs off its edge), no word is wider than its cell
    (and the columns it spans), and each row is as tall as its wrapped cells need."""
    widths = [table.columnWidth(c) for c in range(table.columnCount())]
    assert sum(widths) <= table.viewport().width(), (widths, table.viewport().width())
    fm = table.fontMetrics()
    for r in range(table.rowCount()):
        assert table.rowHeight(r) >= table.sizeHintForRow(r), (r, table.rowHeight(r), table.sizeHintForRow(r))
        for c in range(table.columnCount()):
            item = table.item(r, c)
            if item is None or not item.text():
                continue
            width = sum(widths[c:c + table.columnSpan(r, c)]) - 8  # the cell's margins
            longest = max(item.text().split(), key=fm.horizontalAdvance)
            assert fm.horizontalAdvance(longest) <= width, (item.text(), longest, width)


def shoot(widget, name: str) -> None:
    if SHOTS is not None and SHOTS.is_dir():
        widget.grab().save(str(SHOTS / name))
