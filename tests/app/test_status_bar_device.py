"""The status bar names why a model runs on the CPU when a GPU was meant to run it."""

from __future__ import annotations

from app.ground.status_bar import fallback_note


def test_fallback_reason_is_in_view():
    assert fallback_note("CPU: no NVIDIA driver found (libcuda.so.1 is missing; this build uses CUDA 13.0)") == \
        " — no NVIDIA driver found"
    assert fallback_note("CPU: an NVIDIA driver is installed but this torch is a CPU-only build (install the CUDA "
                         "build)") == " — an NVIDIA driver is installed but this torch is a CPU-only build"
    assert fallback_note("CPU: no CUDA or MPS device") == fallback_note("CPU: chosen") == ""
    assert fallback_note("CUDA: NVIDIA H200") == ""
