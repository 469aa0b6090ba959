// sh_bwd.metal: gradients of sh.metal's view-dependent colour (degree 0..4) with respect to the SH
// coefficients and, through the normalised view direction, to the unnormalised directions (gsplat 1.4's
// compute_sh_bwd, written as the exact derivative of ops/reference.py::spherical_harmonics; the basis and
// its partials are sh.h's, shared with the native CPU backend).
// Compiled after common.h, covar.h and sh.h: kernels.py prepends them (compile_shader has no include path).

// sh_bwd: one thread per (camera, gaussian), flat index idx = c*N + n < C*N.
// Why it is shaped so: like sh_fwd, each output row depends on one direction and one coefficient row,
// so threads are independent (no barriers, no atomics; the host sums over cameras where the public op
// broadcast the coefficients); a thread may return early once its rows are written.
// Invariants:
//   * v_coeffs[idx, k, :] = basis_k(dir) v_color for k < (degree+1)^2 and 0 for the other K rows, and
//     every row is written (the output may be torch.empty);
//   * masked-out entries get zero gradients (the forward wrote a constant);
//   * activate != 0: the forward applied clamp_min(c + 0.5, 0) and `colors` holds its output y;
//     clamp_min's gradient passes where c + 0.5 > 0, i.e. y > 0 (0 for NaN), else v_color is 0;
//   * v_dirs (only if calc_dirs != 0) = normalise_vjp(sum_k (d basis_k / d n) (coeff_k . v_color)),
//     with d/dn the plain partial derivatives of the basis polynomials in (x, y, z), as autograd
//     takes them, and normalise_vjp(g) = (g - n (n . g)) / |d| for |d| > 1e-12, g / 1e-12 below
//     (F.normalize's clamp).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void sh_bwd(
    const device float* dirs [[buffer(0)]],       // [C*N, 3] unnormalised
    const device float* coeffs [[buffer(1)]],     // [C*N, K, 3]
    const device uchar* masks [[buffer(2)]],      // [C*N] 0/1, or [1] placeholder
    const device float* v_colors [[buffer(3)]],   // [C*N, 3]
    device float* v_coeffs [[buffer(4)]],         // [C*N, K, 3]
    device float* v_dirs [[buffer(5)]],           // [C*N, 3] or [1] placeholder
    constant long& total [[buffer(6)]],           // C*N
    constant long& K [[buffer(7)]],
    constant long& degree [[buffer(8)]],
    constant long& has_masks [[buffer(9)]],
    constant long& calc_dirs [[buffer(10)]],
    const device float* colors [[buffer(11)]],    // [C*N, 3] forward output (activate != 0), or [1]
    constant long& activate [[buffer(12)]],
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= total) {
    return;
  }
  device float* vrow = v_coeffs + (long)idx * K * 3;
  const bool masked = has_masks != 0 && masks[idx] == 0;
  const long n_bases = (degree + 1) * (degree + 1);
  if (masked) {
    for (long k = 0; k < K * 3; ++k) {
      vrow[k] = 0.0f;
    }
    if (calc_dirs != 0) {
      v_dirs[3 * idx + 0] = 0.0f;
      v_dirs[3 * idx + 1] = 0.0f;
      v_dirs[3 * idx + 2] = 0.0f;
    }
    return;
  }
  const float dx = dirs[3 * idx + 0], dy = dirs[3 * idx + 1], dz = dirs[3 * idx + 2];
  const float len = sqrt(dx * dx + dy * dy + dz * dz);
  const float norm = max(len, 1e-12f);
  const float x = dx / norm, y = dy / norm, z = dz / norm;
  float vr = v_colors[3 * idx + 0], vg = v_colors[3 * idx + 1], vb = v_colors[3 * idx + 2];
  if (activate != 0) {
    vr = colors[3 * idx + 0] > 0.0f ? vr : 0.0f;
    vg = colors[3 * idx + 1] > 0.0f ? vg : 0.0f;
    vb = colors[3 * idx + 2] > 0.0f ? vb : 0.0f;
  }

  // Basis values (same expressions as sh_fwd) and their partials d/dx, d/dy, d/dz (sh.h).
  const SplatShBasisGrad basis = splat_sh_basis_grad(degree, x, y, z);

  const device float* row = coeffs + (long)idx * K * 3;
  float gx = 0.0f, gy = 0.0f, gz = 0.0f;  // d loss / d (x, y, z) of the normalised direction
  for (long k = 0; k < K; ++k) {
    if (k < n_bases) {
      vrow[3 * k + 0] = basis.v[k] * vr;
      vrow[3 * k + 1] = basis.v[k] * vg;
      vrow[3 * k + 2] = basis.v[k] * vb;
      if (calc_dirs != 0 && k > 0) {
        const float w = row[3 * k + 0] * vr + row[3 * k + 1] * vg + row[3 * k + 2] * vb;
        gx += basis.dx[k] * w;
        gy += basis.dy[k] * w;
        gz += basis.dz[k] * w;
      }
    } else {
      vrow[3 * k + 0] = 0.0f;
      vrow[3 * k + 1] = 0.0f;
      vrow[3 * k + 2] = 0.0f;
    }
  }
  if (calc_dirs != 0) {
    const float proj = len > 1e-12f ? x * gx + y * gy + z * gz : 0.0f;
    v_dirs[3 * idx + 0] = (gx - x * proj) / norm;
    v_dirs[3 * idx + 1] = (gy - y * proj) / norm;
    v_dirs[3 * idx + 2] = (gz - z * proj) / norm;
  }
}

// sh_fused_bwd: the SH half of the fused preparation's unfused twin backward (prepare.py: this, then project_bwd
// with PROJECT_MEANS_SH), kept as the reference project_bwd's PROJECT_SHADE is tested against. One thread per
// (camera, gaussian), idx = c*N + n < C*N: the direction is means[n] minus camera c's position (common.h
// splat_camera_position), the mask radii > 0 (0 also where the forward's colour culled), the colour recomputed
// (no [C, N, 3] colours kept for the backward) and its gradient taken by sh.h's splat_sh_color_bwd, as in
// project_bwd; the coefficient gradients are written in the layout the coefficients were read
// (v_sh_dc[idx * dc_stride], v_sh_rest[idx * rest_stride + rest_offset + 3 (k - 1)], every one of the K rows: 0
// beyond (degree+1)^2 and where masked), and v_dirs [C, N, 3] is the gradient of the direction, which is that
// of means[n] (projection's backward adds it).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void sh_fused_bwd(
    const device float* means [[buffer(0)]],     // [N, 3]
    const device float* viewmats [[buffer(1)]],  // [C, 4, 4]
    const device float* sh_dc [[buffer(2)]],
    const device float* sh_rest [[buffer(3)]],
    const device int* radii [[buffer(4)]],       // [C, N]
    const device float* v_colors [[buffer(5)]],  // [C, N, 3]
    device float* v_sh_dc [[buffer(6)]],
    device float* v_sh_rest [[buffer(7)]],
    device float* v_dirs [[buffer(8)]],          // [C, N, 3]
    constant long& C [[buffer(9)]],
    constant long& N [[buffer(10)]],
    constant long& K [[buffer(11)]],
    constant long& degree [[buffer(12)]],
    constant long& dc_stride [[buffer(13)]],
    constant long& rest_stride [[buffer(14)]],
    constant long& rest_offset [[buffer(15)]],
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= C * N) {
    return;
  }
  const long cam = (long)idx / N;
  const long g = (long)idx - cam * N;
  device float* vdc = v_sh_dc + (long)idx * dc_stride;
  device float* vrest = v_sh_rest + (long)idx * rest_stride + rest_offset;
  if (radii[idx] <= 0) {
    splat_sh_color_bwd_zero(K, vdc, vrest);
    v_dirs[3 * idx + 0] = 0.0f;
    v_dirs[3 * idx + 1] = 0.0f;
    v_dirs[3 * idx + 2] = 0.0f;
    return;
  }
  float campos[3];
  splat_camera_position(viewmats + cam * 16, campos);
  float v_dir[3];
  splat_sh_color_bwd(degree, K, means[3 * g + 0] - campos[0], means[3 * g + 1] - campos[1], means[3 * g + 2] - campos[2],
                     sh_dc + g * dc_stride, sh_rest + g * rest_stride + rest_offset, v_colors + 3 * idx, vdc, vrest,
                     v_dir);  // sh.h
  v_dirs[3 * idx + 0] = v_dir[0];
  v_dirs[3 * idx + 1] = v_dir[1];
  v_dirs[3 * idx + 2] = v_dir[2];
}
