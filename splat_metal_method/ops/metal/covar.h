// covar.h: a gaussian's rotation, covariance and precision from its quaternion and scales -- the one
// source of this math for the Metal kernels and the native CPU backend.
//
//   * Metal: kernels.py assembles every library as defines + common.h + this file + the stage file
//     (torch.mps.compile_shader has no include path); sqrt, max and isfinite are metal::'s.
//   * CPU: ops/cpu/shared.h #includes it inside a namespace that has `using std::sqrt; using std::max;
//     using std::isfinite;`
//     (this file includes nothing and names no std::, which MSL has not).
//
// So it is written in the subset both compile: no pointers or references (MSL would need an address
// space on each), values in and out, plain float arithmetic in the reference's operation order
// (ops/reference.py quat_to_rotmat and quat_scale_to_covar_preci), no contraction into fma on either
// side (Metal: fast math off; CPU: -ffp-contract=off).
#ifndef SPLAT_COVAR_H
#define SPLAT_COVAR_H

struct SplatMat3 {
  float m[9];  // row-major: m[r * 3 + c]
};

// Rotation matrix of the quaternion (w, x, y, z), normalised as F.normalize does: q / max(|q|, 1e-12),
// so a zero quaternion gives the identity.
inline SplatMat3 splat_quat_to_rotmat(float w, float x, float y, float z) {
  const float n = max(sqrt(w * w + x * x + y * y + z * z), 1e-12f);
  w = w / n;
  x = x / n;
  y = y / n;
  z = z / n;
  const SplatMat3 R = {{
      1.0f - 2.0f * (y * y + z * z), 2.0f * (x * y - w * z), 2.0f * (x * z + w * y),
      2.0f * (x * y + w * z), 1.0f - 2.0f * (x * x + z * z), 2.0f * (y * z - w * x),
      2.0f * (x * z - w * y), 2.0f * (y * z + w * x), 1.0f - 2.0f * (x * x + y * y)}};
  return R;
}

// M M^T, computed in full: entries (r, c) and (c, r) are the same products in the same order, so the
// result is exactly symmetric.
inline SplatMat3 splat_outer(SplatMat3 M) {
  SplatMat3 out;
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 3; ++c) {
      out.m[r * 3 + c] = M.m[r * 3 + 0] * M.m[c * 3 + 0] + M.m[r * 3 + 1] * M.m[c * 3 + 1] +
                         M.m[r * 3 + 2] * M.m[c * 3 + 2];
    }
  }
  return out;
}

// Covariance (R S)(R S)^T, S = diag(sx, sy, sz): column k of R times scale k.
inline SplatMat3 splat_covariance(SplatMat3 R, float sx, float sy, float sz) {
  for (int r = 0; r < 3; ++r) {
    R.m[r * 3 + 0] = R.m[r * 3 + 0] * sx;
    R.m[r * 3 + 1] = R.m[r * 3 + 1] * sy;
    R.m[r * 3 + 2] = R.m[r * 3 + 2] * sz;
  }
  return splat_outer(R);
}

// Precision (R S^-1)(R S^-1)^T, the covariance's inverse: column k of R divided by scale k (the
// reference's R / scales; gsplat multiplies by 1 / s, which differs in the last bit).
inline SplatMat3 splat_precision(SplatMat3 R, float sx, float sy, float sz) {
  for (int r = 0; r < 3; ++r) {
    R.m[r * 3 + 0] = R.m[r * 3 + 0] / sx;
    R.m[r * 3 + 1] = R.m[r * 3 + 1] / sy;
    R.m[r * 3 + 2] = R.m[r * 3 + 2] / sz;
  }
  return splat_outer(R);
}

// Whether a gaussian's own parameters can be projected at all (README "Known limits", non-finite
// inputs): every mean, quaternion and scale entry finite, and the quaternion's squared norm too (|q| of
// 1e30 overflows float32; normalising would then silently give the identity rotation). A gaussian that
// fails is culled by every backend (radius 0, zero gradient); the check is explicit, never left to how
// a comparison with NaN happens to come out.
inline bool splat_params_finite(float mx, float my, float mz, float w, float x, float y, float z, float sx,
                                float sy, float sz) {
  return isfinite(mx) && isfinite(my) && isfinite(mz) && isfinite(w) && isfinite(x) && isfinite(y) &&
         isfinite(z) && isfinite(w * w + x * x + y * y + z * z) && isfinite(sx) && isfinite(sy) && isfinite(sz);
}

// Whether the 12 entries of a world -> camera matrix that projection reads are finite; a camera that
// fails culls every gaussian (v points at the row-major [4, 4] matrix's 16 floats).
inline bool splat_viewmat_finite(float v0, float v1, float v2, float v3, float v4, float v5, float v6, float v7,
                                 float v8, float v9, float v10, float v11) {
  return isfinite(v0) && isfinite(v1) && isfinite(v2) && isfinite(v3) && isfinite(v4) && isfinite(v5) &&
         isfinite(v6) && isfinite(v7) && isfinite(v8) && isfinite(v9) && isfinite(v10) && isfinite(v11);
}

// A projected gaussian is kept only if its screen-space values are finite and its radius fits the int32
// radii: radius < 2^31 (exactly representable in float32). Converting anything else to int is undefined
// in C++ and MSL (x86 gives INT_MIN, a GPU may saturate), so this check comes before every (int)radius.
#define SPLAT_RADIUS_LIMIT 2147483648.0f
inline bool splat_projection_finite(float u, float v, float conic_a, float conic_b, float conic_c, float radius) {
  return isfinite(u) && isfinite(v) && isfinite(conic_a) && isfinite(conic_b) && isfinite(conic_c) &&
         isfinite(radius) && radius < SPLAT_RADIUS_LIMIT;
}

// Entry k of the upper triangle [xx, xy, xz, yy, yz, zz] (gsplat's triu order) in the row-major 3x3.
inline int splat_triu_index(int k) {
  return k < 3 ? k : (k < 5 ? k + 1 : 8);
}

#endif  // SPLAT_COVAR_H
