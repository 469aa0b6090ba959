// Native spherical harmonics (degree 0..4), forward and backward, one (camera, gaussian) row per
// iteration on n_threads threads. The arithmetic is sh.metal's and sh_bwd.metal's statement for
// statement, and the basis and its partials are the same source, ../metal/sh.h (through shared.h; the
// reference's basis, ops/reference.py::sh_bases).
//
// Layouts (contiguous float32): dirs [total, 3] unnormalised view directions, coeffs [total, K, 3],
// masks [total] uint8 or null (null: every row is visible), colors [total, 3] (no +0.5 offset).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "shared.h"

extern "C" {

int splat_sh_fwd(int64_t total, int64_t K, int64_t degree, const float* dirs, const float* coeffs,
                 const uint8_t* masks, float* colors, int n_threads) {
    splat::parallel_for(total, n_threads, [&](int64_t idx) {
      if (masks != nullptr && masks[idx] == 0) {
        colors[3 * idx + 0] = 0.0f;
        colors[3 * idx + 1] = 0.0f;
        colors[3 * idx + 2] = 0.0f;
        return;
      }
      const float dx = dirs[3 * idx + 0], dy = dirs[3 * idx + 1], dz = dirs[3 * idx + 2];
      const float norm = std::max(std::sqrt(dx * dx + dy * dy + dz * dz), 1e-12f);
      const float x = dx / norm, y = dy / norm, z = dz / norm;

      const splat_sh::SplatShBasis basis = splat_sh::splat_sh_basis(degree, x, y, z);  // ../metal/sh.h
      const int n_bases = (int)((degree + 1) * (degree + 1));

      const float* row = coeffs + (long)idx * K * 3;
      float r = 0.0f, g = 0.0f, b = 0.0f;
      for (int k = 0; k < n_bases; ++k) {
        r += basis.v[k] * row[3 * k + 0];
        g += basis.v[k] * row[3 * k + 1];
        b += basis.v[k] * row[3 * k + 2];
      }
      colors[3 * idx + 0] = r;
      colors[3 * idx + 1] = g;
      colors[3 * idx + 2] = b;
    });
    return 0;
}

// v_coeffs [total, K, 3] (rows past (degree+1)^2 are zero) and, unless v_dirs is null, v_dirs [total, 3].
int splat_sh_bwd(int64_t total, int64_t K, int64_t degree, const float* dirs, const float* coeffs,
                 const uint8_t* masks, const float* v_colors, float* v_coeffs, float* v_dirs, int n_threads) {
    splat::parallel_for(total, n_threads, [&](int64_t idx) {
      float* vrow = v_coeffs + (long)idx * K * 3;
      const bool masked = masks != nullptr && masks[idx] == 0;
      const long n_bases = (degree + 1) * (degree + 1);
      if (masked) {
        for (long k = 0; k < K * 3; ++k) {
          vrow[k] = 0.0f;
        }
        if (v_dirs != nullptr) {
          v_dirs[3 * idx + 0] = 0.0f;
          v_dirs[3 * idx + 1] = 0.0f;
          v_dirs[3 * idx + 2] = 0.0f;
        }
        return;
      }
      const float dx = dirs[3 * idx + 0], dy = dirs[3 * idx + 1], dz = dirs[3 * idx + 2];
      const float len = std::sqrt(dx * dx + dy * dy + dz * dz);
      const float norm = std::max(len, 1e-12f);
      const float x = dx / norm, y = dy / norm, z = dz / norm;
      const float vr = v_colors[3 * idx + 0], vg = v_colors[3 * idx + 1], vb = v_colors[3 * idx + 2];

      // Basis values (same expressions as the forward) and their partials d/dx, d/dy, d/dz (../metal/sh.h).
      const splat_sh::SplatShBasisGrad basis = splat_sh::splat_sh_basis_grad(degree, x, y, z);

      const float* row = coeffs + (long)idx * K * 3;
      float gx = 0.0f, gy = 0.0f, gz = 0.0f;  // d loss / d (x, y, z) of the normalised direction
      for (long k = 0; k < K; ++k) {
        if (k < n_bases) {
          vrow[3 * k + 0] = basis.v[k] * vr;
          vrow[3 * k + 1] = basis.v[k] * vg;
          vrow[3 * k + 2] = basis.v[k] * vb;
          if (v_dirs != nullptr && k > 0) {
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
      if (v_dirs != nullptr) {
        const float proj = len > 1e-12f ? x * gx + y * gy + z * gz : 0.0f;
        v_dirs[3 * idx + 0] = (gx - x * proj) / norm;
        v_dirs[3 * idx + 1] = (gy - y * proj) / norm;
        v_dirs[3 * idx + 2] = (gz - z * proj) / norm;
      }
    });
    return 0;
}

}  // extern "C"
