// Swizzles are not supported by the emulator: line 7 must be a compile error, not a miscompile.
#include <metal_stdlib>
using namespace metal;
kernel void swizzle(device float* out [[buffer(0)]],
                    uint i [[thread_position_in_grid]]) {
  float3 v = float3(1.0f, 2.0f, 3.0f);
  float2 xy = v.xy;
  out[i] = xy.x;
}
