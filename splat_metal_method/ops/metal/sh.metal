// sh.metal: view-dependent colour from real spherical harmonics of degree 0..4 (the basis is sh.h's, shared
// with the native CPU backend: gsplat's and ops/reference.py::sh_bases's). Backward kernels: sh_bwd.metal.
// Compiled after common.h, covar.h and sh.h: kernels.py prepends them (compile_shader has no include path).

// sh_fwd: one thread per (camera, gaussian), flat index idx = c*N + n < C*N; writes 3 floats.
// Why it is shaped so: a colour depends on one direction and one coefficient row only, so threads are
// independent (no barriers); a thread may return early.
// Invariants:
//   * degree in 0..SPLAT_SH_MAX_DEGREE (4; checked on the host, sh.h's arrays hold 25 basis values); only
//     the first (degree+1)^2 of K coefficient rows are read;
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

  const SplatShBasis basis = splat_sh_basis(degree, x, y, z);  // sh.h
  const int n_bases = (int)((degree + 1) * (degree + 1));

  const device float* row = coeffs + (long)idx * K * 3;
  float r = 0.0f, g = 0.0f, b = 0.0f;
  for (int k = 0; k < n_bases; ++k) {
    r += basis.v[k] * row[3 * k + 0];
    g += basis.v[k] * row[3 * k + 1];
    b += basis.v[k] * row[3 * k + 2];
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

// sh_fused_fwd: sh_fwd of the fused preparation (prepare.py), one thread per (camera, gaussian), flat index
// idx = c*N + n < C*N: the direction is means[n] - inv(viewmats)[c, 0:3, 3] (rasterization.py's glue computed it in
// PyTorch, the same float32 subtraction), the coefficients are read where splatfacto keeps them (band 0
// at sh_dc[n * dc_stride], bands k >= 1 at sh_rest[n * rest_stride + rest_offset + 3 (k - 1)]; one [N, K, 3]
// tensor is dc = rest = it, dc_stride = rest_stride = 3 K, rest_offset = 3), the mask is radii > 0 and
// the colour is activated (clamp_min(c + 0.5, 0)). Same arithmetic as sh_fwd otherwise.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void sh_fused_fwd(
    const device float* means [[buffer(0)]],    // [N, 3]
    const device float* inv_viewmats [[buffer(1)]],  // [C, 4, 4] inv(viewmats): camera c's position at [c, 0:3, 3]
    const device float* sh_dc [[buffer(2)]],
    const device float* sh_rest [[buffer(3)]],
    const device int* radii [[buffer(4)]],      // [C, N]
    device float* colors [[buffer(5)]],         // [C, N, 3]
    constant long& C [[buffer(6)]],
    constant long& N [[buffer(7)]],
    constant long& degree [[buffer(8)]],
    constant long& dc_stride [[buffer(9)]],
    constant long& rest_stride [[buffer(10)]],
    constant long& rest_offset [[buffer(11)]],
    constant long& inv_row_stride [[buffer(12)]],  // inv_viewmats[c, r, k] at c * 16 + r * row + k * col
    constant long& inv_col_stride [[buffer(13)]],  // (torch.linalg.inv_ex returns column-major matrices)
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= C * N) {
    return;
  }
  const long cam = (long)idx / N;
  const long g = (long)idx - cam * N;
  if (radii[idx] <= 0) {
    colors[3 * idx + 0] = 0.5f;  // clamp_min(0 + 0.5, 0)
    colors[3 * idx + 1] = 0.5f;
    colors[3 * idx + 2] = 0.5f;
    return;
  }
  const float dx = means[3 * g + 0] - inv_viewmats[16 * cam + 0 * inv_row_stride + 3 * inv_col_stride];
  const float dy = means[3 * g + 1] - inv_viewmats[16 * cam + 1 * inv_row_stride + 3 * inv_col_stride];
  const float dz = means[3 * g + 2] - inv_viewmats[16 * cam + 2 * inv_row_stride + 3 * inv_col_stride];
  const float norm = max(sqrt(dx * dx + dy * dy + dz * dz), 1e-12f);
  const float x = dx / norm, y = dy / norm, z = dz / norm;
  const SplatShBasis basis = splat_sh_basis(degree, x, y, z);  // sh.h
  const int n_bases = (int)((degree + 1) * (degree + 1));
  const device float* dc = sh_dc + g * dc_stride;
  const device float* rest = sh_rest + g * rest_stride + rest_offset;
  float r = basis.v[0] * dc[0], gr = basis.v[0] * dc[1], b = basis.v[0] * dc[2];
  for (int k = 1; k < n_bases; ++k) {
    r += basis.v[k] * rest[3 * (k - 1) + 0];
    gr += basis.v[k] * rest[3 * (k - 1) + 1];
    b += basis.v[k] * rest[3 * (k - 1) + 2];
  }
  colors[3 * idx + 0] = sh_activate(r + 0.5f);
  colors[3 * idx + 1] = sh_activate(gr + 0.5f);
  colors[3 * idx + 2] = sh_activate(b + 0.5f);
}
