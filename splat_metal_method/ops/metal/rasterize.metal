// rasterize.metal: front-to-back alpha compositing of each tile's depth-sorted gaussians
// (gsplat 1.4 rasterize_to_pixels, classic mode). Backward kernels will live next to the forward one.
//
// Per-variant values injected by kernels.py: SPLAT_CHANNELS (D, colour channels per gaussian) and
// SPLAT_TILE_SIZE. One library is compiled per (D, tile size).
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

#ifndef SPLAT_CHANNELS
#error "SPLAT_CHANNELS must be injected by kernels.py"
#endif
#if SPLAT_TILE_PIXELS > 1024
#error "a tile must have at most 1024 pixels (one thread each)"
#endif

// rasterize_fwd: one threadgroup per (tile x, tile y, camera), one thread per pixel of the tile
// (grid = (tile_width*TS, tile_height*TS, C), group = (TS, TS, 1); threads of pixels outside the image
// stay alive, masked, because they load gaussians and must reach every barrier). Where the pipeline
// allows fewer threads, group = (TS, GROUP_ROWS, 1): one group per strip of GROUP_ROWS rows of a tile.
//
// Work bound: a pass handles at most `chunk` gaussians of each tile: [start + pass*chunk, ...). The
// host runs ceil(max tile length / chunk) passes when one is not enough; between passes a pixel's
// state lives in global memory (running colour in render_colors, T in transmittance, last_ids, and
// pixel_done), and the pass that reaches the end of a tile's range finalises it (background,
// render_alphas). A group whose tile has nothing left in this pass returns at once: that condition
// is uniform over the group, so no thread of it ever reaches a barrier.
//
// Loop invariant per batch of RASTER_THREADS gaussians (three barriers):
//   A. every simdgroup publishes simd_all(done) in sg_done[]; barrier;
//   B. all threads read the same sg_done[] -> the same decision to stop (uniform break), else each
//      thread loads one gaussian (id, mean, conic, opacity) into threadgroup memory; barrier;
//   C. each live pixel composites the batch in order; barrier (before the next batch overwrites it).
// Compositing (identical to ops/reference.py): d = mean - (x+0.5, y+0.5),
// sigma = 0.5 (a dx^2 + c dy^2) + b dx dy, alpha = min(ALPHA_MAX, opacity exp(-sigma)); skip unless
// sigma and opacity exp(-sigma) are finite, sigma >= 0 and alpha >= ALPHA_MIN (explicit isfinite: a NaN
// opacity or conic is skipped, never clamped to ALPHA_MAX by Metal's NaN-ignoring min); stop (without
// contributing) once T (1 - alpha) <= TRANSMITTANCE_MIN.
// Recorded for the backward pass: transmittance = final T, last_ids = index into flatten_ids of the
// last gaussian that contributed (-1 if none).
// Resuming a depth chunk (has_resume != 0, ops/chunked.py): pass 0 starts each pixel from trans_in
// (the transmittance after the earlier chunks) and stopped_in instead of T = 1, and the final pass
// also writes pixel_done (then [C, H, W]), the stop state the next chunk resumes from.
// Fused composite (has_composite != 0, the training step's and the viewer's render; D >= 3): the final
// pass also writes rgb = clamp(render_colors[:3] + (1 - render_alphas) * composite_bg, 0, 1), splatfacto's
// composite of the rendered image over its background (train.metal composite_fwd, its unfused twin), in
// the same float32 operations (1 - render_alpha, then the product and the sum), so the same bits.
// Threadgroup memory: TILE_PIXELS * (4 + 8 + 16 + 4 / 8) bytes = 7.3 KB for 16x16 tiles. Nothing
// assumes 32-wide simdgroups (Apple's width) or full ones: tiles of 1 to 32 pixels a side.
[[max_total_threads_per_threadgroup(SPLAT_RASTER_THREADS)]]
kernel void rasterize_fwd(
    const device float* means2d [[buffer(0)]],       // [C*N, 2]
    const device float* conics [[buffer(1)]],        // [C*N, 3]
    const device float* colors [[buffer(2)]],        // [C*N, D]
    const device float* opacities [[buffer(3)]],     // [C*N]
    const device float* backgrounds [[buffer(4)]],   // [C, D] or [1] placeholder
    const device int* tile_offsets [[buffer(5)]],    // [C, tile_height, tile_width]
    const device int* flatten_ids [[buffer(6)]],     // [M]
    device float* render_colors [[buffer(7)]],       // [C, H, W, D]
    device float* render_alphas [[buffer(8)]],       // [C, H, W]
    device float* transmittance [[buffer(9)]],       // [C, H, W]
    device int* last_ids [[buffer(10)]],             // [C, H, W]
    device int* pixel_done [[buffer(11)]],           // [C, H, W], or [1] when there is one pass
    constant long* params [[buffer(12)]],            // [RASTER_FWD_COUNT] common.h RASTER_FWD_*
    const device float* trans_in [[buffer(13)]],     // [C, H, W] or [1] placeholder
    const device int* stopped_in [[buffer(14)]],     // [C, H, W] or [1] placeholder
    const device float* composite_bg [[buffer(15)]], // [3], or [1] placeholder
    device float* rgb [[buffer(16)]],                // [C, H, W, 3], or [1] placeholder
    uint3 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]]) {
  const long width = params[RASTER_FWD_WIDTH];
  const long height = params[RASTER_FWD_HEIGHT];
  const long tile_width = params[RASTER_FWD_TILE_WIDTH];
  const long tile_height = params[RASTER_FWD_TILE_HEIGHT];
  const long total_tiles = params[RASTER_FWD_TOTAL_TILES];
  const long n_isects = params[RASTER_FWD_N_ISECTS];
  const long has_background = params[RASTER_FWD_HAS_BACKGROUND];
  const long pass_index = params[RASTER_FWD_PASS_INDEX];
  const long chunk = params[RASTER_FWD_CHUNK];
  const long has_resume = params[RASTER_FWD_HAS_RESUME];
  const long row0 = params[RASTER_FWD_ROW0];
  const long has_composite = params[RASTER_FWD_HAS_COMPOSITE];
  threadgroup int s_ids[SPLAT_RASTER_THREADS];
  threadgroup float2 s_xy[SPLAT_RASTER_THREADS];
  threadgroup float4 s_conic_opac[SPLAT_RASTER_THREADS];
  threadgroup int s_sg_done[(SPLAT_RASTER_THREADS + 7) / 8];  // one per simdgroup (room for 8-wide ones)

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
  const long lo = range_start + pass_index * chunk;
  if (pass_index > 0 && lo >= range_end) {
    return;  // uniform over the group: this tile was finalised by an earlier pass
  }
  const long hi = (lo + chunk < range_end) ? lo + chunk : range_end;
  const bool final_pass = hi == range_end;

  const uint2 in_group = raster_pixel_in_group(tid);  // common.h: 8x4 blocks a simdgroup where the tile allows
  const long pix_x = (long)tgp.x * SPLAT_TILE_SIZE + (long)in_group.x;
  const long pix_y = tile_y * SPLAT_TILE_SIZE + ((long)tgp.y % groups_per_tile) * SPLAT_GROUP_ROWS + (long)in_group.y;
  const bool inside = pix_x < width && pix_y < height;
  const long pix = (cam * height + pix_y) * width + pix_x;  // meaningful only if inside
  const float px = (float)pix_x + 0.5f;
  const float py = (float)pix_y + 0.5f;

  float T = 1.0f;
  float acc[SPLAT_CHANNELS];
  for (int k = 0; k < SPLAT_CHANNELS; ++k) {
    acc[k] = 0.0f;
  }
  int last = -1;
  bool done = !inside;
  if (pass_index == 0 && has_resume != 0 && inside) {
    T = trans_in[pix];
    done = stopped_in[pix] != 0;
  }
  if (pass_index > 0 && inside) {
    T = transmittance[pix];
    for (int k = 0; k < SPLAT_CHANNELS; ++k) {
      acc[k] = render_colors[pix * SPLAT_CHANNELS + k];
    }
    last = last_ids[pix];
    done = pixel_done[pix] != 0;
  }

  for (long batch_start = lo; batch_start < hi; batch_start += SPLAT_RASTER_THREADS) {
    // A. publish per-simdgroup completion
    const bool sg_all_done = simd_all(done);
    if (lane == 0 && sgid < (SPLAT_RASTER_THREADS + 7) / 8) {
      s_sg_done[sgid] = sg_all_done ? 1 : 0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // B. uniform stop decision, then cooperative load
    bool all_done = true;
    for (uint s = 0; s < n_sg && s < (SPLAT_RASTER_THREADS + 7) / 8; ++s) {
      all_done = all_done && (s_sg_done[s] != 0);
    }
    if (all_done) {
      break;
    }
    const long j = batch_start + (long)tid;
    if (j < hi) {
      const int g = flatten_ids[j];
      s_ids[tid] = g;
      s_xy[tid] = float2(means2d[2 * (long)g], means2d[2 * (long)g + 1]);
      s_conic_opac[tid] = float4(conics[3 * (long)g], conics[3 * (long)g + 1], conics[3 * (long)g + 2], opacities[g]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // C. composite this batch
    const long remaining = hi - batch_start;
    const int batch_size = remaining < SPLAT_RASTER_THREADS ? (int)remaining : SPLAT_RASTER_THREADS;
    for (int t = 0; t < batch_size && !done; ++t) {
      const float4 co = s_conic_opac[t];
      const float2 xy = s_xy[t];
      const float dx = xy.x - px;
      const float dy = xy.y - py;
      const float sigma = 0.5f * (co.x * dx * dx + co.z * dy * dy) + co.y * dx * dy;
      // Explicit: Metal's min(ALPHA_MAX, NaN) is ALPHA_MAX, so a NaN must be rejected before the clamp
      // decides anything. The same test as rasterize_bwd.metal's, the reference's and the CPU backend's.
      const float raw_alpha = co.w * exp(-sigma);
      const float alpha = min(SPLAT_ALPHA_MAX, raw_alpha);
      if (!(isfinite(sigma) && sigma >= 0.0f && isfinite(raw_alpha) && alpha >= SPLAT_ALPHA_MIN)) {
        continue;
      }
      const float next_T = T * (1.0f - alpha);
      if (next_T <= SPLAT_TRANSMITTANCE_MIN) {
        done = true;
        break;
      }
      const float vis = alpha * T;
      const long g = (long)s_ids[t];
      for (int k = 0; k < SPLAT_CHANNELS; ++k) {
        acc[k] += colors[g * SPLAT_CHANNELS + k] * vis;
      }
      last = (int)(batch_start + t);
      T = next_T;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (inside) {
    transmittance[pix] = T;
    last_ids[pix] = last;
    if (final_pass) {
      const float render_alpha = 1.0f - T;
      render_alphas[pix] = render_alpha;
      for (int k = 0; k < SPLAT_CHANNELS; ++k) {
        const float bg = has_background != 0 ? backgrounds[cam * SPLAT_CHANNELS + k] : 0.0f;
        const float out = acc[k] + T * bg;
        render_colors[pix * SPLAT_CHANNELS + k] = out;
        if (has_composite != 0 && k < 3) {
          rgb[pix * 3 + k] = splat_clamp01(out + (1.0f - render_alpha) * composite_bg[k]);
        }
      }
      if (has_resume != 0) {
        pixel_done[pix] = done ? 1 : 0;
      }
    } else {
      for (int k = 0; k < SPLAT_CHANNELS; ++k) {
        render_colors[pix * SPLAT_CHANNELS + k] = acc[k];
      }
      pixel_done[pix] = done ? 1 : 0;
    }
  }
}
