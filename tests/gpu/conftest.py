"""GPU checks (marker ``gpu``): skipped where torch sees no CUDA device. ``tests/gpu/run.sh`` runs them with
the GPU benchmarks in one go; the figures they measure are appended to ``$KVSCOPE_GPU_FIGURES`` (JSON lines)."""

from __future__ import annotations

import json
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if os.environ.get("KVSCOPE_GPU_TEST_DEVICE", "cuda") == "cuda" and not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)"))


@pytest.fixture(scope="session")
def record():
    """``record(name, **figures)``: keep a measured figure for the report (and print it)."""
    path = os.environ.get("KVSCOPE_GPU_FIGURES")

    def write(name: str, **figures) -> None:
        line = json.dumps({"check": name, **figures})
        print(line)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    return write
