// kvscope::gguf_linear in C++: a GGUF weight's product (engine/quant/modules.py defines the operator, with its
// Python kernel), part of the torch operators' library (engine/native/libraries.py: TORCH_OPS, built with
// torch_ops.cpp). Its blocked road calls torch_ops.cpp's blocked products (torch_ops.h).
//
// A compiled decode step calls it ~113 times (1B shape): its Python kernel (find the weight's packed owner or
// descriptor, then kq_linear through ctypes) cost ~12 us a call, ~1.4 ms a token. Here a table maps a call's
// arguments to the descriptor Python made for them, and the same C function runs; a call the table does not hold
// (a first call, a packing still pending, a loader's shapes-only run) goes to the Python kernel,
// kvscope::gguf_linear_py, which fills the table once its answer is a plain descriptor's product or a blocked
// owner's: a BF16 GGUF's (float32 rows; its blocked copy's product, 5.8 us a call of a 64x256 weight against 31
// through Python) or a bf16 folder's (its rows rounded to bfloat16 and its outputs widened, as its layout's product
// does them: through Python the 113 calls of a 1B-shape two-thread step took ~14 ms of its ~70, each call back into
// Python running cold after the weights streamed by).

// (the tensor and the two operators it calls, not all of ATen.h: each file of the library parses torch's headers
// again, 13.3 s of compiling this one with ATen.h, 10.6 with these)
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "torch_ops.h"

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
// kq_matmul.c's embedding lookup and row width (kvscope::gguf_rows below)
typedef int (*kq_get_rows_fn)(int type, const uint8_t* w, int64_t rb, int64_t n_rows, int64_t n, const int64_t* ids,
                              int64_t count, float* out);
typedef int64_t (*kq_row_bytes_fn)(int type, int64_t n);
static std::atomic<kq_get_rows_fn> bound_rows{nullptr};
static std::atomic<kq_row_bytes_fn> bound_row_bytes{nullptr};

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
    bool half = false;  // the blocked copy's bfloat16 product answers (a bf16 folder's linears: no bias, rows <= 16)
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

// rows a bf16 folder's owner is answered here for at most: up to 16 its Python product is the blocked one on every CPU
// (packed_linear.native_max_rows; beyond, where the CPU lacks AVX512_BF16, oneDNN's), so the answer is its own
static const int64_t HALF_MAX_ROWS = 16;

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
    if (!e || (!e->wb && !kq_linear) || (e->half && x2.size(0) > HALF_MAX_ROWS))
        return gguf_linear_py(x2, w, std::move(type), std::move(n_in), bias, out_map, std::move(road));
    const at::Tensor x = x2.contiguous();
    const int64_t m = x.size(0);
    if (e->half) {  // the rows rounded to bfloat16, the blocked bfloat16 product (linear_kernel.product), widened
        const at::Tensor xh = x.to(at::kBFloat16);  // [m, n]
        at::Tensor yh = at::empty({m, e->nb * 16}, xh.options());  // [m, n_out] bfloat16
        if (m && kvs_blocked_h_parallel((int)m, (int)n, e->nb, (const uint16_t*)xh.data_ptr(), e->wb, nullptr,
                                        (uint16_t*)yh.data_ptr(), e->nb * 16))
            TORCH_CHECK(false, "the blocked product refused its arguments");
        const at::Tensor y = yh.to(at::kFloat);
        return e->map.defined() ? at::empty_like(y).index_copy_(1, e->map, y) : y;
    }
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

static at::Tensor gguf_rows_py(const at::Tensor& w, c10::SymInt type, c10::SymInt dim, const at::Tensor& ids) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvscope::gguf_rows_py", "")
        .typed<at::Tensor(const at::Tensor&, c10::SymInt, c10::SymInt, const at::Tensor&)>();
    return op.call(w, std::move(type), std::move(dim), ids);
}

// kvscope::gguf_rows: rows `ids` (any shape, integers) of the GGUF table w [rows, row_bytes] dequantized -> [*ids, dim]
// float32, as its Python kernel (engine/quant/block_embedding.py), which answers until it has bound the lookup here
// and whatever this does not take (another device, ids not integers). A compiled step looks its token's row up once
// a step: through Python ~40 us warm, here ~2.
static at::Tensor gguf_rows(const at::Tensor& w, c10::SymInt type, c10::SymInt dim, const at::Tensor& ids) {
    const kq_get_rows_fn get = bound_rows.load();
    const kq_row_bytes_fn row_bytes = bound_row_bytes.load();
    const int64_t t = type.expect_int(), n = dim.expect_int();
    if (!get || !row_bytes || w.dim() != 2 || w.scalar_type() != at::kByte || w.stride(1) != 1 || !w.device().is_cpu()
            || !ids.device().is_cpu() || !at::isIntegralType(ids.scalar_type(), false) || n < 1
            || t != (int)t || row_bytes((int)t, n) == 0 || w.size(1) != row_bytes((int)t, n))
        return gguf_rows_py(w, std::move(type), std::move(dim), ids);
    const at::Tensor flat = ids.reshape(-1).to(at::kLong).contiguous();  // [count]
    at::Tensor out = at::empty({flat.numel(), n}, w.options().dtype(at::kFloat));  // [count, dim]
    if (flat.numel() && get((int)t, (const uint8_t*)w.data_ptr(), w.stride(0), w.size(0), n,
                            flat.data_ptr<int64_t>(), flat.numel(), out.data_ptr<float>()) != 0)
        TORCH_CHECK_INDEX(false, "an id outside the table's ", w.size(0), " rows");
    std::vector<int64_t> shape = ids.sizes().vec();
    shape.push_back(n);
    return out.reshape(shape);
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
// rounded to bfloat16), as its Python product answers them; `half`: the owner computes in bfloat16 (no bias): the
// rows rounded to bfloat16, the bfloat16 product, its outputs widened. Refused without the product it needs bound.
static void gguf_table_put_blocked(const at::Tensor& w, int64_t type, int64_t n_in,
                                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_map,
                                   int64_t road, const at::Tensor& wb, bool rounded, bool half) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1
                && (half ? kvs_h_bound() && !bias.has_value() && !rounded : kvs_xh_bound())
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
    e->half = half;
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

// kq_get_rows' and kq_row_bytes_of's addresses (engine/quant/csrc, loaded by ctypes): kvscope::gguf_rows answers here
// once they are bound
extern "C" void kvs_gguf_bind_rows(void* get_rows, void* row_bytes) {
    bound_row_bytes = (kq_row_bytes_fn)row_bytes;
    bound_rows = (kq_get_rows_fn)get_rows;
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
    m.impl("gguf_linear", &gguf_linear);
    m.impl("gguf_rows", &gguf_rows);
    m.impl("gguf_table_put", &gguf_table_put);
    m.impl("gguf_table_put_blocked", &gguf_table_put_blocked);
}
