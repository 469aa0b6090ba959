// loss.metal: splatfacto's training loss (1 - lambda) * L1 + lambda * (1 - SSIM) in three launches, with
// the SSIM of pytorch_msssim 1.0 (splat_metal_method/ssim.py, the reference): 11-tap gaussian window
// (sigma 1.5, weights passed in from Python), K = (0.01, 0.03), data range 1, valid padding, mean over
// pixels, channels and images. Compiled after common.h: kernels.py prepends it.
//
// Images are [B, H, W, C] contiguous (channel last, as the model renders them); the SSIM map is
// [B, H', W', C] with H' = H - 10, W' = W - 10 (the host checks H, W >= 11). X = pred, Y = gt below.
//
// l1_ssim_fwd: one threadgroup of LOSS_T x LOSS_T threads per LOSS_T x LOSS_T block of pixels of one image.
//   Thread (ly, lx) owns pixel (i0 + ly, j0 + lx): its |gt - pred| over channels (every pixel), and the SSIM
//   value at that position of the SSIM map (pixels with i < H', j < W'), whose window covers input rows
//   i..i+10 and columns j..j+10. Per channel the group stages a (LOSS_T + 10)^2 patch of pred and gt in
//   threadgroup memory, blurs the five maps (X, Y, X^2, Y^2, XY) along H into threadgroup memory, then each
//   thread blurs along W: the separable blur of the reference (along H, then along W), taps in order.
//   It writes, per SSIM pixel and channel, the three partial derivatives of the SSIM value S with respect
//   to the blurred maps it depends on through pred (mu_x, E[X^2], E[XY]), which the backward blurs once
//   more, and per group the sums of |gt - pred| and of S (a threadgroup tree: fixed order, deterministic).
// l1_ssim_reduce: one threadgroup sums the per-group sums (fixed order) and writes loss and, when asked
//   (has_stats), L1 and SSIM (the training step's loss needs neither: two allocations fewer).
// l1_ssim_bwd: one thread per pixel of pred; the same tiling, with the transposed blur of the partials
//   (a window sum over the SSIM pixels whose window covers this pixel):
//     dS_sum/dX[q] = blurT(g_mu)[q] + 2 X[q] blurT(g_xx)[q] + Y[q] blurT(g_xy)[q]
//     dloss/dX[q]  = grad * ((1 - lambda) / N_l1 * sign(X - Y) - lambda / N_ssim * dS_sum/dX[q]).
// Bounds: every device read is guarded by i < H, j < W (images) or i < H', j < W' (partials); threadgroup
// arrays are indexed by loop bounds derived from LOSS_T and LOSS_WIN only.

#ifndef SPLAT_LOSS_TILE
#error "SPLAT_LOSS_TILE and SPLAT_LOSS_WIN must be injected by loss.py (kernels.library extra defines)"
#endif
#define LOSS_T SPLAT_LOSS_TILE             // pixels per side of a threadgroup's block
#define LOSS_WIN SPLAT_LOSS_WIN            // the gaussian window's taps
#define LOSS_SPAN (LOSS_T + LOSS_WIN - 1)  // input rows/columns a block's SSIM windows cover
#define LOSS_THREADS (LOSS_T * LOSS_T)
#define LOSS_C1 0.0001f                    // (0.01 * data_range)^2
#define LOSS_C2 0.0009f                    // (0.03 * data_range)^2

// Sums s[0..LOSS_THREADS) and s[LOSS_THREADS..2 LOSS_THREADS) into s[0] and s[LOSS_THREADS], in a fixed order.
inline void loss_tree_sum(threadgroup float* s, uint tid) {
  for (uint half_n = LOSS_THREADS / 2; half_n > 0; half_n /= 2) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < half_n) {
      s[tid] += s[tid + half_n];
      s[LOSS_THREADS + tid] += s[LOSS_THREADS + tid + half_n];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

[[max_total_threads_per_threadgroup(LOSS_THREADS)]]
kernel void l1_ssim_fwd(
    const device float* pred [[buffer(0)]],  // [B, H, W, C]
    const device float* gt [[buffer(1)]],    // [B, H, W, C]
    const device float* win [[buffer(2)]],   // [LOSS_WIN] gaussian window (sums to 1)
    device float* partials [[buffer(3)]],    // [B, H', W', C, 3]: dS/dmu_x, dS/dE[X^2], dS/dE[XY]; or [1]
    device float* sums [[buffer(4)]],        // [groups, 2]: sum |gt - pred|, sum S of each threadgroup
    constant long& H [[buffer(5)]],
    constant long& W [[buffer(6)]],
    constant long& C [[buffer(7)]],
    constant long& groups_x [[buffer(8)]],   // threadgroups along W
    constant long& groups_y [[buffer(9)]],   // threadgroups along H
    constant long& has_partials [[buffer(10)]],
    uint3 tgp [[threadgroup_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float s_x[LOSS_SPAN * LOSS_SPAN];
  threadgroup float s_y[LOSS_SPAN * LOSS_SPAN];
  threadgroup float s_v[5 * LOSS_T * LOSS_SPAN];  // blurred along H: [map, row < LOSS_T, column < LOSS_SPAN]
  threadgroup float s_sum[2 * LOSS_THREADS];

  const long b = (long)tgp.z;
  const long i0 = (long)tgp.y * LOSS_T, j0 = (long)tgp.x * LOSS_T;
  const long i = i0 + (long)lid.y, j = j0 + (long)lid.x;
  const long Ho = H - (LOSS_WIN - 1), Wo = W - (LOSS_WIN - 1);
  const bool in_image = i < H && j < W;
  const bool in_map = i < Ho && j < Wo;
  const device float* X = pred + b * H * W * C;
  const device float* Y = gt + b * H * W * C;

  float l1 = 0.0f, ssim = 0.0f;
  for (long c = 0; c < C; ++c) {
    for (uint k = tid; k < LOSS_SPAN * LOSS_SPAN; k += LOSS_THREADS) {
      const long r = i0 + (long)(k / LOSS_SPAN), q = j0 + (long)(k % LOSS_SPAN);
      const bool inside = r < H && q < W;
      s_x[k] = inside ? X[(r * W + q) * C + c] : 0.0f;
      s_y[k] = inside ? Y[(r * W + q) * C + c] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (in_image) {
      l1 += fabs(s_y[lid.y * LOSS_SPAN + lid.x] - s_x[lid.y * LOSS_SPAN + lid.x]);
    }
    for (uint k = tid; k < LOSS_T * LOSS_SPAN; k += LOSS_THREADS) {
      const uint r = k / LOSS_SPAN, q = k % LOSS_SPAN;
      float mx = 0.0f, my = 0.0f, mxx = 0.0f, myy = 0.0f, mxy = 0.0f;
      for (uint a = 0; a < LOSS_WIN; ++a) {
        const float w = win[a], x = s_x[(r + a) * LOSS_SPAN + q], y = s_y[(r + a) * LOSS_SPAN + q];
        mx += w * x;
        my += w * y;
        mxx += w * (x * x);
        myy += w * (y * y);
        mxy += w * (x * y);
      }
      s_v[0 * LOSS_T * LOSS_SPAN + k] = mx;
      s_v[1 * LOSS_T * LOSS_SPAN + k] = my;
      s_v[2 * LOSS_T * LOSS_SPAN + k] = mxx;
      s_v[3 * LOSS_T * LOSS_SPAN + k] = myy;
      s_v[4 * LOSS_T * LOSS_SPAN + k] = mxy;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (in_map) {
      float m[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (uint t = 0; t < 5; ++t) {
        const threadgroup float* row = s_v + t * LOSS_T * LOSS_SPAN + lid.y * LOSS_SPAN + lid.x;
        for (uint a = 0; a < LOSS_WIN; ++a) {
          m[t] += win[a] * row[a];
        }
      }
      // The reference's expression, with its X = gt (mu1) and Y = pred (mu2), operation for operation.
      const float mu1 = m[1], mu2 = m[0], e11 = m[3], e22 = m[2], e12 = m[4];
      const float mu1_sq = mu1 * mu1, mu2_sq = mu2 * mu2, mu1_mu2 = mu1 * mu2;
      const float A2 = 2.0f * (e12 - mu1_mu2) + LOSS_C2;
      const float B2 = (e11 - mu1_sq) + (e22 - mu2_sq) + LOSS_C2;
      const float A1 = 2.0f * mu1_mu2 + LOSS_C1, B1 = mu1_sq + mu2_sq + LOSS_C1;
      const float cs = A2 / B2, lum = A1 / B1;
      const float S = lum * cs;
      ssim += S;
      if (has_partials != 0) {
        device float* g = partials + (((b * Ho + i) * Wo + j) * C + c) * 3;
        g[0] = cs * 2.0f * (mu1 - lum * mu2) / B1 + lum * 2.0f * (cs * mu2 - mu1) / B2;  // dS/dmu_pred
        g[1] = -S / B2;                                                                 // dS/dE[pred^2]
        g[2] = 2.0f * lum / B2;                                                         // dS/dE[pred gt]
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next channel overwrites the patch
  }
  s_sum[tid] = l1;
  s_sum[LOSS_THREADS + tid] = ssim;
  loss_tree_sum(s_sum, tid);
  if (tid == 0) {
    const long group = (b * groups_y + (long)tgp.y) * groups_x + (long)tgp.x;
    sums[2 * group + 0] = s_sum[0];
    sums[2 * group + 1] = s_sum[LOSS_THREADS];
  }
}

[[max_total_threads_per_threadgroup(LOSS_THREADS)]]
kernel void l1_ssim_reduce(
    const device float* sums [[buffer(0)]],  // [groups, 2]
    device float* loss [[buffer(1)]],        // [] (1 - lambda) * L1 + lambda * (1 - SSIM)
    device float* l1_out [[buffer(2)]],      // [] mean |gt - pred|, or [1] placeholder
    device float* ssim_out [[buffer(3)]],    // [] mean SSIM, or [1] placeholder
    constant long& groups [[buffer(4)]],
    constant float& n_l1 [[buffer(5)]],      // B * H * W * C
    constant float& n_ssim [[buffer(6)]],    // B * H' * W' * C
    constant float& w_l1 [[buffer(7)]],      // 1 - lambda
    constant float& w_ssim [[buffer(8)]],    // lambda
    constant long& has_stats [[buffer(9)]],  // write l1_out and ssim_out
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float s_sum[2 * LOSS_THREADS];
  float l1 = 0.0f, ssim = 0.0f;
  for (long g = (long)tid; g < groups; g += LOSS_THREADS) {
    l1 += sums[2 * g + 0];
    ssim += sums[2 * g + 1];
  }
  s_sum[tid] = l1;
  s_sum[LOSS_THREADS + tid] = ssim;
  loss_tree_sum(s_sum, tid);
  if (tid == 0) {
    const float mean_l1 = s_sum[0] / n_l1, mean_ssim = s_sum[LOSS_THREADS] / n_ssim;
    if (has_stats != 0) {
      l1_out[0] = mean_l1;
      ssim_out[0] = mean_ssim;
    }
    loss[0] = w_l1 * mean_l1 + w_ssim * (1.0f - mean_ssim);  // splatfacto's expression
  }
}

[[max_total_threads_per_threadgroup(LOSS_THREADS)]]
kernel void l1_ssim_bwd(
    const device float* pred [[buffer(0)]],      // [B, H, W, C]
    const device float* gt [[buffer(1)]],        // [B, H, W, C]
    const device float* win [[buffer(2)]],       // [LOSS_WIN]
    const device float* partials [[buffer(3)]],  // [B, H', W', C, 3] from l1_ssim_fwd
    const device float* grad_loss [[buffer(4)]], // [] d(objective)/d(loss)
    device float* grad_pred [[buffer(5)]],       // [B, H, W, C]
    constant long& H [[buffer(6)]],
    constant long& W [[buffer(7)]],
    constant long& C [[buffer(8)]],
    constant float& scale_l1 [[buffer(9)]],      // (1 - lambda) / N_l1
    constant float& scale_ssim [[buffer(10)]],   // lambda / N_ssim
    uint3 tgp [[threadgroup_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  // Partials of the SSIM pixels whose windows cover this block: map rows i0-10..i0+LOSS_T-1 (likewise columns).
  threadgroup float s_g[3 * LOSS_SPAN * LOSS_SPAN];  // [partial, row, column]
  threadgroup float s_v[3 * LOSS_T * LOSS_SPAN];     // transposed-blurred along H: [partial, row < LOSS_T, column]

  const long b = (long)tgp.z;
  const long i0 = (long)tgp.y * LOSS_T, j0 = (long)tgp.x * LOSS_T;
  const long i = i0 + (long)lid.y, j = j0 + (long)lid.x;
  const long Ho = H - (LOSS_WIN - 1), Wo = W - (LOSS_WIN - 1);
  const float go = grad_loss[0];

  for (long c = 0; c < C; ++c) {
    for (uint k = tid; k < LOSS_SPAN * LOSS_SPAN; k += LOSS_THREADS) {
      const long r = i0 - (LOSS_WIN - 1) + (long)(k / LOSS_SPAN), q = j0 - (LOSS_WIN - 1) + (long)(k % LOSS_SPAN);
      const bool inside = r >= 0 && q >= 0 && r < Ho && q < Wo;
      const device float* g = partials + (((b * Ho + (inside ? r : 0)) * Wo + (inside ? q : 0)) * C + c) * 3;
      s_g[0 * LOSS_SPAN * LOSS_SPAN + k] = inside ? g[0] : 0.0f;
      s_g[1 * LOSS_SPAN * LOSS_SPAN + k] = inside ? g[1] : 0.0f;
      s_g[2 * LOSS_SPAN * LOSS_SPAN + k] = inside ? g[2] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Pixel row i0 + r gets map row i0 + r - a through tap a: patch row r + 10 - a.
    for (uint k = tid; k < LOSS_T * LOSS_SPAN; k += LOSS_THREADS) {
      const uint r = k / LOSS_SPAN, q = k % LOSS_SPAN;
      for (uint t = 0; t < 3; ++t) {
        const threadgroup float* col = s_g + t * LOSS_SPAN * LOSS_SPAN + q;
        float acc = 0.0f;
        for (uint a = 0; a < LOSS_WIN; ++a) {
          acc += win[a] * col[(r + LOSS_WIN - 1 - a) * LOSS_SPAN];
        }
        s_v[t * LOSS_T * LOSS_SPAN + k] = acc;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (i < H && j < W) {
      float d[3] = {0.0f, 0.0f, 0.0f};
      for (uint t = 0; t < 3; ++t) {
        const threadgroup float* row = s_v + t * LOSS_T * LOSS_SPAN + lid.y * LOSS_SPAN + lid.x;
        for (uint a = 0; a < LOSS_WIN; ++a) {
          d[t] += win[a] * row[LOSS_WIN - 1 - a];
        }
      }
      const long idx = ((b * H + i) * W + j) * C + c;
      const float x = pred[idx], y = gt[idx];
      const float sign = x > y ? 1.0f : (x < y ? -1.0f : 0.0f);
      const float dssim = d[0] + 2.0f * x * d[1] + y * d[2];
      grad_pred[idx] = go * (scale_l1 * sign - scale_ssim * dssim);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next channel overwrites the patch
  }
}
