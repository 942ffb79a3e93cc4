"""Shared test fixtures: the real stories260K model, the copy shipped in ``resources/models/stories260K``."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The checkout's own copy (not engine.model.builtin's answer, which is wherever ``engine`` was imported from), so a
# fresh clone tests its own files; KVSCOPE_STORIES points the tests at another copy of the model.
STORIES = Path(os.environ.get("KVSCOPE_STORIES") or ROOT / "resources" / "models" / "stories260K")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The compiled decode step (engine.model.fast_step) compiles in the background on a model's first decode: ~25 s of
# CPU for each model a test loads. Off unless a test turns it on (tests/engine/test_fast_step.py).
os.environ.setdefault("KVSCOPE_FAST_STEP", "off")
# ``--quantize`` loads of a folder keep a quantized copy (engine.model.quant_copies): in a folder of this run's own,
# never the user's cache (tests/engine/test_quant_copies.py points it elsewhere where it needs to)
if "KVSCOPE_QUANTIZED_CACHE" not in os.environ:
    os.environ["KVSCOPE_QUANTIZED_CACHE"] = tempfile.mkdtemp(prefix="kvscope-quantized-")
    atexit.register(shutil.rmtree, os.environ["KVSCOPE_QUANTIZED_CACHE"], True)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    assert (STORIES / "config.json").is_file(), f"test model missing: {STORIES}"
    return STORIES


@pytest.fixture(scope="session")
def stories(stories_path):
    from engine.model.loader import load_model

    return load_model(str(stories_path))


@pytest.fixture(scope="session")
def demo_model():
    from engine.model.loader import load_model

    return load_model("demo")


def pytest_collection_finish(session) -> None:
    """The session's slow one-time set-ups begun in the background as soon as it is known which tests run: each
    selected test module's ``early_start()`` (vLLM's venv to install, the bundle to build: ~5 and ~7 minutes on
    CI's 2 cores), so they run on the second core beside the first tests instead of in line with their own."""
    if session.config.option.collectonly:
        return
    seen = set()
    for item in session.items:
        module = getattr(item, "module", None)
        start = getattr(module, "early_start", None)
        if callable(start) and id(module) not in seen:
            seen.add(id(module))
            start()
