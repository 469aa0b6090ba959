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
// sh_activate (sh.h): the public API's colour activation, clamp_min(c + 0.5, 0) given c + 0.5.

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

// sh_fused_fwd: the SH half of the fused preparation's unfused twin (prepare.py: project_fwd without
// PROJECT_SHADE, then this), kept as the reference project_fwd's PROJECT_SHADE is tested against. One thread
// per (camera, gaussian), flat index idx = c*N + n < C*N: the direction is means[n] minus camera c's position
// (common.h splat_camera_position, as project_fwd), the coefficients are read where splatfacto keeps them
// (band 0 at sh_dc[n * dc_stride], bands k >= 1 at sh_rest[n * rest_stride + rest_offset + 3 (k - 1)]; one
// [N, K, 3] tensor is dc = rest = it, dc_stride = rest_stride = 3 K, rest_offset = 3), the mask is radii > 0
// and the colour is activated (clamp_min(c + 0.5, 0)); the colour itself is sh.h's splat_sh_color, as in
// project_fwd. Where it is not finite the entry is culled as project_fwd culls it: radius, means2d, depth,
// conic and opacity 0, colour 0.5.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void sh_fused_fwd(
    const device float* means [[buffer(0)]],     // [N, 3]
    const device float* viewmats [[buffer(1)]],  // [C, 4, 4]
    const device float* sh_dc [[buffer(2)]],
    const device float* sh_rest [[buffer(3)]],
    device int* radii [[buffer(4)]],             // [C, N] project_fwd's
    device float* colors [[buffer(5)]],          // [C, N, 3]
    constant long& C [[buffer(6)]],
    constant long& N [[buffer(7)]],
    constant long& degree [[buffer(8)]],
    constant long& dc_stride [[buffer(9)]],
    constant long& rest_stride [[buffer(10)]],
    constant long& rest_offset [[buffer(11)]],
    device float* means2d [[buffer(12)]],        // [C, N, 2]  project_fwd's outputs, zeroed
    device float* depths [[buffer(13)]],         // [C, N]     where the colour culls
    device float* conics [[buffer(14)]],         // [C, N, 3]
    device float* opacities_out [[buffer(15)]],  // [C, N]
    uint idx [[thread_position_in_grid]]) {
  if ((long)idx >= C * N) {
    return;
  }
  const long cam = (long)idx / N;
  const long g = (long)idx - cam * N;
  colors[3 * idx + 0] = 0.5f;  // clamp_min(0 + 0.5, 0) where culled
  colors[3 * idx + 1] = 0.5f;
  colors[3 * idx + 2] = 0.5f;
  if (radii[idx] <= 0) {
    return;
  }
  float campos[3];
  splat_camera_position(viewmats + cam * 16, campos);
  float rgb[3];
  splat_sh_color(degree, means[3 * g + 0] - campos[0], means[3 * g + 1] - campos[1], means[3 * g + 2] - campos[2],
                 sh_dc + g * dc_stride, sh_rest + g * rest_stride + rest_offset, rgb);
  if (!(isfinite(rgb[0]) && isfinite(rgb[1]) && isfinite(rgb[2]))) {
    radii[idx] = 0;
    means2d[2 * idx + 0] = 0.0f;
    means2d[2 * idx + 1] = 0.0f;
    depths[idx] = 0.0f;
    conics[3 * idx + 0] = 0.0f;
    conics[3 * idx + 1] = 0.0f;
    conics[3 * idx + 2] = 0.0f;
    opacities_out[idx] = 0.0f;
    return;
  }
  colors[3 * idx + 0] = sh_activate(rgb[0] + 0.5f);
  colors[3 * idx + 1] = sh_activate(rgb[1] + 0.5f);
  colors[3 * idx + 2] = sh_activate(rgb[2] + 0.5f);
}
