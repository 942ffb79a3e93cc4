// What torch_ops.cpp shares with gguf_ops.cpp, the other half of the torch operators' library: the blocked products
// that a BF16 GGUF's blocked linears (float32 rows) and a bf16 folder's (bfloat16 rows) are answered by.
#pragma once

#include <cstdint>

// float32 rows x [rows, n_in] (xb: the same rounded to bfloat16, or null) times blocked bfloat16 wb [nb, n_in, 16]
// (+ float32 bias) -> y [rows, ldy] float32, the blocks shared among torch's threads. 0 done; -1 unbound or refused.
extern "C" int kvs_blocked_xh_parallel(int rows, int n_in, int64_t nb, const float* x, const uint16_t* xb,
                                       const uint16_t* wb, const float* bias, float* y, int64_t ldy);

// bfloat16 rows x [rows, n_in] times blocked bfloat16 wb [nb, n_in, 16] (+ bfloat16 bias) -> y [rows, ldy]
// bfloat16, the blocks shared among torch's threads. 0 done; -1 unbound or refused.
extern "C" int kvs_blocked_h_parallel(int rows, int n_in, int64_t nb, const uint16_t* x, const uint16_t* wb,
                                      const uint16_t* bias, uint16_t* y, int64_t ldy);

// Is kvs_blocked_mm_xh bound (kvs_ops_bind_xh)? Without it kvs_blocked_xh_parallel refuses every call.
bool kvs_xh_bound();

// Is kvs_blocked_mm_h bound (kvs_ops_bind)? Without it kvs_blocked_h_parallel refuses every call.
bool kvs_h_bound();
