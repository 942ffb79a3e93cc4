// CPU kernels in C++ for the compiled step's operators: kvscope::blocked_linear (the native blocked product),
// kvscope::paged_decode / paged_decode_batch (one token's attention read in place from its pages) and
// kvscope::write_slot (its new K/V written after the step), plus kvs_tq_decode_parallel (the quantized pages' fused
// attention, its KV heads shared among torch's threads; called through ctypes). kvscope::gguf_linear (a GGUF
// weight's product, from a table of the weights Python has described) is gguf_ops.cpp's, built into the same
// library (engine/native/libraries.py: TORCH_OPS).
//
// A compiled step's package calls the operators through torch's dispatcher (engine/model/linear_kernel.py,
// engine/kv/store/paged_decode.py and engine/quant/modules.py define them, with Python kernels). Each call of a
// Python kernel from the package costs ~10 us of dispatch plus ~7 us of Python around the native code: ~2 ms of a
// SmolLM2-shape step's 121 linears, a seventh of a bfloat16 step. Loaded (engine/model/linear_op.py), this library takes the operators' CPU dispatch
// from the Python kernels at ~2 us a call, calling the same C functions; without it the Python kernels answer, the
// results the same. Built against torch's headers: one build per torch version.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>
#include <cstdint>

#include "torch_ops.h"

static const int64_t GRAIN = 1 << 16;  // multiply-adds a thread's share holds at least: ~5-15 us of work

// The C kernels these operators call (blocked_linear.c, kv_plain.c, kv_tq.c), handed over by address once their
// libraries are loaded (kvs_ops_bind): this library links torch only, so one build serves every CPU level of theirs.
// Until they are bound (or where a library is missing) the operators answer with torch's ops.
typedef int (*kvs_mm_fn)(int rows, int n_in, int64_t b0, int64_t b1, const float* x, const float* wb,
                         const float* bias, float* y, int64_t ldy);
typedef int (*kvs_mm_h_fn)(int rows, int n_in, int64_t b0, int64_t b1, const uint16_t* x, const uint16_t* wb,
                           const uint16_t* bias, uint16_t* y, int64_t ldy);
typedef int (*kvs_mm_xh_fn)(int rows, int n_in, int64_t b0, int64_t b1, const float* xf, const uint16_t* xb,
                            const uint16_t* wb, const float* bias, float* y, int64_t ldy);
typedef int (*kvs_plain_fn)(int h0, int h1, int rep, int64_t n, int dk, int dv, int bf16, const void* kp,
                            int64_t k_head, const void* vp, int64_t v_head, const int64_t* slots, const void* q,
                            const void* nk, const void* nv, float scale, void* out);
typedef int (*kvs_tq_heads_fn)(int h0, int h1, int rep, const float* q, int64_t n, int64_t nt, const void* k,
                               const void* v, float* out);
static std::atomic<kvs_mm_fn> bound_mm{nullptr};
static std::atomic<kvs_mm_h_fn> bound_mm_h{nullptr};
static std::atomic<kvs_mm_xh_fn> bound_mm_xh{nullptr};
static std::atomic<kvs_plain_fn> bound_plain{nullptr};
static std::atomic<kvs_tq_heads_fn> bound_tq_heads{nullptr};

// The kernels' addresses (null: that library is missing, its operators keep torch's ops).
extern "C" void kvs_ops_bind(void* mm, void* mm_h, void* plain, void* tq_heads) {
    bound_mm = (kvs_mm_fn)mm;
    bound_mm_h = (kvs_mm_h_fn)mm_h;
    bound_plain = (kvs_plain_fn)plain;
    bound_tq_heads = (kvs_tq_heads_fn)tq_heads;
}

// kvs_blocked_mm_xh's address (float32 rows, bfloat16 weights): bound apart from the others, so a Python that finds
// this symbol missing (a library prebuilt before it) keeps calling kvs_ops_bind as before
extern "C" void kvs_ops_bind_xh(void* mm_xh) { bound_mm_xh = (kvs_mm_xh_fn)mm_xh; }

bool kvs_xh_bound() { return bound_mm_xh.load() != nullptr; }
bool kvs_h_bound() { return bound_mm_h.load() != nullptr; }

// float32 rows x [rows, n_in] (xb: the same rounded to bfloat16 by the caller, or null) times blocked bfloat16 wb
// [nb, n_in, 16] (+ float32 bias) -> y [rows, ldy] float32, the blocks shared among torch's threads: called through
// ctypes (linear_kernel.float_product), by blocked_linear below and by gguf_ops.cpp. 0 done; -1 unbound or refused.
extern "C" int kvs_blocked_xh_parallel(int rows, int n_in, int64_t nb, const float* x, const uint16_t* xb,
                                       const uint16_t* wb, const float* bias, float* y, int64_t ldy) {
    const kvs_mm_xh_fn mm = bound_mm_xh.load();
    if (!mm || rows < 1) return -1;
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, (int64_t)rows * n_in * 16));
    std::atomic<int> rc{0};
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
        if (mm(rows, n_in, b0, b1, x, xb, wb, bias, y, ldy)) rc = -1;
    });
    return rc;
}

// bfloat16 rows x [rows, n_in] times blocked bfloat16 wb [nb, n_in, 16] (+ bfloat16 bias) -> y [rows, ldy] bfloat16
// (sums in float32, rounded once), the blocks shared among torch's threads: blocked_linear's bfloat16 product, and
// gguf_ops.cpp's for a bf16 folder's linears. 0 done; -1 unbound or refused.
extern "C" int kvs_blocked_h_parallel(int rows, int n_in, int64_t nb, const uint16_t* x, const uint16_t* wb,
                                      const uint16_t* bias, uint16_t* y, int64_t ldy) {
    const kvs_mm_h_fn mm = bound_mm_h.load();
    if (!mm || rows < 1) return -1;
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, (int64_t)rows * n_in * 16));
    std::atomic<int> rc{0};
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
        if (mm(rows, n_in, b0, b1, x, wb, bias, y, ldy)) rc = -1;
    });
    return rc;
}

// x2 [rows, in] times blocked wb [out/16, in, 16] (+ bias [out]) -> [rows, out], as linear_kernel.blocked_product:
// the native product, its blocks shared among torch's threads (at::parallel_for: torch's own pool, no second one);
// torch's per-block product for other dtypes (and without the kernel).
static at::Tensor blocked_linear(const at::Tensor& x2, const at::Tensor& wb, const std::optional<at::Tensor>& bias) {
    const kvs_mm_fn kvs_blocked_mm = bound_mm.load();
    const kvs_mm_h_fn kvs_blocked_mm_h = bound_mm_h.load();
    const bool f32 = wb.scalar_type() == at::kFloat && kvs_blocked_mm,
               bf16 = wb.scalar_type() == at::kBFloat16 && kvs_blocked_mm_h;
    const bool mixed = x2.scalar_type() == at::kFloat && wb.scalar_type() == at::kBFloat16;
    if (mixed && bound_mm_xh.load() && x2.size(0) >= 1) {  // float32 rows, bfloat16 weights: float32 out
        const at::Tensor x = x2.contiguous(), w = wb.contiguous();
        const int64_t rows = x.size(0), nb = w.size(0);
        at::Tensor y = at::empty({rows, nb * 16}, x.options());
        at::Tensor b;
        if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
        if (kvs_blocked_xh_parallel((int)rows, (int)x.size(1), nb, x.data_ptr<float>(), nullptr,
                                    (const uint16_t*)w.data_ptr(), b.defined() ? b.data_ptr<float>() : nullptr,
                                    y.data_ptr<float>(), nb * 16))
            TORCH_CHECK(false, "blocked_linear: the float32-rows product refused its arguments");
        return y;
    }
    if (!(f32 || bf16) || x2.scalar_type() != wb.scalar_type() || x2.size(0) < 1) {
        at::Tensor y = at::matmul(x2, wb.to(x2.scalar_type())).transpose(0, 1).reshape({x2.size(0), -1});
        return bias.has_value() ? y + *bias : y;
    }
    const at::Tensor x = x2.contiguous(), w = wb.contiguous();
    const int64_t rows = x.size(0), n_in = x.size(1), nb = w.size(0), out = nb * 16;
    at::Tensor y = at::empty({rows, out}, x.options());
    at::Tensor b;
    if (bias.has_value()) b = bias->to(x.scalar_type()).contiguous();
    if (bf16) {
        kvs_blocked_h_parallel((int)rows, (int)n_in, nb, (const uint16_t*)x.data_ptr(), (const uint16_t*)w.data_ptr(),
                               b.defined() ? (const uint16_t*)b.data_ptr() : nullptr, (uint16_t*)y.data_ptr(), out);
        return y;
    }
    // a thread's share is at least GRAIN multiply-adds (a fork and join costs a few microseconds: a share must
    // take far longer), so small linears and one thread run inline
    const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, rows * n_in * 16));
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
        kvs_blocked_mm((int)rows, (int)n_in, b0, b1, x.data_ptr<float>(), w.data_ptr<float>(),
                       b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), out);
    });
    return y;
}

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
    const kvs_plain_fn kvs_plain_decode = bound_plain.load();
    const int64_t hk = kp.size(0), dk = kp.size(2), dv = vp.size(2), hq = q.dim() == 4 ? q.size(1) : 0;
    const bool fits = kvs_plain_decode && q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && hq % hk == 0 && kp.device().is_cpu()
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
    const kvs_plain_fn kvs_plain_decode = bound_plain.load();
    const bool fits = kvs_plain_decode && q.dim() == 4 && q.size(2) == 1 && hq % hk == 0 && kp.device().is_cpu()
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

// The fused tq decode attention (engine.kv.quantized.tq_attend) with its KV heads shared among torch's threads:
// called through ctypes (the roles are the kernel's own structs), not as an operator.
extern "C" int kvs_tq_decode_parallel(int hk, int rep, const float* q, int64_t n, int64_t nt, const void* k,
                                      const void* v, float* out, int64_t width, int64_t dv) {
    const kvs_tq_heads_fn kvs_tq_decode_heads = bound_tq_heads.load();
    if (!kvs_tq_decode_heads) return -1;
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
