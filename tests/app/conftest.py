"""Qt test setup: offscreen platform (set before Qt is imported), temp data dirs, the real tiny model."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

os.environ["QT_QPA_PLATFORM"] = "offscreen"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

import app  # noqa: E402,F401 - applies the PySide6 refcount fix before any Qt call


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


@pytest.fixture(scope="session", autouse=True)
def _theme(qapp):
    from app.ground.theme import apply_theme

    apply_theme(qapp)
    yield


@pytest.fixture(autouse=True)
def _collect_on_the_gui_thread():
    """Widgets a test made and left in reference cycles are collected here, on the GUI thread, after the
    test's own cleanup; left for later, a worker thread of another test could collect them and deadlock
    on Qt's object mutex (see app/shell/gc_guard.py)."""
    yield
    gc.collect()
