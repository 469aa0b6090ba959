// Planted float-to-int conversions for the UBSan build of the emulator (tests/ops/metal/test_emulator_ubsan.py).
// Valid MSL, following the emulator's kernel-author rules.
#include <metal_stdlib>
using namespace metal;

// BUG on purpose: converts without checking. Undefined in C++ and MSL for NaN, inf and |x| >= 2^31
// (x86 gives INT_MIN, an Apple GPU may saturate to INT_MAX). out: int32 [n], x: float32 [n]
kernel void float_to_int_unguarded(device int* out [[buffer(0)]], device const float* x [[buffer(1)]],
                                   uint gid [[thread_position_in_grid]]) {
  out[gid] = (int)x[gid];
}

// The guard the projection kernels use before (int)radius: finite and in range first, else 0.
kernel void float_to_int_guarded(device int* out [[buffer(0)]], device const float* x [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]]) {
  const float v = x[gid];
  out[gid] = (isfinite(v) && v < 2147483648.0f && v >= -2147483648.0f) ? (int)v : 0;
}
