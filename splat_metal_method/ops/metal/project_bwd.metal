// project_bwd.metal: gradients of the EWA projection (project.metal) with respect to means, quats,
// scales, viewmats (the camera pose) and the intrinsics fx, fy, cx, cy (gsplat gives none; the
// reference oracle does), including the antialiased compensation term. The maths is
// gsplat 1.4's fully_fused_projection_bwd (persp_proj_vjp with the clamped tx/ty,
// covar_world_to_cam_vjp, quat_scale_to_covar_vjp), written as the exact derivative of
// ops/reference.py::project, which is the oracle.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

// 2x2 symmetric helpers: a symmetric matrix is (m00, m01, m11).
// out = -P V P for symmetric P (the conic) and V: the vjp of a matrix inverse.
inline void inverse_vjp2(float p00, float p01, float p11, float v00, float v01, float v11,
                         thread float* g00, thread float* g01, thread float* g11) {
  const float a00 = v00 * p00 + v01 * p01, a01 = v00 * p01 + v01 * p11;  // V P, row 0
  const float a10 = v01 * p00 + v11 * p01, a11 = v01 * p01 + v11 * p11;  // V P, row 1
  *g00 = -(p00 * a00 + p01 * a10);
  *g01 = -(p00 * a01 + p01 * a11);
  *g11 = -(p01 * a01 + p11 * a11);
}

// out = a^T * b (3x3, row-major)
inline void mat3_mul_at(thread const float* a, thread const float* b, thread float* out) {
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 3; ++c) {
      out[r * 3 + c] = a[0 * 3 + r] * b[0 * 3 + c] + a[1 * 3 + r] * b[1 * 3 + c] + a[2 * 3 + r] * b[2 * 3 + c];
    }
  }
}

// project_bwd: one thread per (gaussian n, camera c) on the grid (N_pad, C), N_pad = N rounded up to
// the group size SPLAT_PROJECT_BWD_GROUP (256, injected) so that every threadgroup is full and lies in
// one camera; threads with
// n >= N or radius 0 (culled: the forward wrote constant zeros) contribute zeros.
// Outputs:
//   * v_means / v_quats / v_scales: one row per (camera, gaussian), [C, N, .]; the host sums over C
//     (deterministic, no atomics; a view when C == 1);
//   * camera gradients: only if calc_camera != 0 (uniform, so barriers stay uniform): 16 values per
//     (camera, gaussian), d/d viewmat[c, 0:3, 0:4] (12) then d/d (fx, fy, cx, cy) (4), are reduced
//     over the group's 256 gaussians with simd_sum (float4s) and then across simdgroups in
//     threadgroup memory: one partial row per group, v_camera_part [C, n_groups, 16]; the host sums
//     over groups (deterministic: no float atomics).
// Every derivative mirrors the reference's forward term by term:
//   conics = inverse(cov2d + eps2d I)        -> G = -P V P, V = [[v0, v1/2], [v1/2, v2]]
//   compensation = sqrt(det_orig / det_blur)  -> dG from d ratio / d (a, b, c), zero where ratio <= 0
//   cov2d = J covc J^T                        -> v_covc = J^T G J, v_J = G J covc^T + G^T J covc
//   J = [[fx/z, 0, -fx tx_c/z^2], [0, fy/z, -fy ty_c/z^2]], tx_c = z clamp(x/z, -lim_neg, lim_pos):
//       d J02/dx = -fx/z^2 unclamped, 0 clamped; d J02/dz = 2 fx tx_c/z^3 (- fx tx_c/z^3 if clamped);
//       the limits are (W - cx)/fx + 0.15 W/fx and (cx + 0.15 W)/fx, so a clamped J02 is
//       -(1.15 W - cx)/z or (cx + 0.15 W)/z: d J02/d fx = -tx_c/z^2 unclamped, 0 clamped;
//       d J02/d cx = 0 unclamped, 1/z clamped
//   means2d = (fx x/z + cx, fy y/z + cy); depth = z
//   mean_c = R m + t, covc = R cov R^T       -> v_m = R^T v_mc, v_R = v_mc m^T + v_covc R cov^T + v_covc^T R cov
//   cov = M M^T, M = Rq(q/|q|) diag(s)       -> v_M = (v_cov + v_cov^T) M, then rotation-matrix and
//                                               normalisation vjps.
// The cross-simdgroup sum reads simdgroups_per_threadgroup partial rows: Apple GPUs run 32-wide
// simdgroups (8 rows for 256 threads), but nothing here assumes it; s_part has room for simdgroups
// as narrow as 8 lanes (2 KB for 256 threads).
#ifndef SPLAT_PROJECT_BWD_GROUP
#error "SPLAT_PROJECT_BWD_GROUP (threads per group, a multiple of 32) must be injected by project_bwd.py"
#endif
#if SPLAT_PROJECT_BWD_GROUP % 32 != 0 || SPLAT_PROJECT_BWD_GROUP < 32
#error "SPLAT_PROJECT_BWD_GROUP must be a positive multiple of 32"
#endif
#define PROJECT_BWD_MAX_SIMDGROUPS (SPLAT_PROJECT_BWD_GROUP / 8)
// Flags of the fused preparation (as project.metal). Fused, the backward also takes the glue's steps in
// reverse: v_opacity = v_opacities_out x compensation (0 where culled: radius 0), v_compensation =
// v_opacities_out x opacity, then sigmoid's derivative (g (1 - y) y, as PyTorch's sigmoid_backward) and
// exp's (g exp(s)) for raw parameters, and the SH directions' gradient added to v_means.
#define PROJECT_FUSED 1
#define PROJECT_EXP_SCALES 2
#define PROJECT_SIGMOID_OPACITIES 4
#define PROJECT_MEANS_SH 16
#define PROJECT_NO_V_DEPTHS 32  // the depths fed nothing: v_depths is a placeholder, read as 0
#define PROJECT_SH_APART 64      // (PROJECT_SHADE) the SH bands as splatfacto keeps them: band 0 and the others apart
#define PROJECT_SHADE 256        // the SH colour's backward too, in this thread (else sh_bwd.metal's sh_fused_bwd, its
                                 // twin, wrote v_means_sh): coefficient gradients and the direction's, into v_means
// (PROJECT_SHADE) the SH degree in use and the coefficients per gaussian K ride in flags' bits 16-19 and 20-27.
// PROJECT_SH_ADAM (with PROJECT_FUSED, PROJECT_SHADE, PROJECT_SH_APART and one camera): the SH coefficients take
// their Adam step here (engine/optimizers.py arms it, prepare.py dispatches it): each thread computes its
// gaussian's coefficient gradients in registers (sh.h's outer product) and updates features_dc / features_rest and
// both of their moments in place with splat_adam_update (common.h), slot 0 of adam_coef for band 0 and slot 1 for
// the rest (adam.metal's adam_prepare wrote them just before), every gaussian stepped (a culled one with gradient
// 0, as torch's Adam does); no coefficient gradient is written. A non-finite gradient or updated coefficient
// stores NaN in adam_flag[0] (the NaN guard's flag, as adam_step). The moments are views of the moment arenas
// (exp_avgs, exp_avg_sqs), each at its offset in the params list.
#define PROJECT_SH_ADAM 128
// PROJECT_ADAM_MEANS / _QUATS / _SCALES / _OPACITIES (each with PROJECT_SH_ADAM): that parameter takes its Adam step
// here too, with the gradient this thread computed (the means': projection's + the SH directions'; the opacity's after
// sigmoid's derivative, the scales' after exp's), in place, in the slot of adam_coef that byte k (means 0, quats 1,
// scales 2, opacities 3) of the flags' bits PROJECT_ADAM_SLOT_SHIFT.. names; its gradient is not written. Its exp_avg
// is read where its gradient would be written (v_means, v_quats, v_scales, v_opacities: in exp_avgs, not grads), its
// exp_avg_sq in exp_avg_sqs, and the verdict joins the SH step's.
#define PROJECT_ADAM_MEANS 2048
#define PROJECT_ADAM_QUATS 4096
#define PROJECT_ADAM_SCALES 8192
#define PROJECT_ADAM_OPACITIES 16384
#define PROJECT_ADAM_SLOT_SHIFT 32
// PROJECT_ADAM_VISIBLE (with PROJECT_SH_ADAM; the model's visible_adam option, engine/optimizers.py): a culled gaussian
// (radius 0 in this one camera: not visible in this render) takes no Adam step at all, neither its parameters nor
// their moments are read or written (gsplat's SelectiveAdam); a visible one's step is the same as without it. The
// step counters and bias corrections stay per tensor (adam_prepare), as torch's.
#define PROJECT_ADAM_VISIBLE 32768
#define PROJECT_CALC_COMP 512    // the compensation term is in use (was a buffer of its own)
#define PROJECT_CALC_CAMERA 1024 // camera gradients: uniform, so barriers stay uniform (was a buffer of its own)
#define PROJECT_SH_DEGREE_SHIFT 16
#define PROJECT_SH_K_SHIFT 20
// PROJECT_SH_ADAM: Adam on gaussian g's SH coefficients (band 0 slot 0, the rest slot 1 of adam_coef) from the
// gradients in `t`; false where a gradient or an updated coefficient is not finite.
inline bool project_sh_adam(long g, long sh_k, long rest_stride, thread const SplatShColorGrad* t, device float* sh_dc,
                            device float* sh_rest, device float* m_dc, device float* v_dc, device float* m_rest,
                            device float* v_rest, const device float* adam_coef) {
  const float b1 = adam_coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 0];
  const float b2 = adam_coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 1];
  bool ok = true;
  for (long k = 0; k < sh_k; ++k) {
    device float* p = k == 0 ? sh_dc + g * 3 : sh_rest + g * rest_stride + 3 * (k - 1);
    device float* m1 = k == 0 ? m_dc + g * 3 : m_rest + g * rest_stride + 3 * (k - 1);
    device float* m2 = k == 0 ? v_dc + g * 3 : v_rest + g * rest_stride + 3 * (k - 1);
    for (long c = 0; c < 3; ++c) {
      const float grad = splat_sh_coef_grad(t, k, c);
      float exp_avg = m1[c], exp_avg_sq = m2[c];
      const float param = splat_adam_update(p[c], grad, &exp_avg, &exp_avg_sq, adam_coef, k == 0 ? 0 : 1, b1, b2);
      m1[c] = exp_avg;
      m2[c] = exp_avg_sq;
      p[c] = param;
      ok = ok && isfinite(grad) && isfinite(param);
    }
  }
  return ok;
}

// PROJECT_ADAM_*: Adam on the `width` floats of row g of one parameter from the gradients `grad` (slot `slot` of
// adam_coef), as adam.metal's adam_row with the gradient in registers; false where one is not finite.
inline bool project_adam_row(device float* p, thread const float* grad, device float* m, device float* v, long width,
                             long g, const device float* adam_coef, long slot) {
  const float b1 = adam_coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 0];
  const float b2 = adam_coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 1];
  bool ok = true;
  for (long j = 0; j < width; ++j) {
    const long i = g * width + j;
    float exp_avg = m[i], exp_avg_sq = v[i];
    const float param = splat_adam_update(p[i], grad[j], &exp_avg, &exp_avg_sq, adam_coef, slot, b1, b2);
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    p[i] = param;
    ok = ok && isfinite(grad[j]) && isfinite(param);
  }
  return ok;
}

// A culled entry (radius 0, for any reason) had opacity 0 and constant outputs: every gradient is 0.
// The gradients it writes are views of one allocation (`grads`), and the Adam moments it updates (PROJECT_SH_ADAM,
// PROJECT_ADAM_*) views of the moment arenas (`exp_avgs`, `exp_avg_sqs`: ops/metal/adam.py): each reached at its
// element offset in `params` (common.h PROJECT_BWD_*), so 14 outputs and moments take 3 slots. A parameter stepped
// here has its exp_avg where its gradient would be (v_means .. v_sh_rest read from exp_avgs, else from grads).
[[max_total_threads_per_threadgroup(SPLAT_PROJECT_BWD_GROUP)]]
kernel void project_bwd(
    device float* means [[buffer(0)]],             // [N, 3]; written only with PROJECT_ADAM_MEANS
    device float* quats [[buffer(1)]],             // [N, 4] wxyz; written only with PROJECT_ADAM_QUATS
    device float* scales [[buffer(2)]],            // [N, 3]; written only with PROJECT_ADAM_SCALES
    const device float* viewmats [[buffer(3)]],    // [C, 4, 4]
    const device float* Ks [[buffer(4)]],          // [C, 3, 3]
    const device int* radii [[buffer(5)]],         // [C, N] (forward output; 0 = culled)
    const device float* v_means2d [[buffer(6)]],   // [C, N, 2]
    const device float* v_depths [[buffer(7)]],    // [C, N]
    const device float* v_conics [[buffer(8)]],    // [C, N, 3]
    const device float* v_comp [[buffer(9)]],      // [C, N] or [1] placeholder (read only without PROJECT_FUSED)
    device float* grads [[buffer(10)]],            // the gradients written: v_means [C, N, 3], v_quats [C, N, 4],
                                                   // v_scales [C, N, 3], v_opacities [C, N], v_sh_dc, v_sh_rest
    device float* exp_avgs [[buffer(11)]],         // PROJECT_SH_ADAM: the exp_avg arena (else a placeholder)
    device float* exp_avg_sqs [[buffer(12)]],      // PROJECT_SH_ADAM: the exp_avg_sq arena (else a placeholder)
    device float* v_camera_part [[buffer(13)]],    // [C, n_groups, 16] or [1] placeholder
    constant long* params [[buffer(14)]],          // [PROJECT_BWD_COUNT] common.h PROJECT_BWD_*: sizes, flags, offsets
    const device float* adam_coef [[buffer(15)]],   // PROJECT_SH_ADAM: adam_prepare's [SPLAT_ADAM_SLOTS * COEFS + 2]
    device atomic_float* adam_flag [[buffer(16)]],  // PROJECT_SH_ADAM: [1], NaN where a value is not finite
    // The fused preparation (prepare.py; flags 0: the plain stage, buffers 17-20 are placeholders):
    device float* opacities [[buffer(17)]],    // [N] the forward's input (logits with PROJECT_SIGMOID_OPACITIES);
                                               // written only with PROJECT_ADAM_OPACITIES
    const device float* v_opacities_out [[buffer(18)]],  // [C, N] d loss / d opacities_out
    device float* v_means_sh [[buffer(19)]],   // [C, N, 3] d loss / d SH directions (PROJECT_MEANS_SH); may be
                                               // v_means itself (each thread reads its row before writing it)
    // PROJECT_SHADE (else placeholders): the SH coefficients as project_fwd read them (band 0 of gaussian n at
    // sh_dc[n * dc_stride], bands k >= 1 at sh_rest[n * rest_stride + rest_offset + 3 (k - 1)]; the layout from
    // PROJECT_SH_APART and K), d loss / d colours, and their gradients [C, N, .] in the same layout.
    const device float* v_colors [[buffer(20)]],  // [C, N, 3]
    device float* sh_dc [[buffer(21)]],      // written only with PROJECT_SH_ADAM
    device float* sh_rest [[buffer(22)]],    // written only with PROJECT_SH_ADAM
    uint2 gpos [[thread_position_in_grid]],
    uint2 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float s_part[PROJECT_BWD_MAX_SIMDGROUPS * 16];
  const long N = params[PROJECT_BWD_N], width = params[PROJECT_BWD_WIDTH], height = params[PROJECT_BWD_HEIGHT];
  const long n_groups = params[PROJECT_BWD_N_GROUPS], flags = params[PROJECT_BWD_FLAGS];
  const float eps2d = as_type<float>((uint)params[PROJECT_BWD_EPS2D]);

  const long g = (long)gpos.x;
  const long cam = (long)gpos.y;
  const long idx = cam * N + g;
  const bool active = g < N && radii[idx] > 0;
  const bool shade = (flags & PROJECT_SHADE) != 0;
  const long sh_k = (flags >> PROJECT_SH_K_SHIFT) & 255, sh_degree = (flags >> PROJECT_SH_DEGREE_SHIFT) & 15;
  const bool apart = (flags & PROJECT_SH_APART) != 0;
  const long dc_stride = apart ? 3 : 3 * sh_k, rest_stride = apart ? 3 * (sh_k - 1) : 3 * sh_k;
  const long rest_offset = apart ? 0 : 3;
  const bool calc_comp = (flags & PROJECT_CALC_COMP) != 0, calc_camera = (flags & PROJECT_CALC_CAMERA) != 0;
  const bool sh_adam = (flags & PROJECT_SH_ADAM) != 0;
  bool sh_ok = true;  // PROJECT_SH_ADAM (and _ADAM_*): every gradient it steps and updated value of this thread finite
  // PROJECT_ADAM_*: which of means, quats, scales, opacities take their step here, and their adam_coef slots
  const bool adam_means = (flags & PROJECT_ADAM_MEANS) != 0, adam_quats = (flags & PROJECT_ADAM_QUATS) != 0;
  const bool adam_scales = (flags & PROJECT_ADAM_SCALES) != 0, adam_opacities = (flags & PROJECT_ADAM_OPACITIES) != 0;
  const long slot_means = (flags >> PROJECT_ADAM_SLOT_SHIFT) & 255, slot_quats = (flags >> (PROJECT_ADAM_SLOT_SHIFT + 8)) & 255;
  const long slot_scales = (flags >> (PROJECT_ADAM_SLOT_SHIFT + 16)) & 255;
  const long slot_opacities = (flags >> (PROJECT_ADAM_SLOT_SHIFT + 24)) & 255;
  // the gradients at their offsets in grads, or (stepped here) their exp_avgs in exp_avgs; the exp_avg_sqs
  device float* v_means = (adam_means ? exp_avgs : grads) + params[PROJECT_BWD_V_MEANS];
  device float* v_quats = (adam_quats ? exp_avgs : grads) + params[PROJECT_BWD_V_QUATS];
  device float* v_scales = (adam_scales ? exp_avgs : grads) + params[PROJECT_BWD_V_SCALES];
  device float* v_opacities = (adam_opacities ? exp_avgs : grads) + params[PROJECT_BWD_V_OPACITIES];
  device float* v_sh_dc = (sh_adam ? exp_avgs : grads) + params[PROJECT_BWD_V_SH_DC];
  device float* v_sh_rest = (sh_adam ? exp_avgs : grads) + params[PROJECT_BWD_V_SH_REST];
  device float* avg_sq_means = exp_avg_sqs + params[PROJECT_BWD_AVG_SQ_MEANS];
  device float* avg_sq_quats = exp_avg_sqs + params[PROJECT_BWD_AVG_SQ_QUATS];
  device float* avg_sq_scales = exp_avg_sqs + params[PROJECT_BWD_AVG_SQ_SCALES];
  device float* avg_sq_opacities = exp_avg_sqs + params[PROJECT_BWD_AVG_SQ_OPACITIES];
  device float* avg_sq_dc = exp_avg_sqs + params[PROJECT_BWD_AVG_SQ_DC];
  device float* avg_sq_rest = exp_avg_sqs + params[PROJECT_BWD_AVG_SQ_REST];

  float vR[9] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // d/d viewmat[0:3, 0:3]
  float vt[3] = {0.0f, 0.0f, 0.0f};                                        // d/d viewmat[0:3, 3]
  float vK[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                  // d/d (fx, fy, cx, cy)
  float opacity = 0.0f;  // activated (fused)
  if ((flags & PROJECT_FUSED) != 0 && active) {
    opacity = opacities[g];
    if ((flags & PROJECT_SIGMOID_OPACITIES) != 0) {
      opacity = 1.0f / (1.0f + exp(-opacity));
    }
  }
  if (active) {
    // ---- forward recomputation (same operations as project.metal) ----
    const device float* V = viewmats + cam * 16;
    const float Rv[9] = {V[0], V[1], V[2], V[4], V[5], V[6], V[8], V[9], V[10]};
    const float m[3] = {means[3 * g + 0], means[3 * g + 1], means[3 * g + 2]};
    const float tx = Rv[0] * m[0] + Rv[1] * m[1] + Rv[2] * m[2] + V[3];
    const float ty = Rv[3] * m[0] + Rv[4] * m[1] + Rv[5] * m[2] + V[7];
    const float tz = Rv[6] * m[0] + Rv[7] * m[1] + Rv[8] * m[2] + V[11];

    const float q0[4] = {quats[4 * g + 0], quats[4 * g + 1], quats[4 * g + 2], quats[4 * g + 3]};
    const float qnorm = sqrt(q0[0] * q0[0] + q0[1] * q0[1] + q0[2] * q0[2] + q0[3] * q0[3]);
    const float qden = max(qnorm, 1e-12f);
    const float qw = q0[0] / qden, qx = q0[1] / qden, qy = q0[2] / qden, qz = q0[3] / qden;
    const float Rq[9] = {
        1.0f - 2.0f * (qy * qy + qz * qz), 2.0f * (qx * qy - qw * qz), 2.0f * (qx * qz + qw * qy),
        2.0f * (qx * qy + qw * qz), 1.0f - 2.0f * (qx * qx + qz * qz), 2.0f * (qy * qz - qw * qx),
        2.0f * (qx * qz - qw * qy), 2.0f * (qy * qz + qw * qx), 1.0f - 2.0f * (qx * qx + qy * qy)};
    float s[3] = {scales[3 * g + 0], scales[3 * g + 1], scales[3 * g + 2]};
    if ((flags & PROJECT_EXP_SCALES) != 0) {
      s[0] = exp(s[0]);
      s[1] = exp(s[1]);
      s[2] = exp(s[2]);
    }
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

    const device float* K = Ks + cam * 9;
    const float fx = K[0], fy = K[4], cx = K[2], cy = K[5];
    const float W = (float)width, H = (float)height;
    const float tan_fovx = 0.5f * W / fx, tan_fovy = 0.5f * H / fy;
    const float lim_x_pos = (W - cx) / fx + 0.3f * tan_fovx, lim_x_neg = cx / fx + 0.3f * tan_fovx;
    const float lim_y_pos = (H - cy) / fy + 0.3f * tan_fovy, lim_y_neg = cy / fy + 0.3f * tan_fovy;
    const float rx = tx / tz, ry = ty / tz;
    const bool x_clamped = rx < -lim_x_neg || rx > lim_x_pos;
    const bool y_clamped = ry < -lim_y_neg || ry > lim_y_pos;
    const float tx_c = tz * min(max(rx, -lim_x_neg), lim_x_pos);
    const float ty_c = tz * min(max(ry, -lim_y_neg), lim_y_pos);
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
    const device float* vc = v_conics + 3 * idx;
    float G00, G01, G11;
    inverse_vjp2(P00, P01, P11, vc[0], 0.5f * vc[1], vc[2], &G00, &G01, &G11);
    float v_opacity = 0.0f;
    if ((flags & PROJECT_FUSED) != 0) {
      v_opacity = v_opacities_out[idx];
    }
    if (calc_comp) {
      const float ratio = det_orig / det;
      if ((flags & PROJECT_FUSED) != 0) {
        v_opacity = v_opacities_out[idx] * (ratio > 0.0f ? sqrt(ratio) : 0.0f);
      }
      if (ratio > 0.0f) {
        const float vc_in = (flags & PROJECT_FUSED) != 0 ? v_opacities_out[idx] * opacity : v_comp[idx];
        const float v_ratio = vc_in * 0.5f / sqrt(ratio);  // d sqrt(r) / d r = 1 / (2 sqrt(r))
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
    v_mc[2] = -fx * tx / tz2 * vu - fy * ty / tz2 * vv + ((flags & PROJECT_NO_V_DEPTHS) != 0 ? 0.0f : v_depths[idx]);
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

    // ---- the SH colour (PROJECT_SHADE): coefficient gradients, and the direction's, which is the mean's ----
    float v_sh[3] = {0.0f, 0.0f, 0.0f};
    if (shade) {
      float campos[3];
      splat_camera_position(V, campos);  // common.h, as project_fwd
      const float dir[3] = {m[0] - campos[0], m[1] - campos[1], m[2] - campos[2]};
      if (sh_adam) {  // the coefficient gradients stay in registers: Adam at once (one camera: idx == g)
        const SplatShColorGrad t = splat_sh_color_bwd_terms(sh_degree, sh_k, dir[0], dir[1], dir[2],
                                                            sh_dc + g * dc_stride,
                                                            sh_rest + g * rest_stride + rest_offset,
                                                            v_colors + 3 * idx, v_sh);
        sh_ok = project_sh_adam(g, sh_k, rest_stride, &t, sh_dc, sh_rest, v_sh_dc, avg_sq_dc, v_sh_rest, avg_sq_rest,
                                adam_coef);
      } else {
        splat_sh_color_bwd(sh_degree, sh_k, dir[0], dir[1], dir[2], sh_dc + g * dc_stride,
                           sh_rest + g * rest_stride + rest_offset, v_colors + 3 * idx, v_sh_dc + idx * dc_stride,
                           v_sh_rest + idx * rest_stride + rest_offset, v_sh);  // sh.h, as sh_fused_bwd
      }
    }

    // ---- world -> camera ----
    float v_mean[3];
    for (int k = 0; k < 3; ++k) {
      const float v_m = Rv[0 * 3 + k] * v_mc[0] + Rv[1 * 3 + k] * v_mc[1] + Rv[2 * 3 + k] * v_mc[2];
      v_mean[k] = (flags & PROJECT_MEANS_SH) != 0 ? v_m + v_means_sh[3 * idx + k] : (shade ? v_m + v_sh[k] : v_m);
    }
    if (!adam_means) {
      for (int k = 0; k < 3; ++k) {
        v_means[3 * idx + k] = v_mean[k];
      }
    }
    if ((flags & PROJECT_FUSED) != 0) {
      if ((flags & PROJECT_SIGMOID_OPACITIES) != 0) {
        v_opacity = v_opacity * (1.0f - opacity) * opacity;
      }
      if (!adam_opacities) {
        v_opacities[idx] = v_opacity;
      }
    }
    float tmp[9];
    float v_cov[9];  // Rv^T v_covc Rv
    mat3_mul_at(Rv, v_covc, tmp);
    mat3_mul(tmp, Rv, v_cov);
    if (calc_camera) {
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
    float v_scale[3];
    for (int k = 0; k < 3; ++k) {
      v_scale[k] = vM[0 * 3 + k] * Rq[0 * 3 + k] + vM[1 * 3 + k] * Rq[1 * 3 + k] + vM[2 * 3 + k] * Rq[2 * 3 + k];
      if ((flags & PROJECT_EXP_SCALES) != 0) {
        v_scale[k] = v_scale[k] * s[k];
      }
      if (!adam_scales) {
        v_scales[3 * idx + k] = v_scale[k];
      }
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
    // q / max(|q|, eps): (v - qn (qn . v)) / |q| above eps, v / eps below
    const float qn[4] = {qw, qx, qy, qz};
    const float proj = qnorm > 1e-12f ? qn[0] * vqn[0] + qn[1] * vqn[1] + qn[2] * vqn[2] + qn[3] * vqn[3] : 0.0f;
    float v_quat[4];
    for (int k = 0; k < 4; ++k) {
      v_quat[k] = (vqn[k] - qn[k] * proj) / qden;
      if (!adam_quats) {
        v_quats[4 * idx + k] = v_quat[k];
      }
    }
    // PROJECT_ADAM_*: the step, after every read of this gaussian's parameters (one camera: idx == g)
    if (adam_means) {
      sh_ok = project_adam_row(means, v_mean, v_means, avg_sq_means, 3, g, adam_coef, slot_means) && sh_ok;
    }
    if (adam_quats) {
      sh_ok = project_adam_row(quats, v_quat, v_quats, avg_sq_quats, 4, g, adam_coef, slot_quats) && sh_ok;
    }
    if (adam_scales) {
      sh_ok = project_adam_row(scales, v_scale, v_scales, avg_sq_scales, 3, g, adam_coef, slot_scales) && sh_ok;
    }
    if (adam_opacities) {
      const float v_op[1] = {v_opacity};
      sh_ok = project_adam_row(opacities, v_op, v_opacities, avg_sq_opacities, 1, g, adam_coef, slot_opacities) && sh_ok;
    }
  } else if (g < N) {
    const float zeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // culled: every gradient 0, stepped all the same
    const bool step_culled = (flags & PROJECT_ADAM_VISIBLE) == 0;  // PROJECT_ADAM_VISIBLE: no step for it
    for (int k = 0; k < 3; ++k) {
      if (!adam_means) {
        v_means[3 * idx + k] = 0.0f;
      }
      if (!adam_scales) {
        v_scales[3 * idx + k] = 0.0f;
      }
    }
    for (int k = 0; k < 4; ++k) {
      if (!adam_quats) {
        v_quats[4 * idx + k] = 0.0f;
      }
    }
    if ((flags & PROJECT_FUSED) != 0 && !adam_opacities) {
      v_opacities[idx] = 0.0f;  // culled: its opacity_out was the constant 0
    }
    if (adam_means && step_culled) {
      sh_ok = project_adam_row(means, zeros, v_means, avg_sq_means, 3, g, adam_coef, slot_means) && sh_ok;
    }
    if (adam_quats && step_culled) {
      sh_ok = project_adam_row(quats, zeros, v_quats, avg_sq_quats, 4, g, adam_coef, slot_quats) && sh_ok;
    }
    if (adam_scales && step_culled) {
      sh_ok = project_adam_row(scales, zeros, v_scales, avg_sq_scales, 3, g, adam_coef, slot_scales) && sh_ok;
    }
    if (adam_opacities && step_culled) {
      sh_ok = project_adam_row(opacities, zeros, v_opacities, avg_sq_opacities, 1, g, adam_coef, slot_opacities) && sh_ok;
    }
    if (shade && sh_adam && !step_culled) {
      // PROJECT_ADAM_VISIBLE: the coefficients and their moments untouched; no coefficient gradient is written
    } else if (shade && sh_adam) {  // culled: gradient 0, stepped all the same (as torch's Adam steps every row)
      SplatShColorGrad t;
      t.n_bases = 0;
      sh_ok = project_sh_adam(g, sh_k, rest_stride, &t, sh_dc, sh_rest, v_sh_dc, avg_sq_dc, v_sh_rest, avg_sq_rest,
                              adam_coef) && sh_ok;
    } else if (shade) {
      splat_sh_color_bwd_zero(sh_k, v_sh_dc + idx * dc_stride, v_sh_rest + idx * rest_stride + rest_offset);
    }
  }

  // the NaN verdict as adam_step folds it: one simd_any vote per simdgroup (every thread reaches here), one atomic
  // only where a value is not finite
  if (simd_any(!sh_ok) && simd_is_first()) {
    atomic_store_explicit(adam_flag, as_type<float>(0x7fc00000u), memory_order_relaxed);  // a quiet NaN
  }

  if (calc_camera) {  // uniform over the dispatch: every thread reaches the barrier
    float vals[16];
    for (int k = 0; k < 3; ++k) {  // rows of viewmat[0:3, 0:4]
      vals[4 * k + 0] = vR[3 * k + 0];
      vals[4 * k + 1] = vR[3 * k + 1];
      vals[4 * k + 2] = vR[3 * k + 2];
      vals[4 * k + 3] = vt[k];
    }
    for (int k = 0; k < 4; ++k) {
      vals[12 + k] = vK[k];
    }
    for (int k = 0; k < 4; ++k) {  // four float4 reductions over the simdgroup
      const float4 r = simd_sum(float4(vals[4 * k + 0], vals[4 * k + 1], vals[4 * k + 2], vals[4 * k + 3]));
      if (lane == 0) {
        s_part[sgid * 16 + 4 * k + 0] = r.x;
        s_part[sgid * 16 + 4 * k + 1] = r.y;
        s_part[sgid * 16 + 4 * k + 2] = r.z;
        s_part[sgid * 16 + 4 * k + 3] = r.w;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < 16) {
      float total = 0.0f;
      for (uint sg = 0; sg < n_sg && sg < PROJECT_BWD_MAX_SIMDGROUPS; ++sg) {
        total += s_part[sg * 16 + tid];
      }
      v_camera_part[(cam * n_groups + (long)tgp.x) * 16 + tid] = total;
    }
  }
}
