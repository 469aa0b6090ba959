// sh.h: the real spherical-harmonics basis of degree 0..4 (25 functions) and its partial derivatives --
// the one source of this math for the Metal kernels (sh.metal, sh_bwd.metal) and the native CPU backend
// (ops/cpu/sh.cpp). Sloan 2013's evaluation order and constants, as gsplat 1.4 (_torch_impl.py
// _eval_sh_bases_fast, its CUDA kernels) and ops/reference.py::sh_bases write them, expression for
// expression.
//
//   * Metal: kernels.py assembles every library as defines + common.h + covar.h + this file + the stage file
//     (torch.mps.compile_shader has no include path).
//   * CPU: ops/cpu/shared.h #includes it.
//
// So it is written in the subset both compile (as covar.h): no pointers or references (MSL would need an
// address space on each), values in and out, plain float arithmetic, no contraction into fma on either side.
#ifndef SPLAT_SH_H
#define SPLAT_SH_H

#define SPLAT_SH_MAX_DEGREE 4
#define SPLAT_SH_MAX_BASES 25  // (SPLAT_SH_MAX_DEGREE + 1)^2; ops/constants.py SH_MAX_DEGREE is the host's twin

// Basis values at a unit direction; only the first (degree + 1)^2 entries are written.
struct SplatShBasis {
  float v[SPLAT_SH_MAX_BASES];
};

// Basis values and their plain partial derivatives d/dx, d/dy, d/dz as polynomials in (x, y, z) (what
// autograd takes of the reference); only the first (degree + 1)^2 entries are written.
struct SplatShBasisGrad {
  float v[SPLAT_SH_MAX_BASES];
  float dx[SPLAT_SH_MAX_BASES];
  float dy[SPLAT_SH_MAX_BASES];
  float dz[SPLAT_SH_MAX_BASES];
};

// The basis in the reference's order at the unit direction (x, y, z), bands 0..degree (degree <= 4).
inline SplatShBasis splat_sh_basis(long degree, float x, float y, float z) {
  SplatShBasis b;
  b.v[0] = 0.2820947917738781f;
  if (degree >= 1) {
    b.v[1] = -0.48860251190292f * y;
    b.v[2] = 0.48860251190292f * z;
    b.v[3] = -0.48860251190292f * x;
  }
  if (degree >= 2) {
    const float z2 = z * z;
    const float fc1 = x * x - y * y, fs1 = 2.0f * x * y;
    const float tmp_b = -1.092548430592079f * z;
    b.v[4] = 0.5462742152960395f * fs1;
    b.v[5] = tmp_b * y;
    b.v[6] = 0.9461746957575601f * z2 - 0.3153915652525201f;
    b.v[7] = tmp_b * x;
    b.v[8] = 0.5462742152960395f * fc1;
    if (degree >= 3) {
      const float tmp_c = -2.285228997322329f * z2 + 0.4570457994644658f;
      const float tmp_b3 = 1.445305721320277f * z;
      const float fc2 = x * fc1 - y * fs1, fs2 = x * fs1 + y * fc1;
      b.v[9] = -0.5900435899266435f * fs2;
      b.v[10] = tmp_b3 * fs1;
      b.v[11] = tmp_c * y;
      b.v[12] = z * (1.865881662950577f * z2 - 1.119528997770346f);
      b.v[13] = tmp_c * x;
      b.v[14] = tmp_b3 * fc1;
      b.v[15] = -0.5900435899266435f * fc2;
      if (degree >= 4) {
        const float tmp_d4 = z * (-4.683325804901025f * z2 + 2.007139630671868f);
        const float tmp_c4 = 3.31161143515146f * z2 - 0.47308734787878f;
        const float tmp_b4 = -1.770130769779931f * z;
        const float fc3 = x * fc2 - y * fs2, fs3 = x * fs2 + y * fc2;
        b.v[16] = 0.6258357354491763f * fs3;
        b.v[17] = tmp_b4 * fs2;
        b.v[18] = tmp_c4 * fs1;
        b.v[19] = tmp_d4 * y;
        b.v[20] = 1.984313483298443f * z2 * (1.865881662950577f * z2 - 1.119528997770346f) -
                  1.006230589874905f * (0.9461746957575601f * z2 - 0.3153915652525201f);
        b.v[21] = tmp_d4 * x;
        b.v[22] = tmp_c4 * fc1;
        b.v[23] = tmp_b4 * fc2;
        b.v[24] = 0.6258357354491763f * fc3;
      }
    }
  }
  return b;
}

// splat_sh_basis's values (same expressions) and their partials. With fc_m + i fs_m = (x + i y)^(m+1):
// d fc_m/dx = (m+1) fc_{m-1}, d fc_m/dy = -(m+1) fs_{m-1}, d fs_m/dx = (m+1) fs_{m-1}, d fs_m/dy = (m+1) fc_{m-1}
// (fc_0 = x, fs_0 = y), the partials of the polynomials autograd differentiates.
inline SplatShBasisGrad splat_sh_basis_grad(long degree, float x, float y, float z) {
  SplatShBasisGrad b;
  b.v[0] = 0.2820947917738781f;
  b.dx[0] = 0.0f;
  b.dy[0] = 0.0f;
  b.dz[0] = 0.0f;
  if (degree >= 1) {
    const float c1 = 0.48860251190292f;
    b.v[1] = -c1 * y;
    b.v[2] = c1 * z;
    b.v[3] = -c1 * x;
    b.dx[1] = 0.0f;  b.dy[1] = -c1;   b.dz[1] = 0.0f;
    b.dx[2] = 0.0f;  b.dy[2] = 0.0f;  b.dz[2] = c1;
    b.dx[3] = -c1;   b.dy[3] = 0.0f;  b.dz[3] = 0.0f;
  }
  if (degree >= 2) {
    const float z2 = z * z;
    const float fc1 = x * x - y * y, fs1 = 2.0f * x * y;
    const float c4 = 0.5462742152960395f, c5 = -1.092548430592079f, c6 = 0.9461746957575601f;
    const float tmp_b = c5 * z;
    b.v[4] = c4 * fs1;
    b.v[5] = tmp_b * y;
    b.v[6] = c6 * z2 - 0.3153915652525201f;
    b.v[7] = tmp_b * x;
    b.v[8] = c4 * fc1;
    b.dx[4] = c4 * 2.0f * y;  b.dy[4] = c4 * 2.0f * x;   b.dz[4] = 0.0f;
    b.dx[5] = 0.0f;           b.dy[5] = tmp_b;           b.dz[5] = c5 * y;
    b.dx[6] = 0.0f;           b.dy[6] = 0.0f;            b.dz[6] = 2.0f * c6 * z;
    b.dx[7] = tmp_b;          b.dy[7] = 0.0f;            b.dz[7] = c5 * x;
    b.dx[8] = c4 * 2.0f * x;  b.dy[8] = -c4 * 2.0f * y;  b.dz[8] = 0.0f;
    if (degree >= 3) {
      const float c9 = -0.5900435899266435f, c10 = 1.445305721320277f;
      const float c11a = -2.285228997322329f, c11b = 0.4570457994644658f;
      const float c12a = 1.865881662950577f, c12b = -1.119528997770346f;
      const float tmp_c = c11a * z2 + c11b;
      const float tmp_b3 = c10 * z;
      const float fc2 = x * fc1 - y * fs1, fs2 = x * fs1 + y * fc1;
      b.v[9] = c9 * fs2;
      b.v[10] = tmp_b3 * fs1;
      b.v[11] = tmp_c * y;
      b.v[12] = z * (c12a * z2 + c12b);
      b.v[13] = tmp_c * x;
      b.v[14] = tmp_b3 * fc1;
      b.v[15] = c9 * fc2;
      // fs2 = 3 x^2 y - y^3, fc2 = x^3 - 3 x y^2
      b.dx[9] = c9 * 6.0f * x * y;             b.dy[9] = c9 * 3.0f * (x * x - y * y);  b.dz[9] = 0.0f;
      b.dx[10] = tmp_b3 * 2.0f * y;            b.dy[10] = tmp_b3 * 2.0f * x;           b.dz[10] = c10 * fs1;
      b.dx[11] = 0.0f;                         b.dy[11] = tmp_c;                       b.dz[11] = 2.0f * c11a * z * y;
      b.dx[12] = 0.0f;                         b.dy[12] = 0.0f;                        b.dz[12] = 3.0f * c12a * z2 + c12b;
      b.dx[13] = tmp_c;                        b.dy[13] = 0.0f;                        b.dz[13] = 2.0f * c11a * z * x;
      b.dx[14] = tmp_b3 * 2.0f * x;            b.dy[14] = -tmp_b3 * 2.0f * y;          b.dz[14] = c10 * fc1;
      b.dx[15] = c9 * 3.0f * (x * x - y * y);  b.dy[15] = -c9 * 6.0f * x * y;          b.dz[15] = 0.0f;
      if (degree >= 4) {
        const float c16 = 0.6258357354491763f, c17 = -1.770130769779931f;
        const float c18a = 3.31161143515146f, c18b = -0.47308734787878f;
        const float c19a = -4.683325804901025f, c19b = 2.007139630671868f;
        const float c20 = 1.984313483298443f, c20b = -1.006230589874905f;
        const float tmp_d4 = z * (c19a * z2 + c19b);
        const float tmp_c4 = c18a * z2 + c18b;
        const float tmp_b4 = c17 * z;
        const float fc3 = x * fc2 - y * fs2, fs3 = x * fs2 + y * fc2;
        b.v[16] = c16 * fs3;
        b.v[17] = tmp_b4 * fs2;
        b.v[18] = tmp_c4 * fs1;
        b.v[19] = tmp_d4 * y;
        b.v[20] = c20 * z2 * (c12a * z2 + c12b) + c20b * (c6 * z2 - 0.3153915652525201f);
        b.v[21] = tmp_d4 * x;
        b.v[22] = tmp_c4 * fc1;
        b.v[23] = tmp_b4 * fc2;
        b.v[24] = c16 * fc3;
        const float d_tmp_d4 = 3.0f * c19a * z2 + c19b;  // d tmp_d4 / dz
        const float d_tmp_c4 = 2.0f * c18a * z;           // d tmp_c4 / dz
        b.dx[16] = c16 * 4.0f * fs2;      b.dy[16] = c16 * 4.0f * fc2;       b.dz[16] = 0.0f;
        b.dx[17] = tmp_b4 * 3.0f * fs1;   b.dy[17] = tmp_b4 * 3.0f * fc1;    b.dz[17] = c17 * fs2;
        b.dx[18] = tmp_c4 * 2.0f * y;     b.dy[18] = tmp_c4 * 2.0f * x;      b.dz[18] = d_tmp_c4 * fs1;
        b.dx[19] = 0.0f;                  b.dy[19] = tmp_d4;                 b.dz[19] = d_tmp_d4 * y;
        b.dx[20] = 0.0f;                  b.dy[20] = 0.0f;
        b.dz[20] = c20 * z * (4.0f * c12a * z2 + 2.0f * c12b) + c20b * 2.0f * c6 * z;
        b.dx[21] = tmp_d4;                b.dy[21] = 0.0f;                   b.dz[21] = d_tmp_d4 * x;
        b.dx[22] = tmp_c4 * 2.0f * x;     b.dy[22] = -tmp_c4 * 2.0f * y;     b.dz[22] = d_tmp_c4 * fc1;
        b.dx[23] = tmp_b4 * 3.0f * fc1;   b.dy[23] = -tmp_b4 * 3.0f * fs1;   b.dz[23] = c17 * fc2;
        b.dx[24] = c16 * 4.0f * fc2;      b.dy[24] = -c16 * 4.0f * fs2;      b.dz[24] = 0.0f;
      }
    }
  }
  return b;
}

#ifdef __METAL_VERSION__
// torch.clamp_min(x, 0): x where x > 0 or x is NaN, else 0 (the sign of a zero is that of 0).
inline float sh_activate(float x) {
  return (x > 0.0f || isnan(x)) ? x : 0.0f;
}

// Metal only (device pointers; the CPU backend does not see it): the colour of the fused preparation, before
// its activation, of a gaussian whose band-0 coefficients are at dc[0:3] and bands k >= 1 at rest[3 (k - 1)],
// seen along the unnormalised direction (dx, dy, dz) (normalised as F.normalize: d / max(|d|, 1e-12)), from
// the first (degree + 1)^2 bands, each coefficient read once. sh.metal's sh_fused_fwd and project.metal's
// project_fwd (PROJECT_SHADE) both call it: one source of the fused colour.
inline void splat_sh_color(long degree, float dx, float dy, float dz, const device float* dc, const device float* rest,
                           thread float* rgb) {
  const float norm = max(sqrt(dx * dx + dy * dy + dz * dz), 1e-12f);
  const SplatShBasis basis = splat_sh_basis(degree, dx / norm, dy / norm, dz / norm);
  const int n_bases = (int)((degree + 1) * (degree + 1));
  float r = basis.v[0] * dc[0], g = basis.v[0] * dc[1], b = basis.v[0] * dc[2];
  for (int k = 1; k < n_bases; ++k) {
    r += basis.v[k] * rest[3 * (k - 1) + 0];
    g += basis.v[k] * rest[3 * (k - 1) + 1];
    b += basis.v[k] * rest[3 * (k - 1) + 2];
  }
  rgb[0] = r;
  rgb[1] = g;
  rgb[2] = b;
}

// The backward of splat_sh_color and the activation clamp_min(c + 0.5, 0), given d loss / d (activated colour)
// v_rgb[0:3]: writes d loss / d coefficient of every one of the K rows (v_dc[0:3], v_rest[3 (k - 1)]; 0 beyond
// the bands in use) and returns d loss / d (dx, dy, dz), the unnormalised direction, in v_dir. The colour is
// recomputed (bit for bit the forward's): clamp_min passes the gradient where the activated colour is > 0.
// v_dir = normalise_vjp(sum_k (d basis_k / d n) (coeff_k . v)), normalise_vjp(g) = (g - n (n . g)) / |d| for
// |d| > 1e-12, g / 1e-12 below (F.normalize's clamp). sh_bwd.metal's sh_fused_bwd and project_bwd.metal's
// project_bwd (PROJECT_SHADE) both call it.
// The coefficient gradients are an outer product: d loss / d coefficient (k, channel c) = basis_k v_c
// (0 for k >= n_bases). splat_sh_color_bwd_terms computes its factors and the direction's gradient;
// splat_sh_coef_grad reads one coefficient's gradient from them (project_bwd.metal's SH Adam step,
// PROJECT_SH_ADAM, takes them from registers; splat_sh_color_bwd writes them all).
struct SplatShColorGrad {
  SplatShBasisGrad basis;
  float v[3];     // d loss / d colour where the clamp passes it
  long n_bases;   // (degree + 1)^2; 0: every gradient 0 (a culled entry)
};

inline float splat_sh_coef_grad(thread const SplatShColorGrad* t, long k, long c) {
  return k < t->n_bases ? t->basis.v[k] * t->v[c] : 0.0f;
}

inline SplatShColorGrad splat_sh_color_bwd_terms(long degree, long K, float dx, float dy, float dz,
                                                 const device float* dc, const device float* rest,
                                                 const device float* v_rgb, thread float* v_dir) {
  const float len = sqrt(dx * dx + dy * dy + dz * dz);
  const float norm = max(len, 1e-12f);
  const float x = dx / norm, y = dy / norm, z = dz / norm;
  float rgb[3];
  splat_sh_color(degree, dx, dy, dz, dc, rest, rgb);
  SplatShColorGrad t;
  t.v[0] = sh_activate(rgb[0] + 0.5f) > 0.0f ? v_rgb[0] : 0.0f;
  t.v[1] = sh_activate(rgb[1] + 0.5f) > 0.0f ? v_rgb[1] : 0.0f;
  t.v[2] = sh_activate(rgb[2] + 0.5f) > 0.0f ? v_rgb[2] : 0.0f;
  t.basis = splat_sh_basis_grad(degree, x, y, z);
  t.n_bases = (degree + 1) * (degree + 1);
  float gx = 0.0f, gy = 0.0f, gz = 0.0f;  // d loss / d (x, y, z) of the normalised direction
  for (long k = 1; k < K && k < t.n_bases; ++k) {
    const device float* row = rest + 3 * (k - 1);
    const float w = row[0] * t.v[0] + row[1] * t.v[1] + row[2] * t.v[2];
    gx += t.basis.dx[k] * w;
    gy += t.basis.dy[k] * w;
    gz += t.basis.dz[k] * w;
  }
  const float proj = len > 1e-12f ? x * gx + y * gy + z * gz : 0.0f;
  v_dir[0] = (gx - x * proj) / norm;
  v_dir[1] = (gy - y * proj) / norm;
  v_dir[2] = (gz - z * proj) / norm;
  return t;
}

inline void splat_sh_color_bwd(long degree, long K, float dx, float dy, float dz, const device float* dc,
                               const device float* rest, const device float* v_rgb, device float* v_dc,
                               device float* v_rest, thread float* v_dir) {
  const SplatShColorGrad t = splat_sh_color_bwd_terms(degree, K, dx, dy, dz, dc, rest, v_rgb, v_dir);
  for (long c = 0; c < 3; ++c) {
    v_dc[c] = splat_sh_coef_grad(&t, 0, c);
  }
  for (long k = 1; k < K; ++k) {
    for (long c = 0; c < 3; ++c) {
      v_rest[3 * (k - 1) + c] = splat_sh_coef_grad(&t, k, c);
    }
  }
}

// The coefficient gradients of a culled entry: 0 in every one of the K rows.
inline void splat_sh_color_bwd_zero(long K, device float* v_dc, device float* v_rest) {
  for (int k = 0; k < 3; ++k) {
    v_dc[k] = 0.0f;
  }
  for (long k = 0; k < 3 * (K - 1); ++k) {
    v_rest[k] = 0.0f;
  }
}
#endif

#endif  // SPLAT_SH_H
