// Test kernels for the MSL emulator (tests/ops/metal/test_emulator.py). Valid MSL: they must also
// compile with Apple's compiler, so they follow the emulator's kernel-author rules.
#include <metal_stdlib>
using namespace metal;

#define TG_MAX 256

// out[i] = a * x[i] + b over a 3D grid of shape (nx, ny, nz); x, out: float32 [nz, ny, nx]
kernel void axpb_3d(device float* out [[buffer(0)]],
                    device const float* x [[buffer(1)]],
                    constant long& nx [[buffer(2)]],
                    constant long& ny [[buffer(3)]],
                    constant float& a [[buffer(4)]],
                    constant float& b [[buffer(5)]],
                    uint3 pos [[thread_position_in_grid]]) {
  long i = (long(pos.z) * ny + pos.y) * nx + pos.x;
  out[i] = a * x[i] + b;
}

// One row of 17 int32 per thread, indexed by its grid position; out: int32 [H, W, 17]
kernel void positions_2d(device int* out [[buffer(0)]],
                         constant long& width [[buffer(1)]],
                         uint2 tpig [[thread_position_in_grid]],
                         uint2 tpt [[thread_position_in_threadgroup]],
                         uint2 tgp [[threadgroup_position_in_grid]],
                         uint2 tptg [[threads_per_threadgroup]],
                         uint2 grid [[threads_per_grid]],
                         uint tidx [[thread_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint tps [[threads_per_simdgroup]],
                         uint nsg [[simdgroups_per_threadgroup]],
                         uint tew [[thread_execution_width]]) {
  device int* o = out + (long(tpig.y) * width + tpig.x) * 17;
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpt.x; o[3] = tpt.y; o[4] = tgp.x; o[5] = tgp.y;
  o[6] = tptg.x; o[7] = tptg.y; o[8] = grid.x; o[9] = grid.y; o[10] = tidx; o[11] = lane;
  o[12] = sg; o[13] = tps; o[14] = nsg; o[15] = tew; o[16] = 1;
}

// Per-group sum by tree reduction in threadgroup memory; out: float32 [n_groups]
kernel void group_sum(device float* out [[buffer(0)]],
                      device const float* x [[buffer(1)]],
                      constant long& n [[buffer(2)]],
                      uint gid [[thread_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint group [[threadgroup_position_in_grid]],
                      uint ntg [[threads_per_threadgroup]]) {
  threadgroup float sh[TG_MAX];
  sh[tid] = gid < n ? x[gid] : 0.0f;  // masked, never an early return before the barriers
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = TG_MAX / 2; s > 0; s >>= 1) {
    if (tid < s && tid + s < ntg) sh[tid] += sh[tid + s];  // an edge group has only ntg threads
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) out[group] = sh[0];
}

// A helper working on threadgroup memory through a pointer: in-place inclusive scan (Hillis-Steele).
inline float scan_shared(threadgroup float* sh, uint tid, uint n) {
  for (uint off = 1; off < n; off <<= 1) {
    float add = tid >= off ? sh[tid - off] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sh[tid] += add;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  return sh[tid];
}

// Inclusive prefix sum within each group; out, x: float32 [n]
kernel void group_scan(device float* out [[buffer(0)]],
                       device const float* x [[buffer(1)]],
                       uint gid [[thread_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint ntg [[threads_per_threadgroup]]) {
  threadgroup float sh[TG_MAX];
  sh[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup float* p = sh;  // a threadgroup pointer local is fine too
  out[gid] = scan_shared(p, tid, ntg);
}

// Rotate values around the group `rounds` times through two shared buffers, one barrier per phase:
// after r rounds thread t holds x[(t + r) % group]. out, x: float32 [n] (n multiple of TG_MAX)
kernel void rotate_rounds(device float* out [[buffer(0)]],
                          device const float* x [[buffer(1)]],
                          constant long& rounds [[buffer(2)]],
                          uint gid [[thread_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint ntg [[threads_per_threadgroup]]) {
  threadgroup float buf[2][TG_MAX];
  buf[0][tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (long r = 0; r < rounds; ++r) {
    uint src = r & 1, dst = 1 - src;
    buf[dst][tid] = buf[src][(tid + 1) % ntg];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = buf[rounds & 1][tid];
}

// Reads a neighbour's shared value WITHOUT a barrier: a data race (see test_races_are_out_of_scope).
kernel void racy_neighbour(device float* out [[buffer(0)]],
                           device const float* x [[buffer(1)]],
                           uint gid [[thread_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint ntg [[threads_per_threadgroup]]) {
  threadgroup float sh[TG_MAX];
  sh[tid] = x[gid];
  out[gid] = sh[(tid + 1) % ntg];  // missing threadgroup_barrier before this read
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Simdgroup ops; out: float32 [n, 9], ballot: int32 [n], x: float32 [n], flags: int32 [n]
kernel void simd_ops(device float* out [[buffer(0)]],
                     device int* ballot [[buffer(1)]],
                     device const float* x [[buffer(2)]],
                     device const int* flags [[buffer(3)]],
                     uint gid [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  float v = x[gid];
  bool f = flags[gid] != 0;
  device float* o = out + long(gid) * 9;
  o[0] = simd_sum(v);
  o[1] = simd_prefix_exclusive_sum(v);
  o[2] = simd_prefix_inclusive_sum(v);
  o[3] = simd_shuffle(v, (lane * 7 + 3) % 32);
  o[4] = simd_shuffle_down(v, 5u);
  o[5] = simd_broadcast(v, 2u);
  o[6] = simd_max(v);
  o[7] = simd_min(v);
  o[8] = float(simd_any(f)) + 2.0f * float(simd_all(f));
  ballot[gid] = as_type<int>(uint(ulong(simd_ballot(f))));  // lanes 0..31 -> bits 0..31
}

// Many groups add into a few float and int accumulators. acc: float32 [nbins], cnt: int32 [nbins]
kernel void atomic_accumulate(device atomic_float* acc [[buffer(0)]],
                              device atomic_int* cnt [[buffer(1)]],
                              device const float* x [[buffer(2)]],
                              device const int* bin [[buffer(3)]],
                              constant long& n [[buffer(4)]],
                              uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  atomic_fetch_add_explicit(&acc[bin[gid]], x[gid], memory_order_relaxed);
  atomic_fetch_add_explicit(&cnt[bin[gid]], 1, memory_order_relaxed);
}

// sizeof/alignof of the Metal types that differ from naive C layouts; out: int64 [8]
kernel void layout_sizes(device long* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  if (gid != 0) return;
  out[0] = sizeof(float3); out[1] = alignof(float3); out[2] = sizeof(packed_float3);
  out[3] = sizeof(float3x3); out[4] = sizeof(float2); out[5] = sizeof(float4);
  out[6] = sizeof(float2x2); out[7] = alignof(float3x3);
}

// Three ways to read a torch [N, 3] float32 tensor; only the last one is WRONG (float3 is 16 bytes).
// out: float32 [N, 3]
kernel void read_xyz_floats(device float* out [[buffer(0)]], device const float* p [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  float3 v = float3(p[3 * i], p[3 * i + 1], p[3 * i + 2]);
  out[3 * i] = v.x; out[3 * i + 1] = v.y; out[3 * i + 2] = v.z;
}
kernel void read_xyz_packed(device float* out [[buffer(0)]], device const packed_float3* p [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  float3 v = p[i];
  out[3 * i] = v.x; out[3 * i + 1] = v.y; out[3 * i + 2] = v.z;
}
kernel void read_xyz_wrong(device float* out [[buffer(0)]], device const float3* p [[buffer(1)]],
                           uint i [[thread_position_in_grid]]) {
  float3 v = p[i];  // WRONG over a packed tensor: strides 16 bytes per element
  out[3 * i] = v.x; out[3 * i + 1] = v.y; out[3 * i + 2] = v.z;
}

// Matrix/vector math; m: float32 [9] (row-major A), v: float32 [3], out: float32 [32]
kernel void matrix_math(device float* out [[buffer(0)]], device const float* m [[buffer(1)]],
                        device const float* v [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid != 0) return;
  // columns of A: A[r][c] = m[3r + c]
  float3x3 A = float3x3(float3(m[0], m[3], m[6]), float3(m[1], m[4], m[7]), float3(m[2], m[5], m[8]));
  float3 x = float3(v[0], v[1], v[2]);
  float3 Ax = A * x;
  float3 xA = x * A;
  float3x3 AAt = A * transpose(A);
  float3x3 I = float3x3(2.0f);
  float3x3 B = A + I * 0.5f - A;
  float2x2 S = float2x2(1.0f, 2.0f, 3.0f, 4.0f);  // columns (1,2) and (3,4)
  float2 sv = S * float2(1.0f, 1.0f);
  int k = 0;
  out[k++] = Ax.x; out[k++] = Ax.y; out[k++] = Ax.z;
  out[k++] = xA.x; out[k++] = xA.y; out[k++] = xA.z;
  for (int c = 0; c < 3; ++c) for (int r = 0; r < 3; ++r) out[k++] = AAt[c][r];
  for (int c = 0; c < 3; ++c) for (int r = 0; r < 3; ++r) out[k++] = B[c][r];
  out[k++] = sv.x; out[k++] = sv.y;
  out[k++] = determinant(A);
  out[k++] = length(x); out[k++] = dot(x, normalize(x));
  float3 cr = cross(x, float3(0.0f, 0.0f, 1.0f));
  out[k++] = cr.x;
}

// BUG on purpose: out-of-range threads return before the barrier the others wait at.
kernel void early_return(device float* out [[buffer(0)]], constant long& n [[buffer(1)]],
                         uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sh[TG_MAX];
  if (gid >= n) return;
  sh[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = sh[0];
}

// BUG on purpose: the barrier sits in divergent control flow.
kernel void divergent_barrier(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// 40 KiB of threadgroup memory: over Metal's 32 KiB limit.
kernel void too_much_shared(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[10240];
  big[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[0];
}

// BUG on purpose: thread 0 reads its shared slot before anyone wrote it (see test_uninitialised_...).
kernel void uninit_shared(device float* out [[buffer(0)]], device int* out_i [[buffer(1)]],
                          uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sh[TG_MAX];
  threadgroup int sh_i[TG_MAX];
  if (tid > 0) { sh[tid] = float(tid); sh_i[tid] = int(tid); }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = sh[tid];
  out_i[gid] = sh_i[tid];
}

// BUG on purpose: the last thread reads one element past the end of x (see test_asan.py).
kernel void read_past_end(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
  out[gid] = x[gid + 1];
}

// BUG on purpose: the last thread of a full group writes one element past a threadgroup array.
kernel void shared_past_end(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sh[TG_MAX];
  sh[tid + 1] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = sh[tid];
}

// Declares a smaller limit than Metal's 1024 threads per group (a literal or a constant expression).
[[max_total_threads_per_threadgroup(64)]]
kernel void limited_64(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = 1.0f;
}
[[max_total_threads_per_threadgroup(TG_MAX / 8)]] kernel void limited_32(device float* out [[buffer(0)]],
                                                                        uint gid [[thread_position_in_grid]]) {
  out[gid] = 2.0f;
}
