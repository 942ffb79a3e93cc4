"""The native blocked product as a C++ kernel of the ``kvscope::blocked_linear`` operator, for compiled steps.

A compiled step's package calls ``kvscope::blocked_linear`` through torch's dispatcher (``engine.model.linear_kernel``
defines it, with a Python kernel). Each call of a Python kernel from the package costs ~10 us of dispatch plus
~7 us of Python around the native product: ~2 ms of a SmolLM2-shape step's 121 linears, a seventh of a bfloat16
step. This file builds, once per machine and torch, a small C++ library that registers a CPU kernel for the same
operator calling the same C functions (the linear kernel's library, linked in): ~2 us a call. Loaded, it takes
the CPU dispatch from the Python kernel; without it (no C++ compiler, no torch headers, a failed build) the
Python kernel answers, the results the same.

Built off the engine thread (the compiled step's watcher opens packages there): ~10-30 s the first time, cached
in the native kernels' folder (``engine.kv.quantized.native.cache_dir``) under a hash of the source, the compiler,
the CPU and torch's version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.kv.quantized import native
from engine.model import linear_kernel

log = logging.getLogger(__name__)
BUILD_TIMEOUT_S = 300
# -fopenmp: at::parallel_for's OpenMP loop is compiled into this library (without it the pragma is dropped and
# the loop runs on one thread); its libgomp is the one torch loaded (the same soname: the loader reuses it)
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++20", "-w", "-fopenmp")

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

static const int64_t GRAIN = 1 << 16;  // multiply-adds a thread's share holds at least: ~5-15 us of work

extern "C" {
int kvs_blocked_mm(int rows, int n_in, int64_t b0, int64_t b1, const float* x, const float* wb, const float* bias,
                   float* y, int64_t ldy);
int kvs_blocked_mm_h(int rows, int n_in, int64_t b0, int64_t b1, const uint16_t* x, const uint16_t* wb,
                     const uint16_t* bias, uint16_t* y, int64_t ldy);
}

// x2 [rows, in] times blocked wb [out/16, in, 16] (+ bias [out]) -> [rows, out], as linear_kernel.blocked_product:
// the native product, its blocks shared among torch's threads (at::parallel_for: torch's own pool, no second one);
// torch's per-block product for other dtypes.
static at::Tensor blocked_linear(const at::Tensor& x2, const at::Tensor& wb, const std::optional<at::Tensor>& bias) {
    const bool f32 = wb.scalar_type() == at::kFloat, bf16 = wb.scalar_type() == at::kBFloat16;
    if (!(f32 || bf16) || x2.scalar_type() != wb.scalar_type() || x2.size(0) < 1) {
        at::Tensor y = at::matmul(x2, wb).transpose(0, 1).reshape({x2.size(0), -1});
        return bias.has_value() ? y + *bias : y;
    }
    const at::Tensor x = x2.contiguous(), w = wb.contiguous();
    const int64_t rows = x.size(0), n_in = x.size(1), nb = w.size(0), out = nb * 16;
    at::Tensor y = at::empty({rows, out}, x.options());
    at::Tensor b;
    if (bias.has_value()) b = bias->to(x.scalar_type()).contiguous();
    // a thread's share is at least GRAIN multiply-adds (a fork and join costs a few microseconds: a share must
    // take far longer), so small linears and one thread run inline
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, rows * n_in * 16));
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
        if (f32)
            kvs_blocked_mm((int)rows, (int)n_in, b0, b1, x.data_ptr<float>(), w.data_ptr<float>(),
                           b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), out);
        else
            kvs_blocked_mm_h((int)rows, (int)n_in, b0, b1, (const uint16_t*)x.data_ptr(),
                             (const uint16_t*)w.data_ptr(), b.defined() ? (const uint16_t*)b.data_ptr() : nullptr,
                             (uint16_t*)y.data_ptr(), out);
    });
    return y;
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
"""

_lock = threading.Lock()
_state = {"tried": False, "loaded": False, "why": ""}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cached_path(cxx: str, kernel: Path) -> Path:
    parts = (SOURCE, *FLAGS, cxx, str(kernel), native._cpu(), torch.__version__)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return native.cache_dir() / f"linear_op-{key[:20]}.so"


def _build(cxx: str, kernel: Path, target: Path) -> None:
    """Compile beside ``target`` and rename into place (as ``native.Native`` does)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = cpp_extension.library_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
        src, out = Path(tmp) / "linear_op.cpp", Path(tmp) / "linear_op.so"
        src.write_text(SOURCE)
        cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(src),
               str(kernel), "-o", str(out), *[f"-I{p}" for p in cpp_extension.include_paths()],
               *[f"-L{p}" for p in libs], "-lc10", "-ltorch_cpu", "-ltorch",
               *[f"-Wl,-rpath,{p}" for p in libs], f"-Wl,-rpath,{kernel.parent}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if r.returncode != 0:
            last = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cxx).name} failed: {last[-1] if last else 'exit status ' + str(r.returncode)}")
        os.replace(out, target)


def attach() -> bool:
    """Build (once) and load the C++ kernel of ``kvscope::blocked_linear``; False, said once in the log and in
    ``why()``, where it cannot be (the Python kernel answers then). Blocks for the build: call it off the engine
    thread."""
    with _lock:
        if _state["tried"]:
            return _state["loaded"]
        _state["tried"] = True
        try:
            lib = linear_kernel.LINEAR.library()
            cxx = _compiler()
            if lib is None or cxx is None:
                raise RuntimeError(linear_kernel.LINEAR.why() or "no C++ compiler (c++, g++ or clang++) on PATH")
            kernel = Path(lib._name)
            target = cached_path(cxx, kernel)
            if not target.exists():
                _build(cxx, kernel, target)
            torch.ops.load_library(str(target))
            _state["loaded"] = True
            linear_kernel.PARALLEL = True
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _state["why"] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            log.warning("the compiled step's blocked linears call their Python kernel (%s)", _state["why"])
        return _state["loaded"]


def attach_soon() -> None:
    """``attach`` on a thread of its own (a model on several threads: its blocked linears' products are shared
    among them once the kernel loads; until then they run as on one thread or through MKL)."""
    if not _state["tried"]:
        threading.Thread(target=attach, name="kvscope-linear-op", daemon=True).start()


def why() -> str:
    """Why ``attach()`` found no C++ kernel ('' when it did, or before it was asked)."""
    return _state["why"]
