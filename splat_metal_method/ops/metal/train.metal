// train.metal: the training step's small per-element work outside the render, one launch each where
// PyTorch issued 5-15 aten ops (each one encode on MPS): gsplat's densification statistics, the NaN
// guard's flag, and the background composite of the rendered image.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

// densify_stats: gsplat 1.4 DefaultStrategy._update_state (non-packed) of one render, as
// memory.BudgetedStrategy writes it densely, one thread per gaussian n < N:
//   grad2d[n] += sum_c (radii[c, n] > 0 ? |(g[c, n, 0] * sx, g[c, n, 1] * sy)| : 0)
//   count[n]  += #{c : radii[c, n] > 0}
//   radii_max[n] = max(radii_max[n], max_c radii[c, n] / size)      (only if has_radii != 0)
// with (sx, sy) = (W / 2 C, H / 2 C) and size = max(W, H): count and radii_max are PyTorch's bits; the
// norm is float32 sqrt(x * x + y * y), as MPS computes it (PyTorch's CPU norm accumulates in double: an
// ulp or two apart), summed over cameras in camera order. Why a kernel: these 12 aten ops ran every step. Threads are independent (no barriers).
// Bounds: n < N checked; radii_max is a [1] placeholder unless has_radii != 0.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void densify_stats(
    const device float* grads [[buffer(0)]],   // [C, N, 2] means2d.grad or .absgrad
    const device int* radii [[buffer(1)]],     // [C, N]
    device float* grad2d [[buffer(2)]],        // [N]
    device float* count [[buffer(3)]],         // [N]
    device float* radii_max [[buffer(4)]],     // [N] or [1] placeholder
    constant long& C [[buffer(5)]],
    constant long& N [[buffer(6)]],
    constant float& sx [[buffer(7)]],
    constant float& sy [[buffer(8)]],
    constant float& size [[buffer(9)]],
    constant long& has_radii [[buffer(10)]],
    uint n [[thread_position_in_grid]]) {
  if ((long)n >= N) {
    return;
  }
  float norms = 0.0f;
  float visible = 0.0f;
  int widest = 0;
  for (long c = 0; c < C; ++c) {
    const long idx = c * N + (long)n;
    const int r = radii[idx];
    if (r > 0) {
      const float gx = grads[2 * idx + 0] * sx, gy = grads[2 * idx + 1] * sy;
      norms += sqrt(gx * gx + gy * gy);
      visible += 1.0f;
    }
    widest = c == 0 ? r : max(widest, r);
  }
  grad2d[n] = grad2d[n] + norms;
  count[n] = count[n] + visible;
  if (has_radii != 0) {
    const float r = (float)widest / size;
    const float old = radii_max[n];
    radii_max[n] = (isnan(old) || old >= r) ? old : r;  // torch.maximum (NaN propagates)
  }
}

// nonfinite_flag: the NaN guard's verdict (engine/reliability.py) over up to SPLAT_FLAG_SLOTS tensors
// at once: flag[0] is set to NaN when any element of any tensor is NaN or +-Inf, and left as it is
// otherwise (the host zeroes it once per step; several launches share it). One thread per
// FLAG_RUN consecutive elements of the longest tensor; a thread reads the same run of every tensor.
// Why it is shaped so: the guard ran one norm per tensor (MPS has no foreach kernels), a stack and a
// sum every step. Racing threads store the same NaN (no read-modify-write), so no atomics are needed.
// Bounds: slot k is read only below n[k] (0 for an unused slot, which is bound to a placeholder).
#define SPLAT_FLAG_SLOTS 12
#define FLAG_RUN 16
inline bool flag_run_finite(const device float* t, long n, long start) {
  bool ok = true;
  const long end = min(start + (long)FLAG_RUN, n);
  for (long i = start; i < end; ++i) {
    ok = ok && isfinite(t[i]);
  }
  return ok;
}

[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void nonfinite_flag(
    const device float* t0 [[buffer(0)]], const device float* t1 [[buffer(1)]],
    const device float* t2 [[buffer(2)]], const device float* t3 [[buffer(3)]],
    const device float* t4 [[buffer(4)]], const device float* t5 [[buffer(5)]],
    const device float* t6 [[buffer(6)]], const device float* t7 [[buffer(7)]],
    const device float* t8 [[buffer(8)]], const device float* t9 [[buffer(9)]],
    const device float* t10 [[buffer(10)]], const device float* t11 [[buffer(11)]],
    constant long* n [[buffer(12)]],  // [SPLAT_FLAG_SLOTS] elements of each tensor (one list: one slot)
    device float* flag [[buffer(13)]],  // [1]
    uint i [[thread_position_in_grid]]) {
  const long start = (long)i * FLAG_RUN;
  bool ok = true;
  ok = ok && flag_run_finite(t0, n[0], start);
  ok = ok && flag_run_finite(t1, n[1], start);
  ok = ok && flag_run_finite(t2, n[2], start);
  ok = ok && flag_run_finite(t3, n[3], start);
  ok = ok && flag_run_finite(t4, n[4], start);
  ok = ok && flag_run_finite(t5, n[5], start);
  ok = ok && flag_run_finite(t6, n[6], start);
  ok = ok && flag_run_finite(t7, n[7], start);
  ok = ok && flag_run_finite(t8, n[8], start);
  ok = ok && flag_run_finite(t9, n[9], start);
  ok = ok && flag_run_finite(t10, n[10], start);
  ok = ok && flag_run_finite(t11, n[11], start);
  if (!ok) {
    flag[0] = as_type<float>(0x7fc00000u);  // a quiet NaN
  }
}

// composite_fwd: splatfacto's rgb = clamp(color + (1 - alpha) * background, 0, 1) of one rendered
// camera, one thread per pixel p < P, in PyTorch's float32 operations and order (so the same bits);
// clamp as torch.clamp (NaN stays NaN: common.h splat_clamp01). color is [P, D] with D >= 3 (only the first 3 channels are
// composited: "RGB+ED" renders carry depth last), alpha [P], background [3].
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void composite_fwd(
    const device float* color [[buffer(0)]],       // [P, D]
    const device float* alpha [[buffer(1)]],       // [P]
    const device float* background [[buffer(2)]],  // [3]
    device float* rgb [[buffer(3)]],               // [P, 3]
    constant long& P [[buffer(4)]],
    constant long& D [[buffer(5)]],
    uint p [[thread_position_in_grid]]) {
  if ((long)p >= P) {
    return;
  }
  const float t = 1.0f - alpha[p];
  for (int k = 0; k < 3; ++k) {
    rgb[3 * (long)p + k] = splat_clamp01(color[D * (long)p + k] + t * background[k]);
  }
}

// composite_bwd: the gradient of composite_fwd, as autograd takes it: clamp passes the gradient where
// min <= x <= max (x recomputed in the same operations), v_color = that; v_alpha = -sum_k v_x[k] bg[k]
// (the channel sum of the broadcast product, in channel order). v_color is [P, D]: channels past 3
// (depth) get 0.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void composite_bwd(
    const device float* color [[buffer(0)]],       // [P, D]
    const device float* alpha [[buffer(1)]],       // [P]
    const device float* background [[buffer(2)]],  // [3]
    const device float* v_rgb [[buffer(3)]],       // [P, 3]
    device float* v_color [[buffer(4)]],           // [P, D]
    device float* v_alpha [[buffer(5)]],           // [P]
    constant long& P [[buffer(6)]],
    constant long& D [[buffer(7)]],
    uint p [[thread_position_in_grid]]) {
  if ((long)p >= P) {
    return;
  }
  const float t = 1.0f - alpha[p];
  float v_t = 0.0f;
  for (int k = 0; k < 3; ++k) {
    const float x = color[D * (long)p + k] + t * background[k];
    const float g = (x >= 0.0f && x <= 1.0f) ? v_rgb[3 * (long)p + k] : 0.0f;
    v_color[D * (long)p + k] = g;
    v_t += g * background[k];
  }
  for (long k = 3; k < D; ++k) {
    v_color[D * (long)p + k] = 0.0f;
  }
  v_alpha[p] = -v_t;
}
