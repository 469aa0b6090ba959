// covar.h: a gaussian's rotation, covariance and precision from its quaternion and scales -- the one
// source of this math for the Metal kernels and the native CPU backend.
//
//   * Metal: kernels.py assembles every library as defines + common.h + this file + the stage file
//     (torch.mps.compile_shader has no include path); sqrt and max are metal::'s.
//   * CPU: ops/cpu/shared.h #includes it inside a namespace that has `using std::sqrt; using std::max;`
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

// Entry k of the upper triangle [xx, xy, xz, yy, yz, zz] (gsplat's triu order) in the row-major 3x3.
inline int splat_triu_index(int k) {
  return k < 3 ? k : (k < 5 ? k + 1 : 8);
}

#endif  // SPLAT_COVAR_H
