// Shared header for the compile-error test.
#include <metal_stdlib>
using namespace metal;
inline float twice(float x) { return 2.0f * x; }
