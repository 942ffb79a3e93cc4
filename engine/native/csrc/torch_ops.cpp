// CPU kernels in C++ for the compiled step's operators: kvscope::blocked_linear (the native blocked product),
// kvscope::paged_decode / paged_decode_batch (one token's attention read in place from its pages),
// kvscope::write_slot (its new K/V written after the step) and kvscope::gguf_linear (a GGUF weight's product, from a
// table of the weights Python has described), plus kvs_tq_decode_parallel (the quantized pages' fused
// attention, its KV heads shared among torch's threads; called through ctypes).
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
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>
#include <cstdint>

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

// float32 rows x [rows, n_in] (xb: the same rounded to bfloat16 by the caller, or null) times blocked bfloat16 wb
// [nb, n_in, 16] (+ float32 bias) -> y [rows, ldy] float32, the blocks shared among torch's threads: called through
// ctypes (linear_kernel.float_product) and by blocked_linear below. 0 done; -1 unbound or refused.
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

// ---- kvscope::gguf_linear: a GGUF weight's product (engine/quant/modules.py defines the operator) ----
// A compiled decode step calls it ~113 times (1B shape): its Python kernel (find the weight's packed owner or
// descriptor, then kq_linear through ctypes) cost ~12 us a call, ~1.4 ms a token. Here a table maps a call's
// arguments to the descriptor Python made for them, and the same C function runs; a call the table does not hold
// (a first call, a packing still pending, a bfloat16-compute layout's owner, a loader's shapes-only run) goes to the
// Python kernel, kvscope::gguf_linear_py, which fills the table once its answer is a plain descriptor's product or
// a float32-rows blocked owner's (a BF16 GGUF's: its blocked copy's product, 5.8 us a call of a 64x256 weight
// against 31 through Python).

// engine/quant/csrc/kq_matmul.c's descriptor (engine.quant.kernel.Weight), copied into the table's entry
struct kq_weight {
    int32_t type, road;
    const uint8_t* w;
    int64_t rb, n_out, n;
    const float* bias;
    const int32_t* map;
    const uint8_t* packed;
};
typedef int (*kq_linear_fn)(const kq_weight* W, const float* x, int64_t m, float* y, int threads);
static std::atomic<kq_linear_fn> bound_kq{nullptr};
static std::atomic<const int*> bound_held{nullptr};  // engine.quant.modules' shapes-only count: nonzero, no table

// a call's arguments: the weight's address, rows, row bytes and row stride, its type, inputs and road, bias and
// row map (the Python kernel's descriptors are keyed by the same, less the stride)
struct GgufKey {
    const void *w, *bias, *map;
    int64_t rows, row_bytes, rb, type, n_in, road;
    bool operator==(const GgufKey& o) const {
        return w == o.w && bias == o.bias && map == o.map && rows == o.rows && row_bytes == o.row_bytes
            && rb == o.rb && type == o.type && n_in == o.n_in && road == o.road;
    }
};
struct GgufKeyHash {
    size_t operator()(const GgufKey& k) const {
        size_t h = std::hash<const void*>()(k.w);
        for (int64_t v : {(int64_t)(uintptr_t)k.bias, (int64_t)(uintptr_t)k.map, k.rows, k.row_bytes, k.rb, k.type,
                          k.n_in, k.road})
            h = h * 1000003u ^ std::hash<int64_t>()(v);
        return h;
    }
};
// the descriptor and the storages it points into: an entry holds them, so no address in it is freed (and so
// reused by another weight) while the table has it; a call in flight holds its entry. A float layout's owner (a BF16
// GGUF's blocked linear, packed_linear.BF16_BLOCKED_F32) is an entry of its blocked copy instead: wb [nb, n, 16]
// bfloat16, its float32 bias, whether its rows are rounded to bfloat16, its row map as int64 (index_copy's)
struct GgufEntry {
    kq_weight desc;
    std::vector<c10::Storage> held;
    const uint16_t* wb = nullptr;
    int64_t nb = 0;
    bool rounded = false;
    at::Tensor map;
};
static std::mutex gguf_mu;
static std::unordered_map<GgufKey, std::shared_ptr<const GgufEntry>, GgufKeyHash> gguf_table;

static GgufKey gguf_key(const at::Tensor& w, int64_t type, int64_t n_in, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& out_map, int64_t road) {
    return GgufKey{w.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr,
                   out_map.has_value() ? out_map->data_ptr() : nullptr, w.size(0), w.size(1), w.stride(0), type, n_in,
                   road};
}

static at::Tensor gguf_linear_py(const at::Tensor& x2, const at::Tensor& w, c10::SymInt type, c10::SymInt n_in,
                                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_map,
                                 c10::SymInt road) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvscope::gguf_linear_py", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, c10::SymInt,
                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, c10::SymInt)>();
    return op.call(x2, w, std::move(type), std::move(n_in), bias, out_map, std::move(road));
}

// x2 [m, n_in] float32 times the GGUF weight w [n_out, row_bytes] -> [m, n_out] float32, as the Python kernel
static at::Tensor gguf_linear(const at::Tensor& x2, const at::Tensor& w, c10::SymInt type, c10::SymInt n_in,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_map,
                              c10::SymInt road) {
    const kq_linear_fn kq_linear = bound_kq.load();
    const int* held = bound_held.load();
    std::shared_ptr<const GgufEntry> e;
    const int64_t n = n_in.expect_int();
    if (held && __atomic_load_n(held, __ATOMIC_ACQUIRE) == 0 && x2.scalar_type() == at::kFloat
            && x2.dim() == 2 && x2.size(1) == n && w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1) {
        const GgufKey k = gguf_key(w, type.expect_int(), n, bias, out_map, road.expect_int());
        std::lock_guard<std::mutex> g(gguf_mu);
        auto it = gguf_table.find(k);
        if (it != gguf_table.end()) e = it->second;
    }
    if (!e || (!e->wb && !kq_linear))
        return gguf_linear_py(x2, w, std::move(type), std::move(n_in), bias, out_map, std::move(road));
    const at::Tensor x = x2.contiguous();
    const int64_t m = x.size(0);
    if (e->wb) {  // the blocked copy's product, as the layout's (linear_kernel.float_product) and its row map
        at::Tensor y = at::empty({m, e->nb * 16}, x.options());  // [m, n_out]
        const at::Tensor xb = e->rounded ? x.to(at::kBFloat16) : at::Tensor();  // [m, n]
        if (m && kvs_blocked_xh_parallel((int)m, (int)n, e->nb, x.data_ptr<float>(),
                                         xb.defined() ? (const uint16_t*)xb.data_ptr() : nullptr, e->wb,
                                         e->desc.bias, y.data_ptr<float>(), e->nb * 16))
            TORCH_CHECK(false, "the blocked product refused its arguments");
        return e->map.defined() ? at::empty_like(y).index_copy_(1, e->map, y) : y;
    }
    at::Tensor y = at::empty({m, w.size(0)}, x.options());  // [m, n_out]
    if (m && kq_linear(&e->desc, x.data_ptr<float>(), m, y.data_ptr<float>(), at::get_num_threads()) != 0)
        TORCH_CHECK(false, "the GGUF block product refused its arguments or ran out of memory");
    return y;
}

// kvscope::gguf_table_put: the descriptor at `desc` (engine.quant.kernel.Weight) answers the calls with these
// arguments from now on; `held`: the tensors it points into (refused unless every address in it lies in one)
static void gguf_table_put(const at::Tensor& w, int64_t type, int64_t n_in, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& out_map, int64_t road, at::TensorList held,
                           int64_t desc) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1, "gguf_table_put: not a GGUF weight");
    auto e = std::make_shared<GgufEntry>();
    std::memcpy(&e->desc, (const void*)(uintptr_t)desc, sizeof(kq_weight));
    for (const at::Tensor& t : held)
        if (t.defined() && t.has_storage()) e->held.push_back(t.storage());
    auto inside = [&](const void* p) {
        if (!p) return true;
        for (const c10::Storage& s : e->held) {
            const char* b = (const char*)s.data();
            if ((const char*)p >= b && (const char*)p < b + s.nbytes()) return true;
        }
        return false;
    };
    const kq_weight& d = e->desc;
    TORCH_CHECK(d.w == w.data_ptr() && d.n == n_in && d.n_out == w.size(0) && d.type == type && d.road == road
                && d.bias == (bias.has_value() ? bias->data_ptr() : nullptr)
                && d.map == (out_map.has_value() ? out_map->data_ptr() : nullptr)
                && inside(d.w) && inside(d.bias) && inside(d.map) && inside(d.packed),
                "gguf_table_put: the descriptor is not these arguments' or points outside the tensors held");
    const GgufKey k = gguf_key(w, type, n_in, bias, out_map, road);
    std::lock_guard<std::mutex> g(gguf_mu);
    gguf_table[k] = std::move(e);
}

// kvscope::gguf_table_put_blocked: the calls with these arguments are answered from now on by the blocked copy wb
// [n_out / 16, n_in, 16] bfloat16 of a float layout's owner (its bias float32, contiguous; `rounded`: its rows
// rounded to bfloat16), as its Python product answers them; refused without the float32-rows product bound
static void gguf_table_put_blocked(const at::Tensor& w, int64_t type, int64_t n_in,
                                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_map,
                                   int64_t road, const at::Tensor& wb, bool rounded) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && bound_mm_xh.load()
                && wb.dim() == 3 && wb.scalar_type() == at::kBFloat16 && wb.is_contiguous() && wb.size(1) == n_in
                && wb.size(2) == 16 && wb.size(0) * 16 == w.size(0)
                && (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous()
                                          && bias->numel() == w.size(0)))
                && (!out_map.has_value() || out_map->numel() == w.size(0)),
                "gguf_table_put_blocked: not a blocked copy of these arguments");
    auto e = std::make_shared<GgufEntry>();
    std::memset(&e->desc, 0, sizeof(kq_weight));
    e->desc.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    e->wb = (const uint16_t*)wb.data_ptr();
    e->nb = wb.size(0);
    e->rounded = rounded;
    for (const at::Tensor* t : {&w, &wb})
        e->held.push_back(t->storage());
    if (bias.has_value()) e->held.push_back(bias->storage());
    if (out_map.has_value()) e->map = out_map->to(at::kLong);
    const GgufKey k = gguf_key(w, type, n_in, bias, out_map, road);
    std::lock_guard<std::mutex> g(gguf_mu);
    gguf_table[k] = std::move(e);
}

// kq_linear's address (engine/quant/csrc, loaded by ctypes) and the shapes-only count's: the table answers once both
// are bound
extern "C" void kvs_gguf_bind(void* kq_linear, const int* held) {
    bound_kq = (kq_linear_fn)kq_linear;
    bound_held = held;
}

// Empty the table (its storages let go): a weight's module changed, packed or was collected.
extern "C" void kvs_gguf_clear() {
    std::unordered_map<GgufKey, std::shared_ptr<const GgufEntry>, GgufKeyHash> old;
    {
        std::lock_guard<std::mutex> g(gguf_mu);
        old.swap(gguf_table);
    }  // the storages are let go outside the lock
}

extern "C" int64_t kvs_gguf_size() {
    std::lock_guard<std::mutex> g(gguf_mu);
    return (int64_t)gguf_table.size();
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
    m.impl("write_slot", &write_slot);
    m.impl("blocked_linear", &blocked_linear);
    m.impl("paged_decode", &paged_decode);
    m.impl("paged_decode_batch", &paged_decode_batch);
    m.impl("gguf_linear", &gguf_linear);
    m.impl("gguf_table_put", &gguf_table_put);
    m.impl("gguf_table_put_blocked", &gguf_table_put_blocked);
}
