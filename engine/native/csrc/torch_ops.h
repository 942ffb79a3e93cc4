// What torch_ops.cpp shares with gguf_ops.cpp, the other half of the torch operators' library: the float32-rows
// blocked product that a BF16 GGUF's blocked linears are answered by.
#pragma once

#include <cstdint>

// float32 rows x [rows, n_in] (xb: the same rounded to bfloat16, or null) times blocked bfloat16 wb [nb, n_in, 16]
// (+ float32 bias) -> y [rows, ldy] float32, the blocks shared among torch's threads. 0 done; -1 unbound or refused.
extern "C" int kvs_blocked_xh_parallel(int rows, int n_in, int64_t nb, const float* x, const uint16_t* xb,
                                       const uint16_t* wb, const float* bias, float* y, int64_t ldy);

// Is kvs_blocked_mm_xh bound (kvs_ops_bind_xh)? Without it kvs_blocked_xh_parallel refuses every call.
bool kvs_xh_bound();
