// rasterize_bwd.metal: gradients of front-to-back alpha compositing (rasterize.metal) with respect to
// means2d (and the per-pixel absolute sums gsplat calls absgrad), conics, colors (all D channels) and
// opacities. The maths is gsplat 1.4's rasterize_to_pixels_bwd; backgrounds' gradient is a plain
// torch reduction on the host side (sum over pixels of T_final * v_render_colors).
//
// Per-variant values injected by kernels.py: SPLAT_CHANNELS (D), SPLAT_TILE_SIZE and SPLAT_BWD_BATCH
// (gaussians per shared-memory batch: TILE_PIXELS, or fewer when D is large so the batch stays under
// the threadgroup-memory budget; see rasterize_bwd.py).
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

#ifndef SPLAT_CHANNELS
#error "SPLAT_CHANNELS must be injected by kernels.py"
#endif
#ifndef SPLAT_BWD_BATCH
#error "SPLAT_BWD_BATCH must be injected by rasterize_bwd.py"
#endif
#if SPLAT_BWD_BATCH > SPLAT_RASTER_THREADS || SPLAT_BWD_BATCH < 1
#error "SPLAT_BWD_BATCH must be in 1..RASTER_THREADS (one loading thread per gaussian)"
#endif

// Bits of `flags` (rasterize_bwd.py BWD_*): what this launch reads and writes.
#define SPLAT_BWD_BACKGROUND 1  // backgrounds [C, D] were composited by the forward
#define SPLAT_BWD_ABSGRAD 2     // accumulate |d loss / d means2d| per pixel into v_means2d_abs
#define SPLAT_BWD_COMPOSITE 4   // the forward's fused composite: v_rgb, render_out and composite_bg are bound
#define SPLAT_BWD_V_COLORS 8    // v_render_colors is bound (else it is zero)
#define SPLAT_BWD_V_ALPHAS 16   // v_render_alphas is bound (else it is zero)

// Colour gradients are reduced four channels at a time (simd_sum of a float4; the last vector over its used
// channels only).
#define SPLAT_COLOR_VEC4 ((SPLAT_CHANNELS + 3) / 4)
// Per gaussian and simdgroup, the reduced quantities q scattered to device memory:
//   q = 0,1,2: conic; 3: opacity; 4,5: means2d; 6,7: |means2d| (absgrad); 8 + k: colour channel k.
#define SPLAT_BWD_QUANTITIES (8 + SPLAT_CHANNELS)

// Tile merge (SPLAT_BWD_MERGE = 1, rasterize_to_pixels_bwd tile_merge, the model config bwd_tile_merge; off by default until a Mac measures it):
// instead of one device atomic per quantity and simdgroup, each simdgroup stores its reduced quantities of
// a batch's gaussians in threadgroup memory (s_part[simdgroup][slot][q], zeroed per batch), and after the
// batch one thread per (slot, q) sums the simdgroups' values in simdgroup order and issues ONE device atomic
// per gaussian, quantity and tile (none when the sum is 0). Costs one barrier more per batch and
// MERGE_SG x BATCH x QUANTITIES floats of threadgroup memory, so its batches are smaller (variants.bwd_batch).
// MERGE_SG is the simdgroups of a group at width 32 (Apple's); a GPU that forms more simdgroups per group
// takes the direct path (`merge` below is uniform over the group).
#ifndef SPLAT_BWD_MERGE
#define SPLAT_BWD_MERGE 0
#endif
#define SPLAT_BWD_MERGE_SG ((SPLAT_RASTER_THREADS + 31) / 32)
#if SPLAT_BWD_MERGE
#define SPLAT_BWD_PART_FLOATS (SPLAT_BWD_MERGE_SG * SPLAT_BWD_BATCH * SPLAT_BWD_QUANTITIES)
#else
#define SPLAT_BWD_PART_FLOATS 1
#endif

// The simd_sum of the last colour vector, over its SPLAT_CHANNELS - 4 (SPLAT_COLOR_VEC4 - 1) used channels
// (the others are zero and stay zero).
inline float4 simd_sum_last_color(float4 v) {
#if SPLAT_CHANNELS % 4 == 1
  return float4(simd_sum(v.x), 0.0f, 0.0f, 0.0f);
#elif SPLAT_CHANNELS % 4 == 2
  return float4(simd_sum(float2(v.x, v.y)), 0.0f, 0.0f);
#elif SPLAT_CHANNELS % 4 == 3
  return float4(simd_sum(float3(v.x, v.y, v.z)), 0.0f);
#else
  return simd_sum(v);
#endif
}

// Adds quantity q (the numbering above) of gaussian g to its gradient buffer.
inline void bwd_atomic_add(int q, long g, float value, device atomic_float* v_means2d, device atomic_float* v_conics,
                           device atomic_float* v_colors, device atomic_float* v_opacities,
                           device atomic_float* v_means2d_abs, bool absgrad) {
  if (q < 3) {
    atomic_fetch_add_explicit(&v_conics[3 * g + q], value, memory_order_relaxed);
  } else if (q == 3) {
    atomic_fetch_add_explicit(&v_opacities[g], value, memory_order_relaxed);
  } else if (q < 6) {
    atomic_fetch_add_explicit(&v_means2d[2 * g + (q - 4)], value, memory_order_relaxed);
  } else if (q < 8) {
    if (absgrad) {
      atomic_fetch_add_explicit(&v_means2d_abs[2 * g + (q - 6)], value, memory_order_relaxed);
    }
  } else {
    atomic_fetch_add_explicit(&v_colors[g * SPLAT_CHANNELS + (q - 8)], value, memory_order_relaxed);
  }
}

// rasterize_bwd: one threadgroup per (tile x, tile y, camera), one thread per pixel of the tile
// (grid = (tile_width*TS, tile_height*TS, C), group = (TS, TS, 1)); the launch geometry of
// rasterize_fwd, also where the pipeline allows fewer threads: group = (TS, GROUP_ROWS, 1), one group
// per strip of a tile. Threads of pixels outside the image stay alive (masked): they load gaussians and
// reach every barrier.
//
// The walk is back to front (gsplat's): each pixel starts from the forward's final transmittance
// T_final and "un-composites" one gaussian at a time, T_i = T_{i+1} / (1 - alpha_i), keeping in
// `buf` the colour composited behind the current gaussian. Only gaussians at list positions
// <= last_ids[pixel] (the forward's last contributor) and passing the forward's tests (sigma and
// raw alpha finite, sigma >= 0, alpha >= ALPHA_MIN) are differentiated, which is exactly the set the
// forward used.
// Per pixel and gaussian (v_c = dL/d colour_out, v_a = dL/d alpha_out, bg = background):
//   v_alpha = sum_k (c_k T_i - buf_k / (1 - alpha)) v_c_k + T_final / (1 - alpha) (v_a - sum_k bg_k v_c_k)
//   v_colour_k = alpha T_i v_c_k;  if opacity*exp(-sigma) <= ALPHA_MAX (alpha not clamped):
//   v_sigma = -opacity exp(-sigma) v_alpha, v_conic = (dx^2/2, dx dy, dy^2/2) v_sigma,
//   v_mean = v_sigma (a dx + b dy, b dx + c dy), v_opacity = exp(-sigma) v_alpha.
// absgrad accumulates |v_mean| per pixel before summing, as gsplat does.
// Fused composite (flags & COMPOSITE; rasterize.metal's): rgb_k = clamp(x_k, 0, 1) with
// x_k = render_colors_k + (1 - render_alpha) composite_bg_k, recomputed here from the forward's outputs in
// its operations (the same bits); g_k = v_rgb_k where 0 <= x_k <= 1 (torch.clamp's gradient), else 0.
// The composite adds g_k to v_c_k and, through T_final, sum_k g_k composite_bg_k to bg_dot: exactly what
// train.metal's composite_bwd hands an unfused backward (v_colour = g, v_alpha = -sum_k g_k bg_k).
//
// Reduction: per gaussian, every simdgroup sums its pixels' contributions with simd_sum over float4s
// (3 + ceil(D/4) reductions), then its lanes share the 8 + D quantities round-robin (the lane of rank
// r among the simdgroup's live lanes scatters q = r, r + lanes, ...), each with ONE device atomic add,
// so a gaussian costs at most (simdgroups per tile) atomics per output element and tile. No geometry
// is assumed: a simdgroup may have fewer than 32 live lanes (tiles of 1..5 pixels a side, or the last
// simdgroup of a tile whose pixel count is not a multiple of 32, e.g. 12x12 = 4.5 simdgroups), and
// 8 + D may exceed the lane count (D up to MAX_CHANNELS = 64). The rank and count come from simd
// prefix sums, so they also hold if a GPU formed simdgroups other than from consecutive thread indices. A simdgroup skips
// gaussians behind all of its pixels' last contributors (simd_max of last_ids) and gaussians that
// touch none of its pixels (simd_any), like gsplat's warp-level skips.
//
// Work bound (GPU watchdog): a pass handles at most `chunk` gaussians of each tile, counted from the
// back: [max(start, end - (p+1) chunk), end - p chunk). Between passes a pixel's T and buf live in
// pix_T / pix_buf. A group whose tile has nothing in this pass returns at once: that condition is
// uniform over the group, so no thread of it reaches a barrier.
//
// Loop invariant per batch (two barriers): barrier (everyone finished reading the previous batch);
// threads tid < batch_size load gaussian (batch_end - 1 - tid) into slot tid, so slot 0 is the
// furthest back; barrier; each simdgroup walks the slots in order.
// Threadgroup memory: BATCH * (4 + 8 + 16 + 4 D) bytes = 10 KB for 16x16 tiles and D = 3 (the tile merge
// adds BATCH * MERGE_SG * (8 + D) * 4: 24.5 KB in all at its batch of 64).
[[max_total_threads_per_threadgroup(SPLAT_RASTER_THREADS)]]
kernel void rasterize_bwd(
    const device float* means2d [[buffer(0)]],          // [C*N, 2]
    const device float* conics [[buffer(1)]],           // [C*N, 3]
    const device float* colors [[buffer(2)]],           // [C*N, D]
    const device float* opacities [[buffer(3)]],        // [C*N]
    const device float* backgrounds [[buffer(4)]],      // [C, D] or [1] placeholder
    const device int* tile_offsets [[buffer(5)]],       // [C, tile_height, tile_width]
    const device int* flatten_ids [[buffer(6)]],        // [M]
    const device float* transmittance [[buffer(7)]],    // [C, H, W] final T of the forward
    const device int* last_ids [[buffer(8)]],           // [C, H, W] last contributor (-1: none)
    const device float* v_render_colors [[buffer(9)]],  // [C, H, W, D]
    const device float* v_render_alphas [[buffer(10)]], // [C, H, W]
    device float* pix_T [[buffer(11)]],                 // [C, H, W] between passes, or [1]
    device float* pix_buf [[buffer(12)]],               // [C, H, W, D] between passes, or [1]
    device atomic_float* v_means2d [[buffer(13)]],      // [C*N, 2], zero-initialised
    device atomic_float* v_conics [[buffer(14)]],       // [C*N, 3], zero-initialised
    device atomic_float* v_colors [[buffer(15)]],       // [C*N, D], zero-initialised
    device atomic_float* v_opacities [[buffer(16)]],    // [C*N], zero-initialised
    device atomic_float* v_means2d_abs [[buffer(17)]],  // [C*N, 2] (accumulated into), or [1]
    constant long* params [[buffer(18)]],               // [RASTER_BWD_COUNT] common.h RASTER_BWD_*
    const device float* composite_bg [[buffer(19)]],    // [3], or [1] placeholder
    const device float* render_out [[buffer(20)]],      // [C, H, W, D] the forward's render_colors, or [1]
    const device float* v_rgb [[buffer(21)]],           // [C, H, W, 3], or [1] placeholder
    uint3 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]]) {
  const long width = params[RASTER_BWD_WIDTH];
  const long height = params[RASTER_BWD_HEIGHT];
  const long tile_width = params[RASTER_BWD_TILE_WIDTH];
  const long tile_height = params[RASTER_BWD_TILE_HEIGHT];
  const long total_tiles = params[RASTER_BWD_TOTAL_TILES];
  const long n_isects = params[RASTER_BWD_N_ISECTS];
  const long flags = params[RASTER_BWD_FLAGS];
  const long pass_index = params[RASTER_BWD_PASS_INDEX];
  const long chunk = params[RASTER_BWD_CHUNK];
  const long row0 = params[RASTER_BWD_ROW0];
  threadgroup int s_ids[SPLAT_BWD_BATCH];
  threadgroup float s_part[SPLAT_BWD_PART_FLOATS];  // [sg][slot][q] (one unused float without the merge)
#if SPLAT_BWD_MERGE
  const bool merge = n_sg <= SPLAT_BWD_MERGE_SG;
#else
  (void)sgid;
  (void)n_sg;
  (void)s_part;
#endif
  threadgroup float2 s_xy[SPLAT_BWD_BATCH];
  threadgroup float4 s_conic_opac[SPLAT_BWD_BATCH];
  threadgroup float s_rgb[SPLAT_BWD_BATCH * SPLAT_CHANNELS];

  // A dispatch covers the flat tile rows [row0, row0 + grid rows) of [C * tile_height] (a band of rows:
  // row0 is an argument, every buffer is bound whole, nothing is copied per band); tgp.z counts cameras
  // when a dispatch covers all of them (row0 = 0). A group covers GROUP_ROWS pixel rows of its tile.
  const long groups_per_tile = SPLAT_TILE_SIZE / SPLAT_GROUP_ROWS;
  const long flat_row = row0 + (long)tgp.z * tile_height + (long)tgp.y / groups_per_tile;
  const long cam = flat_row / tile_height;
  const long tile_y = flat_row - cam * tile_height;
  const long tile_flat = flat_row * tile_width + (long)tgp.x;
  const long range_start = tile_offsets[tile_flat];
  const long range_end = (tile_flat + 1 < total_tiles) ? (long)tile_offsets[tile_flat + 1] : n_isects;
  const long hi = range_end - pass_index * chunk;  // exclusive end of this pass (back to front)
  if (hi <= range_start) {
    return;  // uniform over the group: empty tile, or finished by earlier passes
  }
  const long lo = (hi - chunk > range_start) ? hi - chunk : range_start;
  const bool more_passes = lo > range_start;

  const uint2 in_group = raster_pixel_in_group(tid);  // common.h: 8x4 blocks a simdgroup where the tile allows
  const long pix_x = (long)tgp.x * SPLAT_TILE_SIZE + (long)in_group.x;
  const long pix_y = tile_y * SPLAT_TILE_SIZE + ((long)tgp.y % groups_per_tile) * SPLAT_GROUP_ROWS + (long)in_group.y;
  const bool inside = pix_x < width && pix_y < height;
  const long pix = (cam * height + pix_y) * width + pix_x;  // meaningful only if inside
  const float px = (float)pix_x + 0.5f;
  const float py = (float)pix_y + 0.5f;

  float T_final = 1.0f;
  float T = 1.0f;
  float buf[SPLAT_CHANNELS];
  float v_c[SPLAT_CHANNELS];
  float v_a = 0.0f;
  float bg_dot = 0.0f;  // sum_k bg_k v_c_k
  long bin_final = -1;
  for (int k = 0; k < SPLAT_CHANNELS; ++k) {
    buf[k] = 0.0f;
    v_c[k] = 0.0f;
  }
  const bool has_background = (flags & SPLAT_BWD_BACKGROUND) != 0;
  const bool absgrad = (flags & SPLAT_BWD_ABSGRAD) != 0;
  if (inside) {
    T_final = transmittance[pix];
    T = T_final;
    bin_final = (long)last_ids[pix];
    v_a = (flags & SPLAT_BWD_V_ALPHAS) != 0 ? v_render_alphas[pix] : 0.0f;
    for (int k = 0; k < SPLAT_CHANNELS; ++k) {
      v_c[k] = (flags & SPLAT_BWD_V_COLORS) != 0 ? v_render_colors[pix * SPLAT_CHANNELS + k] : 0.0f;
    }
    float composite_dot = 0.0f;  // sum_k g_k composite_bg_k
    if ((flags & SPLAT_BWD_COMPOSITE) != 0) {
      const float t = 1.0f - (1.0f - T_final);  // 1 - render_alpha, as the forward computed it
      for (int k = 0; k < 3 && k < SPLAT_CHANNELS; ++k) {
        const float x = render_out[pix * SPLAT_CHANNELS + k] + t * composite_bg[k];
        const float g = (x >= 0.0f && x <= 1.0f) ? v_rgb[pix * 3 + k] : 0.0f;
        v_c[k] += g;
        composite_dot += g * composite_bg[k];
      }
    }
    for (int k = 0; k < SPLAT_CHANNELS; ++k) {
      if (has_background) {
        bg_dot += backgrounds[cam * SPLAT_CHANNELS + k] * v_c[k];
      }
    }
    bg_dot += composite_dot;
    if (pass_index > 0) {
      T = pix_T[pix];
      for (int k = 0; k < SPLAT_CHANNELS; ++k) {
        buf[k] = pix_buf[pix * SPLAT_CHANNELS + k];
      }
    }
  }
  // Gaussians behind every pixel of this simdgroup are skipped without touching memory.
  const long sg_bin_final = (long)simd_max((int)bin_final);
  // This lane's rank among the simdgroup's live lanes, and their count (every thread is live here).
  const int sg_rank = (int)simd_prefix_exclusive_sum(1u);
  const int sg_lanes = (int)simd_sum(1u);

  for (long batch_end = hi; batch_end > lo; batch_end -= SPLAT_BWD_BATCH) {
    const long batch_lo = (batch_end - SPLAT_BWD_BATCH > lo) ? batch_end - SPLAT_BWD_BATCH : lo;
    const int batch_size = (int)(batch_end - batch_lo);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // previous batch fully read
    if ((int)tid < batch_size) {
      const long j = batch_end - 1 - (long)tid;
      const int g = flatten_ids[j];
      s_ids[tid] = g;
      s_xy[tid] = float2(means2d[2 * (long)g], means2d[2 * (long)g + 1]);
      s_conic_opac[tid] = float4(conics[3 * (long)g], conics[3 * (long)g + 1], conics[3 * (long)g + 2], opacities[g]);
      for (int k = 0; k < SPLAT_CHANNELS; ++k) {
        s_rgb[(int)tid * SPLAT_CHANNELS + k] = colors[(long)g * SPLAT_CHANNELS + k];
      }
    }
#if SPLAT_BWD_MERGE
    if (merge) {  // a simdgroup that skips a gaussian leaves its zeros
      for (uint i = tid; i < n_sg * SPLAT_BWD_BATCH * SPLAT_BWD_QUANTITIES; i += SPLAT_RASTER_THREADS) {
        s_part[i] = 0.0f;
      }
    }
#endif
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Slot t holds list position batch_end - 1 - t; start at the first one <= sg_bin_final.
    // (simdgroup-uniform loop bounds: the simd ops inside are reached by every lane)
    const long skip = batch_end - 1 - sg_bin_final;
    const int t_start = skip > 0 ? (skip < (long)batch_size ? (int)skip : batch_size) : 0;
    for (int t = t_start; t < batch_size; ++t) {
      const long pos = batch_end - 1 - (long)t;
      const float4 co = s_conic_opac[t];
      const float2 xy = s_xy[t];
      const float dx = xy.x - px;
      const float dy = xy.y - py;
      const float sigma = 0.5f * (co.x * dx * dx + co.z * dy * dy) + co.y * dx * dy;
      const float vis = exp(-sigma);
      const float raw_alpha = co.w * vis;
      const float alpha = min(SPLAT_ALPHA_MAX, raw_alpha);
      // rasterize.metal's test, term for term (explicit isfinite: Metal's min ignores a NaN).
      const bool valid = inside && pos <= bin_final && isfinite(sigma) && sigma >= 0.0f && isfinite(raw_alpha) &&
                         alpha >= SPLAT_ALPHA_MIN;
      if (!simd_any(valid)) {
        continue;
      }
      float4 g_conic_opac = float4(0.0f);  // conic x, y, z; opacity
      float4 g_xy = float4(0.0f);          // means2d x, y; |means2d| x, y
      float4 g_rgb[SPLAT_COLOR_VEC4];
      for (int q = 0; q < SPLAT_COLOR_VEC4; ++q) {
        g_rgb[q] = float4(0.0f);
      }
      if (valid) {
        const float ra = 1.0f / (1.0f - alpha);
        T = T * ra;  // transmittance in front of this gaussian
        const float fac = alpha * T;
        float v_alpha = 0.0f;
        for (int k = 0; k < SPLAT_CHANNELS; ++k) {
          g_rgb[k / 4][k % 4] = fac * v_c[k];
          v_alpha += (s_rgb[t * SPLAT_CHANNELS + k] * T - buf[k] * ra) * v_c[k];
        }
        v_alpha += T_final * ra * (v_a - bg_dot);
        if (co.w * vis <= SPLAT_ALPHA_MAX) {
          const float v_sigma = -co.w * vis * v_alpha;
          g_conic_opac = float4(0.5f * v_sigma * dx * dx, v_sigma * dx * dy, 0.5f * v_sigma * dy * dy, vis * v_alpha);
          const float gx = v_sigma * (co.x * dx + co.y * dy);
          const float gy = v_sigma * (co.y * dx + co.z * dy);
          g_xy = float4(gx, gy, abs(gx), abs(gy));
        }
        for (int k = 0; k < SPLAT_CHANNELS; ++k) {
          buf[k] += s_rgb[t * SPLAT_CHANNELS + k] * fac;
        }
      }
      // Only the components issued below are reduced (a simd_sum costs one reduction per component):
      // |means2d| only with absgrad, the last colour vector's used channels only (rgb: a float3).
      g_conic_opac = simd_sum(g_conic_opac);
      if (absgrad) {
        g_xy = simd_sum(g_xy);
      } else {
        g_xy = float4(simd_sum(float2(g_xy.x, g_xy.y)), 0.0f, 0.0f);
      }
      for (int q = 0; q < SPLAT_COLOR_VEC4 - 1; ++q) {
        g_rgb[q] = simd_sum(g_rgb[q]);
      }
      g_rgb[SPLAT_COLOR_VEC4 - 1] = simd_sum_last_color(g_rgb[SPLAT_COLOR_VEC4 - 1]);
      // Every lane now holds the simdgroup's sums; the quantities are shared out by lane rank.
      const long g = (long)s_ids[t];
      for (int q = sg_rank; q < SPLAT_BWD_QUANTITIES; q += sg_lanes) {
        const float value = q < 4 ? g_conic_opac[q] : (q < 8 ? g_xy[q - 4] : g_rgb[(q - 8) / 4][(q - 8) % 4]);
#if SPLAT_BWD_MERGE
        if (merge) {
          s_part[((int)sgid * SPLAT_BWD_BATCH + t) * SPLAT_BWD_QUANTITIES + q] = value;
          continue;
        }
#endif
        bwd_atomic_add(q, g, value, v_means2d, v_conics, v_colors, v_opacities, v_means2d_abs, absgrad);
      }
    }
#if SPLAT_BWD_MERGE
    if (merge) {  // uniform: every thread reaches the barrier
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint i = tid; i < (uint)batch_size * SPLAT_BWD_QUANTITIES; i += SPLAT_RASTER_THREADS) {
        const int t = (int)(i / SPLAT_BWD_QUANTITIES), q = (int)(i % SPLAT_BWD_QUANTITIES);
        float value = 0.0f;
        for (uint sg = 0; sg < n_sg; ++sg) {
          value += s_part[((int)sg * SPLAT_BWD_BATCH + t) * SPLAT_BWD_QUANTITIES + q];
        }
        if (value != 0.0f) {  // a NaN is issued
          bwd_atomic_add(q, (long)s_ids[t], value, v_means2d, v_conics, v_colors, v_opacities, v_means2d_abs, absgrad);
        }
      }
    }
#endif
  }

  if (inside && more_passes) {
    pix_T[pix] = T;
    for (int k = 0; k < SPLAT_CHANNELS; ++k) {
      pix_buf[pix * SPLAT_CHANNELS + k] = buf[k];
    }
  }
}
