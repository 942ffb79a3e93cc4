"""C++ kernels of the compiled step's operators: ``kvscope::blocked_linear`` (the native blocked product),
``kvscope::paged_decode`` (one token's attention read in place from its pages) and ``kvscope::write_slot`` (its new
K/V written after the step).

A compiled step's package calls them through torch's dispatcher (``engine.model.linear_kernel`` and
``engine.kv.store.paged_decode`` define them, with Python kernels). Each call of a Python kernel from the package costs
~10 us of dispatch plus ~7 us of Python around the native code: ~2 ms of a SmolLM2-shape step's 121 linears, a seventh
of a bfloat16 step. This file builds, once per machine and torch, a small C++ library that registers CPU kernels for
the same operators calling the same C functions (the linear and attention kernels' libraries, linked in): ~2 us a
call. Loaded, it takes the CPU dispatch from the Python kernels; without it (no C++ compiler, no torch headers, a
failed build) the Python kernels answer, the results the same.

Built off the engine thread (the compiled step's watcher opens packages there): ~10-30 s the first time, cached
in the native kernels' folder (``engine.kv.quantized.native.cache_dir``) under a hash of the source, the compiler,
the CPU and torch's version.
"""

from __future__ import annotations

import ctypes
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
from engine.kv.store import paged_decode  # noqa: F401 - defines kvscope::paged_decode, whose CPU kernel is here
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
#include <atomic>
#include <cstring>
#include <vector>
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

extern "C" int kvs_plain_decode(int h0, int h1, int rep, int64_t n, int dk, int dv, int bf16, const void* kp,
                                int64_t k_head, const void* vp, int64_t v_head, const int64_t* slots, const void* q,
                                const void* nk, const void* nv, float scale, void* out);

// engine.kv.store.paged_decode.reference: the K/V gathered through the slots, SDPA in float32
static at::Tensor paged_decode_ref(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                                   const at::Tensor& slots, const at::Tensor& nk, const at::Tensor& nv, double scale) {
    at::Tensor k = at::cat({kp.index_select(1, slots).unsqueeze(0), nk}, 2).to(at::kFloat);  // [1, Hk, n + 1, Dk]
    at::Tensor v = at::cat({vp.index_select(1, slots).unsqueeze(0), nv}, 2).to(at::kFloat);  // [1, Hk, n + 1, Dv]
    at::Tensor o = at::scaled_dot_product_attention(q.to(at::kFloat), k, v, std::nullopt, 0.0, false, scale,
                                                    q.size(1) != k.size(1));  // [1, Hq, 1, Dv]
    return o.transpose(1, 2).to(q.scalar_type()).contiguous();  // [1, 1, Hq, Dv]
}

// One query token over the cached rows at `slots` of the page tensors kp [Hk, S, Dk] / vp [Hk, S, Dv] and its own
// nk / nv [1, Hk, 1, D]: [1, 1, Hq, Dv], as engine.kv.store.paged_decode.paged_decode; the KV heads shared among
// torch's threads where the work is large enough.
static at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                               const at::Tensor& slots, const at::Tensor& nk, const at::Tensor& nv, double scale) {
    const auto dt = kp.scalar_type();
    const int64_t hk = kp.size(0), dk = kp.size(2), dv = vp.size(2), hq = q.dim() == 4 ? q.size(1) : 0;
    const bool fits = q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && hq % hk == 0 && kp.device().is_cpu()
        && (dt == at::kFloat || dt == at::kBFloat16) && vp.scalar_type() == dt && q.scalar_type() == dt
        && nk.scalar_type() == dt && nv.scalar_type() == dt && kp.stride(2) == 1 && kp.stride(1) == dk
        && vp.stride(2) == 1 && vp.stride(1) == dv && vp.size(0) == hk && q.size(3) == dk
        && slots.scalar_type() == at::kLong && dk <= 1024 && dv <= 1024;
    if (!fits) return paged_decode_ref(q, kp, vp, slots, nk, nv, scale);
    const at::Tensor qc = q.contiguous(), nkc = nk.contiguous(), nvc = nv.contiguous(), sl = slots.contiguous();
    const int64_t n = sl.size(0), rep = hq / hk;
    at::Tensor out = at::empty({1, 1, hq, dv}, q.options());
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, (n + 1) * rep * (dk + dv)));
    std::atomic<int> rc{0};
    at::parallel_for(0, hk, grain, [&](int64_t h0, int64_t h1) {
        if (kvs_plain_decode((int)h0, (int)h1, (int)rep, n, (int)dk, (int)dv, dt == at::kBFloat16, kp.data_ptr(),
                             kp.stride(0), vp.data_ptr(), vp.stride(0), sl.data_ptr<int64_t>(), qc.data_ptr(),
                             nkc.data_ptr(), nvc.data_ptr(), (float)scale, out.data_ptr()))
            rc = 1;
    });
    return rc ? paged_decode_ref(q, kp, vp, slots, nk, nv, scale) : out;
}

// paged_decode for B sequences of one arena: q [B, Hq, 1, Dk], slots [B, n] (padded), lens [B], nk / nv
// [B, Hk, 1, D] -> [B, 1, Hq, Dv]; the sequences' KV heads shared among torch's threads
static at::Tensor paged_decode_batch(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                                     const at::Tensor& slots, const at::Tensor& lens, const at::Tensor& nk,
                                     const at::Tensor& nv, double scale) {
    const auto dt = kp.scalar_type();
    const int64_t hk = kp.size(0), dk = kp.size(2), dv = vp.size(2), hq = q.dim() == 4 ? q.size(1) : 0;
    const int64_t B = q.dim() == 4 ? q.size(0) : 0;
    const bool fits = q.dim() == 4 && q.size(2) == 1 && hq % hk == 0 && kp.device().is_cpu()
        && (dt == at::kFloat || dt == at::kBFloat16) && vp.scalar_type() == dt && q.scalar_type() == dt
        && nk.scalar_type() == dt && nv.scalar_type() == dt && kp.stride(2) == 1 && kp.stride(1) == dk
        && vp.stride(2) == 1 && vp.stride(1) == dv && vp.size(0) == hk && q.size(3) == dk && slots.dim() == 2
        && slots.size(0) == B && lens.numel() == B && slots.scalar_type() == at::kLong && dk <= 1024 && dv <= 1024;
    const at::Tensor ln = lens.to(at::kLong).contiguous();
    if (!fits) {
        std::vector<at::Tensor> outs;
        for (int64_t b = 0; b < B; b++)
            outs.push_back(paged_decode_ref(q.narrow(0, b, 1), kp, vp, slots[b].narrow(0, 0, ln[b].item<int64_t>()),
                                            nk.narrow(0, b, 1), nv.narrow(0, b, 1), scale));
        return at::cat(outs, 0);
    }
    const at::Tensor qc = q.contiguous(), nkc = nk.contiguous(), nvc = nv.contiguous(), sl = slots.contiguous();
    const int64_t n = sl.size(1), rep = hq / hk, es = q.element_size();
    const int64_t* lp = ln.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) TORCH_CHECK(lp[b] >= 0 && lp[b] <= n, "paged_decode_batch: a length over the slots");
    at::Tensor out = at::empty({B, 1, hq, dv}, q.options());
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, (n + 1) * rep * (dk + dv)));
    std::atomic<int> rc{0};
    at::parallel_for(0, B * hk, grain, [&](int64_t i0, int64_t i1) {  // item i: sequence i / hk, KV head i % hk
        for (int64_t i = i0; i < i1; i++) {
            const int64_t b = i / hk, h = i % hk;
            const char* qb = (const char*)qc.data_ptr() + b * hq * dk * es;
            if (kvs_plain_decode((int)h, (int)h + 1, (int)rep, lp[b], (int)dk, (int)dv, dt == at::kBFloat16,
                                 kp.data_ptr(), kp.stride(0), vp.data_ptr(), vp.stride(0),
                                 sl.data_ptr<int64_t>() + b * n, qb, (const char*)nkc.data_ptr() + b * hk * dk * es,
                                 (const char*)nvc.data_ptr() + b * hk * dv * es, (float)scale,
                                 (char*)out.data_ptr() + b * hq * dv * es))
                rc = 1;
        }
    });
    if (rc) TORCH_CHECK(false, "paged_decode_batch: the kernel refused its shapes");
    return out;
}

// rows[i] [1, H, 1, D] into pages[i] [H, S, D] at `slot`, as engine.kv.store.paged_decode.write_slot: a row's heads
// copied straight where both are contiguous and of one dtype, else through copy_
static void write_slot(at::TensorList pages, at::TensorList rows, int64_t slot) {
    TORCH_CHECK(pages.size() == rows.size(), "write_slot: ", pages.size(), " page tensors, ", rows.size(), " rows");
    for (size_t i = 0; i < pages.size(); i++) {
        const at::Tensor& t = pages[i];
        const at::Tensor& x = rows[i];
        const int64_t h = t.size(0), d = t.size(2);
        TORCH_CHECK(slot >= 0 && slot < t.size(1) && x.numel() == h * d, "write_slot: a row does not fit its pages");
        if (t.is_contiguous() && x.is_contiguous() && t.scalar_type() == x.scalar_type() && t.device().is_cpu()) {
            const int64_t es = t.element_size(), s = t.size(1);
            char* dst = (char*)t.data_ptr();
            const char* src = (const char*)x.data_ptr();
            for (int64_t k = 0; k < h; k++) std::memcpy(dst + ((k * s + slot) * d) * es, src + k * d * es, d * es);
        } else {
            t.select(1, slot).copy_(x.reshape({h, d}));
        }
    }
}

extern "C" int kvs_tq_decode_heads(int h0, int h1, int rep, const float* q, int64_t n, int64_t nt, const void* k,
                                   const void* v, float* out);

// The fused tq decode attention (engine.kv.quantized.tq_attend) with its KV heads shared among torch's threads:
// called through ctypes (the roles are the kernel's own structs), not as an operator.
extern "C" int kvs_tq_decode_parallel(int hk, int rep, const float* q, int64_t n, int64_t nt, const void* k,
                                      const void* v, float* out, int64_t width, int64_t dv) {
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, (n + nt) * rep * (width + dv)));
    std::atomic<int> rc{0};
    at::parallel_for(0, hk, grain, [&](int64_t h0, int64_t h1) {
        if (kvs_tq_decode_heads((int)h0, (int)h1, rep, q, n, nt, k, v, out)) rc = 1;
    });
    return rc;
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
    m.impl("write_slot", &write_slot);
    m.impl("blocked_linear", &blocked_linear);
    m.impl("paged_decode", &paged_decode);
    m.impl("paged_decode_batch", &paged_decode_batch);
}
"""

_lock = threading.Lock()
_state = {"tried": False, "loaded": False, "why": ""}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cached_path(cxx: str, kernels: tuple[Path, ...]) -> Path:
    parts = (SOURCE, *FLAGS, cxx, *map(str, kernels), native._cpu(), torch.__version__)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return native.cache_dir() / f"linear_op-{key[:20]}.so"


def _build(cxx: str, kernels: tuple[Path, ...], target: Path) -> None:
    """Compile beside ``target`` and rename into place (as ``native.Native`` does)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = cpp_extension.library_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
        src, out = Path(tmp) / "linear_op.cpp", Path(tmp) / "linear_op.so"
        src.write_text(SOURCE, encoding="utf-8")
        cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(src),
               *map(str, kernels), "-o", str(out), *[f"-I{p}" for p in cpp_extension.include_paths()],
               *[f"-L{p}" for p in libs], "-lc10", "-ltorch_cpu", "-ltorch",
               *[f"-Wl,-rpath,{p}" for p in libs], *{f"-Wl,-rpath,{k.parent}" for k in kernels}]
        r = native.compile_run(cmd, BUILD_TIMEOUT_S)
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
            lib, attn = linear_kernel.LINEAR.library(), native.library()  # the products; the decode attention
            cxx = _compiler()
            if lib is None or attn is None or cxx is None:
                raise RuntimeError(linear_kernel.LINEAR.why() or native.why()
                                   or "no C++ compiler (c++, g++ or clang++) on PATH")
            kernels = (Path(lib._name), Path(attn._name))
            target = cached_path(cxx, kernels)
            if not target.exists():
                _build(cxx, kernels, target)
            torch.ops.load_library(str(target))
            _declare_parallel(ctypes.CDLL(str(target)))
            _state["loaded"] = True
            linear_kernel.PARALLEL = True
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _state["why"] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            log.warning("the compiled step's blocked linears call their Python kernel (%s)", _state["why"])
        return _state["loaded"]


def _declare_parallel(lib: ctypes.CDLL) -> None:
    """Hand the quantized pages' fused attention its several-thread entry (``native.PARALLEL_TQ``)."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn = lib.kvs_tq_decode_parallel
    fn.restype = i
    fn.argtypes = [i, i, p, i64, i64, p, p, p, i64, i64]  # hk rep q n nt keys values out width dv
    native.PARALLEL_TQ = fn


def attach_soon() -> None:
    """``attach`` on a thread of its own (a model on several threads: its blocked linears' products are shared
    among them once the kernel loads; until then they run as on one thread or through MKL)."""
    if not _state["tried"]:
        threading.Thread(target=attach, name="kvscope-linear-op", daemon=True).start()


def loaded() -> bool:
    """Has ``attach`` loaded the C++ kernels (the operators' CPU dispatch is theirs)?"""
    return _state["loaded"]


def why() -> str:
    """Why ``attach()`` found no C++ kernel ('' when it did, or before it was asked)."""
    return _state["why"]
