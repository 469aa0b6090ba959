// sh.metal: view-dependent colour from real spherical harmonics (Sloan 2013 evaluation order, the
// basis and constants of gsplat and of ops/reference.py::sh_bases). Backward kernels go next to it.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

// sh_fwd: one thread per (camera, gaussian), flat index idx = c*N + n < C*N; writes 3 floats.
// Why it is shaped so: a colour depends on one direction and one coefficient row only, so threads are
// independent (no barriers); a thread may return early.
// Invariants:
//   * degree in 0..3 (checked on the host); only the first (degree+1)^2 of K coefficient rows are read;
//   * dirs are normalised here as F.normalize does: d / max(|d|, 1e-12) (a zero direction gives a
//     zero vector, so only the constant band contributes);
//   * masked-out entries (has_masks != 0 and masks[idx] == 0) get exactly 0 before the activation;
//   * activate != 0 applies the public API's colour activation, torch.clamp_min(c + 0.5, 0) (NaN
//     stays NaN, as clamp_min keeps it), in the same float32 operations; activate == 0 returns c.
// Bounds: coefficient reads stay inside coeffs[idx, 0:(degree+1)^2, 0:3] because K >= (degree+1)^2.
// torch.clamp_min(x, 0): x where x > 0 or x is NaN, else 0 (the sign of a zero is that of 0).
inline float sh_activate(float x) {
  return (x > 0.0f || isnan(x)) ? x : 0.0f;
}

[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void sh_fwd(
    const device float* dirs [[buffer(0)]],     // [C*N, 3] unnormalised
    const device float* coeffs [[buffer(1)]],   // [C*N, K, 3]
    const device uchar* masks [[buffer(2)]],    // [C*N] 0/1, or [1] placeholder
    device float* colors [[buffer(3)]],         // [C*N, 3]
    constant long& total [[buffer(4)]],         // C*N
    constant long& K [[buffer(5)]],
    constant long& degree [[buffer(6)]],
    constant long& has_masks [[buffer(7)]],
    constant long& activate [[buffer(8)]],
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= total) {
    return;
  }
  if (has_masks != 0 && masks[idx] == 0) {
    const float masked = activate != 0 ? 0.5f : 0.0f;  // clamp_min(0 + 0.5, 0)
    colors[3 * idx + 0] = masked;
    colors[3 * idx + 1] = masked;
    colors[3 * idx + 2] = masked;
    return;
  }
  const float dx = dirs[3 * idx + 0], dy = dirs[3 * idx + 1], dz = dirs[3 * idx + 2];
  const float norm = max(sqrt(dx * dx + dy * dy + dz * dz), 1e-12f);
  const float x = dx / norm, y = dy / norm, z = dz / norm;

  // Basis values in the reference's order (16 = (3+1)^2 at most).
  float basis[16];
  basis[0] = 0.2820947917738781f;
  int n_bases = 1;
  if (degree >= 1) {
    basis[1] = -0.48860251190292f * y;
    basis[2] = 0.48860251190292f * z;
    basis[3] = -0.48860251190292f * x;
    n_bases = 4;
  }
  if (degree >= 2) {
    const float z2 = z * z;
    const float fc1 = x * x - y * y, fs1 = 2.0f * x * y;
    const float tmp_b = -1.092548430592079f * z;
    basis[4] = 0.5462742152960395f * fs1;
    basis[5] = tmp_b * y;
    basis[6] = 0.9461746957575601f * z2 - 0.3153915652525201f;
    basis[7] = tmp_b * x;
    basis[8] = 0.5462742152960395f * fc1;
    n_bases = 9;
    if (degree >= 3) {
      const float tmp_c = -2.285228997322329f * z2 + 0.4570457994644658f;
      const float tmp_b3 = 1.445305721320277f * z;
      const float fc2 = x * fc1 - y * fs1, fs2 = x * fs1 + y * fc1;
      basis[9] = -0.5900435899266435f * fs2;
      basis[10] = tmp_b3 * fs1;
      basis[11] = tmp_c * y;
      basis[12] = z * (1.865881662950577f * z2 - 1.119528997770346f);
      basis[13] = tmp_c * x;
      basis[14] = tmp_b3 * fc1;
      basis[15] = -0.5900435899266435f * fc2;
      n_bases = 16;
    }
  }

  const device float* row = coeffs + (long)idx * K * 3;
  float r = 0.0f, g = 0.0f, b = 0.0f;
  for (int k = 0; k < n_bases; ++k) {
    r += basis[k] * row[3 * k + 0];
    g += basis[k] * row[3 * k + 1];
    b += basis[k] * row[3 * k + 2];
  }
  if (activate != 0) {
    r = sh_activate(r + 0.5f);
    g = sh_activate(g + 0.5f);
    b = sh_activate(b + 0.5f);
  }
  colors[3 * idx + 0] = r;
  colors[3 * idx + 1] = g;
  colors[3 * idx + 2] = b;
}
