// Native EWA projection, forward and backward, one (camera, gaussian) pair per iteration on
// n_threads threads. The arithmetic is project.metal's and project_bwd.metal's, statement for statement
// (itself the reference's operation order, ops/reference.py::project), so the CPU, Metal and reference
// backends agree to float32 rounding; see those files for the derivation of every term.
//
// Layouts (contiguous float32 unless noted): means [N,3], quats [N,4] wxyz, scales [N,3],
// viewmats [C,4,4] row-major world -> camera, Ks [C,3,3]; radii [C,N] int32, means2d [C,N,2],
// depths [C,N], conics [C,N,3], compensations [C,N].

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "shared.h"

namespace {

// Row-major 3x3 products on plain arrays (index r*3+c), as in the Metal kernels' common.h.
inline void mat3_mul(const float* a, const float* b, float* out) {
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 3; ++c)
            out[r * 3 + c] = a[r * 3 + 0] * b[0 * 3 + c] + a[r * 3 + 1] * b[1 * 3 + c] + a[r * 3 + 2] * b[2 * 3 + c];
}

// out = a * b^T
inline void mat3_mul_bt(const float* a, const float* b, float* out) {
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 3; ++c)
            out[r * 3 + c] = a[r * 3 + 0] * b[c * 3 + 0] + a[r * 3 + 1] * b[c * 3 + 1] + a[r * 3 + 2] * b[c * 3 + 2];
}

inline void inverse_vjp2(float p00, float p01, float p11, float v00, float v01, float v11,
                         float* g00, float* g01, float* g11) {
  const float a00 = v00 * p00 + v01 * p01, a01 = v00 * p01 + v01 * p11;  // V P, row 0
  const float a10 = v01 * p00 + v11 * p01, a11 = v01 * p01 + v11 * p11;  // V P, row 1
  *g00 = -(p00 * a00 + p01 * a10);
  *g01 = -(p00 * a01 + p01 * a11);
  *g11 = -(p01 * a01 + p11 * a11);
}

// out = a^T * b (3x3, row-major)
inline void mat3_mul_at(const float* a, const float* b, float* out) {
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 3; ++c) {
      out[r * 3 + c] = a[0 * 3 + r] * b[0 * 3 + c] + a[1 * 3 + r] * b[1 * 3 + c] + a[2 * 3 + r] * b[2 * 3 + c];
    }
  }
}

}  // namespace

extern "C" {

// Forward: radii, means2d, depths, conics and (if calc_comp) compensations of every (camera, gaussian);
// culled pairs get radius 0 and zeros.
int splat_project_fwd(int64_t C, int64_t N, int64_t width, int64_t height, float eps2d, float near_plane,
                      float far_plane, float radius_clip, int calc_comp, const float* means, const float* quats,
                      const float* scales, const float* viewmats, const float* Ks, int32_t* radii, float* means2d,
                      float* depths, float* conics, float* compensations, int n_threads) {
    splat::parallel_for(C * N, n_threads, [&](int64_t idx) {
        const int64_t cam = idx / N;
        const int64_t g = idx - cam * N;
      // Culled entries: zeros everywhere (overwritten below if the gaussian survives).
      radii[idx] = 0;
      means2d[2 * idx + 0] = 0.0f;
      means2d[2 * idx + 1] = 0.0f;
      depths[idx] = 0.0f;
      conics[3 * idx + 0] = 0.0f;
      conics[3 * idx + 1] = 0.0f;
      conics[3 * idx + 2] = 0.0f;
      if (calc_comp != 0) {
        compensations[idx] = 0.0f;
      }

      // World -> camera.
      const float* V = viewmats + cam * 16;
      float Rv[9] = {V[0], V[1], V[2], V[4], V[5], V[6], V[8], V[9], V[10]};
      const float mx = means[3 * g + 0], my = means[3 * g + 1], mz = means[3 * g + 2];
      // Non-finite or overflowing parameters, or a non-finite camera: culled (explicit; README Known limits).
      const float* q = quats + 4 * g;
      if (!splat_covar::splat_params_finite(mx, my, mz, q[0], q[1], q[2], q[3], scales[3 * g + 0],
                                            scales[3 * g + 1], scales[3 * g + 2]) ||
          !splat_covar::splat_viewmat_finite(V[0], V[1], V[2], V[3], V[4], V[5], V[6], V[7], V[8], V[9], V[10],
                                             V[11])) {
        return;
      }
      const float tx = Rv[0] * mx + Rv[1] * my + Rv[2] * mz + V[3];
      const float ty = Rv[3] * mx + Rv[4] * my + Rv[5] * mz + V[7];
      const float tz = Rv[6] * mx + Rv[7] * my + Rv[8] * mz + V[11];
      if (!(tz > near_plane && tz < far_plane)) {
        return;
      }

      // covar = (R S)(R S)^T, R from the normalised quaternion (covar.h, shared with the Metal kernels).
      const splat_covar::SplatMat3 cov = splat_covar::splat_covariance(
          splat_covar::splat_quat_to_rotmat(q[0], q[1], q[2], q[3]), scales[3 * g + 0], scales[3 * g + 1],
          scales[3 * g + 2]);
      float tmp[9];
      mat3_mul(Rv, cov.m, tmp);
      float covc[9];  // camera-space covariance Rv cov Rv^T
      mat3_mul_bt(tmp, Rv, covc);

      // Perspective Jacobian with the 1.3 x tan(fov) clamp of the direction used inside J.
      const float* K = Ks + cam * 9;
      const float fx = K[0], fy = K[4], cx = K[2], cy = K[5];
      const float W = (float)width, H = (float)height;
      const float tan_fovx = 0.5f * W / fx, tan_fovy = 0.5f * H / fy;
      const float lim_x_pos = (W - cx) / fx + 0.3f * tan_fovx, lim_x_neg = cx / fx + 0.3f * tan_fovx;
      const float lim_y_pos = (H - cy) / fy + 0.3f * tan_fovy, lim_y_neg = cy / fy + 0.3f * tan_fovy;
      const float tx_c = tz * std::min(std::max(tx / tz, -lim_x_neg), lim_x_pos);
      const float ty_c = tz * std::min(std::max(ty / tz, -lim_y_neg), lim_y_pos);
      const float J[6] = {fx / tz, 0.0f, -fx * tx_c / (tz * tz), 0.0f, fy / tz, -fy * ty_c / (tz * tz)};
      float JC[6];  // J covc, 2x3
      for (int r = 0; r < 2; ++r) {
        for (int k = 0; k < 3; ++k) {
          JC[r * 3 + k] = J[r * 3 + 0] * covc[0 * 3 + k] + J[r * 3 + 1] * covc[1 * 3 + k] + J[r * 3 + 2] * covc[2 * 3 + k];
        }
      }
      float cov2d[4];  // JC J^T, 2x2
      for (int r = 0; r < 2; ++r) {
        for (int s = 0; s < 2; ++s) {
          cov2d[r * 2 + s] = JC[r * 3 + 0] * J[s * 3 + 0] + JC[r * 3 + 1] * J[s * 3 + 1] + JC[r * 3 + 2] * J[s * 3 + 2];
        }
      }
      const float u = fx * tx / tz + cx;
      const float v = fy * ty / tz + cy;

      // Blur, inverse, radius.
      float a = cov2d[0], b = 0.5f * (cov2d[1] + cov2d[2]), c = cov2d[3];
      const float det_orig = a * c - b * b;
      a = a + eps2d;
      c = c + eps2d;
      const float det = a * c - b * b;
      if (!(det > 0.0f)) {
        return;
      }
      const float half_trace = 0.5f * (a + c);
      const float v1 = half_trace + std::sqrt(std::max(half_trace * half_trace - det, 0.01f));
      const float radius = std::ceil(3.0f * std::sqrt(v1));
      if (!(radius > radius_clip)) {
        return;
      }
      if (!(u + radius > 0.0f && u - radius < W && v + radius > 0.0f && v - radius < H)) {
        return;
      }

      const float conic_a = c / det, conic_b = -b / det, conic_c = a / det;
      // Finite outputs and a radius that fits int32 (explicit: also the guard of the float-to-int below).
      const float ratio = det_orig / det;
      if (!splat_covar::splat_projection_finite(u, v, conic_a, conic_b, conic_c, radius) || !std::isfinite(tz) ||
          (calc_comp != 0 && !std::isfinite(ratio))) {
        return;
      }
      radii[idx] = (int)radius;
      means2d[2 * idx + 0] = u;
      means2d[2 * idx + 1] = v;
      depths[idx] = tz;
      conics[3 * idx + 0] = conic_a;
      conics[3 * idx + 1] = conic_b;
      conics[3 * idx + 2] = conic_c;
      if (calc_comp != 0) {
        compensations[idx] = ratio > 0.0f ? std::sqrt(ratio) : 0.0f;
      }
    });
    return 0;
}

// Backward: v_means [C,N,3], v_quats [C,N,4], v_scales [C,N,3] per (camera, gaussian) (the caller sums
// over cameras) and, if calc_camera, per block of `block` gaussians of each camera the sums of
// d/d viewmat[0:3, 0:4] (12 values) and d/d (fx, fy, cx, cy) (4): v_camera_part [C, n_blocks, 16]
// (the caller sums over blocks). Blocks are summed in gaussian order: the same bits for any
// thread count.
int splat_project_bwd(int64_t C, int64_t N, int64_t width, int64_t height, float eps2d, int calc_comp,
                      int calc_camera, int64_t block, const float* means, const float* quats, const float* scales,
                      const float* viewmats, const float* Ks, const int32_t* radii, const float* v_means2d,
                      const float* v_depths, const float* v_conics, const float* v_comp, float* v_means,
                      float* v_quats, float* v_scales, float* v_camera_part, int n_threads) {
    const int64_t n_blocks = (N + block - 1) / block;
    splat::parallel_for(C * n_blocks, n_threads, [&](int64_t job) {
        const int64_t cam = job / n_blocks, first = (job % n_blocks) * block;
        float camera_sum[16] = {0.0f};
        for (int64_t g = first; g < std::min(N, first + block); ++g) {
            const int64_t idx = cam * N + g;
            const bool active = radii[idx] > 0;
          float vR[9] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // d/d viewmat[0:3, 0:3]
          float vt[3] = {0.0f, 0.0f, 0.0f};                                        // d/d viewmat[0:3, 3]
          float vK[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                  // d/d (fx, fy, cx, cy)
          if (active) {
            // ---- forward recomputation (same operations as project.metal) ----
            const float* V = viewmats + cam * 16;
            const float Rv[9] = {V[0], V[1], V[2], V[4], V[5], V[6], V[8], V[9], V[10]};
            const float m[3] = {means[3 * g + 0], means[3 * g + 1], means[3 * g + 2]};
            const float tx = Rv[0] * m[0] + Rv[1] * m[1] + Rv[2] * m[2] + V[3];
            const float ty = Rv[3] * m[0] + Rv[4] * m[1] + Rv[5] * m[2] + V[7];
            const float tz = Rv[6] * m[0] + Rv[7] * m[1] + Rv[8] * m[2] + V[11];

            const float q0[4] = {quats[4 * g + 0], quats[4 * g + 1], quats[4 * g + 2], quats[4 * g + 3]};
            const float qnorm = std::sqrt(q0[0] * q0[0] + q0[1] * q0[1] + q0[2] * q0[2] + q0[3] * q0[3]);
            const float qden = std::max(qnorm, 1e-12f);
            const float qw = q0[0] / qden, qx = q0[1] / qden, qy = q0[2] / qden, qz = q0[3] / qden;
            const float Rq[9] = {
                1.0f - 2.0f * (qy * qy + qz * qz), 2.0f * (qx * qy - qw * qz), 2.0f * (qx * qz + qw * qy),
                2.0f * (qx * qy + qw * qz), 1.0f - 2.0f * (qx * qx + qz * qz), 2.0f * (qy * qz - qw * qx),
                2.0f * (qx * qz - qw * qy), 2.0f * (qy * qz + qw * qx), 1.0f - 2.0f * (qx * qx + qy * qy)};
            const float s[3] = {scales[3 * g + 0], scales[3 * g + 1], scales[3 * g + 2]};
            float M[9];
            for (int r = 0; r < 3; ++r) {
              for (int c = 0; c < 3; ++c) {
                M[r * 3 + c] = Rq[r * 3 + c] * s[c];
              }
            }
            float cov[9];
            mat3_mul_bt(M, M, cov);
            float Rcov[9];  // Rv cov
            mat3_mul(Rv, cov, Rcov);
            float covc[9];  // Rv cov Rv^T
            mat3_mul_bt(Rcov, Rv, covc);

            const float* K = Ks + cam * 9;
            const float fx = K[0], fy = K[4], cx = K[2], cy = K[5];
            const float W = (float)width, H = (float)height;
            const float tan_fovx = 0.5f * W / fx, tan_fovy = 0.5f * H / fy;
            const float lim_x_pos = (W - cx) / fx + 0.3f * tan_fovx, lim_x_neg = cx / fx + 0.3f * tan_fovx;
            const float lim_y_pos = (H - cy) / fy + 0.3f * tan_fovy, lim_y_neg = cy / fy + 0.3f * tan_fovy;
            const float rx = tx / tz, ry = ty / tz;
            const bool x_clamped = rx < -lim_x_neg || rx > lim_x_pos;
            const bool y_clamped = ry < -lim_y_neg || ry > lim_y_pos;
            const float tx_c = tz * std::min(std::max(rx, -lim_x_neg), lim_x_pos);
            const float ty_c = tz * std::min(std::max(ry, -lim_y_neg), lim_y_pos);
            const float J[6] = {fx / tz, 0.0f, -fx * tx_c / (tz * tz), 0.0f, fy / tz, -fy * ty_c / (tz * tz)};
            float JC[6];  // J covc, 2x3
            for (int r = 0; r < 2; ++r) {
              for (int k = 0; k < 3; ++k) {
                JC[r * 3 + k] = J[r * 3 + 0] * covc[0 * 3 + k] + J[r * 3 + 1] * covc[1 * 3 + k] + J[r * 3 + 2] * covc[2 * 3 + k];
              }
            }
            float JCt[6];  // J covc^T, 2x3
            for (int r = 0; r < 2; ++r) {
              for (int k = 0; k < 3; ++k) {
                JCt[r * 3 + k] = J[r * 3 + 0] * covc[k * 3 + 0] + J[r * 3 + 1] * covc[k * 3 + 1] + J[r * 3 + 2] * covc[k * 3 + 2];
              }
            }
            float cov2d[4];
            for (int r = 0; r < 2; ++r) {
              for (int c = 0; c < 2; ++c) {
                cov2d[r * 2 + c] = JC[r * 3 + 0] * J[c * 3 + 0] + JC[r * 3 + 1] * J[c * 3 + 1] + JC[r * 3 + 2] * J[c * 3 + 2];
              }
            }
            const float a0 = cov2d[0], b = 0.5f * (cov2d[1] + cov2d[2]), c0 = cov2d[3];
            const float det_orig = a0 * c0 - b * b;
            const float a = a0 + eps2d, c = c0 + eps2d;
            const float det = a * c - b * b;

            // ---- conics -> G = d loss / d cov2d (symmetric: G01 = G10 = d loss / d b / 2) ----
            const float P00 = c / det, P01 = -b / det, P11 = a / det;
            const float* vc = v_conics + 3 * idx;
            float G00, G01, G11;
            inverse_vjp2(P00, P01, P11, vc[0], 0.5f * vc[1], vc[2], &G00, &G01, &G11);
            if (calc_comp != 0) {
              const float ratio = det_orig / det;
              if (ratio > 0.0f) {
                const float v_ratio = v_comp[idx] * 0.5f / std::sqrt(ratio);  // d std::sqrt(r) / d r = 1 / (2 std::sqrt(r))
                const float det2 = det * det;
                G00 += v_ratio * (c0 * det - det_orig * c) / det2;
                G11 += v_ratio * (a0 * det - det_orig * a) / det2;
                G01 += 0.5f * v_ratio * (-2.0f * b * (det - det_orig)) / det2;
              }
            }
            const float G[4] = {G00, G01, G01, G11};

            // ---- cov2d = J covc J^T ----
            float GJ[6];  // G J, 2x3
            for (int r = 0; r < 2; ++r) {
              for (int k = 0; k < 3; ++k) {
                GJ[r * 3 + k] = G[r * 2 + 0] * J[0 * 3 + k] + G[r * 2 + 1] * J[1 * 3 + k];
              }
            }
            float v_covc[9];  // J^T G J
            for (int r = 0; r < 3; ++r) {
              for (int k = 0; k < 3; ++k) {
                v_covc[r * 3 + k] = J[0 * 3 + r] * GJ[0 * 3 + k] + J[1 * 3 + r] * GJ[1 * 3 + k];
              }
            }
            float vJ[6];  // G (J covc^T) + G^T (J covc)
            for (int r = 0; r < 2; ++r) {
              for (int k = 0; k < 3; ++k) {
                vJ[r * 3 + k] = G[r * 2 + 0] * JCt[0 * 3 + k] + G[r * 2 + 1] * JCt[1 * 3 + k] +
                                G[0 * 2 + r] * JC[0 * 3 + k] + G[1 * 2 + r] * JC[1 * 3 + k];
              }
            }

            // ---- camera-space mean: means2d, depth and J ----
            const float vu = v_means2d[2 * idx + 0], vv = v_means2d[2 * idx + 1];
            const float tz2 = tz * tz, tz3 = tz2 * tz;
            float v_mc[3];
            v_mc[0] = fx / tz * vu;
            v_mc[1] = fy / tz * vv;
            v_mc[2] = -fx * tx / tz2 * vu - fy * ty / tz2 * vv + v_depths[idx];
            v_mc[2] += -fx / tz2 * vJ[0] - fy / tz2 * vJ[4];
            v_mc[2] += 2.0f * fx * tx_c / tz3 * vJ[2] + 2.0f * fy * ty_c / tz3 * vJ[5];
            if (x_clamped) {
              v_mc[2] += -fx / tz2 * (tx_c / tz) * vJ[2];
            } else {
              v_mc[0] += -fx / tz2 * vJ[2];
            }
            if (y_clamped) {
              v_mc[2] += -fy / tz2 * (ty_c / tz) * vJ[5];
            } else {
              v_mc[1] += -fy / tz2 * vJ[5];
            }

            // ---- world -> camera ----
            for (int k = 0; k < 3; ++k) {
              v_means[3 * idx + k] = Rv[0 * 3 + k] * v_mc[0] + Rv[1 * 3 + k] * v_mc[1] + Rv[2 * 3 + k] * v_mc[2];
            }
            float tmp[9];
            float v_cov[9];  // Rv^T v_covc Rv
            mat3_mul_at(Rv, v_covc, tmp);
            mat3_mul(tmp, Rv, v_cov);
            if (calc_camera != 0) {
              vK[0] = tx / tz * vu + vJ[0] / tz + (x_clamped ? 0.0f : -tx_c / tz2 * vJ[2]);
              vK[1] = ty / tz * vv + vJ[4] / tz + (y_clamped ? 0.0f : -ty_c / tz2 * vJ[5]);
              vK[2] = vu + (x_clamped ? vJ[2] / tz : 0.0f);
              vK[3] = vv + (y_clamped ? vJ[5] / tz : 0.0f);
              float A[9], B[9], Bt[9];
              mat3_mul(v_covc, Rv, A);   // v_covc Rv
              mat3_mul_bt(A, cov, B);    // v_covc Rv cov^T
              mat3_mul_at(v_covc, Rv, A);  // v_covc^T Rv
              mat3_mul(A, cov, Bt);      // v_covc^T Rv cov
              for (int r = 0; r < 3; ++r) {
                for (int k = 0; k < 3; ++k) {
                  vR[r * 3 + k] = v_mc[r] * m[k] + B[r * 3 + k] + Bt[r * 3 + k];
                }
                vt[r] = v_mc[r];
              }
            }

            // ---- cov = M M^T, M = Rq diag(s) ----
            float vcs[9];  // v_cov + v_cov^T
            for (int r = 0; r < 3; ++r) {
              for (int k = 0; k < 3; ++k) {
                vcs[r * 3 + k] = v_cov[r * 3 + k] + v_cov[k * 3 + r];
              }
            }
            float vM[9];
            mat3_mul(vcs, M, vM);
            float vRq[9];
            for (int k = 0; k < 3; ++k) {
              v_scales[3 * idx + k] = vM[0 * 3 + k] * Rq[0 * 3 + k] + vM[1 * 3 + k] * Rq[1 * 3 + k] + vM[2 * 3 + k] * Rq[2 * 3 + k];
              for (int r = 0; r < 3; ++r) {
                vRq[r * 3 + k] = vM[r * 3 + k] * s[k];
              }
            }
            // d Rq / d (w, x, y, z) of the normalised quaternion
            const float vqn[4] = {
                2.0f * (-qz * vRq[1] + qy * vRq[2] + qz * vRq[3] - qx * vRq[5] - qy * vRq[6] + qx * vRq[7]),
                2.0f * (qy * vRq[1] + qz * vRq[2] + qy * vRq[3] - 2.0f * qx * vRq[4] - qw * vRq[5] + qz * vRq[6] +
                        qw * vRq[7] - 2.0f * qx * vRq[8]),
                2.0f * (-2.0f * qy * vRq[0] + qx * vRq[1] + qw * vRq[2] + qx * vRq[3] + qz * vRq[5] - qw * vRq[6] +
                        qz * vRq[7] - 2.0f * qy * vRq[8]),
                2.0f * (-2.0f * qz * vRq[0] - qw * vRq[1] + qx * vRq[2] + qw * vRq[3] - 2.0f * qz * vRq[4] + qy * vRq[5] +
                        qx * vRq[6] + qy * vRq[7])};
            // q / std::max(|q|, eps): (v - qn (qn . v)) / |q| above eps, v / eps below
            const float qn[4] = {qw, qx, qy, qz};
            const float proj = qnorm > 1e-12f ? qn[0] * vqn[0] + qn[1] * vqn[1] + qn[2] * vqn[2] + qn[3] * vqn[3] : 0.0f;
            for (int k = 0; k < 4; ++k) {
              v_quats[4 * idx + k] = (vqn[k] - qn[k] * proj) / qden;
            }
          } else if (g < N) {
            for (int k = 0; k < 3; ++k) {
              v_means[3 * idx + k] = 0.0f;
              v_scales[3 * idx + k] = 0.0f;
            }
            for (int k = 0; k < 4; ++k) {
              v_quats[4 * idx + k] = 0.0f;
            }
          }

            if (calc_camera != 0) {
                for (int k = 0; k < 3; ++k) {  // rows of viewmat[0:3, 0:4]
                    camera_sum[4 * k + 0] += vR[3 * k + 0];
                    camera_sum[4 * k + 1] += vR[3 * k + 1];
                    camera_sum[4 * k + 2] += vR[3 * k + 2];
                    camera_sum[4 * k + 3] += vt[k];
                }
                for (int k = 0; k < 4; ++k) camera_sum[12 + k] += vK[k];
            }
        }
        if (calc_camera != 0)
            for (int k = 0; k < 16; ++k) v_camera_part[job * 16 + k] = camera_sum[k];
    }, 1);
    return 0;
}

}  // extern "C"
