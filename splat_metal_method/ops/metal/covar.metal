// covar.metal: gsplat 1.4's quat_scale_to_covar_preci forward (MCMCStrategy shapes its position noise
// by the covariance every step). The math is covar.h's (shared with the native CPU backend).
// Compiled after common.h and covar.h: kernels.py prepends them.

// quat_scale_to_covar_preci_fwd: one thread per gaussian, idx < N.
// Why it is shaped so: each output row depends on one gaussian only, so threads are independent (no
// barriers, no shared memory) and a thread may return early.
// Invariants:
//   * covars / precis rows are written iff compute_covar / compute_preci != 0 (otherwise the host
//     passes a 1-element placeholder), every requested row exactly once (outputs may be torch.empty);
//   * a row is the full row-major 3x3 (9 floats) or, with triu != 0, its upper triangle
//     [xx, xy, xz, yy, yz, zz] (6 floats);
//   * quats are normalised here (q / max(|q|, 1e-12): a zero quaternion is the identity rotation).
// Bounds: idx < N < 2^31 (checked on the host).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void quat_scale_to_covar_preci_fwd(
    const device float* quats [[buffer(0)]],   // [N, 4] wxyz
    const device float* scales [[buffer(1)]],  // [N, 3]
    device float* covars [[buffer(2)]],        // [N, 9] or [N, 6], or [1] placeholder
    device float* precis [[buffer(3)]],        // [N, 9] or [N, 6], or [1] placeholder
    constant long& N [[buffer(4)]],
    constant long& compute_covar [[buffer(5)]],
    constant long& compute_preci [[buffer(6)]],
    constant long& triu [[buffer(7)]],
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= N) {
    return;
  }
  const long i = (long)idx;
  const SplatMat3 R = splat_quat_to_rotmat(quats[4 * i + 0], quats[4 * i + 1], quats[4 * i + 2], quats[4 * i + 3]);
  const float sx = scales[3 * i + 0], sy = scales[3 * i + 1], sz = scales[3 * i + 2];
  const int width = triu != 0 ? 6 : 9;
  if (compute_covar != 0) {
    const SplatMat3 cov = splat_covariance(R, sx, sy, sz);
    for (int k = 0; k < width; ++k) {
      covars[width * i + k] = cov.m[triu != 0 ? splat_triu_index(k) : k];
    }
  }
  if (compute_preci != 0) {
    const SplatMat3 pre = splat_precision(R, sx, sy, sz);
    for (int k = 0; k < width; ++k) {
      precis[width * i + k] = pre.m[triu != 0 ? splat_triu_index(k) : k];
    }
  }
}
