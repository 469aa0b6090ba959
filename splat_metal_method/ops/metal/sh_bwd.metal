// sh_bwd.metal: gradients of sh.metal's view-dependent colour with respect to the SH coefficients
// and, through the normalised view direction, to the unnormalised directions (gsplat 1.4's
// compute_sh_bwd, written as the exact derivative of ops/reference.py::spherical_harmonics).
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

// Basis values (same expressions as sh_fwd) and their partials d/dx, d/dy, d/dz at the normalised
// direction (x, y, z), for bands up to `degree`.
inline void sh_basis_grad(long degree, float x, float y, float z, thread float* basis, thread float* bx,
                          thread float* by, thread float* bz) {
  basis[0] = 0.2820947917738781f;
  bx[0] = 0.0f;
  by[0] = 0.0f;
  bz[0] = 0.0f;
  if (degree >= 1) {
    const float c1 = 0.48860251190292f;
    basis[1] = -c1 * y;
    basis[2] = c1 * z;
    basis[3] = -c1 * x;
    bx[1] = 0.0f;  by[1] = -c1;   bz[1] = 0.0f;
    bx[2] = 0.0f;  by[2] = 0.0f;  bz[2] = c1;
    bx[3] = -c1;   by[3] = 0.0f;  bz[3] = 0.0f;
  }
  if (degree >= 2) {
    const float z2 = z * z;
    const float fc1 = x * x - y * y, fs1 = 2.0f * x * y;
    const float c4 = 0.5462742152960395f, c5 = -1.092548430592079f, c6 = 0.9461746957575601f;
    const float tmp_b = c5 * z;
    basis[4] = c4 * fs1;
    basis[5] = tmp_b * y;
    basis[6] = c6 * z2 - 0.3153915652525201f;
    basis[7] = tmp_b * x;
    basis[8] = c4 * fc1;
    bx[4] = c4 * 2.0f * y;  by[4] = c4 * 2.0f * x;   bz[4] = 0.0f;
    bx[5] = 0.0f;           by[5] = tmp_b;           bz[5] = c5 * y;
    bx[6] = 0.0f;           by[6] = 0.0f;            bz[6] = 2.0f * c6 * z;
    bx[7] = tmp_b;          by[7] = 0.0f;            bz[7] = c5 * x;
    bx[8] = c4 * 2.0f * x;  by[8] = -c4 * 2.0f * y;  bz[8] = 0.0f;
    if (degree >= 3) {
      const float c9 = -0.5900435899266435f, c10 = 1.445305721320277f;
      const float c11a = -2.285228997322329f, c11b = 0.4570457994644658f;
      const float c12a = 1.865881662950577f, c12b = -1.119528997770346f;
      const float tmp_c = c11a * z2 + c11b;
      const float tmp_b3 = c10 * z;
      const float fc2 = x * fc1 - y * fs1, fs2 = x * fs1 + y * fc1;
      basis[9] = c9 * fs2;
      basis[10] = tmp_b3 * fs1;
      basis[11] = tmp_c * y;
      basis[12] = z * (c12a * z2 + c12b);
      basis[13] = tmp_c * x;
      basis[14] = tmp_b3 * fc1;
      basis[15] = c9 * fc2;
      // fs2 = 3 x^2 y - y^3, fc2 = x^3 - 3 x y^2 (as polynomials; autograd differentiates the same)
      bx[9] = c9 * 6.0f * x * y;                 by[9] = c9 * 3.0f * (x * x - y * y);  bz[9] = 0.0f;
      bx[10] = tmp_b3 * 2.0f * y;                by[10] = tmp_b3 * 2.0f * x;           bz[10] = c10 * fs1;
      bx[11] = 0.0f;                             by[11] = tmp_c;                       bz[11] = 2.0f * c11a * z * y;
      bx[12] = 0.0f;                             by[12] = 0.0f;                        bz[12] = 3.0f * c12a * z2 + c12b;
      bx[13] = tmp_c;                            by[13] = 0.0f;                        bz[13] = 2.0f * c11a * z * x;
      bx[14] = tmp_b3 * 2.0f * x;                by[14] = -tmp_b3 * 2.0f * y;          bz[14] = c10 * fc1;
      bx[15] = c9 * 3.0f * (x * x - y * y);      by[15] = -c9 * 6.0f * x * y;          bz[15] = 0.0f;
    }
  }
}

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

  // Basis values (same expressions as sh_fwd) and their partials d/dx, d/dy, d/dz.
  float basis[16];
  float bx[16];
  float by[16];
  float bz[16];
  sh_basis_grad(degree, x, y, z, basis, bx, by, bz);

  const device float* row = coeffs + (long)idx * K * 3;
  float gx = 0.0f, gy = 0.0f, gz = 0.0f;  // d loss / d (x, y, z) of the normalised direction
  for (long k = 0; k < K; ++k) {
    if (k < n_bases) {
      vrow[3 * k + 0] = basis[k] * vr;
      vrow[3 * k + 1] = basis[k] * vg;
      vrow[3 * k + 2] = basis[k] * vb;
      if (calc_dirs != 0 && k > 0) {
        const float w = row[3 * k + 0] * vr + row[3 * k + 1] * vg + row[3 * k + 2] * vb;
        gx += bx[k] * w;
        gy += by[k] * w;
        gz += bz[k] * w;
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

// sh_fused_bwd: sh_bwd of the fused preparation (sh.metal sh_fused_fwd), one thread per (camera, gaussian),
// idx = c*N + n < C*N: the direction is means[n] - inv(viewmats)[c, 0:3, 3], the mask radii > 0, the colour activated
// (`colors` is the forward's output), the coefficient gradients are written in the layout the
// coefficients were read (v_sh_dc[idx * dc_stride], v_sh_rest[idx * rest_stride + rest_offset + 3 (k - 1)],
// every one of the K rows: 0 beyond (degree+1)^2 and where masked), and v_dirs [C, N, 3] is the gradient
// of the direction, which is that of means[n] (projection's backward adds it). Same arithmetic as sh_bwd.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void sh_fused_bwd(
    const device float* means [[buffer(0)]],     // [N, 3]
    const device float* inv_viewmats [[buffer(1)]],  // [C, 4, 4] inv(viewmats): camera c's position at [c, 0:3, 3]
    const device float* sh_dc [[buffer(2)]],
    const device float* sh_rest [[buffer(3)]],
    const device int* radii [[buffer(4)]],       // [C, N]
    const device float* v_colors [[buffer(5)]],  // [C, N, 3]
    const device float* colors [[buffer(6)]],    // [C, N, 3] forward output (activated)
    device float* v_sh_dc [[buffer(7)]],
    device float* v_sh_rest [[buffer(8)]],
    device float* v_dirs [[buffer(9)]],          // [C, N, 3]
    constant long& C [[buffer(10)]],
    constant long& N [[buffer(11)]],
    constant long& K [[buffer(12)]],
    constant long& degree [[buffer(13)]],
    constant long& dc_stride [[buffer(14)]],
    constant long& rest_stride [[buffer(15)]],
    constant long& rest_offset [[buffer(16)]],
    constant long& inv_row_stride [[buffer(17)]],  // inv_viewmats[c, r, k] at c * 16 + r * row + k * col
    constant long& inv_col_stride [[buffer(18)]],
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= C * N) {
    return;
  }
  const long cam = (long)idx / N;
  const long g = (long)idx - cam * N;
  device float* vdc = v_sh_dc + (long)idx * dc_stride;
  device float* vrest = v_sh_rest + (long)idx * rest_stride + rest_offset;
  const long n_bases = (degree + 1) * (degree + 1);
  if (radii[idx] <= 0) {
    for (int k = 0; k < 3; ++k) {
      vdc[k] = 0.0f;
      v_dirs[3 * idx + k] = 0.0f;
    }
    for (long k = 0; k < 3 * (K - 1); ++k) {
      vrest[k] = 0.0f;
    }
    return;
  }
  const float dx = means[3 * g + 0] - inv_viewmats[16 * cam + 0 * inv_row_stride + 3 * inv_col_stride];
  const float dy = means[3 * g + 1] - inv_viewmats[16 * cam + 1 * inv_row_stride + 3 * inv_col_stride];
  const float dz = means[3 * g + 2] - inv_viewmats[16 * cam + 2 * inv_row_stride + 3 * inv_col_stride];
  const float len = sqrt(dx * dx + dy * dy + dz * dz);
  const float norm = max(len, 1e-12f);
  const float x = dx / norm, y = dy / norm, z = dz / norm;
  const float vr = colors[3 * idx + 0] > 0.0f ? v_colors[3 * idx + 0] : 0.0f;
  const float vg = colors[3 * idx + 1] > 0.0f ? v_colors[3 * idx + 1] : 0.0f;
  const float vb = colors[3 * idx + 2] > 0.0f ? v_colors[3 * idx + 2] : 0.0f;
  float basis[16];
  float bx[16];
  float by[16];
  float bz[16];
  sh_basis_grad(degree, x, y, z, basis, bx, by, bz);

  const device float* rest = sh_rest + g * rest_stride + rest_offset;
  vdc[0] = basis[0] * vr;
  vdc[1] = basis[0] * vg;
  vdc[2] = basis[0] * vb;
  float gx = 0.0f, gy = 0.0f, gz = 0.0f;  // d loss / d (x, y, z) of the normalised direction
  for (long k = 1; k < K; ++k) {
    device float* vrow = vrest + 3 * (k - 1);
    if (k < n_bases) {
      vrow[0] = basis[k] * vr;
      vrow[1] = basis[k] * vg;
      vrow[2] = basis[k] * vb;
      const device float* row = rest + 3 * (k - 1);
      const float w = row[0] * vr + row[1] * vg + row[2] * vb;
      gx += bx[k] * w;
      gy += by[k] * w;
      gz += bz[k] * w;
    } else {
      vrow[0] = 0.0f;
      vrow[1] = 0.0f;
      vrow[2] = 0.0f;
    }
  }
  const float proj = len > 1e-12f ? x * gx + y * gy + z * gz : 0.0f;
  v_dirs[3 * idx + 0] = (gx - x * proj) / norm;
  v_dirs[3 * idx + 1] = (gy - y * proj) / norm;
  v_dirs[3 * idx + 2] = (gz - z * proj) / norm;
}
