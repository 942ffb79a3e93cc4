"""The integer road against llama.cpp's own kernels, one linear at a time: for each quantized type in the given GGUF
files, the first 512 rows of a weight times a random activation row, by the engine (``engine.quant.kernel``: one
row, and twenty rows through the GEMM) and by ggml's ``quantize_row_q8_*`` + ``ggml_vec_dot_*`` from llama.cpp's
CPU library; printed as max relative difference (float summation order apart, the same: ~1e-7). The float road is
printed too: its difference is the activations' 8-bit rounding (~5e-3).

    python tests/engine/measure_gguf_ggml_dot.py /path/to/llama_cpp/lib/libggml-cpu.so FILE.gguf [FILE.gguf ...]

Not in the default suite (needs a llama.cpp build).
"""
import ctypes, sys, numpy as np, torch
from pathlib import Path
from engine.quant import gguf_keep, kernel, formats
lib = ctypes.CDLL(sys.argv[1])
lib.ggml_cpu_init()
p = ctypes.c_void_p
QUANT = {"Q4_K": ("q8_K", 292, 256), "Q5_K": ("q8_K", 292, 256), "Q6_K": ("q8_K", 292, 256), "Q8_0": ("q8_0", 34, 32),
         "Q4_0": ("q8_0", 34, 32), "Q5_0": ("q8_0", 34, 32), "Q4_1": ("q8_1", 36, 32), "Q5_1": ("q8_1", 36, 32)}
def ggml(name, w, n, x):
    act, size, blk = QUANT[name]
    q = np.zeros(n // blk * size, np.uint8)
    qf = getattr(lib, f"quantize_row_{act}"); qf.argtypes = [p, p, ctypes.c_int64]
    qf(x.ctypes.data, q.ctypes.data, n)
    f = getattr(lib, f"ggml_vec_dot_{name.lower().replace('_k', '_K')}_{act.replace('_k', '_K')}")
    f.argtypes = [ctypes.c_int, p, ctypes.c_size_t, p, ctypes.c_size_t, p, ctypes.c_size_t, ctypes.c_int]
    out = np.zeros(w.shape[0], np.float32); s = ctypes.c_float(); wn = w.numpy()
    for r in range(w.shape[0]):
        f(n, ctypes.byref(s), 0, wn[r].ctypes.data, 0, q.ctypes.data, 0, 1); out[r] = s.value
    return out
seen = set()
for path in sys.argv[2:]:
    t = gguf_keep.Table(Path(path))
    for name_t, (ty, shape, _, _) in t.entries.items():
        if len(shape) != 2 or formats.name(ty) in seen or formats.name(ty) not in QUANT: continue
        seen.add(formats.name(ty))
        w = t.blocks(name_t)[:512]
        x = np.random.default_rng(0).standard_normal((1, shape[1])).astype(np.float32)
        ref = ggml(formats.name(ty), w, shape[1], x[0])
        ours = kernel.matmul(torch.from_numpy(x), w, ty, shape[1]).numpy()[0]
        fl = kernel.matmul(torch.from_numpy(x), w, ty, shape[1], road="float").numpy()[0]
        xs = torch.from_numpy(np.repeat(x, 20, 0))  # 20 rows: the GEMM path
        many = kernel.matmul(xs, w, ty, shape[1]).numpy()[0]
        e = lambda a: float(np.abs(a - ref).max() / np.abs(ref).max())
        print(f"{formats.name(ty):5s} {name_t:24s} int8 one row {e(ours):.1e}  int8 GEMM {e(many):.1e}  float road {e(fl):.1e}  (vs ggml's vec_dot on its own Q8 activations)")
