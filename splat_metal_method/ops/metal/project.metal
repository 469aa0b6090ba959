// project.metal: EWA projection of 3D gaussians into every camera (gsplat 1.4 fully_fused_projection,
// non-packed, pinhole). Backward kernels will live next to the forward one.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

// Flags of the fused preparation (project_fwd, project_bwd; prepare.py passes them).
#define PROJECT_FUSED 1              // cull as rasterization.py's glue, write opacities_out / v_opacities
#define PROJECT_EXP_SCALES 2         // scales are logs: exp here, and the chain rule in backward
#define PROJECT_SIGMOID_OPACITIES 4  // opacities are logits: sigmoid here, and its derivative in backward
#define PROJECT_CAMPOS 8             // SH colours: culls a camera whose position (common.h) is not finite
#define PROJECT_MEANS_SH 16          // backward: v_means_sh (the SH directions' gradient) is added to v_means
#define PROJECT_SHADE 256            // the SH colour too, in this thread (else sh.metal's sh_fused_fwd, its twin)

// project_fwd: one thread per (camera, gaussian), flat index idx = c*N + n < C*N.
// Why it is shaped so: each output element depends on one gaussian and one camera only, so threads
// are independent (no barriers, no shared memory) and a thread may return early.
// Invariants:
//   * every output slot [c, n] is written exactly once, culled ones with zeros (radius 0), so the
//     outputs may be allocated with torch.empty;
//   * the arithmetic follows ops/reference.py::project term by term (same operation order), so the
//     only differences to the oracle are float32 rounding of library functions;
//   * quats are normalised here (q / max(|q|, 1e-12), as F.normalize);
//   * a gaussian is kept iff its parameters and the camera's view matrix are finite (covar.h
//     splat_params_finite, splat_viewmat_finite), near < depth < far, det(cov2d + eps2d I) > 0,
//     radius > radius_clip, its 3-sigma square touches the image, and means2d, conic, radius (and the
//     compensation ratio when asked) are finite with radius < 2^31 (splat_projection_finite, checked
//     before (int)radius, which is undefined otherwise); radius = ceil(3 sqrt(b + sqrt(max(b^2 - det, 0.01))));
//   * fused (PROJECT_FUSED, prepare.py), also: its activated opacity is finite, the camera's 16 view matrix
//     entries and (PROJECT_CAMPOS) its position are (common.h splat_camera_finite), and with PROJECT_SHADE
//     its colour in this camera, computed here before the activation from the (degree+1)^2 bands in use
//     (sh.h splat_sh_color: each coefficient read once, never re-read to be tested), is finite: a
//     non-finite coefficient in use makes it non-finite. opacities_out is 0 wherever radius is 0, else the
//     opacity (x the compensation); colours are clamp_min(c + 0.5, 0), 0.5 where radius is 0.
// Bounds: idx < C*N < 2^32 (checked on the host); compensations is written only if calc_comp != 0
// (otherwise the host passes a 1-element placeholder); coefficient reads stay inside the gaussian's row
// because K >= (degree+1)^2 (checked on the host).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void project_fwd(
    const device float* means [[buffer(0)]],     // [N, 3]
    const device float* quats [[buffer(1)]],     // [N, 4] wxyz
    const device float* scales [[buffer(2)]],    // [N, 3]
    const device float* viewmats [[buffer(3)]],  // [C, 4, 4] row-major world -> camera
    const device float* Ks [[buffer(4)]],        // [C, 3, 3]
    device int* radii [[buffer(5)]],             // [C, N]
    device float* means2d [[buffer(6)]],         // [C, N, 2]
    device float* depths [[buffer(7)]],          // [C, N]
    device float* conics [[buffer(8)]],          // [C, N, 3]
    device float* compensations [[buffer(9)]],   // [C, N] or [1] placeholder
    constant long* ints [[buffer(10)]],          // [PROJECT_FWD_INTS_COUNT] common.h PROJECT_FWD_INTS_*
    constant float* floats [[buffer(11)]],       // [PROJECT_FWD_FLOATS_COUNT] common.h PROJECT_FWD_FLOATS_*
    // The fused preparation (prepare.py, PROJECT_* flags; 0: the plain stage, buffers 12-16 are placeholders):
    const device float* opacities [[buffer(12)]],  // [N] (logits with PROJECT_SIGMOID_OPACITIES)
    const device float* sh_dc [[buffer(13)]],      // PROJECT_SHADE: band 0 of gaussian n at sh_dc[n * dc_stride]
    const device float* sh_rest [[buffer(14)]],    // bands k >= 1 at sh_rest[n * rest_stride + rest_offset + 3 (k - 1)]
    device float* colors [[buffer(15)]],           // [C, N, 3] activated SH colours (PROJECT_SHADE)
    device float* opacities_out [[buffer(16)]],    // [C, N] opacity (x compensation) the rasterizer composites
    uint idx [[thread_position_in_grid]]) {
  const long C = ints[PROJECT_FWD_INTS_C];
  const long N = ints[PROJECT_FWD_INTS_N];
  const long width = ints[PROJECT_FWD_INTS_WIDTH];
  const long height = ints[PROJECT_FWD_INTS_HEIGHT];
  const long calc_comp = ints[PROJECT_FWD_INTS_CALC_COMP];
  const long flags = ints[PROJECT_FWD_INTS_FLAGS];
  const long degree = ints[PROJECT_FWD_INTS_DEGREE];
  const long dc_stride = ints[PROJECT_FWD_INTS_DC_STRIDE];
  const long rest_stride = ints[PROJECT_FWD_INTS_REST_STRIDE];
  const long rest_offset = ints[PROJECT_FWD_INTS_REST_OFFSET];
  const float eps2d = floats[PROJECT_FWD_FLOATS_EPS2D];
  const float near_plane = floats[PROJECT_FWD_FLOATS_NEAR_PLANE];
  const float far_plane = floats[PROJECT_FWD_FLOATS_FAR_PLANE];
  const float radius_clip = floats[PROJECT_FWD_FLOATS_RADIUS_CLIP];
  if ((long)idx >= C * N) {
    return;
  }
  const long cam = (long)idx / N;
  const long g = (long)idx - cam * N;
  const bool fused = (flags & PROJECT_FUSED) != 0;
  const bool shade = (flags & PROJECT_SHADE) != 0;
  // Fused: what rasterization.py's glue culls besides projection (its "x * 0 == 0" tests), on values this
  // thread computes: the activated opacity, the camera's position and (below) the colour.
  float opacity = 0.0f;
  bool keep = true;
  float campos[3] = {0.0f, 0.0f, 0.0f};
  if (fused) {
    opacity = opacities[g];
    if ((flags & PROJECT_SIGMOID_OPACITIES) != 0) {
      opacity = 1.0f / (1.0f + exp(-opacity));
    }
    if ((flags & PROJECT_CAMPOS) != 0) {
      splat_camera_position(viewmats + cam * 16, campos);
    }
    keep = isfinite(opacity) && splat_camera_finite(viewmats + cam * 16, campos);
    opacities_out[idx] = 0.0f;
  }
  if (shade) {
    colors[3 * idx + 0] = 0.5f;  // clamp_min(0 + 0.5, 0) where culled
    colors[3 * idx + 1] = 0.5f;
    colors[3 * idx + 2] = 0.5f;
  }

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
  const device float* V = viewmats + cam * 16;
  float Rv[9] = {V[0], V[1], V[2], V[4], V[5], V[6], V[8], V[9], V[10]};
  const float mx = means[3 * g + 0], my = means[3 * g + 1], mz = means[3 * g + 2];
  // Non-finite or overflowing parameters, or a non-finite camera: culled (explicit; README Known limits).
  const device float* q = quats + 4 * g;
  float s0 = scales[3 * g + 0], s1 = scales[3 * g + 1], s2 = scales[3 * g + 2];
  if ((flags & PROJECT_EXP_SCALES) != 0) {  // log-scales, as splatfacto stores them
    s0 = exp(s0);
    s1 = exp(s1);
    s2 = exp(s2);
  }
  if (!keep || !splat_params_finite(mx, my, mz, q[0], q[1], q[2], q[3], s0, s1, s2) ||
      !splat_viewmat_finite(V[0], V[1], V[2], V[3], V[4], V[5], V[6], V[7], V[8], V[9], V[10], V[11])) {
    return;
  }
  const float tx = Rv[0] * mx + Rv[1] * my + Rv[2] * mz + V[3];
  const float ty = Rv[3] * mx + Rv[4] * my + Rv[5] * mz + V[7];
  const float tz = Rv[6] * mx + Rv[7] * my + Rv[8] * mz + V[11];
  if (!(tz > near_plane && tz < far_plane)) {
    return;
  }

  // covar = (R S)(R S)^T, R from the normalised quaternion (covar.h, shared with the CPU backend).
  const SplatMat3 cov = splat_covariance(splat_quat_to_rotmat(q[0], q[1], q[2], q[3]), s0, s1, s2);
  float tmp[9];
  mat3_mul(Rv, cov.m, tmp);
  float covc[9];  // camera-space covariance Rv cov Rv^T
  mat3_mul_bt(tmp, Rv, covc);

  // Perspective Jacobian with the 1.3 x tan(fov) clamp of the direction used inside J.
  const device float* K = Ks + cam * 9;
  const float fx = K[0], fy = K[4], cx = K[2], cy = K[5];
  const float W = (float)width, H = (float)height;
  const float tan_fovx = 0.5f * W / fx, tan_fovy = 0.5f * H / fy;
  const float lim_x_pos = (W - cx) / fx + 0.3f * tan_fovx, lim_x_neg = cx / fx + 0.3f * tan_fovx;
  const float lim_y_pos = (H - cy) / fy + 0.3f * tan_fovy, lim_y_neg = cy / fy + 0.3f * tan_fovy;
  const float tx_c = tz * min(max(tx / tz, -lim_x_neg), lim_x_pos);
  const float ty_c = tz * min(max(ty / tz, -lim_y_neg), lim_y_pos);
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
  const float v1 = half_trace + sqrt(max(half_trace * half_trace - det, 0.01f));
  const float radius = ceil(3.0f * sqrt(v1));
  if (!(radius > radius_clip)) {
    return;
  }
  if (!(u + radius > 0.0f && u - radius < W && v + radius > 0.0f && v - radius < H)) {
    return;
  }

  const float conic_a = c / det, conic_b = -b / det, conic_c = a / det;
  // Finite outputs and a radius that fits int32 (explicit: also the guard of the float-to-int below).
  const float ratio = det_orig / det;
  if (!splat_projection_finite(u, v, conic_a, conic_b, conic_c, radius) || !isfinite(tz) ||
      (calc_comp != 0 && !isfinite(ratio))) {
    return;
  }
  if (shade) {  // the colour, from the coefficients in use, each read once (sh.h)
    float rgb[3];
    splat_sh_color(degree, mx - campos[0], my - campos[1], mz - campos[2], sh_dc + g * dc_stride,
                   sh_rest + g * rest_stride + rest_offset, rgb);
    if (!(isfinite(rgb[0]) && isfinite(rgb[1]) && isfinite(rgb[2]))) {
      return;  // a non-finite coefficient in use (or a colour past float32): culled
    }
    colors[3 * idx + 0] = sh_activate(rgb[0] + 0.5f);
    colors[3 * idx + 1] = sh_activate(rgb[1] + 0.5f);
    colors[3 * idx + 2] = sh_activate(rgb[2] + 0.5f);
  }
  radii[idx] = (int)radius;
  means2d[2 * idx + 0] = u;
  means2d[2 * idx + 1] = v;
  depths[idx] = tz;
  conics[3 * idx + 0] = conic_a;
  conics[3 * idx + 1] = conic_b;
  conics[3 * idx + 2] = conic_c;
  const float comp = ratio > 0.0f ? sqrt(ratio) : 0.0f;
  if (calc_comp != 0) {
    compensations[idx] = comp;
  }
  if (fused) {
    opacities_out[idx] = calc_comp != 0 ? opacity * comp : opacity;
  }
}
