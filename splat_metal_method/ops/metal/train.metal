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
